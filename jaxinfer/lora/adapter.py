"""LoRA adapters in PEFT's on-disk format (8.2.1): load, validate, save. Host side.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, rank_pattern, alpha_pattern, ...) and `adapter_model.safetensors` with, per
adapted linear layer, `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight`
[out, r]; the layer computes W x + scaling * B (A x), scaling = alpha / r (alpha /
sqrt(r) with rsLoRA). Here every weight is stored [in, out] (`x @ w`), so an adapter
becomes per target a [L, in, r] and b [L, r, out] with the scaling folded into b; a layer
the adapter leaves out (layers_to_transform) holds zeros. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.costmodel.lora import (TARGETS, adapter_bytes,  # noqa: F401 (re-exported)
                                     target_shape)

# PEFT / HF module name -> the weight it adapts here (TARGETS' order).
MODULES = dict(zip(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"), TARGETS))
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
  """An adapter that cannot be served: the message names the adapter and the mismatch."""


@dataclasses.dataclass
class LoraAdapter:
  """One adapter in this project's layout. weights[target] = (a [L, in, r], b [L, r, out])
  float32, b already scaled."""
  name: str
  rank: int  # the largest rank of any module (rank_pattern may give some a smaller one)
  weights: Dict[str, Tuple[np.ndarray, np.ndarray]]
  path: Optional[str] = None

  @property
  def targets(self) -> Tuple[str, ...]:
    return tuple(t for t in TARGETS if t in self.weights)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def union_targets(adapters: Sequence[LoraAdapter]) -> Tuple[str, ...]:
  """Every target any of the adapters adapts, in TARGETS order; all of them if none."""
  return tuple(t for t in TARGETS if any(t in a.weights for a in adapters)) or TARGETS


def _pattern_value(patterns: dict, module: str, default):
  """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?{key}$", module):
      return value
  return default


def load_peft(path: str, cfg: ModelConfig, name: Optional[str] = None,
              max_rank: Optional[int] = None) -> LoraAdapter:
  """Read a PEFT LoRA directory for a base model of config `cfg`. Every mismatch is an
  AdapterError naming the adapter: missing files, an unsupported option (DoRA, bias,
  modules_to_save, embedding or LM-head targets), a module or layer the model lacks,
  shapes that do not fit it, a rank above max_rank."""
  name = name or os.path.basename(os.path.normpath(path))
  where = f"LoRA adapter {name!r} ({path})"
  conf_path = os.path.join(path, "adapter_config.json")
  weights_path = os.path.join(path, "adapter_model.safetensors")
  missing = lambda p: AdapterError(  # noqa: E731
      f"{where}: {os.path.basename(p)} not found (a PEFT adapter directory holds "
      "adapter_config.json and adapter_model.safetensors)")
  if not os.path.isfile(conf_path):
    raise missing(conf_path)
  try:
    with open(conf_path) as f:
      conf = json.load(f)
  except (OSError, ValueError) as e:
    raise AdapterError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
  if str(conf.get("peft_type", "LORA")).upper() != "LORA":
    raise AdapterError(f"{where}: peft_type {conf.get('peft_type')!r} is not LORA")
  for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
    if bool(conf.get(key, ok)) != ok:
      raise AdapterError(f"{where}: {key}=true is not supported")
  if conf.get("bias", "none") != "none":
    raise AdapterError(f"{where}: bias={conf['bias']!r} is not supported (only 'none')")
  if conf.get("modules_to_save"):
    raise AdapterError(f"{where}: modules_to_save={conf['modules_to_save']} is not supported "
                       "(fully trained modules are not low-rank)")
  alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
  rslora = bool(conf.get("use_rslora", False))

  if not os.path.isfile(weights_path):
    raise missing(weights_path)
  from safetensors.numpy import load_file
  try:
    tensors = load_file(weights_path)
  except Exception as e:  # noqa: BLE001 — a corrupt file of any kind
    raise AdapterError(f"{where}: cannot read adapter_model.safetensors: {e}") from None
  parts: Dict[Tuple[int, str], Dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    m = _KEY.match(key)
    if m is None:
      raise AdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a q/k/v/o/gate/"
                         f"up/down projection of {cfg.name} (embedding, LM-head and other "
                         "targets are not supported)")
    layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if module not in MODULES or _PARENT[module] != parent:
      raise AdapterError(f"{where}: target module {parent}.{module!r} does not exist in "
                         f"{cfg.name} (targets: {', '.join(MODULES)})")
    if layer >= cfg.num_layers:
      raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}, but {cfg.name} has "
                         f"{cfg.num_layers} layers")
    parts.setdefault((layer, module), {})[ab] = value
  if not parts:
    raise AdapterError(f"{where}: adapter_model.safetensors holds no LoRA weights")

  ranks = {}
  for (layer, module), ab in parts.items():
    if set(ab) != {"A", "B"}:
      raise AdapterError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} only")
    d_in, d_out = target_shape(cfg, MODULES[module])
    a, b = ab["A"], ab["B"]
    for which, v in (("lora_A", a), ("lora_B", b)):
      if v.dtype.kind != "f" and v.dtype.name != "bfloat16":
        raise AdapterError(f"{where}: layer {layer} {module} {which} has dtype {v.dtype}; "
                           "LoRA weights must be floating point (f16, bf16, f32, f64)")
    r = a.shape[0]
    if a.ndim != 2 or b.ndim != 2 or a.shape != (r, d_in) or b.shape != (d_out, r):
      raise AdapterError(
          f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
          f"{tuple(b.shape)} do not fit {cfg.name}'s {module} of in={d_in}, out={d_out} "
          f"(expected ({r}, {d_in}) and ({d_out}, {r})): an adapter for another base model?")
    ranks[(layer, module)] = r
  rank = max(ranks.values())
  if max_rank is not None and rank > max_rank:
    raise AdapterError(f"{where}: rank {rank} is above max_lora_rank={max_rank}")

  weights: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
  for (layer, module), ab in parts.items():
    target = MODULES[module]
    d_in, d_out = target_shape(cfg, target)
    if target not in weights:
      weights[target] = (np.zeros((cfg.num_layers, d_in, rank), np.float32),
                         np.zeros((cfg.num_layers, rank, d_out), np.float32))
    r = ranks[(layer, module)]
    full = f"model.layers.{layer}.{_PARENT[module]}.{module}"
    a_alpha = float(_pattern_value(conf.get("alpha_pattern"), full, alpha))
    scale = a_alpha / (math.sqrt(r) if rslora else r)
    a, b = weights[target]
    a[layer, :, :r] = ab["A"].astype(np.float32).T
    b[layer, :r, :] = ab["B"].astype(np.float32).T * scale
  adapter = LoraAdapter(name=name, rank=rank, weights=weights, path=path)
  check_finite(adapter, where)
  return adapter


def check_finite(adapter: LoraAdapter, where: Optional[str] = None) -> None:
  """AdapterError unless every weight (b after its scaling, in float32) is finite: one
  NaN or Inf in a slot would reach every row of a step that reads all slots at once."""
  where = where or f"LoRA adapter {adapter.name!r}"
  for target, (a, b) in adapter.weights.items():
    for which, v in (("A", a), ("B (scaled)", b)):
      bad = ~np.isfinite(v)
      if bad.any():
        layer = int(np.argwhere(bad)[0][0])
        raise AdapterError(f"{where}: {target} lora_{which} holds {int(bad.sum())} non-finite "
                           f"values (NaN or Inf), the first in layer {layer}")


def save_peft(path: str, adapter_a: Dict[str, np.ndarray], adapter_b: Dict[str, np.ndarray],
              cfg: ModelConfig, *, rank: int, alpha: float,
              base_model: str = "", dtype=np.float32) -> None:
  """Write a PEFT LoRA directory from this layout's unscaled factors: adapter_a[target]
  [L, in, r], adapter_b[target] [L, r, out] (the layer adds alpha / r * (x a) b). PEFT
  and vLLM load what this writes."""
  os.makedirs(path, exist_ok=True)
  inv = {v: k for k, v in MODULES.items()}
  tensors = {}
  for target, a in adapter_a.items():
    b = adapter_b[target]
    module = inv[target]
    for layer in range(cfg.num_layers):
      prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
          np.asarray(a[layer]).T.astype(dtype))
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
          np.asarray(b[layer]).T.astype(dtype))
  from safetensors.numpy import save_file
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"),
            metadata={"format": "pt"})
  conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank),
          "lora_alpha": float(alpha), "lora_dropout": 0.0, "bias": "none",
          "target_modules": sorted(inv[t] for t in adapter_a), "use_rslora": False,
          "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
          "base_model_name_or_path": base_model, "inference_mode": True}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(conf, f, indent=2)


def random_adapter_factors(cfg: ModelConfig, rank: int, targets: Sequence[str], seed: int = 0,
                           std: float = 0.05):
  """Random unscaled factors (a, b) of the given targets, both non-zero (PEFT initialises
  B to zero; a test adapter must change the output)."""
  rng = np.random.default_rng(seed)
  a, b = {}, {}
  for t in targets:
    if t not in TARGETS:
      raise AdapterError(f"unknown LoRA target {t!r}; choose from {TARGETS}")
    d_in, d_out = target_shape(cfg, t)
    a[t] = (std * rng.standard_normal((cfg.num_layers, d_in, rank))).astype(np.float32)
    b[t] = (std * rng.standard_normal((cfg.num_layers, rank, d_out))).astype(np.float32)
  return a, b
