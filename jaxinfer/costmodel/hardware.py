"""Hardware profiles (the chapter's reference table) as JSON files under configs/hardware/."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "hardware")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  name: str
  memory_bandwidth_gbs: float  # beta
  peak_tflops_bf16: Optional[float]  # P (dense BF16, FP32 accumulation)
  memory_gb: Optional[float] = None
  power_w: Optional[float] = None
  host_link_gbs: Optional[float] = None  # per direction
  host_link: str = ""
  peak_tflops_f32: Optional[float] = None
  description: str = ""
  compute_dtype: str = "bfloat16"  # which peak a step runs against (CPUs here: float32)
  # device-to-device link of tensor parallelism (per direction) and a per-hop latency
  interconnect_gbs: Optional[float] = None
  interconnect: str = ""
  interconnect_latency_us: float = 0.0

  @property
  def bandwidth(self) -> float:
    return self.memory_bandwidth_gbs * 1e9

  @property
  def peak_flops(self) -> float:
    if self.compute_dtype == "float32":
      tf = self.peak_tflops_f32
    else:
      tf = self.peak_tflops_bf16 or self.peak_tflops_f32
    if not tf:
      raise ValueError(f"hardware {self.name!r} has no peak FLOP/s in its profile")
    return tf * 1e12

  @property
  def link_bandwidth(self) -> float:
    if not self.host_link_gbs:
      raise ValueError(f"hardware {self.name!r} has no host link bandwidth in its profile")
    return self.host_link_gbs * 1e9


  @property
  def interconnect_bandwidth(self) -> float:
    if not self.interconnect_gbs:
      raise ValueError(f"hardware {self.name!r} has no device-to-device link in its profile "
                       "(interconnect_gbs): tensor parallelism cannot be modelled on it")
    return self.interconnect_gbs * 1e9


def available() -> list:
  return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def load_hardware(name_or_path: str) -> HardwareProfile:
  path = name_or_path if name_or_path.endswith(".json") else os.path.join(
      CONFIG_DIR, name_or_path + ".json")
  if not os.path.isfile(path):
    raise ValueError(f"unknown hardware profile {name_or_path!r}; available: {available()}")
  with open(path) as f:
    d = json.load(f)
  fields = {f.name for f in dataclasses.fields(HardwareProfile)}
  return HardwareProfile(**{k: v for k, v in d.items() if k in fields})
