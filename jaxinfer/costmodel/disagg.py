"""How to split GPUs between a prefill pool and a decode pool for a request stream
(disaggregated serving: DistServe, Splitwise, Mooncake), from the step model alone; the
fleet simulator (jaxinfer.runtime.fleet, decode_replicas=...) checks the choice.

The prefill pool is a queue of prompts, each taking the step model's time for its prompt
alone; its utilisation is rate x that time / its replicas. The decode pool holds each
request for its G - 1 rounds; a replica carrying `rate / n_d` requests per second runs
rounds of b requests, where b = (rate / n_d) x (G - 1) x round(b) (Little's law, 8.6.1,
with the round time depending on b): the smallest such b, if it fits the replica's KV
and running cap, is its steady decode batch, and round(b) its inter-token latency.
The suggested split meets both objectives and keeps the busier pool least busy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional


@dataclasses.dataclass
class Split:
  prefill: int  # replicas
  decode: int
  prefill_utilisation: float  # of the prefill pool
  prefill_s: float  # one prompt's prefill step
  ttft_s: float  # predicted mean TTFT: prefill + its queueing (M/D/1) + the K/V transfer
  decode_batch: Optional[float]  # the steady decode batch per replica (None: no steady
  #                                state; over the cap: more than a replica can hold)
  decode_utilisation: Optional[float]  # that batch over the most a replica runs (its
  #                                      running cap, or what its KV holds)
  itl_s: Optional[float]  # the decode round at that batch
  feasible: bool  # both pools keep up: prefill utilisation < 1, decode batch within cap


def _decode_batch(rm, per_replica_rate: float, output_tokens: int, context: int,
                  cap: int) -> Optional[float]:
  """The least fixed point of b = rate x (G - 1) x round(b), from b = 1 up (None when it
  runs past 4 x cap: no steady state near the replica's limits)."""
  if per_replica_rate <= 0 or output_tokens <= 1:
    return 0.0
  b = 1.0
  for _ in range(500):
    nb = per_replica_rate * (output_tokens - 1) * rm.decode_round(max(1, math.ceil(b)), context)
    if nb > 4 * cap:
      return None
    if abs(nb - b) < 1e-6:
      return nb
    b = nb
  return b


def plan_split(rm, gpus: int, rate: float, prompt_tokens: int, output_tokens: int,
               transfer_s: float = 0.0, max_running: int = 64,
               kv_tokens: Optional[int] = None) -> List[Split]:
  """Every split of `gpus` into n_p prefill and n_d = gpus - n_p decode replicas, for a
  stream of `rate` requests/s of `prompt_tokens` in and `output_tokens` out. A split is
  feasible when its prefill pool keeps up (utilisation below 1) and its decode replicas
  reach a steady batch within max_running and their KV (kv_tokens per replica: each
  request holds prompt + output tokens)."""
  if gpus < 2:
    raise ValueError(f"a disaggregated split needs at least 2 GPUs, got {gpus}")
  t_p = rm.prefill_time(1, prompt_tokens)
  cap = max_running
  if kv_tokens is not None:
    cap = min(cap, kv_tokens // (prompt_tokens + output_tokens))
  ctx = prompt_tokens + output_tokens // 2
  out = []
  for n_p in range(1, gpus):
    n_d = gpus - n_p
    rho = rate * t_p / n_p
    wait = rho * t_p / (2 * (1 - rho)) if rho < 1 else math.inf
    b = _decode_batch(rm, rate / n_d, output_tokens, ctx, cap)
    itl = rm.decode_round(max(1, math.ceil(b)), ctx) if b is not None else None
    out.append(Split(n_p, n_d, rho, t_p, t_p + wait + transfer_s, b,
                     b / cap if b is not None else None, itl,
                     rho < 1 and b is not None and b <= cap))
  return out


def suggest(splits: List[Split], slo_ttft_s: float, slo_itl_s: float) -> Optional[Split]:
  """Among the feasible splits whose predicted TTFT and ITL meet their objectives, the one
  whose busier pool is least busy: the least max(prefill utilisation, decode
  utilisation), so neither pool is the bottleneck (None if none qualifies)."""
  ok = [s for s in splits if s.feasible and s.ttft_s <= slo_ttft_s and s.itl_s <= slo_itl_s]
  return min(ok, key=lambda s: (max(s.prefill_utilisation, s.decode_utilisation), s.prefill),
             default=None)


def plan(rm, gpus: int, rate: float, prompt_tokens: int, output_tokens: int, transfer_s: float,
         max_running: int, kv_budget_bytes: float, slo_ttft_s: float, slo_itl_s: float):
  """plan_split with each replica's KV from its budget, and suggest's choice: (splits,
  the suggested split or None)."""
  kv_tokens = int(kv_budget_bytes // rm.costs.kv_bytes_per_token)
  splits = plan_split(rm, gpus, rate, prompt_tokens, output_tokens, transfer_s, max_running,
                      kv_tokens)
  return splits, suggest(splits, slo_ttft_s, slo_itl_s)
