"""Fast-forward for simulated engines: a stretch of plain decode rounds as one event.

When every running request only decodes and nothing can change the batch but requests
finishing, the rounds ahead are known: round k runs one token per request after its
context + k tokens, so its time is the step model's for that batch (8.2.1's decode
round), and the requests' tokens, times and pages follow. `fast_forward(engine, until)`
runs the rounds that start before `until` that way — the fleet simulator's replicas
between arrivals — and leaves the engine exactly as `Engine.step` would round by round
(the same per-token times, to the bit: the executor's `decode_times` equal its per-step
times).

A request reaching max_tokens ends inside the stretch, in its last round, as step()
would end it (its pages offered to the prefix cache and released), when nothing waits to
take its place; the batch then runs on without it. Otherwise the stretch stops before
the round in which the first request finishes (left to step(), which admits the next).
A stretch also stops before anything step() would decide differently: an admission (a
request waiting while there is room to run it), a step that would not hold every running
request, pages that are neither reserved nor free (eviction or preemption), a sliding
window releasing pages, the arrival of a request that there is room to admit, a drafter,
a structured-output grammar, stop strings, or a sampled token that is a stop token.
"""
from __future__ import annotations

import bisect
import math

from jaxinfer.runtime.records import trim_requests
from jaxinfer.runtime.step_plan import shared_prefix


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
  tok, detok = ex.token_id, engine.tokenizer is not None
  tok_eos = tok in engine.eos_token_ids
  shares_tail = sch.pm.shares_tail
  for r in reversed(run):  # newest first: a request just admitted still prefills
    sp, out = r.sampling, r.output_token_ids
    if (not out or len(r.prompt_token_ids) + len(out) - r.num_computed != 1  # one pending
        or r.draft or r.grammar is not None or (sp.stop and detok)
        or tok in sp.stop_token_ids or (tok_eos and not sp.ignore_eos)
        or shares_tail(r.request_id)):
      return False
  return True


class _Stretch:
  """The rounds of one batch, planned ahead in growing chunks and applied up to a time:
  `starts` / `ends` of the planned rounds, `applied` of them run on the engine. Request
  i runs rounds 0 .. left[i] - 1 (its last one emits its max_tokens-th token); with
  `finishes` the stretch runs until the last request ends, each round's batch being the
  requests not yet ended (segments of one batch between ends), else up to the round
  before the first end."""

  def __init__(self, engine, until: float, finishes: bool):
    sch, pm = engine.scheduler, engine.pm
    self.pm = pm
    self.t0 = engine.now()  # when its first round starts
    self.run = list(sch.running)
    self.contexts = [r.num_computed for r in self.run]  # at the stretch's first round
    self.left = [r.sampling.max_tokens - len(r.output_token_ids) for r in self.run]
    self.n = max(self.left) if finishes else min(self.left) - 1
    self.until = until  # no round starts at or after it (a waiting request's arrival)
    # Rounds at which the batch shrinks (a request's last round is the one before).
    self.cuts = sorted({k for k in self.left if k < self.n})
    self._segments = {}
    self.starts, self.ends, self.applied, self.chunk = [], [], 0, 8
    self.count = engine.steps.count  # the engine's step count the stretch is valid at

  @property
  def end(self) -> float:
    """The clock after the planned rounds."""
    return self.ends[-1] if self.ends else -math.inf

  def segment(self, k: int):
    """(last round + 1, batch indices, shared tokens, sharing requests) of the segment
    holding round k. The shared prefix is the same in each of its rounds: its pages are
    whole pages each request computed past, and the pages a round adds are each
    request's own."""
    j = bisect.bisect_right(self.cuts, k)
    seg = self._segments.get(j)
    if seg is None:
      a = self.cuts[j - 1] if j else 0
      b = self.cuts[j] if j < len(self.cuts) else self.n
      idx = [i for i, n in enumerate(self.left) if n > a]
      shared, sharing = shared_prefix(self.pm, [(self.run[i].request_id,
                                                 self.contexts[i] + a) for i in idx])
      seg = self._segments[j] = (b, idx, shared, sharing)
    return seg

  def plan(self, ex, until: float) -> bool:
    """Plan rounds until one starts at or after `until` (or none is left); False if the
    executor cannot price them."""
    t = self.ends[-1] if self.ends else None
    while len(self.ends) < self.n and (t is None or t < min(until, self.until)):
      done = len(self.ends)
      b, idx, shared, sharing = self.segment(done)
      times = ex.decode_times([self.contexts[i] + done for i in idx],
                              min(self.chunk, b - done), shared, sharing)
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
      if len(self.ends) == b:  # a segment ends: its next chunk starts small again
        self.chunk = 8
      else:
        self.chunk *= 4
    return True

  def apply(self, engine, until: float) -> int:
    """Run the planned rounds that start before `until` on the engine; how many."""
    a = self.applied
    k = bisect.bisect_left(self.starts, until, lo=a)
    m = k - a
    if m <= 0:
      return 0
    ex, pm = engine.executor, engine.pm
    # rounds a .. k - 1 for every request: its tokens, logprobs and times, cut where it ends
    toks, zeros, times = [ex.token_id] * m, [0.0] * m, self.ends[a:k]
    ending, reading = [], []
    for i, (r, c, n) in enumerate(zip(self.run, self.contexts, self.left)):
      if n <= a:
        continue  # ended in an earlier apply
      reading.append(r.request_id)
      upto = k
      if n <= k:  # its last round is among these
        ending.append((n, i))
        upto = n
      pm.grow(r.request_id, c + upto)
      r.num_computed = c + upto
      if upto < k:  # it runs only the first of these rounds
        r.output_token_ids.extend(toks[:upto - a])
        r.logprobs.extend(zeros[:upto - a])
        r.token_times.extend(times[:upto - a])
      else:  # all of them (no copy of the rounds' lists)
        r.output_token_ids.extend(toks)
        r.logprobs.extend(zeros)
        r.token_times.extend(times)
    pm.complete_step(pm.begin_step(reading))
    _record(engine, self, a, k)
    if ending:  # in round order, and in batch order within a round, as step() ends them
      sch = engine.scheduler
      for n, i in sorted(ending):
        r = self.run[i]
        sch.finish(r, engine.stop_check(r), self.ends[n - 1])
        engine.finished_by_fast_forward.append(r.request_id)
      trim_requests(engine.requests, engine.max_retained_requests, sch.forget)
    engine._vclock = self.ends[k - 1]
    self.applied = k
    self.count = engine.steps.count
    return m


def fast_forward(engine, until: float = math.inf, plan: bool = True) -> int:
  """Run the decode rounds that start before `until` in one event, where the batch cannot
  change (module doc); returns how many ran (0: call step() instead). Rounds planned
  past `until` are kept for the next call, valid until the engine steps, adds or aborts
  (plan=False: only those, nothing new planned — bringing a replica up to a time).
  The rounds emit no TokenEvents: this is for simulations that read the requests
  afterwards (the ids of the requests they end are in engine.finished_by_fast_forward)."""
  st = engine._ff_stretch
  if st is not None and (st.count != engine.steps.count or st.applied >= st.n):
    st = engine._ff_stretch = None
  if st is None:
    now = engine.now()
    if not plan or now >= until:
      return 0
    sch = engine.scheduler
    bound = math.inf
    if sch.waiting and len(sch.running) < sch.config.max_running:
      bound = sch.next_arrival()  # a round starting at or after it may admit it
      if bound <= now:  # (told before the batch's walk: the usual exit after an arrival)
        return 0
    if not _batch_fixed(engine):
      return 0
    st = _Stretch(engine, bound, finishes=not sch.waiting)
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


def planned_ahead(engine, t: float):
  """(requests ended, outstanding tokens done) by the planned rounds that
  fast_forward(engine, t, plan=False) would run, told without running them: what
  routing.load and routing.outstanding_tokens would lose. In a stretch every running
  request has one token pending and each round takes one output off each request it
  runs; a request ending in it leaves the engine with its pending token."""
  st = engine._ff_stretch
  if st is None or st.count != engine.steps.count or st.applied >= st.n:
    return 0, 0
  a = st.applied
  k = bisect.bisect_left(st.starts, t, lo=a)
  if k <= a:
    return 0, 0
  ended = done = 0
  for n in st.left:
    if n <= a:
      continue  # ended in an earlier apply
    if n <= k:  # ends: its pending token and its n - a outputs left go with it
      ended += 1
      done += 1 + n - a
    else:
      done += k - a
  return ended, done


def _pages_ready(engine, st: _Stretch) -> bool:
  """Pages for every round reserved (reserve="end") or free now: no eviction or
  preemption inside the stretch."""
  pm = engine.pm
  if engine.scheduler.config.reserve == "end":
    return True
  need = sum(max(pm.pages_for(c + min(st.n, n)) - len(pm.page_table(r.request_id)), 0)
             for c, r, n in zip(st.contexts, st.run, st.left))
  return need <= pm.num_available


def _record(engine, st: _Stretch, a: int, k: int) -> None:
  """Step records for rounds a .. k - 1 of the stretch (the newest the log keeps; older
  ones only counted), and the bucket shapes they ran, as step() would leave them."""
  log, pm = engine.steps, engine.pm
  keep = min(k - a, log.max_records)
  log.count += k - a - keep
  buckets = {}
  kept = []
  j = a
  while j < k:
    b_end, idx, _, _ = st.segment(j)
    top = max(st.contexts[i] for i in idx)
    b = len(idx)
    e = min(b_end, k)
    # round q reads pages_for(top + q + 1) pages: every count from the first round's to
    # the last's (one token more per round)
    for p in range(pm.pages_for(top + j + 1), pm.pages_for(top + e) + 1):
      buckets[(b, p)] = engine.buckets.select(b, b, p, 1, 0, num_logits=b)
    for q in range(max(j, k - keep), e):
      kept.append((q, idx, buckets[(b, pm.pages_for(top + q + 1))]))
    j = e
  engine.executor.mark_run(buckets.values())
  for q, idx, bk in kept:
    log.record_decode(st.starts[q], st.ends[q], [st.run[i].request_id for i in idx],
                      bk.num_tokens - len(idx), (bk.num_tokens, bk.num_requests,
                                                 bk.pages_per_request, bk.max_query_len,
                                                 bk.prefill_slots))
