"""Roofline step-time model with measured MBU / MFU (8.2.1, 8.6.3).

Bytes and FLOPs are derived from the model config (never typed in). A step takes
max(FLOPs / (P x MFU), bytes / (beta x MBU)); MBU is interpolated on the bytes a step
reads and MFU on the log of a step's FLOPs, from a measured calibration table (the chapter's
8-1 table for the RTX PRO 6000; the project's own measurements for local-cpu). The model
plugs into the SimExecutor as its StepTimeModel.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from jaxinfer.config import ModelConfig, get_model_config
from jaxinfer.costmodel.formulas import chunk_pairs, ring_allreduce_time, tp_allreduce_bytes
from jaxinfer.costmodel.hardware import HardwareProfile, load_hardware
from jaxinfer.kv import bytes_per_token

log = logging.getLogger(__name__)

CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "calibration")


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """Byte and FLOP counts of one model, from its config."""
  cfg: ModelConfig
  bytes_per_param: float = 2.0
  kv_format: str = "bf16"
  page_size: int = 16
  expert_load: Optional[Tuple[float, ...]] = None  # measured share of assignments per
  #                                                 expert (None: uniform routing)

  @property
  def weight_bytes(self) -> int:
    return self.cfg.weight_bytes(self.bytes_per_param)

  @property
  def d_w(self) -> int:
    """Weight bytes a step reads (embedding rows are only looked up); for a mixture of
    experts the bound with every expert read (see weights_read)."""
    return self.cfg.weight_bytes_read_per_step(self.bytes_per_param)

  def weights_read(self, tokens: float) -> int:
    """Weight bytes a step of `tokens` new tokens reads: D_w for a dense model; a mixture
    of experts reads the experts its tokens reach (expected under uniform routing), so
    its bytes per step grow with the batch until every expert is read (expected under
    uniform routing, or under expert_load where a run measured it)."""
    if not self.cfg.num_experts:
      return self.d_w
    return self.cfg.weight_bytes_read_per_step(self.bytes_per_param, tokens, self.expert_load)

  @property
  def ffn_bytes_per_layer(self) -> int:
    cfg = self.cfg
    if cfg.num_experts:  # an MoE layer's whole MLP (router, shared and routed experts)
      return int(cfg.moe_mlp_param_count() * self.bytes_per_param)
    return int(3 * cfg.hidden_size * cfg.intermediate_size * self.bytes_per_param)

  @property
  def kv_bytes_per_token(self) -> float:
    return bytes_per_token(self.cfg, self.kv_format, self.page_size)

  @property
  def flops_per_token(self) -> int:
    """Matmul FLOPs per new token through the layers (LM head counted per sampled row); a
    mixture of experts runs each token through its k routed experts only."""
    return 2 * self.cfg.layers_param_count(self.cfg.experts_per_token)

  @property
  def lm_head_flops(self) -> int:
    """Per sampled row: the LM head's product, and a final soft cap's divide, tanh and
    multiply per logit where the model caps them (3 FLOPs each)."""
    cap = 3 * self.cfg.vocab_size if self.cfg.final_softcap else 0
    return 2 * self.cfg.vocab_size * self.cfg.hidden_size + cap

  def step_flops(self, seqs: Sequence[Tuple[int, int]], sampled: Optional[int] = None) -> float:
    """seqs: (new tokens c, cached tokens h) per request."""
    sampled = len(seqs) if sampled is None else sampled
    return (sum(c for c, _ in seqs) * self.flops_per_token + self.attention_flops(seqs)
            + sampled * self.lm_head_flops)

  def attention_flops(self, seqs: Sequence[Tuple[int, int]]) -> float:
    """The attention share of step_flops: score and value products of every new token
    against the keys it reads (its whole context, or its layer's sliding window), plus a
    soft cap's divide, tanh and multiply per score where the model caps them (counted as
    3 FLOPs)."""
    cfg = self.cfg
    per_layer = cfg.attention_flops_per_pair() / cfg.num_layers
    cap = 3 * cfg.num_heads if cfg.attn_softcap else 0
    total = 0.0
    for window, layers in self._window_groups:
      total += layers * (per_layer + cap) * sum(chunk_pairs(c, h, window) for c, h in seqs)
    return total

  @functools.cached_property
  def _window_groups(self):
    """(window, number of layers with it), 0 for full attention (computed once: the
    simulator asks at every step)."""
    ws = self.cfg.windows
    return [(w, ws.count(w)) for w in sorted(set(ws))]

  def kv_read_tokens(self, context: int) -> float:
    """Tokens of K/V a step reads for one request at `context`, averaged over layers: a
    windowed layer reads at most its window (8.2.1's L k, with L per layer)."""
    return self._kv_layer_tokens([context]) / self.cfg.num_layers

  def _kv_layer_tokens(self, contexts) -> int:
    """Tokens of K/V read summed over layers and requests (an integer: the per-step sum
    and decode_times' per-round sums agree exactly)."""
    return sum(n * (sum(min(c, w) for c in contexts) if w else sum(contexts))
               for w, n in self._window_groups)

  def step_bytes(self, seqs: Sequence[Tuple[int, int]], shared_tokens: int = 0,
                 sharing: Optional[int] = None) -> float:
    """Weights once + every request's KV at its context (up to each layer's window); a
    shared prefix of shared_tokens is read once for the `sharing` requests that hold it
    (all of them when None) in the full-attention layers, as the planner charges it
    (8.6.3)."""
    n = len(seqs) if sharing is None else sharing
    full = self.cfg.windows.count(0) / self.cfg.num_layers
    ctx = (self._kv_layer_tokens([h + c for c, h in seqs]) / self.cfg.num_layers
           - shared_tokens * max(n - 1, 0) * full)
    return self.weights_read(sum(c for c, _ in seqs)) + ctx * self.kv_bytes_per_token


@dataclasses.dataclass
class Calibration:
  """Measured efficiency tables that the model passes through at every measured point:
  MBU vs bytes read per step (decode rounds); MFU vs FLOPs per step for prefills with
  nothing cached, and for prefills after cached tokens a factor on that curve keyed by
  the cached share of the context (h / (h + c)): 8.6.3's 8K prompts with 6K cached run
  at 58% MFU where the no-cache curve gives 60.5% at the same FLOPs. Between points,
  linear in bytes, in log FLOPs and in the cached share; constant past the ends."""
  mbu_bytes: List[float]
  mbu: List[float]
  mfu_flops: List[float]
  mfu: List[float]
  source: str = ""
  # (cached share, MFU / the no-cache curve's MFU at that point's FLOPs), sorted by share
  cached_factors: List[Tuple[float, float]] = dataclasses.field(default_factory=list)

  def mbu_at(self, nbytes: float) -> float:
    return float(np.interp(nbytes, self.mbu_bytes, self.mbu))

  def _mfu_no_cache(self, flops: float) -> float:
    return float(np.interp(math.log(max(flops, 1.0)), np.log(self.mfu_flops), self.mfu))

  def mfu_at(self, flops: float, cached_share: float = 0.0) -> float:
    m = self._mfu_no_cache(flops)
    if self.cached_factors and cached_share > 0:
      shares = [0.0] + [s for s, _ in self.cached_factors]
      factors = [1.0] + [f for _, f in self.cached_factors]
      m *= float(np.interp(cached_share, shares, factors))
    return m


def load_calibration(hw: HardwareProfile, costs: ModelCosts,
                     path: Optional[str] = None) -> Calibration:
  """Read a measured table and turn it into (bytes, MBU) and (FLOPs, MFU) points. The
  table's own model config gives the FLOPs of its prefill entries."""
  path = path or os.path.join(CALIBRATION_DIR, f"{hw.name}.json")
  if not os.path.isfile(path):
    raise ValueError(f"no calibration table for hardware {hw.name!r} at {path}; measure one "
                     "(tools/measure_hardware.py --calibrate for local-cpu)")
  with open(path) as f:
    d = json.load(f)
  table_costs = ModelCosts(get_model_config(d["model"]),
                           d.get("bytes_per_param", costs.bytes_per_param),
                           d.get("kv_format", "bf16"), costs.page_size)
  table_hw = load_hardware(d["hardware"]) if d.get("hardware") else hw
  dec = []
  for e in d["decode"]:  # keyed by the table model's bytes at the point (the chapter's
    # "weights + KV read per round" agree with them to 0.05%), so that the model passes
    # through every measured round exactly
    b = table_costs.step_bytes([(1, e["context"])] * e["batch"], e.get("shared", 0))
    dec.append((b, b / (table_hw.bandwidth * e["round_ms"] / 1e3)))
  dec.sort()
  plain, cached = [], []
  for e in d["prefill"]:
    h = e.get("cached", 0)
    f = table_costs.step_flops([(e["input"] - h, h)] * e["batch"])
    (cached if h else plain).append((f, h / e["input"], e["mfu"]))
  plain.sort()
  calib = Calibration([b for b, _ in dec], [m for _, m in dec], [f for f, _, _ in plain],
                      [m for _, _, m in plain], d.get("source", path))
  calib.cached_factors = sorted((s, m / calib.mfu_at(f)) for f, s, m in cached)
  return calib


class RooflineStepModel:
  """StepTimeModel for the simulator: max(compute time, memory time) per step; with
  tensor parallelism over `tp` devices, each device's share of the FLOPs and bytes plus
  the layers' all-reduces over the hardware's device-to-device link."""

  def __init__(self, costs: ModelCosts, hw: HardwareProfile, calib: Optional[Calibration] = None,
               tp: int = 1):
    costs.cfg.check_tp(tp)
    if tp > 1 and not hw.interconnect_gbs:
      raise ValueError(f"hardware {hw.name!r} has no device-to-device link in its profile "
                       "(interconnect_gbs): tensor parallelism cannot be modelled on it")
    self.costs = costs
    self.hw = hw
    self.calib = calib
    self.tp = tp

  @classmethod
  def for_names(cls, model: str, hardware: str, kv_format: str = "bf16", page_size: int = 16,
                bytes_per_param: float = 2.0, calibration: Optional[str] = "auto",
                tp: int = 1) -> "RooflineStepModel":
    """calibration: "auto" (the hardware's own table, else the RTX PRO 6000 table's
    efficiencies as a stand-in, with a warning), a table path, or None (MBU = MFU = 1).
    tp: devices of tensor parallelism (the one-device calibration read at each device's
    share of the step)."""
    costs = ModelCosts(get_model_config(model), bytes_per_param, kv_format, page_size)
    hw = load_hardware(hardware)
    if calibration is None:
      return cls(costs, hw, None, tp)
    path = None if calibration == "auto" else calibration
    if calibration == "auto" and not os.path.isfile(os.path.join(CALIBRATION_DIR,
                                                                 f"{hw.name}.json")):
      path = os.path.join(CALIBRATION_DIR, "rtx-pro-6000.json")
      log.warning("no calibration table for %s: using the RTX PRO 6000 table's MBU/MFU", hw.name)
    return cls(costs, hw, load_calibration(hw, costs, path), tp)

  def compute_time(self, seqs, sampled=None) -> float:
    f = self.costs.step_flops(seqs, sampled) / self.tp  # heads, FFN columns, vocab split
    ctx = sum(c + h for c, h in seqs)
    mfu = self.calib.mfu_at(f, sum(h for _, h in seqs) / ctx if ctx else 0.0) \
        if self.calib else 1.0
    return f / (self.hw.peak_flops * mfu)

  def memory_time(self, seqs, shared_tokens: int = 0, sharing: Optional[int] = None) -> float:
    b = self.costs.step_bytes(seqs, shared_tokens, sharing) / self.tp  # weights, KV split
    mbu = self.calib.mbu_at(b) if self.calib else 1.0
    return b / (self.hw.bandwidth * mbu)

  def comm_time(self, seqs) -> float:
    """Tensor parallel: two all-reduces of the step's [T, D] activations per layer over
    the device-to-device link (on the critical path: not overlapped with compute)."""
    if self.tp == 1:
      return 0.0
    cfg = self.costs.cfg
    msg = tp_allreduce_bytes(sum(c for c, _ in seqs), cfg.hidden_size, self.costs.bytes_per_param)
    return 2 * cfg.num_layers * ring_allreduce_time(
        msg, self.tp, self.hw.interconnect_bandwidth, self.hw.interconnect_latency_us * 1e-6)

  def step_time(self, seqs: Sequence[Tuple[int, int]], shared_tokens: int = 0,
                sharing: Optional[int] = None, logits_rows: Optional[int] = None) -> float:
    """The one step cost of the planner and the simulator: max(compute, memory) time
    (+ the all-reduces under tensor parallelism). logits_rows: LM-head rows the step
    computes (a verify of m drafts: m + 1 per request; a non-final prefill chunk: 0); one
    per request when None."""
    if not seqs:
      return 0.0
    return max(self.compute_time(seqs, logits_rows),
               self.memory_time(seqs, shared_tokens, sharing)) + self.comm_time(seqs)

  def decode_times(self, contexts: Sequence[int], n: int, shared_tokens: int = 0,
                   sharing: Optional[int] = None) -> np.ndarray:
    """The times of n decode rounds of one batch, round k running one token per request
    after contexts[i] + k cached tokens: step_time([(1, h + k) for h in contexts]) for
    k < n, equal to it bit for bit, in one pass (the fleet simulator's fast-forward over
    a stretch of plain decoding). The shared prefix is the same in every round."""
    if n <= 0 or not len(contexts):
      return np.zeros(max(n, 0))
    costs, cfg = self.costs, self.costs.cfg
    b = len(contexts)
    h = np.asarray(contexts, np.int64)
    k = np.arange(n, dtype=np.int64)
    h_sum = int(h.sum())
    # Per-request sums over the window groups, as integers per round: attention pairs
    # (the new token sees min(h + k + 1, W) keys) and K/V tokens read (the same count).
    ctx = h[None, :] + k[:, None] + 1 if any(w for w, _ in costs._window_groups) else None
    sums = {}
    for w, _ in costs._window_groups:
      sums[w] = (np.minimum(ctx, w).sum(1) if w else h_sum + b * (k + 1))
    per_layer = cfg.attention_flops_per_pair() / cfg.num_layers
    cap = 3 * cfg.num_heads if cfg.attn_softcap else 0
    attn = np.zeros(n)
    for w, layers in costs._window_groups:
      attn = attn + layers * (per_layer + cap) * sums[w]
    flops = (b * costs.flops_per_token + attn + b * costs.lm_head_flops) / self.tp
    if self.calib:
      c = self.calib
      logf = np.array([math.log(max(f, 1.0)) for f in flops.tolist()])
      mfu = np.interp(logf, np.log(c.mfu_flops), c.mfu)
      if c.cached_factors:
        share = (h_sum + b * k) / (h_sum + b * k + b)
        f = np.interp(share, [0.0] + [s for s, _ in c.cached_factors],
                      [1.0] + [x for _, x in c.cached_factors])
        mfu = np.where(share > 0, mfu * f, mfu)
    else:
      mfu = 1.0
    compute = flops / (self.hw.peak_flops * mfu)
    layer_tokens = np.zeros(n, np.int64)
    for w, layers in costs._window_groups:
      layer_tokens = layer_tokens + layers * sums[w]
    m = b if sharing is None else sharing
    full = cfg.windows.count(0) / cfg.num_layers
    kv = layer_tokens / cfg.num_layers - shared_tokens * max(m - 1, 0) * full
    nbytes = (costs.weights_read(b) + kv * costs.kv_bytes_per_token) / self.tp
    mbu = np.interp(nbytes, self.calib.mbu_bytes, self.calib.mbu) if self.calib else 1.0
    memory = nbytes / (self.hw.bandwidth * mbu)
    return np.maximum(compute, memory) + self.comm_time([(1, 0)] * b)

  def breakdown(self, seqs: Sequence[Tuple[int, int]], shared_tokens: int = 0,
                sharing: Optional[int] = None) -> dict:
    """What step_time computes, itemised (per device under tensor parallelism): the
    step's FLOPs and bytes, the MFU and MBU the calibration gives them, the compute,
    memory and communication times, and which bound the step (8.6.3's MFU / MBU)."""
    flops = self.costs.step_flops(seqs) / self.tp
    nbytes = self.costs.step_bytes(seqs, shared_tokens, sharing) / self.tp
    ctx = sum(c + h for c, h in seqs)
    mfu = self.calib.mfu_at(flops, sum(h for _, h in seqs) / ctx if ctx else 0.0) \
        if self.calib else 1.0
    mbu = self.calib.mbu_at(nbytes) if self.calib else 1.0
    compute, memory = self.compute_time(seqs), self.memory_time(seqs, shared_tokens, sharing)
    return {"flops": flops, "bytes": nbytes, "mfu": mfu, "mbu": mbu, "compute_s": compute,
            "memory_s": memory, "comm_s": self.comm_time(seqs),
            "bound": "compute" if compute >= memory else "memory",
            "time_s": self.step_time(seqs, shared_tokens, sharing)}

  # 8.6.3 rates
  def decode_round(self, batch: int, context: int, shared_tokens: int = 0) -> float:
    return self.step_time([(1, context)] * batch, shared_tokens)

  def prefill_time(self, batch: int, new_tokens: int, cached: int = 0,
                   shared_tokens: int = 0) -> float:
    return self.step_time([(new_tokens, cached)] * batch, shared_tokens)

  def rates(self, batch: int, prompt_tokens: int, context: int) -> dict:
    """r_P: new prefill tokens per accelerator second; r_D: decode calls per second (a
    batch step counts one call per request, its time once)."""
    t_p = self.prefill_time(batch, prompt_tokens)
    t_d = self.decode_round(batch, context)
    return {"r_prefill": batch * prompt_tokens / t_p, "r_decode": batch / t_d,
            "prefill_s": t_p, "decode_round_s": t_d}
