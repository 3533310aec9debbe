"""The doors between rooms (README: Layout): what may import or reach into what."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_runtime_imports_no_jax():
  code = ("import sys\n"
          "import jaxinfer.runtime.engine, jaxinfer.runtime.speculative, jaxinfer.metrics\n"
          "import jaxinfer.costmodel.accounting, jaxinfer.costmodel.formulas\n"
          "import jaxinfer.structured, jaxinfer.structured.grammar, llguidance\n"
          "import jaxinfer.lora, jaxinfer.runtime.adapter_slots, jaxinfer.costmodel.lora\n"
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]\n"
          "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pallas_kernels_import_only_jax_and_numpy():
  # jax, numpy and the standard library (cpu/native.py builds its C++ with subprocess)
  allowed = {"jax", "numpy", "pallas_kernels"} | set(sys.stdlib_module_names)
  for f in (ROOT / "pallas_kernels").rglob("*.py"):
    for node in ast.walk(ast.parse(f.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      for n in names:
        assert n.split(".")[0] in allowed, f"{f.name} imports {n}"


def test_the_engine_never_imports_serving_and_serving_uses_no_private_engine_names():
  """serving/ talks to the engine through its public calls; the runtime,
  executors and model never import serving/."""
  import re
  for sub in ("runtime", "executors", "model", "kv", "costmodel"):
    for f in (ROOT / "jaxinfer" / sub).rglob("*.py"):
      for node in ast.walk(ast.parse(f.read_text())):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert not any(m.startswith("jaxinfer.serving") for m in mods), f"{f} imports {mods}"
  for f in (ROOT / "jaxinfer" / "serving").rglob("*.py"):
    private = re.findall(r"\b(?:engine|eng)\._[a-z]\w*", f.read_text())
    assert not private, f"{f.name} reaches into the engine: {private}"


def _imports(f):
  for node in ast.walk(ast.parse(f.read_text())):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield a.name, None
    elif isinstance(node, ast.ImportFrom):
      for a in node.names:
        yield node.module or "", a.name


def test_model_never_imports_the_runtime_executors_or_serving():
  for f in (ROOT / "jaxinfer" / "model").rglob("*.py"):
    for mod, _ in _imports(f):
      assert not mod.startswith(("jaxinfer.runtime", "jaxinfer.executors", "jaxinfer.serving",
                                 "jaxinfer.llm")), f"{f.name} imports {mod}"


def test_runtime_sees_adapter_ids_and_slot_counts_only():
  """lora/'s files and device ops belong to loading, the model and the step; the runtime
  keeps its own slot table and imports nothing of lora/."""
  for f in (ROOT / "jaxinfer" / "runtime").rglob("*.py"):
    for mod, name in _imports(f):
      assert not mod.startswith("jaxinfer.lora"), f"{f.name} imports {mod}"


def test_arrows_point_down():
  """metrics, costmodel and lora never import the runtime (its engine, requests, pages);
  page arithmetic lives in costmodel/accounting.py, which both sides import."""
  for sub in ("costmodel", "lora"):
    for f in (ROOT / "jaxinfer" / sub).rglob("*.py"):
      for mod, _ in _imports(f):
        assert not mod.startswith("jaxinfer.runtime"), f"{sub}/{f.name} imports {mod}"
  for mod, _ in _imports(ROOT / "jaxinfer" / "metrics.py"):
    assert not mod.startswith("jaxinfer.runtime"), f"metrics.py imports {mod}"


def test_drafters_use_the_scheduler_and_executor_doors_not_the_engine():
  """Drafters get pages through scheduler hooks and draft steps through the executor:
  nothing in drafters.py names the engine or a private attribute of another object."""
  import re
  src = (ROOT / "jaxinfer" / "executors" / "drafters.py").read_text()
  assert not re.search(r"\bengine\b", src)
  assert not re.findall(r"\b(?!self\b)\w+\._[a-z]\w*", src)


def test_experiments_and_tools_use_public_names():
  """experiments/ and tools/ use the public API, never private helpers of
  jaxinfer or pallas_kernels (`_name` imports or attributes; jit's own _cache_size is
  JAX's, counted as the recompilation probe)."""
  import re
  for sub in ("experiments", "tools"):
    for f in (ROOT / sub).rglob("*.py"):
      for mod, name in _imports(f):
        if mod.startswith(("jaxinfer", "pallas_kernels")) and name:
          assert not name.startswith("_"), f"{f.name} imports {mod}.{name}"
      attrs = re.findall(r"\b(?!self\b)\w+\.(_[a-z]\w*)", f.read_text())
      assert set(attrs) <= {"_cache_size"}, f"{f.name} uses private names {attrs}"


def test_only_the_platform_table_names_the_cpu_backend():
  """The model, sampler and LoRA ops see typed weights and one attention entry point: no
  word of the CPU's layouts or native calls, no import of its room. In the library only
  the platform table (and the loader's GGUF availability check, the benchmarks' floors)
  names pallas_kernels.cpu."""
  import re
  word = re.compile(r"blocks|panels|tiles|native", re.IGNORECASE)
  for f in [*(ROOT / "jaxinfer" / "model").rglob("*.py"), ROOT / "jaxinfer" / "sampling.py",
            *(ROOT / "jaxinfer" / "lora").rglob("*.py")]:
    hits = [ln for ln in f.read_text().splitlines() if word.search(ln)]
    assert not hits, f"{f.relative_to(ROOT)} names the CPU backend: {hits}"
  allowed = {"platforms.py", "benchmarking.py", "loading/registry.py"}
  for f in (ROOT / "jaxinfer").rglob("*.py"):
    rel = str(f.relative_to(ROOT / "jaxinfer"))
    if rel not in allowed:
      assert not any(m.startswith("pallas_kernels.cpu") for m, _ in _imports(f)), rel
      assert "pallas_kernels.cpu" not in f.read_text(), rel


def test_engine_config_is_the_one_list_of_engine_options():
  """LLM takes an EngineConfig or its fields (no option re-declared in its signature); the
  CLI and the server (one flag set) define every command-line option from it, with the
  same defaults; an unknown option or a bad value is a ValueError naming it."""
  import dataclasses
  import inspect
  import pytest
  from absl import flags
  from jaxinfer import cli  # noqa: F401 (defines the flags)
  from jaxinfer.engine_config import EngineConfig, flag_fields, from_flags
  from jaxinfer.llm import LLM
  assert list(inspect.signature(LLM.__init__).parameters) == ["self", "model", "config",
                                                               "options"]
  FLAGS = flags.FLAGS
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  flagged = {name for _, name in flag_fields()}
  for f, name in flag_fields():
    assert name in FLAGS, name
    conv = f.metadata["from_flag"] or (lambda v: v)
    assert conv(FLAGS[name].default) == f.default, name
  assert from_flags(type("V", (), {n: FLAGS[n].default for n in flagged})) == EngineConfig()
  # the CLI's own flags are not engine options under another name
  src = (ROOT / "jaxinfer" / "cli.py").read_text()
  import re
  own = set(re.findall(r'flags\.DEFINE_\w+\("(\w+)"', src))
  assert not own & (fields | flagged), own & (fields | flagged)
  with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
    LLM("no-such-model", max_num_seqs=0)
  with pytest.raises(ValueError, match="unexpected keyword argument 'num_page'"):
    LLM("no-such-model", num_page=4)
