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
pages, the arrival of a request that there is room to admit, a drafter, a structured-output grammar, stop strings, or a sampled token that is a
stop token.
"""
from __future__ import annotations

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
      or engine._failed or not run or cfg.window):
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


def fast_forward(engine, until: float = math.inf) -> int:
  """Run the decode rounds that start before `until` in one event, where the batch cannot
  change (module doc); returns how many ran (0: call step() instead). The rounds emit no
  TokenEvents: this is for simulations that read the requests afterwards."""
  ex, sch, pm = engine.executor, engine.scheduler, engine.pm
  now = engine.now()
  if now >= until:
    return 0
  # A stretch leaves its batch as fixed as it found it (its new pages are each request's
  # own, its shared prefix the same), so until the engine steps, adds or aborts, what the
  # last stretch found still holds: (steps.count then, rounds left, shared prefix).
  known = engine._ff_batch
  if known is not None and known[0] != engine.steps.count:
    known = None
  if known is None and not _batch_fixed(engine):
    return 0
  run = sch.running
  if sch.waiting and len(run) < sch.config.max_running:
    first = sch.next_arrival()  # a round starting at or after it may admit it
    if first <= now:
      return 0
    until = min(until, first)
  contexts = [r.num_computed for r in run]
  if known is not None:
    _, n, shared, sharing = known
  else:
    n = min(r.sampling.max_tokens - len(r.output_token_ids) for r in run) - 1
    # The shared prefix is the same in every round: its pages are whole pages each
    # request computed past, and the pages a round adds are each request's own.
    shared, sharing = StepPlan([ScheduledSeq(r, c, 1) for r, c in zip(run, contexts)],
                               [], [], [], [], [], now, pm).shared
  if n <= 0:
    return 0
  if sch.config.reserve != "end":  # pages for every round must be reserved or free now
    need = sum(max(pm.pages_for(c + n) - len(pm.page_table(r.request_id)), 0)
               for c, r in zip(contexts, run))
    if need > pm.num_available:
      return 0
  starts, ends, t, chunk = [], [], now, 8
  while len(ends) < n and t < until:  # rounds in growing chunks: `until` may come soon
    k = min(chunk, n - len(ends))
    times = ex.decode_times([c + len(ends) for c in contexts], k, shared, sharing)
    if times is None:
      return 0
    for d in times.tolist():  # the clock advances round by round, as step() adds them
      if t >= until:
        break
      starts.append(t)
      t = t + d
      ends.append(t)
    chunk *= 4
  m = len(ends)
  run = list(run)
  for r, c in zip(run, contexts):
    pm.grow(r.request_id, c + m)
    r.num_computed = c + m
    r.output_token_ids.extend([ex.token_id] * m)
    r.logprobs.extend([0.0] * m)
    r.token_times.extend(ends)
  pm.complete_step(pm.begin_step([r.request_id for r in run]))
  _record(engine, run, contexts, starts, ends)
  engine._vclock = ends[-1]
  engine._ff_batch = (engine.steps.count, n - m, shared, sharing)
  return m


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
