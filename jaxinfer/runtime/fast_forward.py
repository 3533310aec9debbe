"""Fast-forward for simulated engines: a stretch of plain decode rounds as one event.

When every running request only decodes and nothing can change the batch, the rounds
ahead are known: round k runs one token per request after its context + k tokens, so its
time is the step model's for that batch (8.2.1's decode round), and the requests' tokens,
times and pages follow. `fast_forward(engine, until)` runs the rounds that start before
`until` that way — the fleet simulator's replicas between arrivals — and leaves the
engine exactly as `Engine.step` would round by round (the same per-token times, to the
bit: the executor's `decode_times` equal its per-step times).

A stretch stops before anything step() would decide differently: the round in which a
request finishes (left to step(): it ends the request), an admission (a request waiting
while there is room to run it), a step that would not hold every running request, pages
that are neither reserved nor free (eviction or preemption), a sliding window releasing
pages, the arrival of a request that there is room to admit, a drafter, a
structured-output grammar, stop strings, or a sampled token that is a stop token.
"""
from __future__ import annotations

import bisect
import math

from jaxinfer.runtime.scheduler import ScheduledSeq, StepPlan


def _batch_fixed(engine) -> bool:
  """Whether step() would run every running request as one decode token, with no
  drafting and no stop decided by the token, for as long as none finishes and nothing is
  admitted."""
  ex, sch = engine.executor, engine.scheduler
  cfg = sch.config
  run = sch.running
  if (not ex.virtual_clock or engine._in_flight is not None or engine.speculator is not None
      or engine._failed or not run or cfg.window or engine.pm.windows):
    return False
  if len(run) > min(cfg.token_budget, sch.max_step_tokens, sch.max_step_requests):
    return False
  tok, eos = ex.token_id, engine.eos_token_ids
  for r in run:
    sp = r.sampling
    if (r.num_pending != 1 or not r.output_token_ids or r.draft or r.grammar is not None
        or (sp.stop and engine.tokenizer is not None) or tok in sp.stop_token_ids
        or (tok in eos and not sp.ignore_eos) or sch.pm.shares_tail(r.request_id)):
      return False
  return True


class _Stretch:
  """The rounds of one fixed batch, planned ahead in growing chunks and applied up to a
  time: `starts` / `ends` of the planned rounds, `applied` of them run on the engine."""

  def __init__(self, engine, until: float):
    sch, pm = engine.scheduler, engine.pm
    self.t0 = engine.now()  # when its first round starts
    self.run = list(sch.running)
    self.contexts = [r.num_computed for r in self.run]  # at the stretch's first round
    # Rounds up to the one in which the first request finishes (left to step()).
    self.n = min(r.sampling.max_tokens - len(r.output_token_ids) for r in self.run) - 1
    self.until = until  # no round starts at or after it (a waiting request's arrival)
    # The shared prefix is the same in every round: its pages are whole pages each
    # request computed past, and the pages a round adds are each request's own.
    self.shared, self.sharing = StepPlan(
        [ScheduledSeq(r, c, 1) for r, c in zip(self.run, self.contexts)], [], [], [], [], [],
        self.t0, pm).shared
    self.starts, self.ends, self.applied, self.chunk = [], [], 0, 8
    self.count = engine.steps.count  # the engine's step count the stretch is valid at

  @property
  def end(self) -> float:
    """The clock after the planned rounds."""
    return self.ends[-1] if self.ends else -math.inf

  def plan(self, ex, until: float) -> bool:
    """Plan rounds until one starts at or after `until` (or none is left); False if the
    executor cannot price them."""
    t = self.ends[-1] if self.ends else None
    while len(self.ends) < self.n and (t is None or t < min(until, self.until)):
      done = len(self.ends)
      times = ex.decode_times([c + done for c in self.contexts], min(self.chunk, self.n - done),
                              self.shared, self.sharing)
      if times is None:
        return False
      t = self.ends[-1] if self.ends else self.t0
      for d in times.tolist():  # the clock advances round by round, as step() adds them
        if t >= self.until:
          self.n = len(self.ends)
          break
        self.starts.append(t)
        t = t + d
        self.ends.append(t)
      self.chunk *= 4
    return True

  def apply(self, engine, until: float) -> int:
    """Run the planned rounds that start before `until` on the engine; how many."""
    k = bisect.bisect_left(self.starts, until, lo=self.applied)
    m = k - self.applied
    if m <= 0:
      return 0
    ex, pm = engine.executor, engine.pm
    ends = self.ends[self.applied:k]
    for r, c in zip(self.run, self.contexts):
      pm.grow(r.request_id, c + k)
      r.num_computed = c + k
      r.output_token_ids.extend([ex.token_id] * m)
      r.logprobs.extend([0.0] * m)
      r.token_times.extend(ends)
    pm.complete_step(pm.begin_step([r.request_id for r in self.run]))
    _record(engine, self.run, [c + self.applied for c in self.contexts],
            self.starts[self.applied:k], ends)
    engine._vclock = ends[-1]
    self.applied = k
    self.count = engine.steps.count
    return m


def fast_forward(engine, until: float = math.inf, plan: bool = True) -> int:
  """Run the decode rounds that start before `until` in one event, where the batch cannot
  change (module doc); returns how many ran (0: call step() instead). Rounds planned
  past `until` are kept for the next call, valid until the engine steps, adds or aborts
  (plan=False: only those, nothing new planned — bringing a replica up to a time).
  The rounds emit no TokenEvents: this is for simulations that read the requests
  afterwards."""
  st = engine._ff_stretch
  if st is not None and (st.count != engine.steps.count or st.applied >= st.n):
    st = engine._ff_stretch = None
  if st is None:
    now = engine.now()
    if not plan or now >= until or not _batch_fixed(engine):
      return 0
    sch = engine.scheduler
    bound = math.inf
    if sch.waiting and len(sch.running) < sch.config.max_running:
      bound = sch.next_arrival()  # a round starting at or after it may admit it
      if bound <= now:
        return 0
    st = _Stretch(engine, bound)
    if st.n <= 0 or not _pages_ready(engine, st):
      return 0
    engine._ff_stretch = st
  if plan and not st.plan(engine.executor, until):
    engine._ff_stretch = None
    return 0
  return st.apply(engine, until)


def pending_end(engine) -> float:
  """The clock after the rounds a stretch planned and has not run (the engine's clock
  when none are pending)."""
  st = engine._ff_stretch
  if st is None or st.count != engine.steps.count or st.applied >= len(st.ends):
    return engine.now()
  return st.end


def _pages_ready(engine, st: _Stretch) -> bool:
  """Pages for every round reserved (reserve="end") or free now: no eviction or
  preemption inside the stretch."""
  pm = engine.pm
  if engine.scheduler.config.reserve == "end":
    return True
  need = sum(max(pm.pages_for(c + st.n) - len(pm.page_table(r.request_id)), 0)
             for c, r in zip(st.contexts, st.run))
  return need <= pm.num_available


def _record(engine, run, contexts, starts, ends) -> None:
  """Step records for the rounds (the newest the log keeps; older ones only counted), and
  the bucket shapes they ran, as step() would leave them."""
  log, pm, b = engine.steps, engine.pm, len(run)
  top = max(contexts)
  buckets = {}
  for pages in range(pm.pages_for(top + 1), pm.pages_for(top + len(ends)) + 1):
    buckets[pages] = engine.buckets.select(b, b, pages, 1, 0, num_logits=b)
  engine.executor.mark_run(buckets.values())
  keep = min(len(ends), log.max_records)
  log.count += len(ends) - keep
  emitted = [(r, 1) for r in run]
  for k in range(len(ends) - keep, len(ends)):
    plan = StepPlan([ScheduledSeq(r, c + k, 1) for r, c in zip(run, contexts)], [], [], [],
                    [], [], starts[k], pm)
    bk = buckets[pm.pages_for(top + k + 1)]
    log.record(starts[k], ends[k], plan, bk.num_tokens - b,
               (bk.num_tokens, bk.num_requests, bk.pages_per_request, bk.max_query_len,
                bk.prefill_slots), 0.0, emitted)
