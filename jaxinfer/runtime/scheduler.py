"""Scheduler: who runs each iteration, which tokens, which pages (8.1, 8.2, 8.3.2, 8.6.1).

Policies (8.2.2):
  fixed       admit a group when nothing runs; retire it as a whole
  continuous  re-form the batch every iteration; a prefill runs whole
  chunked     continuous, decode of running requests first, then prefill chunks of at
              most `chunk_size` within the per-iteration token budget
  separate    prefills first, as iterations of their own (8.1.1: a prompt longer than a
              step goes on in steps of the budget), decodes when no prompt is waiting;
              an offline batch's fastest policy (LLM's default)
A step is a list of (request, new tokens): a decode is a one-token chunk whose logits
are sampled; a prefill chunk samples only when it reaches the end of the known tokens.

Admission reserves the KV a request needs at the end of generation (reserve="end",
8.1), so memory never runs out mid-generation; with reserve="none" pages are taken as
needed and, when the pool runs out, the scheduler **preempts** the lowest-priority,
latest-arrived running request: its pages are freed and it later recomputes its prompt
and the tokens it produced (counted in `recomputed_tokens`). Prefix-cache hits skip the
cached part of the prompt. Host-side only; imports no JAX.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
from typing import Callable, List, Optional, Sequence, Tuple

from jaxinfer.costmodel.accounting import step_pages_bound
from jaxinfer.runtime.pages import PageManager
from jaxinfer.runtime.prefix_cache import PrefixCache
from jaxinfer.runtime.request import Request, State
from jaxinfer.runtime.step_plan import ScheduledSeq, StepPlan

POLICIES = ("fixed", "continuous", "chunked", "separate")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  policy: str = "chunked"
  max_running: int = 16
  token_budget: int = 512  # new tokens per iteration (8.2.4)
  chunk_size: int = 512
  reserve: str = "end"  # "end": L + G - 1 at admission (8.1) | "none": preempt when short
  deadline_admission: bool = False  # 8.6.1: reject early what cannot finish in time
  cache_key: Tuple[str, str, str] = ("model", "", "f32")  # (model, adapter, KV format)
  window: int = 0  # the model's sliding window in every layer: pages behind it are
  #                  released as a request advances (0: full attention somewhere)

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {POLICIES}")
    if self.reserve not in ("end", "none"):
      raise ValueError(f"reserve must be 'end' or 'none', got {self.reserve!r}")
    for name in ("max_running", "token_budget", "chunk_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.window < 0:
      raise ValueError(f"window must be >= 0, got {self.window}")


class Scheduler:

  def __init__(self, config: SchedulerConfig, pages: PageManager,
               prefix_cache: Optional[PrefixCache] = None, *, max_step_tokens: int = 1 << 30,
               max_step_requests: int = 1 << 30,
               step_model=None):
    """max_step_tokens / max_step_requests: the largest bucket's sizes. step_model: a
    StepTimeModel (costmodel.roofline) that predicts a step's seconds; with it, a request
    with a deadline is admitted only if its predicted finish meets it (8.6.1)."""
    self.config = config
    self.pm = pages
    self.cache = prefix_cache
    # the narrowest sliding window of the model's layers (0: none): past it, a request's
    # first pages are released after each step
    self._narrowest_window = min((w for w in pages.windows or (config.window,) if w),
                                 default=0)
    self.max_step_tokens = max_step_tokens
    self.max_step_requests = max_step_requests
    self.step_model = step_model
    # Other KV that a request needs alongside its own (a draft model's): objects with
    # reserve(request) -> bool and release(request), consulted at admission and freed
    # with the request.
    self.reservers: List = []
    # Multi-LoRA (8.2.1): an AdapterSlots when the executor has adapter slots. A request
    # is admitted only when its adapter holds or can take a slot; it pins the slot while
    # it runs, so a step never carries more distinct adapters than there are slots.
    self.adapters = None
    self.waiting: List[Request] = []
    self.running: List[Request] = []
    self._order = itertools.count()
    self._key = {}
    self.num_preemptions = 0
    # After a preemption no request is admitted until a running one ends: readmitting
    # the victim as soon as its first chunk fits made it recompute and be preempted again
    # and again (141 preemptions for 3 requests in a 1 GiB pool; one pass with the hold).
    self._memory_pressure = False

  # --- queue ----------------------------------------------------------------------------
  def add(self, r: Request) -> None:
    self._key[r.request_id] = (r.priority, r.arrival_time, next(self._order))
    bisect.insort(self.waiting, r, key=lambda x: self._key[x.request_id])

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def next_arrival(self) -> Optional[float]:
    return min((r.arrival_time for r in self.waiting), default=None)

  def forget(self, request_id) -> None:
    """Drop what the scheduler keeps of a finished request (its ordering key)."""
    self._key.pop(request_id, None)

  def abort(self, r: Request, now: float) -> None:
    """Stop scheduling at once; pages return once in-flight steps complete (8.3.2)."""
    self._stop(r, State.CANCELLED, "abort", now)

  def fail(self, r: Request, now: float, error: str) -> None:
    """End a request whose step failed: finish_reason "error", pages released like abort."""
    if self._stop(r, State.FAILED, "error", now):
      r.error = error

  def end_unsatisfiable(self, r: Request, now: float, why: str) -> None:
    """End a request whose structured-output constraint allows no next token (finish_reason
    "constraint"); pages released like abort."""
    if self._stop(r, State.FINISHED, "constraint", now):
      r.error = why

  def _stop(self, r: Request, state: State, reason: str, now: float) -> bool:
    if r.state.done:
      return False
    if r in self.waiting:
      self.waiting.remove(r)
    if r in self.running:
      self.running.remove(r)
      self._release(r)
      self._memory_pressure = False
    r.set_state(state)
    r.finish_reason, r.finished_at = reason, now
    return True

  # --- one iteration ----------------------------------------------------------------------
  def schedule(self, now: float) -> StepPlan:
    """One iteration's work. continuous / chunked: the running requests first (decodes,
    then unfinished prefill chunks, 8.2.2), then admissions into the rest of the token
    budget. separate: an admitted prompt's prefill runs as its own iteration, inserted
    between decode iterations (8.1.1's inserted prefill: the running requests wait for
    it); decodes run when nothing is admitted. fixed: a group runs to completion."""
    cfg = self.config
    plan = StepPlan([], [], [], [], [], [], now, self.pm)
    budget = min(cfg.token_budget, self.max_step_tokens)
    if cfg.policy == "separate":
      # a prompt longer than a step goes on in steps of its own before anything else
      budget = self._continue_running(plan, budget, prefills_only=True)
      self._admit_waiting(plan, budget, now)
      if not plan.seqs:
        self._continue_running(plan, budget)
      return self._with_offloads(plan)
    budget = self._continue_running(plan, budget)
    if not (cfg.policy == "fixed" and self.running):  # a fixed group runs to completion first
      self._admit_waiting(plan, budget, now)
    return self._with_offloads(plan)

  def _continue_running(self, plan: StepPlan, budget: int, prefills_only: bool = False) -> int:
    """Running requests: decode first (8.2.2), then unfinished prefills (prefills_only:
    those alone). Budget left."""
    chunked = self.config.policy == "chunked"
    for r in sorted(self.running, key=lambda x: x.in_prefill):
      if r.state is State.WAITING or len(plan.seqs) >= self.max_step_requests:
        continue  # (WAITING: preempted by an earlier one's growth, no longer running)
      if prefills_only and not r.in_prefill:
        continue
      n = self._chunk(r, budget, chunked, first=not plan.seqs)
      if n == 0:
        continue
      draft = r.draft[:max(budget - n, 0)] if (r.draft and not r.in_prefill) else []
      if not self._grow(r, n + len(draft), plan):
        continue  # r itself was preempted
      plan.seqs.append(ScheduledSeq(r, r.num_computed, n, draft))
      budget -= n + len(draft)
    return budget

  def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
    """Admissions in queue order into the budget left (first come, first served); none
    while a preemption's memory pressure lasts (until a running request ends)."""
    if self._memory_pressure and self.running:
      return
    cfg = self.config
    chunked = cfg.policy == "chunked"
    for r in list(self.waiting):
      if r.arrival_time > now:
        continue
      if len(self.running) >= cfg.max_running or len(plan.seqs) >= self.max_step_requests:
        break
      if chunked and budget <= 0:
        break
      if not chunked and plan.seqs and min(r.num_pending, self.max_step_tokens) > budget:
        break  # a whole prefill that does not fit waits for the next iteration
      if cfg.deadline_admission and self._misses_deadline(r, now):
        self.waiting.remove(r)
        r.set_state(State.REJECTED)
        r.finish_reason, r.reject_reason, r.finished_at = "rejected", "deadline", now
        plan.rejected.append(r)
        continue
      lora = r.sampling.lora
      if lora and self.adapters is not None and not self.adapters.can_acquire(lora):
        continue  # every slot holds a running request's adapter: others may still run
      first = not plan.seqs

      def first_tokens(hit, r=r, budget=budget, first=first):
        # tokens r's first step would run if admitted now with `hit` tokens cached
        return self._chunk_len(r.num_tokens - hit, budget, chunked, first)

      if not self._admit(r, plan, first_tokens):
        break  # first come, first served: the head waits for memory
      n = self._chunk(r, budget, chunked, first=not plan.seqs)
      if n == 0 or not self._grow(r, n, plan):
        continue
      plan.seqs.append(ScheduledSeq(r, r.num_computed, n))
      budget -= n

  def _with_offloads(self, plan: StepPlan) -> StepPlan:
    """Pages evicted to the host tier this iteration must be copied out before any step
    reuses them: the executor runs plan.offloads first."""
    if self.cache is not None and self.cache.pending_offloads:
      plan.offloads.extend(self.cache.pending_offloads)
      self.cache.pending_offloads.clear()
    return plan

  def _chunk(self, r: Request, budget: int, chunked: bool, first: bool) -> int:
    return self._chunk_len(r.num_pending, budget, chunked, first)

  def _chunk_len(self, pending: int, budget: int, chunked: bool, first: bool) -> int:
    if pending == 1:
      return 1 if budget >= 1 or first else 0
    n = min(pending, self.max_step_tokens)
    if chunked:
      n = min(n, self.config.chunk_size, budget)
    elif n > budget and not first:
      return 0  # a whole prefill that does not fit waits for the next iteration
    return max(n, 0)

  def _misses_deadline(self, r: Request, now: float) -> bool:
    if r.deadline_s is None or self.step_model is None:
      return False
    finish = now + self.estimate_time(r, len(self.running) + 1, now)
    return finish > r.arrival_time + r.deadline_s

  def estimate_time(self, r: Request, batch: int, now: float) -> float:
    """Predicted seconds from `now` to r's last token if r is admitted now in a batch of
    `batch` (8.6.1), from the work already in the system. (1) The prompt backlog of the
    running requests and r's own prompt pass through steps of at most the token budget,
    each also carrying the running decodes. (2) r's remaining outputs take one round each;
    the prompts of requests that arrived after r (admitted behind it, up to max_running)
    fill the rest of each round's budget until they are done. (Counting r's prefill and
    plain decode rounds only was optimistic by 25-35% under load on the real model: the
    admitted requests then finished just past their deadlines.)"""
    model, cfg = self.step_model, self.config
    budget = cfg.token_budget if cfg.policy == "chunked" else 1 << 30
    decodes = [(1, q.num_tokens) for q in self.running if q.num_pending <= 1]
    ahead = sum(q.num_pending for q in self.running if q.num_pending > 1) + r.num_pending
    t, done = 0.0, 0
    while done < ahead:
      n = min(ahead - done, budget)
      t += model.step_time([(n, r.num_computed + done)] + decodes)
      done += n
    after = self.waiting[self.waiting.index(r) + 1:] if r in self.waiting else []
    arrived = [q for q in after if q.arrival_time <= now][:max(cfg.max_running - batch, 0)]
    behind = sum(q.num_pending for q in arrived)
    round_decodes = [(1, r.num_tokens)] * batch
    for _ in range(r.sampling.max_tokens - 1):
      n = min(behind, max(budget - batch, 0))
      t += model.step_time(([(n, 0)] if n else []) + round_decodes)
      behind -= n
    return t

  # --- memory -----------------------------------------------------------------------------
  def _admit(self, r: Request, plan: StepPlan, first_tokens: Callable[[int], int]) -> bool:
    """Admit r if its KV fits now: to the end of generation (reserve="end"), or its first
    step's tokens (reserve="none": a request admitted with no page for its first chunk
    was preempted in the same schedule(), counted as a preemption of work never done).
    The prefix-cache lookup is recorded once, when r is admitted (a head request that
    waits for memory retries every iteration)."""
    cfg, pm = self.config, self.pm
    nodes, hit, m = [], 0, None
    if self.cache is not None:
      m = self.cache.match(self._cache_key(r), r.all_token_ids, max_tokens=r.num_tokens - 1,
                           record=False)
      nodes = m.nodes[:m.restore_tokens // pm.page_size]
      hit = len(nodes) * pm.page_size
      self.cache.lock(nodes)  # the eviction below must not take the pages we match

    def give_up():
      if nodes:
        self.cache.unlock(nodes)
      return False

    start = max(hit, r.imported_tokens)  # K/V already there: hit pages, or imported ones
    reserve = r.kv_tokens_at_end if cfg.reserve == "end" else start + first_tokens(start)
    bound = self.window_pages(r.kv_tokens_at_end)
    host = [n for n in nodes if not n.on_device]
    while True:
      need = pm.admission_pages(reserve, bound, len(nodes)) + len(host)
      if need <= pm.num_available:
        break
      if self.cache is None or self.cache.evict(need - pm.num_available) == 0:
        return give_up()
    if host:
      fetched = self.cache.fetch(host)
      if fetched is None:
        return give_up()
      plan.fetches.extend(fetched)
    for i, hook in enumerate(self.reservers):  # e.g. a draft model's own KV (8.5.4)
      if not hook.reserve(r):
        for h in self.reservers[:i]:
          h.release(r)
        return give_up()
    added = pm.add_sequence(r.request_id, [n.page for n in nodes], hit, reserve_tokens=reserve,
                            bound_pages=bound)
    # pages for imported K/V, which the transfer writes (None: a sliding window's bound
    # reserved fewer pages than they fill)
    copies = pm.grow(r.request_id, start) if added and start > hit else []
    if not added or copies is None:
      if added:
        pm.free(r.request_id)
      for h in self.reservers:
        h.release(r)
      return give_up()
    plan.copies.extend(copies)
    if m is not None:
      self.cache.record(m, len(r.all_token_ids))
    r.prefix_nodes = nodes
    r.num_computed = start
    if r.sampling.lora and self.adapters is not None:
      r.lora_slot = self.adapters.acquire(r.sampling.lora)
    if not r.output_token_ids:
      r.cached_tokens = hit
    self.waiting.remove(r)
    self.running.append(r)
    r.set_state(State.PREFILL)
    r.admitted_at = plan.now
    if r.first_admitted_at is None:
      r.first_admitted_at = plan.now
    return True

  def _grow(self, r: Request, n: int, plan: StepPlan) -> bool:
    """Pages for r's next n tokens; evict cache pages, then preempt others if short.
    False if r itself had to be preempted."""
    while True:
      copies = self.pm.grow(r.request_id, r.num_computed + n)
      if copies is not None:
        plan.copies.extend(copies)
        # grow() records the tokens as written; postprocess advances num_computed.
        return True
      short = max(1, self.pm.shortfall(r.request_id, r.num_computed + n))
      if self.cache is not None and self.cache.evict(short) > 0:
        continue
      victim = self._victim(plan)
      if victim is None:
        victim = r
      self._preempt(victim, plan)
      if victim is r:
        return False

  def _victim(self, plan: StepPlan) -> Optional[Request]:
    scheduled = {id(s.request) for s in plan.seqs}
    cands = [x for x in self.running if id(x) not in scheduled]
    if not cands:
      return None
    return max(cands, key=lambda x: self._key[x.request_id])  # lowest priority, latest

  def _preempt(self, r: Request, plan: StepPlan) -> None:
    """Free r's KV; it waits again and later recomputes prompt + outputs (8.3.2)."""
    self.running.remove(r)
    r.recomputed_tokens += r.num_computed - r.cached_tokens  # imported K/V included: lost
    self._release(r)
    r.num_computed = 0
    r.imported_tokens = 0  # its K/V are gone: recomputed here
    r.num_preemptions += 1
    self.num_preemptions += 1
    self._memory_pressure = True
    r.set_state(State.WAITING)
    bisect.insort(self.waiting, r, key=lambda x: self._key[x.request_id])
    plan.preempted.append(r)

  def _cache_key(self, r: Request) -> Tuple[str, str, str]:
    """Prefix-cache namespace: K/V computed under an adapter is only that adapter's."""
    model, _, kv = self.config.cache_key
    lora = r.sampling.lora or ""
    if lora and self.adapters is not None and self.adapters.generation.get(lora):
      lora = f"{lora}#{self.adapters.generation[lora]}"  # registered again: other weights
    return (model, lora, kv)

  def _release(self, r: Request) -> None:
    if r.lora_slot:
      self.adapters.release(r.sampling.lora)
      r.lora_slot = 0
    for h in self.reservers:
      h.release(r)
    if self.cache is not None and r.prefix_nodes:
      self.cache.unlock(r.prefix_nodes)
    r.prefix_nodes = []
    if self.pm.has(r.request_id):
      self.pm.free(r.request_id)

  # --- hooks for drafters (8.5.3) -----------------------------------------------------------
  def add_reserver(self, hook) -> None:
    """KV a request needs alongside its own (a draft model's pool): `hook.reserve(r) ->
    bool` is consulted at admission, `hook.release(r)` when the request ends."""
    self.reservers.append(hook)

  def draft_pages(self, r: Request, m: int) -> Optional[List[Tuple[int, int]]]:
    """Pages for m drafted positions after r's computed tokens, written by a draft step
    into r's own pages (positions a previous round drafted past are rolled back first).
    Returns the page copies (copy-on-write) to do before writing, or None if the pool is
    short (r then drafts nothing this round)."""
    rid, c = r.request_id, r.num_computed
    if self.pm.num_tokens(rid) > c:
      self.pm.rollback(rid, c)
    return self.pm.grow(rid, c + m)

  def page_table(self, r: Request) -> List[int]:
    return self.pm.page_table(r.request_id)

  @contextlib.contextmanager
  def reading(self, requests: Sequence[Request]):
    """Brackets a step outside the engine's (a draft step) that reads these requests'
    pages: they are not reused while it runs."""
    sid = self.pm.begin_step([r.request_id for r in requests])
    try:
      yield sid
    finally:
      self.pm.complete_step(sid)

  # --- after the step ---------------------------------------------------------------------
  def postprocess(self, plan: StepPlan, sampled: Sequence[Tuple[int, float, bool]], now: float,
                  stop_check: Callable[[Request], Optional[str]]) -> List[Tuple[Request, int]]:
    """Apply a step's results. `sampled` has one (token, logprob, draft accepted, top-N
    [(token, logprob)] or None) per logits row, in plan order. A verified draft keeps its
    longest accepted prefix plus the target's correction or bonus token (8.5.1); the KV of
    rejected positions is rolled back. Returns (request, tokens emitted) for requests that
    got tokens."""
    it = iter(sampled)
    emitted = []
    running = {id(r) for r in self.running}  # only a request's own end removes it below
    for s in plan.seqs:
      r = s.request
      rows = [next(it) for _ in range(s.num_logits)]
      if id(r) not in running or r.state.done:
        continue  # aborted or preempted while the step ran
      if not rows:
        r.num_computed = s.start + s.num_tokens
        self._behind_window(r)
        continue
      new = []
      for j, (tok, lp, acc, top) in enumerate(rows):
        if j < len(s.draft) and acc:
          new.append((s.draft[j], lp, top))
          continue
        new.append((int(tok), lp, top))
        break
      if s.draft:
        n_acc = len(new) - 1
        r.spec_rounds += 1
        r.spec_drafted += len(s.draft)
        r.spec_accepted += n_acc
        r.spec_emitted += len(new)
        for j in range(len(s.draft)):
          if len(r.drafted_by_position) <= j:
            r.drafted_by_position.append(0)
            r.accepted_by_position.append(0)
          r.drafted_by_position[j] += 1
          r.accepted_by_position[j] += int(j < n_acc)
      # K/V is valid for the known tokens and the accepted drafts; roll back the rest.
      r.num_computed = s.start + s.num_tokens + len(new) - 1
      if self.pm.num_tokens(r.request_id) > r.num_computed:
        self.pm.rollback(r.request_id, r.num_computed)
      self._behind_window(r)
      r.draft = []
      if r.state == State.PREFILL:
        r.set_state(State.DECODE)
      count = 0
      for tok, lp, top in new:
        r.output_token_ids.append(int(tok))
        r.logprobs.append(float(lp))
        if top is not None and r.sampling.logprobs:
          r.top_logprobs.append(top[:r.sampling.logprobs])
        r.token_times.append(now)
        count += 1
        reason = stop_check(r)
        if reason is not None:
          self.finish(r, reason, now)
          break
      emitted.append((r, count))
    return emitted

  def window_pages(self, kv_tokens: int):
    """The most pages a request of kv_tokens K/V tokens at its end holds at once where a
    sliding window bounds them (0: no bound), for the model's one window (config.window:
    every layer windowed) or per page-table group (the page manager's windows; a tuple):
    the window behind its position plus the tokens one step writes (a chunk of the
    chunked policy, else its whole prompt), each end on a page of its own."""
    cfg = self.config
    step = (min(cfg.chunk_size, cfg.token_budget) if cfg.policy == "chunked"
            else kv_tokens)
    bound = lambda w: step_pages_bound(w, step, self.pm.page_size) if w else 0  # noqa: E731
    if self.pm.windows:
      return tuple(bound(w) for w in self.pm.windows)
    return bound(cfg.window)

  def _behind_window(self, r: Request) -> None:
    """Release the pages no later query of `r` reads: keys before the window of its next
    position (every layer windowed: config.window; or each windowed group's). With the
    prefix cache on, the pages computed so far are offered to it before the first release
    (after which the request holds no whole prefix): later requests sharing the prompt hit
    them, and the cache gives them up under memory pressure like any other."""
    w = self._narrowest_window
    if not w:
      return  # no layer has a window: nothing to release
    if self.cache is not None and r.num_computed - w + 1 >= self.pm.page_size:
      pages = self.pm.cacheable_pages(r.request_id)
      if pages is not None:
        self.cache.insert(self._cache_key(r), r.all_token_ids[:r.num_computed], pages)
    self.pm.slide(r.request_id, r.num_computed, self.config.window)

  def finish(self, r: Request, reason: str, now: float) -> None:
    """End a running request as postprocess does when stop_check gives `reason` (the
    fast-forward also ends requests inside a stretch of rounds this way)."""
    self.running.remove(r)
    self._memory_pressure = False
    pages = self.pm.cacheable_pages(r.request_id) if self.cache is not None else None
    if pages is not None:
      # Offer the computed full pages (the last output's K/V is never written; a request
      # that released pages behind its window holds no whole prefix to offer).
      self.cache.insert(self._cache_key(r), r.all_token_ids[:r.num_computed], pages)
    self._release(r)
    r.set_state(State.FINISHED)
    r.finish_reason, r.finished_at = reason, now
