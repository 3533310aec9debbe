"""Save / restore converted params, so a second load is fast.

A checkpoint directory holds the params (stacked-layer layout, compute dtype), the
ModelConfig as `model_config.json` and `checksum`: a JSON object with the CRC-32 of every
tensor's bytes, their dtype and the SHA-256 of model_config.json, so an edited config or
an overwritten tensor is caught before the weights are used. The params are stored in
one of two layouts:
- `params/`: an orbax-checkpoint (a user's checkpoint: `save_checkpoint`, the draft
  trainer), restorable sharded and cast by orbax;
- `params.bin` + `params.json` (flat=True: the converted-weight cache): every tensor's
  bytes one after another, 64-byte aligned, and their names, dtypes, shapes and offsets.
  A restore maps the file and hands the tensors to the device, so a warm start reads
  the weights once (docs/design.md, start-up).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zlib


from jaxinfer.config import ModelConfig
from jaxinfer.loading.errors import ModelLoadError

log = logging.getLogger(__name__)


def params_checksum(params) -> str:
  """CRC-32 over every tensor's bytes in tree order (catches flipped or overwritten bytes
  in a stored copy; ~0.3 s for SmolLM2's 538 MB)."""
  import jax
  import numpy as np
  crc = 0
  for a in jax.tree_util.tree_leaves(params):
    # as bytes: a buffer of bfloat16 (an ml_dtypes type) has no buffer-protocol format
    crc = zlib.crc32(np.ascontiguousarray(np.asarray(a)).view(np.uint8), crc)
  return f"{crc:08x}"


FLAT_DATA, FLAT_INDEX = "params.bin", "params.json"
_ALIGN = 64


def save_checkpoint(path: str, params, cfg: ModelConfig, tokenizer_source: str = "",
                    flat: bool = False) -> None:
  """tokenizer_source: a .gguf file or HF directory whose tokenizer the model uses.
  flat: the params in the flat layout (module docstring) instead of orbax's."""
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  from jaxinfer.model.params import stack_layers
  # the GGUF block weights (weight_format="gguf") are read from their file again, not saved
  params = stack_layers({k: v for k, v in params.items() if k != "blocks"})
  if flat:
    _save_flat(path, params)
  else:
    import orbax.checkpoint as ocp
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(path, "params"), params, force=True)
    ckpt.wait_until_finished()
  dtype = params["embed"].dtype
  with open(os.path.join(path, "model_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)
  with open(os.path.join(path, "checksum"), "w") as f:
    json.dump({"params_crc32": params_checksum(params), "dtype": str(dtype),
               "config_sha256": _file_sha256(os.path.join(path, "model_config.json"))}, f)
  if tokenizer_source:
    with open(os.path.join(path, "tokenizer_source"), "w") as f:
      f.write(os.path.abspath(tokenizer_source))


def _save_flat(path: str, params) -> None:
  import jax
  import numpy as np
  index, offset = [], 0
  with open(os.path.join(path, FLAT_DATA), "wb") as f:
    for key, a in jax.tree_util.tree_flatten_with_path(params)[0]:
      a = np.ascontiguousarray(np.asarray(a))
      pad = -offset % _ALIGN
      f.write(b"\0" * pad)
      offset += pad
      index.append({"name": jax.tree_util.keystr(key), "dtype": str(a.dtype),
                    "shape": list(a.shape), "offset": offset})
      f.write(memoryview(a.reshape(-1).view(np.uint8)))
      offset += a.nbytes
  with open(os.path.join(path, FLAT_INDEX), "w") as f:
    json.dump(index, f)


def _read_flat(path: str, cfg: ModelConfig, dtype):
  """The flat layout's tensors as host arrays mapped from params.bin, in the tree of
  abstract_params(cfg, dtype) (their stored dtype). ModelLoadError on a missing, extra,
  misshapen or truncated tensor."""
  import jax
  import numpy as np
  from jaxinfer.model.params import abstract_params
  specs, treedef = jax.tree_util.tree_flatten_with_path(abstract_params(cfg, dtype))
  try:
    with open(os.path.join(path, FLAT_INDEX)) as f:
      index = {e["name"]: e for e in json.load(f)}
    data = np.memmap(os.path.join(path, FLAT_DATA), np.uint8, mode="r")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ModelLoadError(f"checkpoint {path!r}: unreadable {FLAT_INDEX} / {FLAT_DATA} "
                         f"({e})") from None
  names = [jax.tree_util.keystr(k) for k, _ in specs]
  if set(index) != set(names):
    raise ModelLoadError(f"checkpoint {path!r} holds tensors {sorted(set(index) ^ set(names))} "
                         "where the model has others")
  leaves = []
  for name, (_, spec) in zip(names, specs):
    e = index[name]
    shape, dt = tuple(e["shape"]), jax.numpy.dtype(e["dtype"])
    if shape != tuple(spec.shape):
      raise ModelLoadError(f"checkpoint {path!r}: tensor {name} has shape {shape}, the "
                           f"model's is {tuple(spec.shape)}")
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if e["offset"] + n > data.size:
      raise ModelLoadError(f"checkpoint {path!r}: {FLAT_DATA} is truncated ({data.size} "
                           f"bytes; tensor {name} ends at {e['offset'] + n})")
    leaves.append(data[e["offset"]:e["offset"] + n].view(dt).reshape(shape))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def save_arrays(path: str, tree, what: str) -> None:
  """A nested dict of arrays (any dtypes) in the flat layout with a `checksum` record
  (its CRC-32, and `what` it holds, for `cache list`): the GGUF block weights' cache entry."""
  os.makedirs(path, exist_ok=True)
  _save_flat(path, tree)
  with open(os.path.join(path, "checksum"), "w") as f:
    json.dump({"arrays_crc32": params_checksum(tree), "what": what}, f)


def load_arrays(path: str):
  """The nested dict `save_arrays` wrote, as host arrays mapped from its file, its CRC
  verified. ModelLoadError on anything missing, truncated or changed."""
  import re

  import numpy as np
  try:
    with open(os.path.join(path, FLAT_INDEX)) as f:
      index = json.load(f)
    with open(os.path.join(path, "checksum")) as f:
      want = json.load(f)["arrays_crc32"]
    data = np.memmap(os.path.join(path, FLAT_DATA), np.uint8, mode="r")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ModelLoadError(f"array cache {path!r} is unreadable ({e})") from None
  tree: dict = {}
  for e in index:
    keys = re.findall(r"\['([^']*)'\]", e["name"])
    dt = np.dtype(e["dtype"])
    n = int(np.prod(e["shape"], dtype=np.int64)) * dt.itemsize
    if not keys or e["offset"] + n > data.size:
      raise ModelLoadError(f"array cache {path!r}: tensor {e['name']} is truncated or unnamed")
    node = tree
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = data[e["offset"]:e["offset"] + n].view(dt).reshape(e["shape"])
  got = params_checksum(tree)
  if got != want:
    raise ModelLoadError(f"array cache {path!r} is damaged (CRC-32 {got}, saved {want})")
  return tree


def is_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "model_config.json")) and (
      os.path.isdir(os.path.join(path, "params"))
      or os.path.isfile(os.path.join(path, FLAT_DATA)))


def load_checkpoint_config(path: str) -> ModelConfig:
  with open(os.path.join(path, "model_config.json")) as f:
    d = json.load(f)
  for k in ("eos_token_ids", "layer_windows", "rope_scaling"):  # JSON lists -> tuples
    d[k] = tuple(d.get(k, ()))
  return ModelConfig(**d)


def _file_sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def read_checksum(path: str) -> dict:
  """The checkpoint's `checksum` record ({params_crc32, dtype, config_sha256}); an entry
  written before the config was covered holds "CRC DTYPE" (config_sha256 None).
  ModelLoadError when the file is missing or malformed."""
  sum_file = os.path.join(path, "checksum")
  try:
    with open(sum_file) as f:
      text = f.read().strip()
  except OSError as e:
    raise ModelLoadError(f"checkpoint {path!r} has no readable checksum file ({e})") from None
  try:
    rec = json.loads(text)
  except ValueError:
    crc, _, dtype = text.partition(" ")
    rec = {"params_crc32": crc, "dtype": dtype, "config_sha256": None}
  ok = isinstance(rec, dict) and set(rec) == {"params_crc32", "dtype", "config_sha256"}
  if ok:
    crc, dt, sha = rec["params_crc32"], rec["dtype"], rec["config_sha256"]
    ok = (isinstance(crc, str) and len(crc) == 8 and all(c in "0123456789abcdef" for c in crc)
          and isinstance(dt, str) and bool(dt)
          and (sha is None or (isinstance(sha, str) and len(sha) == 64)))
  if not ok:
    raise ModelLoadError(f"checkpoint {path!r} has a malformed checksum file: {text[:200]!r}")
  return rec


def restore_checkpoint(path: str, dtype, require_checksum: bool = False):
  """Returns (stacked params as jax arrays of `dtype`, ModelConfig). The checksum record
  is verified: the config's hash before it is read, the tensors' CRC after the restore.
  require_checksum (the converted-weight cache, which can rebuild an entry): a missing or
  malformed record, or one without the config's hash, is a ModelLoadError; otherwise (a
  user's checkpoint) a missing record is only a warning."""
  path = os.path.abspath(path)
  if not is_checkpoint(path):
    raise ModelLoadError(f"{path!r} is not a jaxinfer checkpoint (no model_config.json "
                         f"with params/ or {FLAT_DATA})")
  rec = None
  if require_checksum or os.path.exists(os.path.join(path, "checksum")):
    rec = read_checksum(path)
  else:
    log.warning("checkpoint %s has no checksum file: its weights are not verified", path)
  if rec is not None and rec["config_sha256"] is None and require_checksum:
    raise ModelLoadError(f"checkpoint {path!r}: its checksum does not cover model_config.json")
  if rec is not None and rec["config_sha256"] is not None:
    got = _file_sha256(os.path.join(path, "model_config.json"))
    if got != rec["config_sha256"]:
      raise ModelLoadError(f"checkpoint {path!r} is damaged: model_config.json changed since "
                           f"the weights were saved (SHA-256 {got[:16]}..., saved "
                           f"{rec['config_sha256'][:16]}...)")
  import jax
  cfg = load_checkpoint_config(path)
  flat = os.path.isfile(os.path.join(path, FLAT_DATA))
  if flat:  # host arrays mapped from the file: checked before they reach the device
    params = _read_flat(path, cfg, dtype)
  else:
    import orbax.checkpoint as ocp
    from jaxinfer.model.params import abstract_params
    ckpt = ocp.StandardCheckpointer()
    params = ckpt.restore(os.path.join(path, "params"), abstract_params(cfg, dtype))
  if rec is not None:
    want = rec["params_crc32"]
    restored = jax.tree_util.tree_leaves(params)[0].dtype
    got = params_checksum(params) if str(restored) == rec["dtype"] else want  # cast: skip
    if got != want:
      raise ModelLoadError(f"checkpoint {path!r} is damaged: its weights' checksum is {got}, "
                           f"the one saved with them {want}")
  if flat:
    params = jax.tree_util.tree_map(lambda a: jax.numpy.asarray(a, dtype), params)
  return params, cfg
