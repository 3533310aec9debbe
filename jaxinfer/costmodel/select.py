"""Configuration selection (8.6.3): memory first, then the deadline, then GPU-seconds
and energy per good result."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Optional

from jaxinfer.config import get_model_config
from jaxinfer.costmodel.hardware import load_hardware
from jaxinfer.costmodel.roofline import ModelCosts, RooflineStepModel, load_calibration
from jaxinfer.plotting import pyplot, save
from jaxinfer.costmodel.accounting import pages_for

MIB = 2**20
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                              "plan_select.json")


@dataclasses.dataclass
class VariantResult:
  name: str
  label: str
  kv_mib: float  # KV (+ extra, e.g. draft model) memory at the end of generation
  prefill_s: float
  round_ms: float
  rounds: int
  total_s: float
  fits_memory: bool
  meets_deadline: bool
  gpu_s_per_good: float
  joules_per_good: float
  # what the times rest on (8.6.3): FLOPs, bytes, MFU and MBU of the prefill step and of
  # a decode round at the mean context, and which bound each
  prefill_flops: float = 0.0
  prefill_bytes: float = 0.0
  prefill_mfu: float = 0.0
  prefill_bound: str = ""
  round_flops: float = 0.0
  round_bytes: float = 0.0
  round_mbu: float = 0.0
  round_bound: str = ""


def evaluate(variant: Dict, *, model: str, hardware: str, input_tokens: int, shared_prefix: int,
             output_tokens: int, num_requests: int, kv_budget_gib: float, deadline_s: float,
             page_size: int = 16) -> VariantResult:
  cfg = get_model_config(model)
  hw = load_hardware(hardware)
  costs = ModelCosts(cfg, 2.0, variant.get("kv_format", "bf16"), page_size)
  rm = RooflineStepModel(costs, hw, load_calibration(hw, costs))
  share = variant.get("share_prefix", False)
  shared = shared_prefix if share else 0
  shared_full = shared // page_size * page_size
  end_tokens = input_tokens + output_tokens - 1  # L + G - 1 (8.1)
  slot = costs.kv_bytes_per_token * page_size
  kv = (pages_for(shared_full, page_size) +
        num_requests * pages_for(end_tokens - shared_full, page_size)) * slot
  kv_mib = kv / MIB + variant.get("extra_memory_mib", 0.0)
  fits = kv_mib <= kv_budget_gib * 1024
  prefill = rm.prefill_time(num_requests, input_tokens - shared, shared, shared)
  prefill *= 1.0 + variant.get("prefill_overhead", 0.0)
  ctx = input_tokens + output_tokens // 2  # mean context over the decode
  round_s = rm.decode_round(num_requests, ctx, shared) + variant.get("round_overhead_ms", 0) / 1e3
  rounds = math.ceil((output_tokens - 1) / variant.get("tokens_per_round", 1))
  total = prefill + rounds * round_s
  meets = total <= deadline_s
  good = num_requests if (fits and meets) else 0
  gpu_s = total / good if good else math.inf
  watts = hw.power_w or 0.0
  pre = rm.breakdown([(input_tokens - shared, shared)] * num_requests, shared, None)
  rnd = rm.breakdown([(1, ctx)] * num_requests, shared, None)
  return VariantResult(variant["name"], variant.get("label", ""), kv_mib, prefill, 1e3 * round_s,
                       rounds, total, fits, meets, gpu_s, gpu_s * watts if good else math.inf,
                       pre["flops"], pre["bytes"], pre["mfu"], pre["bound"], rnd["flops"],
                       rnd["bytes"], rnd["mbu"], rnd["bound"])


def select(config_path: Optional[str] = None, *, output_tokens: int = 256,
           num_requests: int = 16, kv_budget_gib: float = 12.0, deadline_s: float = 7.0):
  with open(config_path or DEFAULT_CONFIG) as f:
    c = json.load(f)
  results = [evaluate(v, model=c["model"], hardware=c["hardware"],
                      input_tokens=c["input_tokens"], shared_prefix=c["shared_prefix"],
                      output_tokens=output_tokens, num_requests=num_requests,
                      kv_budget_gib=kv_budget_gib, deadline_s=deadline_s)
             for v in c["variants"]]
  ok = [r for r in results if r.fits_memory and r.meets_deadline]
  chosen = min(ok, key=lambda r: r.gpu_s_per_good).name if ok else None
  return results, chosen


def plot_plane(results: List[VariantResult], kv_budget_gib: float, deadline_s: float, path: str,
               chosen: Optional[str] = None) -> None:
  """Figure 8-35: each variant on the memory-vs-time plane, budget and deadline drawn."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for r in results:
    color = "tab:green" if (r.fits_memory and r.meets_deadline) else "tab:red"
    ax.scatter([r.total_s], [r.kv_mib / 1024], s=80 if r.name == chosen else 40, color=color,
               edgecolor="black" if r.name == chosen else None, zorder=3)
    ax.annotate(f"{r.name}: {r.label}", (r.total_s, r.kv_mib / 1024), fontsize=8,
                xytext=(5, 4), textcoords="offset points")
  ax.axhline(kv_budget_gib, color="gray", linestyle="--", label=f"KV budget {kv_budget_gib} GiB")
  ax.axvline(deadline_s, color="gray", linestyle=":", label=f"deadline {deadline_s} s")
  ax.set_xlabel("time to finish all requests (s)")
  ax.set_ylabel("KV + extra memory (GiB)")
  ax.set_title(f"configuration selection (chosen: {chosen or 'none'})")
  ax.legend(fontsize=8, loc="lower right")
  save(fig, path, dpi=110)
