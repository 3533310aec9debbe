"""The chapter's formulas as functions; each docstring cites its chapter section."""
from __future__ import annotations

import math
from typing import Sequence

MIB = 2**20
GIB = 2**30


# --- 8.1 a request's time -----------------------------------------------------------------
def request_time(ttft: float, itl: float, output_tokens: int) -> float:
  """8.1.3: T_request = TTFT + sum_j ITL_j over the G - 1 gaps (here all equal to itl)."""
  return ttft + (output_tokens - 1) * itl


def decode_throughput(batch: int, round_s: float) -> float:
  """8.1.3: output tokens per second when each round of round_s gives batch tokens."""
  return batch / round_s


def compute_seconds(flops: float, peak_flops: float, mfu: float = 1.0) -> float:
  """8.6.3 without measurements: a compute-bound phase takes FLOPs / (P x MFU)."""
  return flops / (peak_flops * mfu)


def read_seconds(nbytes: float, bandwidth: float, mbu: float = 1.0) -> float:
  """8.6.3 without measurements: a read-bound round takes bytes / (beta x MBU); at
  MBU = 1 the read floor (8.2.1's lower bound)."""
  return nbytes / (bandwidth * mbu)


# --- 8.2.1 weight reuse ------------------------------------------------------------------
def bytes_per_round(d_w: float, batch: int, context: int, kv_bytes_per_token: float) -> float:
  """8.2.1: D(b, L) = D_w + b L k."""
  return d_w + batch * context * kv_bytes_per_token


def bytes_per_output_token(d_w: float, batch: int, context: int, kv_bytes_per_token: float,
                           weights_in_rom: bool = False) -> float:
  """8.2.1: d = D_w / b + L k; with weights in a separate fast store (ROM) only L k."""
  return (0.0 if weights_in_rom else d_w / batch) + context * kv_bytes_per_token


def b_kv(d_w: float, context: int, kv_bytes_per_token: float) -> int:
  """8.2.1: the batch at which KV reads reach weight reads, ceil(D_w / (L k))."""
  return math.ceil(d_w / (context * kv_bytes_per_token))


def weight_arithmetic_intensity(batch: int, bytes_per_weight: float) -> float:
  """8.2.1: FLOPs per weight byte of Y = XW with b rows, 2b / s_w."""
  return 2 * batch / bytes_per_weight


def step_time_lower_bound(batch: int, flops_per_token: float, peak_flops: float, d_w: float,
                          context: int, kv_bytes_per_token: float, bandwidth: float) -> float:
  """8.2.1: T_step >= max(b F / P, (D_w + b L k) / beta)."""
  return max(batch * flops_per_token / peak_flops,
             bytes_per_round(d_w, batch, context, kv_bytes_per_token) / bandwidth)


# --- 8.2.3 chunks --------------------------------------------------------------------------
def chunk_pairs(chunk: int, cached: int, window: int = 0) -> int:
  """8.2.3: N_pair = c h + c (c + 1) / 2. With a sliding window of W keys (0: none) the
  query at position p attends to min(p + 1, W) keys: the sum of min(t, W) over t = h + 1
  .. h + c."""
  if not window:
    return chunk * cached + chunk * (chunk + 1) // 2
  lo, hi = cached + 1, cached + chunk
  top = min(hi, window)
  below = top * (top + 1) // 2 - (lo - 1) * lo // 2 if top >= lo else 0
  return below + max(0, hi - max(lo, window + 1) + 1) * window


# --- 8.3.3 recurrent-state snapshots ------------------------------------------------------
def snapshot_restore(match_tokens: int, interval: int) -> int:
  """8.3.3: a recurrent / hybrid model restores a prefix match from its latest snapshot
  at or before it (snapshots every `interval` tokens) and recomputes the rest."""
  return match_tokens // interval * interval


# --- 8.3.4 prefix cache value ----------------------------------------------------------------
def prefix_value(p_hit: float, t_recompute: float, t_fetch: float, t_maintain: float) -> float:
  """8.3.4: V_h = p_h (T_r - T_f) - T_m (expected seconds saved by keeping a prefix)."""
  return p_hit * (t_recompute - t_fetch) - t_maintain


def hit_probability_threshold(t_recompute: float, t_fetch: float, t_maintain: float) -> float:
  """8.3.4: keep the prefix only if p_h > T_m / (T_r - T_f)."""
  if t_recompute <= t_fetch:
    return math.inf
  return t_maintain / (t_recompute - t_fetch)


def saving_per_mib(p_hit: float, t_recompute: float, t_fetch: float, t_maintain: float,
                   size_bytes: float) -> float:
  """8.3.4: rank candidates by V_h per MiB when space is short."""
  return prefix_value(p_hit, t_recompute, t_fetch, t_maintain) / (size_bytes / MIB)


# --- 8.4.2 KV compression --------------------------------------------------------------------
def kv_compression_gain(bytes_saved: float, bandwidth: float, t_convert: float) -> float:
  """8.4.2: net time gain of reading compressed KV, dT = dD / beta - T_c."""
  return bytes_saved / bandwidth - t_convert


def linear_crossover(a1: float, b1: float, a2: float, b2: float) -> float:
  """Where two fitted lines a + b L meet (8.4.2: BF16 6.44 + 4.37e-5 L ms vs FP8
  6.58 + 2.37e-5 L ms on H100 cross at L = 7000)."""
  return (a2 - a1) / (b1 - b2)


# --- 8.4.3 weight offload ---------------------------------------------------------------------
def offload_memory(set_bytes: float, num_offloaded: int, prefetch_buffers: int) -> dict:
  """8.4.3: device memory freed by offloading num_offloaded weight sets, memory the
  prefetch buffers keep, and the net saving."""
  freed = set_bytes * num_offloaded
  kept = set_bytes * min(prefetch_buffers, num_offloaded)
  return {"freed_bytes": freed, "buffer_bytes": kept, "net_bytes": freed - kept}


def offload_copy_time(set_bytes: float, num_offloaded: int, link_bandwidth: float) -> float:
  """8.4.3: copies repeat every step; T_copy >= bytes / link bandwidth."""
  return set_bytes * num_offloaded / link_bandwidth


def offload_step_time(compute_times: Sequence[float], copy_times: Sequence[float],
                      prefetch_buffers: int) -> float:
  """8.4.3: one step through the layers when some layers' weights come from host memory.

  compute_times[i]: layer i's compute; copy_times[i]: its host->device copy (0 if its
  weights stay resident). The copy engine moves one set at a time into one of
  `prefetch_buffers` device buffers; a buffer frees when the layer that used it has run.
  One buffer: copy, compute, copy (serial). Two: the next set's copy overlaps compute.
  A step can't be shorter than its copies.
  """
  if prefetch_buffers < 1:
    raise ValueError("prefetch_buffers must be >= 1")
  offloaded = [i for i, c in enumerate(copy_times) if c > 0]
  copy_end, layer_end, t = [], [], 0.0
  for i, c in enumerate(compute_times):
    if copy_times[i] > 0:
      j = len(copy_end)
      buffer_free = layer_end[offloaded[j - prefetch_buffers]] if j >= prefetch_buffers else 0.0
      engine_free = copy_end[-1] if copy_end else 0.0
      copy_end.append(max(engine_free, buffer_free) + copy_times[i])
      t = max(t, copy_end[-1])
    t += c
    layer_end.append(t)
  return max(t, sum(copy_times))


def compressed_transfer_pays(r_dec: float, link_bandwidth: float, ratio: float) -> bool:
  """8.4.3: compressed transfer (compressed size = ratio x original) helps only if the
  decompression throughput R_dec > B_link / (1 - ratio)."""
  return r_dec > link_bandwidth / (1.0 - ratio)


# --- 8.5 speculative decoding ------------------------------------------------------------------
def expected_tokens(acceptance: Sequence[float] | float, draft_len: int | None = None) -> float:
  """8.5.2 / 8.5.4: E[N_m] = 1 + sum_{j<=m} prod_{i<=j} a_i (a scalar a: 1 + a + ... + a^m)."""
  if not isinstance(acceptance, (list, tuple)):
    acceptance = [acceptance] * int(draft_len or 0)
  e, prod = 1.0, 1.0
  for a in acceptance:
    prod *= a
    e += prod
  return e


def acceptance_rate(p: Sequence[float], q: Sequence[float]) -> float:
  """8.5.1: the chance a draft token x ~ q is accepted with probability min(1, p(x) / q(x)):
  sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x))."""
  return sum(min(a, b) for a, b in zip(p, q))


def time_per_token(round_times: Sequence[float], tokens: Sequence[int]) -> float:
  """8.5.2: sum T_r / sum N_r (never the mean of per-round ratios)."""
  return sum(round_times) / sum(tokens)


def should_lengthen(t_now: float, n_now: float, t_next: float, n_next: float) -> bool:
  """8.5.4: lengthen the draft only while dT / dN < T / N."""
  dn = n_next - n_now
  return dn > 0 and (t_next - t_now) / dn < t_now / n_now


def draft_break_even(round_time: float, plain_step: float) -> float:
  """8.5.2: drafting pays while round time < E[N] x plain step: the E[N] needed."""
  return round_time / plain_step


def amortized_index_cost(build_s: float, output_tokens: int) -> float:
  """8.5.2: one-time index building spread over the output tokens."""
  return build_s / output_tokens


# --- 8.6 serving ---------------------------------------------------------------------------------
def littles_law(arrival_rate: float, mean_time: float) -> float:
  """8.6.1: n = lambda T."""
  return arrival_rate * mean_time


def amdahl(fraction: float, speedup: float, overhead_fraction: float = 0.0) -> float:
  """8.6.3: overall speed-up 1 / ((1 - f) + f / s), with preparation time counted as an
  extra fraction of the original time."""
  return 1.0 / ((1.0 - fraction) + fraction / speedup + overhead_fraction)


def gpu_seconds(prompt_tokens: int, output_tokens: int, r_prefill: float, r_decode: float) -> float:
  """8.6.3: t_GPU = L / r_P + (G - 1) / r_D."""
  return prompt_tokens / r_prefill + (output_tokens - 1) / r_decode


def goodput(correct_on_time: int, t_obs: float) -> float:
  """8.6.2: R_good = sum Q_i D_i / T_obs."""
  return correct_on_time / t_obs


# --- tensor parallelism (beyond the chapter: jaxinfer/sharding.py's Megatron layout) ----------------
def tp_allreduce_bytes(tokens: int, hidden: int, bytes_per_value: float) -> float:
  """One of a layer's two all-reduces under tensor parallelism (after the attention
  output projection and after the FFN's down projection): the [T, D] activations."""
  return tokens * hidden * bytes_per_value


def ring_allreduce_time(nbytes: float, devices: int, link_bandwidth: float,
                        hop_latency_s: float = 0.0) -> float:
  """A ring all-reduce of nbytes over `devices`: reduce-scatter then all-gather, each
  device sending and receiving 2 (n - 1) / n x nbytes over its link, in 2 (n - 1) hops."""
  if devices <= 1:
    return 0.0
  return 2 * (devices - 1) / devices * nbytes / link_bandwidth + 2 * (devices - 1) * hop_latency_s
