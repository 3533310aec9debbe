import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache in the test processes: a long pytest process (hundreds
# of executables) crashed twice inside XLA:CPU's executable serialization on a cache
# write (jax 0.10.2: compilation_cache.put_executable_and_time -> serialize). Inherited by
# the binaries the tests start. Set JAXINFER_XLA_CACHE yourself to override.
os.environ.setdefault("JAXINFER_XLA_CACHE", "off")


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
def smollm2(tmp_path_factory):
  """SmolLM2 loaded once (f32, layers under lax.scan), cached conversion in a temp dir."""
  from jaxinfer.loading import load_model
  cache = str(tmp_path_factory.mktemp("ckpt"))
  return load_model("smollm2-135m-instruct", "float32", cache_dir=cache)
