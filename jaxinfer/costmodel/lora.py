"""What LoRA adapters cost (8.2.1): bytes by rank, targets, dtype and model, and the time
the grouped low-rank work adds to a step. Plain Python (no JAX).

Per adapted weight W [in, out] an adapter holds A [in, r] and B [r, out]: r (in + out)
parameters per layer. In a step each distinct adapter's A and B are read once (the
requests sharing it are grouped, Punica / S-LoRA) and each of its tokens runs 2 FLOPs per
parameter; loading an adapter into a device slot moves its bytes over the host link.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

from jaxinfer.config import ModelConfig
from jaxinfer.costmodel.accounting import pages_for

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_ALIASES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
            "down": "w_down", "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
            "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def parse_targets(names: Sequence[str]) -> Tuple[str, ...]:
  """q,v / q_proj,v_proj / wq,wv / all -> this project's weight names, in TARGETS order."""
  if list(names) == ["all"]:
    return TARGETS
  out = set()
  for n in names:
    t = _ALIASES.get(n, n)
    if t not in TARGETS:
      raise ValueError(f"unknown LoRA target {n!r}; choose from q, k, v, o, gate, up, down "
                       "(or their q_proj / wq names), or all")
    out.add(t)
  return tuple(t for t in TARGETS if t in out)


def target_shape(cfg: ModelConfig, target: str) -> Tuple[int, int]:
  """(in, out) of the adapted weight."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"wq": (D, NH), "wk": (D, KH), "wv": (D, KH), "wo": (NH, D), "w_gate": (D, F),
          "w_up": (D, F), "w_down": (F, D)}[target]


def adapter_params(cfg: ModelConfig, rank: int, targets: Sequence[str]) -> int:
  """Parameters of one adapter over every layer: L r sum(in + out)."""
  return cfg.num_layers * sum(rank * sum(target_shape(cfg, t)) for t in targets)


def adapter_bytes(cfg: ModelConfig, rank: int, targets: Sequence[str],
                  bytes_per_value: float = 2.0) -> int:
  return int(adapter_params(cfg, rank, targets) * bytes_per_value)


def pool_bytes(cfg: ModelConfig, num_slots: int, rank: int, targets: Sequence[str],
               bytes_per_value: float) -> int:
  """Device bytes of the adapter slots: num_slots + 1 (slot 0 = no adapter) of `rank`."""
  return (num_slots + 1) * adapter_bytes(cfg, rank, targets, bytes_per_value)


def kv_pages_taken(cfg: ModelConfig, num_slots: int, rank: int, targets: Sequence[str],
                   bytes_per_value: float, page_bytes: float) -> int:
  """KV pages the adapter slots' device memory displaces (the pool the executor
  allocates, rounded up to whole pages)."""
  return pages_for(pool_bytes(cfg, num_slots, rank, targets, bytes_per_value), int(page_bytes))


@dataclasses.dataclass(frozen=True)
class LoraCost:
  """What adapters add to a step: per distinct adapter its A/B bytes read once at the
  device's bandwidth plus 2 FLOPs per parameter per token at its compute rate; a load
  into a slot moves its bytes over the host link."""
  bytes_per_value: float
  read_bytes_per_s: float
  flops_per_s: float
  link_bytes_per_s: float

  @classmethod
  def for_hardware(cls, hw, bytes_per_value: float = 2.0) -> "LoraCost":
    link = hw.link_bandwidth if hw.host_link_gbs else hw.bandwidth
    return cls(bytes_per_value, hw.bandwidth, hw.peak_flops, link)

  def step_s(self, params: int, tokens: int) -> float:
    """One distinct adapter of `params` parameters serving `tokens` tokens of a step."""
    return (params * self.bytes_per_value / self.read_bytes_per_s
            + 2.0 * params * tokens / self.flops_per_s)

  def load_s(self, params: int) -> float:
    return params * self.bytes_per_value / self.link_bytes_per_s
