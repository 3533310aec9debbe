"""Bucket tables by strategy, and fitted to a trace (8.2.4: static shapes stand in for
captured CUDA graphs; every shape is one compiled executable).

Strategies for the token, request and query axes (one page tier: the attention backends
read only the pages a request holds, whatever the table's width):
  pow2 / pow4  geometric ladders up to the largest size;
  linear       n evenly spaced sizes;
  exact        every size: no padding, one executable per distinct step shape;
  fitted       per-axis sizes chosen by dynamic programming to minimise the expected
               padded size over the steps a trace produces, under a cap on the number of
               executables (`fit_table`).

A trace's steps come from running it through the scheduler on the virtual clock
(`trace_step_shapes`): which requests share a step does not depend on the table, so the
step shapes recorded under the exact table are the demand any table must cover. Imports
no JAX.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from jaxinfer.buckets import Bucket, BucketTable, geometric
from jaxinfer.costmodel.accounting import pages_for

STRATEGIES = ("pow2", "pow4", "linear", "exact", "fitted")


def ladder(strategy: str, lo: int, hi: int, n: int = 4) -> Tuple[int, ...]:
  """Sizes from lo (at least) up to hi (always included) for a fixed strategy."""
  if strategy == "pow2":
    return geometric(lo, hi, 2)
  if strategy == "pow4":
    return geometric(lo, hi, 4)
  if strategy == "linear":
    if n < 1:
      raise ValueError(f"linear ladders need n >= 1 sizes, got {n}")
    return tuple(sorted({max(lo if i == 1 else 1, -(-hi * i // n)) for i in range(1, n + 1)}))
  if strategy == "exact":
    return tuple(range(max(1, min(lo, hi)), hi + 1))
  raise ValueError(f"strategy must be one of {STRATEGIES[:4]} here, got {strategy!r}")


def table_for(strategy: str, max_tokens: int, max_requests: int, max_pages: int,
              n: int = 4) -> BucketTable:
  """A table whose token, request and prefill-slot sizes follow one strategy (tokens
  start at 16 for the geometric ladders, as the default; exact starts at 1)."""
  lo = 1 if strategy == "exact" else min(16, max_tokens)
  req = ladder(strategy, 1, max_requests, n)
  return BucketTable(token_sizes=ladder(strategy, lo, max_tokens, n), request_sizes=req,
                     page_table_sizes=(max_pages,), prefill_slot_sizes=req)


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What a step asks of the table: n tokens, d one-token works, p multi-token works of
  at most q tokens each (q = 0 when p = 0)."""
  n: int
  d: int
  p: int
  q: int


def shape_of_members(members: Sequence[Tuple[object, int, bool]]) -> StepShape:
  """From an engine StepRecord's members: (request id, tokens, is_prefill) each."""
  lens = [t for _, t, _ in members]
  multi = [t for t in lens if t > 1]
  return StepShape(sum(lens), len(lens) - len(multi), len(multi), max(multi, default=0))


def select_for(table: BucketTable, s: StepShape):
  if s.p:
    return table.select(s.n, s.d, 1, s.q, s.p)
  return table.select(s.n, s.d, 1)


def fit_sizes(values: Sequence[int], k: int, hi: int,
              weights: Optional[Sequence[float]] = None,
              cost: Optional[Callable[[int], float]] = None) -> Tuple[int, ...]:
  """At most k sizes (the largest is hi) minimising sum(w * cost(smallest size >= v))
  (cost: non-decreasing; default the size itself): exact dynamic programming over the
  distinct values, O(k m^2) for m of them."""
  cost = cost or float
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  w = np.ones(len(values)) if weights is None else np.asarray(weights, np.float64)
  vals: Dict[int, float] = {}
  for v, x in zip(values, w):
    if not 1 <= v <= hi:
      raise ValueError(f"value {v} outside [1, {hi}]")
    vals[int(v)] = vals.get(int(v), 0.0) + float(x)
  if hi not in vals:
    vals[hi] = 0.0  # the largest size is always a bucket
  xs = sorted(vals)
  ws = np.array([vals[x] for x in xs])
  m = len(xs)
  cw = np.concatenate([[0.0], np.cumsum(ws)])
  # cost(i, j): values i..j (inclusive) all padded to xs[j]
  INF = float("inf")
  best = np.full((k + 1, m), INF)
  back = np.zeros((k + 1, m), np.int64)
  cx = [cost(x) for x in xs]
  for j in range(m):
    best[1, j] = cw[j + 1] * cx[j]
  for kk in range(2, k + 1):
    for j in range(m):
      best[kk, j], back[kk, j] = best[kk - 1, j], -1
      for i in range(j):  # the previous size is xs[i]; values i+1..j pad to xs[j]
        c = best[kk - 1, i] + (cw[j + 1] - cw[i + 1]) * cx[j]
        if c < best[kk, j]:
          best[kk, j], back[kk, j] = c, i
  sizes, kk, j = [], k, m - 1
  while j >= 0 and kk >= 1:
    if kk > 1 and back[kk, j] == -1:
      kk -= 1
      continue
    sizes.append(xs[j])
    j = back[kk, j] if kk > 1 else -1
    kk -= 1
  return tuple(sorted(sizes))


def rows_cost(b: Bucket) -> float:
  """Work rows of a bucket: token rows + prefill query rows (slots x Q)."""
  return float(b.num_tokens + b.prefill_slots * b.max_query_len)


def step_time_cost(step_model) -> Callable[[Bucket], float]:
  """A bucket's cost as the step-time model's seconds for its padded shape: Rp prefill
  slots of Q new tokens, R - Rp decode slots, the rest of T as one-token rows (no cached
  context: the padding's own cost). With a roofline model, padding below the compute
  knee is free and above it costs its FLOPs, as measured here."""
  def cost(b: Bucket) -> float:
    seqs = [(b.max_query_len, 0)] * b.prefill_slots + [(1, 0)] * (
        b.num_requests - b.prefill_slots)
    seqs += [(1, 0)] * max(b.num_tokens - sum(c for c, _ in seqs), 0)
    return float(step_model.step_time(seqs))
  return cost


def roofline_cost(target: str) -> Callable[[Bucket], float]:
  """step_time_cost on the roofline of "model@hardware" (f32 on local-cpu, else bf16)."""
  from jaxinfer.costmodel import RooflineStepModel
  model, sep, hw = target.partition("@")
  if not sep:
    raise ValueError(f"a cost target is 'model@hardware', got {target!r}")
  f32 = hw == "local-cpu"
  return step_time_cost(RooflineStepModel.for_names(
      model, hw, kv_format="f32" if f32 else "bf16", bytes_per_param=4.0 if f32 else 2.0))


def padding(table: BucketTable, shapes: Sequence[StepShape],
            cost: Optional[Callable[[Bucket], float]] = None) -> Dict[str, float]:
  """Padding a trace's steps pay under a table: token rows, request slots and prefill
  query rows (slots x Q) run beyond the real ones, as fractions of what ran; "work" is
  token rows + prefill query rows (what `fit_table` minimises: a padded query row scores
  every cached and new key of its slot, measured here as costly as a token row or more)."""
  tok = tok_b = slots = slots_b = q_rows = q_rows_b = 0
  total = 0.0
  # A trace repeats its shapes (1,696 steps of the chat trace's first 80 requests are 123
  # distinct shapes): each distinct one is selected and costed once, times its count.
  for s, c in collections.Counter(shapes).items():
    b = select_for(table, s)
    total += c * (cost or rows_cost)(b)
    tok, tok_b = tok + c * s.n, tok_b + c * b.num_tokens
    slots, slots_b = slots + c * (s.d + s.p), slots_b + c * b.num_requests
    if s.p:
      q_rows += c * (s.n - s.d)
      q_rows_b += c * b.prefill_slots * b.max_query_len
  return {"steps": len(shapes),
          "padded_token_frac": 1 - tok / tok_b if tok_b else 0.0,
          "padded_slot_frac": 1 - slots / slots_b if slots_b else 0.0,
          "padded_query_row_frac": 1 - q_rows / q_rows_b if q_rows_b else 0.0,
          "padded_work_frac": 1 - (tok + q_rows) / (tok_b + q_rows_b) if tok_b else 0.0,
          "mean_bucket_tokens": tok_b / max(len(shapes), 1),
          "mean_step_cost": total / max(len(shapes), 1)}


def num_shapes(table: BucketTable) -> int:
  return sum(1 for _ in table.all_buckets())


def fit_table(shapes: Sequence[StepShape], max_shapes: int, max_tokens: int,
              max_requests: int, max_pages: int, max_sizes: int = 6,
              cost: Optional[Callable[[Bucket], float]] = None) -> Tuple[BucketTable, dict]:
  """The table of at most max_shapes executables that minimises the trace's mean step
  cost (`cost` of each step's bucket: default `rows_cost`; `step_time_cost(model)` for
  seconds on a roofline): each axis fitted by `fit_sizes` under that cost for every
  combination of sizes per axis up to max_sizes, the combinations compared on the trace.
  (Padded token rows were the first objective: on real SmolLM2 the table it chose ran
  16-request decode steps at 70 tokens, past this CPU's compute knee, and doubled TTFT
  against pow4; step time under the roofline sees the knee.)"""
  cost = functools.cache(cost or rows_cost)  # the combinations share most of their buckets
  P = max_pages
  c_tok = lambda x: cost(Bucket(x, 1, P, 1, 1, 0))  # noqa: E731
  c_qry = lambda x: cost(Bucket(x, 1, P, x, 1, 1))  # noqa: E731
  if not shapes:
    raise ValueError("fitting a table needs at least one step shape")
  if max_shapes < 1:
    raise ValueError(f"max_shapes must be >= 1, got {max_shapes}")
  ns = [s.n for s in shapes]
  rs = [s.d + s.p for s in shapes]
  qs = [min(s.q, max_tokens) for s in shapes if s.p]
  ps = [s.p for s in shapes if s.p]
  best, tried = None, 0
  k = range(1, max_sizes + 1)
  tok_k = {kt: fit_sizes(ns, kt, max_tokens, cost=c_tok) for kt in k}
  req_k = {kr: fit_sizes(rs, kr, max_requests) for kr in k}
  pre_k = {kp: tuple(sorted(set(fit_sizes(ps, kp, max_requests)) | {max_requests}))
           for kp in k} if ps else {1: (max_requests,)}
  qry_k = {kq: (1,) + fit_sizes(qs, kq, max_tokens, cost=c_qry) for kq in k} if qs else {
      1: (1, max_tokens)}
  seen = set()
  for kt, kr, kp, kq in itertools.product(k, k, pre_k, qry_k):
    tok, req, pre, qry = tok_k[kt], req_k[kr], pre_k[kp], qry_k[kq]
    if (tok, req, pre, qry) in seen:  # fewer distinct values than k: same sizes again
      continue
    seen.add((tok, req, pre, qry))
    table = BucketTable(token_sizes=tok, request_sizes=req, page_table_sizes=(max_pages,),
                        query_sizes=qry, prefill_slot_sizes=pre)
    count = num_shapes(table)
    tried += 1
    if count > max_shapes:
      continue
    pad = padding(table, shapes, cost)
    key = (pad["mean_step_cost"], pad["padded_slot_frac"], count)
    if best is None or key < best[0]:
      best = (key, table, count, pad)
  if best is None:
    smallest = BucketTable(token_sizes=(max_tokens,), request_sizes=(max_requests,),
                           page_table_sizes=(max_pages,), query_sizes=(1, max_tokens),
                           prefill_slot_sizes=(max_requests,))
    raise ValueError(f"no table of at most {max_shapes} shapes was found for these steps "
                     f"(one size per axis needs {num_shapes(smallest)}); raise max_shapes")
  _, table, count, pad = best
  return table, {"num_shapes": count, "combinations_tried": tried, **pad}


# --- traces ------------------------------------------------------------------------------

def synthetic_chat_trace(num_requests: int = 200, seed: int = 0, rate: float = 4.0,
                         max_len: int = 2048) -> List[dict]:
  """Chat-like lengths: log-normal prompts (median ~180 tokens) and outputs (median ~120),
  Poisson arrivals at `rate` per second; a stand-in for a production trace."""
  rng = np.random.default_rng(seed)
  prompt = np.clip(rng.lognormal(np.log(180), 0.9, num_requests), 4, max_len // 2)
  out = np.clip(rng.lognormal(np.log(120), 0.8, num_requests), 1, max_len // 2)
  t = np.cumsum(rng.exponential(1.0 / rate, num_requests))
  return [{"arrival_s": round(float(a), 4), "prompt_tokens": int(p), "output_tokens": int(o)}
          for a, p, o in zip(t, prompt, out)]


def load_trace(path: str) -> List[dict]:
  """JSON lines of {"arrival_s", "prompt_tokens", "output_tokens"}; each field checked."""
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      r = json.loads(line)
      if not isinstance(r, dict):
        raise ValueError(f"{path}:{i}: each line must be a JSON object, got "
                         f"{type(r).__name__}")
      for k in ("prompt_tokens", "output_tokens"):
        v = r.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
          raise ValueError(f"{path}:{i}: {k} must be an integer >= 1, got {v!r}")
      a = r.get("arrival_s", 0.0)
      if isinstance(a, bool) or not isinstance(a, (int, float)) or not a >= 0:
        raise ValueError(f"{path}:{i}: arrival_s must be a number >= 0, got {a!r}")
      out.append({"arrival_s": float(a), "prompt_tokens": r["prompt_tokens"],
                  "output_tokens": r["output_tokens"]})
  if not out:
    raise ValueError(f"{path}: no requests")
  return out


def trace_step_shapes(trace: Sequence[dict], max_tokens: int, max_requests: int,
                      policy: str = "chunked", page_size: int = 16,
                      step_model=None) -> List[StepShape]:
  """Run a trace through the scheduler on the virtual clock under the exact table and
  return its steps' shapes (the demand a table must cover)."""
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  longest = max(r["prompt_tokens"] + r["output_tokens"] for r in trace)
  pages = pages_for(longest, page_size)
  table = table_for("exact", max_tokens, max_requests, pages)
  ex = SimExecutor(step_model or AffineStepModel(), num_pages=pages * max_requests + 16,
                   page_size=page_size, token_id=1)
  eng = Engine(ex, SchedulerConfig(policy=policy, max_running=max_requests,
                                   token_budget=max_tokens, chunk_size=max_tokens),
               buckets=table, max_model_len=pages * page_size,
               max_step_records=10 ** 9, max_retained_requests=10 ** 9)
  for i, r in enumerate(sorted(trace, key=lambda r: r["arrival_s"])):
    eng.add_request([2] * r["prompt_tokens"],
                    SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True),
                    request_id=i, arrival_time=r["arrival_s"])
  eng.run()
  return [shape_of_members(s.members) for s in eng.steps]

