import gc
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every test run starts from empty caches (converted weights, compiled executables), as a
# user's first run and CI do, unless JAXINFER_CACHE is set: the suite's time is then the
# same on every machine, and the user's own cache is never touched. The binaries the tests
# start inherit it, so a step compiled by one study is loaded from disk by the next. Under
# pytest-xdist (the default test command) this runs first in the controller, and the workers
# inherit the variable: one cache per run, shared by both workers.
_OWN_CACHE = None
if "JAXINFER_CACHE" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="jaxinfer-test-cache-")
  os.environ["JAXINFER_CACHE"] = _OWN_CACHE


# Every executable the tests compile uses XLA:CPU's loop emitters, as the engine's CPU
# steps do (pallas_kernels.cpu.LOOP_EMITTERS; docs/design.md has their compile times):
# the oracles, the attention and kernel units, the servers and binaries the tests start
# (they inherit the variable). The library's own probe runs in a subprocess first (this
# process's JAX must not start before XLA_FLAGS is set): XLA aborts a process whose
# XLA_FLAGS names a flag its jaxlib lacks.
def _loop_emitters():
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_use_fusion_emitters" in flags or os.environ.get("JAXINFER_FUSION_EMITTERS") == "1":
    return
  probe = ("import sys; from pallas_kernels import cpu; "
           "sys.exit(0 if cpu.loop_emitters_known() else 1)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  try:
    ok = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                        timeout=300).returncode == 0
  except subprocess.TimeoutExpired:
    ok = False
  if ok:
    os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_use_fusion_emitters=false").strip()


_loop_emitters()


# The suite compiles far more than it runs (about half of its test time is XLA compiles),
# so it compiles at LLVM's -O1 rather than XLA's default -O2: test_llm.py 113 s -> 91 s
# (CPU 163 s -> 128 s), while a step runs 5-15% slower (2026-12-02). The float semantics
# are the same at both levels (no fast-math either way); the library's own steps keep
# XLA's default. An XLA_FLAGS that already names the level keeps its own.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=1").strip()


# The files that take longest, longest first: `--dist loadfile` hands each worker the next
# file in collection order as it frees up, so a long file queued last would leave one
# worker running alone at the end.
_LONG_FILES = ("test_families", "test_llm", "test_engine", "test_sharding", "test_lora",
               "test_server", "test_attention_xla", "test_structured", "test_errors",
               "test_binaries", "test_block_matmul", "test_model_hf", "test_pallas_attention",
               "test_mla", "test_engine_properties", "test_sampling", "test_logits_processing",
               "test_accounting", "test_fleet", "test_gguf_loader", "test_bucket_plan",
               "test_moe", "test_faults", "test_attention_reference", "test_kv_formats")


def pytest_collection_modifyitems(session, config, items):
  """Long files first, each file's tests in their own order (a stable sort by file)."""
  def rank(item):
    name = item.path.stem
    return _LONG_FILES.index(name) if name in _LONG_FILES else len(_LONG_FILES)
  items.sort(key=rank)


def pytest_sessionfinish(session, exitstatus):
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _num_mappings():
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


_MAPPINGS_SOFT_CAP = 30_000  # of Linux's default vm.max_map_count, 65530


def _release():
  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_executables_per_module():
  """Drop this module's compiled executables when it ends. Each XLA:CPU executable holds
  3-6 memory mappings until it is freed, and jit caches keep every one alive: one pytest
  process reached Linux's vm.max_map_count (65530) two thirds of the way through the suite,
  and XLA then crashed (SIGSEGV / SIGABRT) inside its next compile. Steps shared across
  modules come back from the persistent compilation cache."""
  yield
  _release()
  n = _num_mappings()
  assert n < 40_000, f"{n} memory mappings after freeing executables: the limit is 65530"


@pytest.fixture(autouse=True)
def _release_executables_when_many():
  """Within a module too, once a test leaves more than 30,000 mappings (test_engine's
  oracles and warm-ups compile thousands of shapes)."""
  yield
  if _num_mappings() > _MAPPINGS_SOFT_CAP:
    _release()


def _has(mod):
  import importlib.util
  return importlib.util.find_spec(mod) is not None


requires_hf = pytest.mark.skipif(not (_has("torch") and _has("transformers")),
                                 reason="HF reference needs the test extra (torch, transformers)")


@pytest.fixture(scope="session")
def smollm2_path():
  from jaxinfer.loading import resolve_model
  return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2():
  """SmolLM2 loaded once per worker (f32, layers under lax.scan); its converted weights go
  to the run's JAXINFER_CACHE, where the other worker and the servers and binaries the
  tests start restore them (6 s) instead of converting the GGUF again (14 s)."""
  from jaxinfer.loading import load_model
  return load_model("smollm2-135m-instruct", "float32")


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2):
  """SmolLM2's tokenizer and vocabulary over a 2-layer random model: the engine's core
  guarantees at a size the default suite compiles in seconds (the full model runs them in
  the slow suite)."""
  import dataclasses
  import jax
  from jaxinfer.model.params import init_params
  cfg = smollm2.cfg.replace(name="tiny-smollm2", num_layers=2, hidden_size=64,
                            intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
  return dataclasses.replace(smollm2, cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(7)))
