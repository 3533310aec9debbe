"""Save / restore converted params with orbax-checkpoint, so a second load is fast.

A checkpoint directory holds the params (stacked-layer layout, compute dtype) under
`params/` and the ModelConfig as `model_config.json`.
"""
from __future__ import annotations

import dataclasses
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


def save_checkpoint(path: str, params, cfg: ModelConfig, tokenizer_source: str = "") -> None:
  """tokenizer_source: a .gguf file or HF directory whose tokenizer the model uses."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  from jaxinfer.model.params import stack_layers
  ckpt = ocp.StandardCheckpointer()
  # the GGUF block weights (weight_format="gguf") are read from their file again, not saved
  params = stack_layers({k: v for k, v in params.items() if k != "blocks"})
  ckpt.save(os.path.join(path, "params"), params, force=True)
  ckpt.wait_until_finished()
  dtype = params["embed"].dtype
  with open(os.path.join(path, "checksum"), "w") as f:
    f.write(f"{params_checksum(params)} {dtype}")
  with open(os.path.join(path, "model_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)
  if tokenizer_source:
    with open(os.path.join(path, "tokenizer_source"), "w") as f:
      f.write(os.path.abspath(tokenizer_source))


def is_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "model_config.json")) and os.path.isdir(
      os.path.join(path, "params"))


def load_checkpoint_config(path: str) -> ModelConfig:
  with open(os.path.join(path, "model_config.json")) as f:
    d = json.load(f)
  d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
  return ModelConfig(**d)


def restore_checkpoint(path: str, dtype):
  """Returns (stacked params as jax arrays of `dtype`, ModelConfig)."""
  import orbax.checkpoint as ocp
  from jaxinfer.model.params import abstract_params
  path = os.path.abspath(path)
  if not is_checkpoint(path):
    raise ModelLoadError(f"{path!r} is not a jaxinfer checkpoint (no model_config.json/params)")
  cfg = load_checkpoint_config(path)
  ckpt = ocp.StandardCheckpointer()
  params = ckpt.restore(os.path.join(path, "params"), abstract_params(cfg, dtype))
  sum_file = os.path.join(path, "checksum")
  if os.path.isfile(sum_file):  # written by save_checkpoint (older entries have none)
    with open(sum_file) as f:
      want, _, saved_dtype = f.read().strip().partition(" ")
    import jax
    restored = jax.tree_util.tree_leaves(params)[0].dtype
    got = params_checksum(params) if str(restored) == saved_dtype else want  # cast: skip
    if got != want:
      raise ModelLoadError(f"checkpoint {path!r} is damaged: its weights' checksum is {got}, "
                           f"the one saved with them {want}")
  return params, cfg
