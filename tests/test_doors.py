"""ARCHITECTURE.md doors: the host runtime imports no JAX; pallas_kernels only jax/numpy."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_runtime_imports_no_jax():
  code = ("import sys\n"
          "import jaxinfer.runtime.engine, jaxinfer.runtime.speculative, jaxinfer.metrics\n"
          "import jaxinfer.runtime.accounting, jaxinfer.costmodel.formulas\n"
          "import jaxinfer.structured, jaxinfer.structured.grammar, llguidance\n"
          "import jaxinfer.lora, jaxinfer.lora.slots, jaxinfer.costmodel.lora\n"
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]\n"
          "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pallas_kernels_import_only_jax_and_numpy():
  allowed = {"jax", "numpy", "pallas_kernels", "__future__", "functools", "math", "dataclasses",
             "typing"}
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
  """ARCHITECTURE: serving/ talks to the engine through its public calls; the runtime,
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
