"""Weight offload with prefetch (8.4.3): which layers' weights live in host memory, what
that frees on the device, what it admits, and what it costs per step."""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

from jaxinfer.config import ModelConfig
from jaxinfer.costmodel import formulas as F

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """FFN weight sets of `layers` stay in host memory and are copied in before their
  layer runs, through `prefetch_buffers` device buffers (1: serial, 2: overlapped)."""
  layers: Tuple[int, ...] = ()
  prefetch_buffers: int = 2

  def __post_init__(self):
    if self.prefetch_buffers not in (1, 2):
      raise ValueError(f"prefetch_buffers must be 1 or 2, got {self.prefetch_buffers}")

  @classmethod
  def every_kth(cls, num_layers: int, k: int, buffers: int = 2) -> "OffloadConfig":
    """Every k-th layer's FFN (layers k-1, 2k-1, ...)."""
    return cls(tuple(range(k - 1, num_layers, k)), buffers)

  @classmethod
  def count(cls, num_layers: int, n: int, buffers: int = 2) -> "OffloadConfig":
    """n FFN sets spread evenly over the layers."""
    if not 0 <= n <= num_layers:
      raise ValueError(f"cannot offload {n} of {num_layers} layers")
    return cls(tuple(sorted({int((i + 1) * num_layers / n) - 1 for i in range(n)})) if n else (),
               buffers)

  @classmethod
  def to_free(cls, cfg: ModelConfig, mib: float, bytes_per_param: float = 2.0,
              buffers: int = 2) -> "OffloadConfig":
    """As many FFN sets as needed to free `mib` MiB net of the prefetch buffers."""
    s = ffn_set_bytes(cfg, bytes_per_param)
    for n in range(cfg.num_layers + 1):
      if F.offload_memory(s, n, buffers)["net_bytes"] >= mib * MIB:
        return cls.count(cfg.num_layers, n, buffers)
    raise ValueError(f"offloading every FFN of {cfg.name} frees less than {mib} MiB")


def ffn_set_bytes(cfg: ModelConfig, bytes_per_param: float = 2.0) -> int:
  """One layer's FFN (gate, up, down): Qwen3-8B bf16 = 288 MiB."""
  return int(3 * cfg.hidden_size * cfg.intermediate_size * bytes_per_param)


def kv_pages_freed(cfg: ModelConfig, off: OffloadConfig, bytes_per_param: float,
                   page_bytes: float) -> int:
  """KV pages the net device saving of `off` holds (freed sets minus prefetch buffers):
  what the engine adds to its pool when weights are offloaded (8.4.3)."""
  m = F.offload_memory(ffn_set_bytes(cfg, bytes_per_param), len(off.layers),
                       off.prefetch_buffers)
  return int(m["net_bytes"] // page_bytes)


@dataclasses.dataclass
class OffloadAccount:
  offloaded_sets: int
  freed_mib: float
  buffer_mib: float
  net_mib: float
  copy_ms_per_step: float
  extra_requests_after_prefill: int
  extra_requests_at_end: int


def account(cfg: ModelConfig, off: OffloadConfig, link_bandwidth: float,
            kv_after_prefill_bytes: float, kv_end_bytes: float,
            bytes_per_param: float = 2.0) -> OffloadAccount:
  """8.4.3: device memory freed / kept / net, copy time per step over the host link, and
  how many more requests' KV the net saving admits (after prefill / at the end)."""
  s = ffn_set_bytes(cfg, bytes_per_param)
  n = len(off.layers)
  m = F.offload_memory(s, n, off.prefetch_buffers)
  return OffloadAccount(n, m["freed_bytes"] / MIB, m["buffer_bytes"] / MIB, m["net_bytes"] / MIB,
                        1e3 * F.offload_copy_time(s, n, link_bandwidth),
                        int(m["net_bytes"] // kv_after_prefill_bytes) if n else 0,
                        int(m["net_bytes"] // kv_end_bytes) if n else 0)


def step_time(base_step_s: float, cfg: ModelConfig, off: OffloadConfig, link_bandwidth: float,
              bytes_per_param: float = 2.0) -> float:
  """A step whose layers each take base_step_s / L, with the offloaded sets' copies
  scheduled through the prefetch buffers (formulas.offload_step_time)."""
  if not off.layers:
    return base_step_s
  L = cfg.num_layers
  copy = ffn_set_bytes(cfg, bytes_per_param) / link_bandwidth
  copies = [copy if i in off.layers else 0.0 for i in range(L)]
  return F.offload_step_time([base_step_s / L] * L, copies, off.prefetch_buffers)


class OffloadStepModel:
  """Wraps a StepTimeModel: every step also streams the offloaded weights in (a step
  can't be shorter than its copies; one buffer serializes them with compute)."""

  def __init__(self, base, cfg: ModelConfig, off: OffloadConfig, link_bandwidth: float,
               bytes_per_param: float = 2.0):
    self.base, self.cfg, self.off = base, cfg, off
    self.link_bandwidth, self.bytes_per_param = link_bandwidth, bytes_per_param

  def step_time(self, seqs: Sequence[Tuple[int, int]], **shared_and_rows) -> float:
    return step_time(self.base.step_time(seqs, **shared_and_rows), self.cfg, self.off,
                     self.link_bandwidth, self.bytes_per_param)
