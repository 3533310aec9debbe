"""Engine: add_request / step / abort / stream, over one Scheduler and one Executor.

    plan = scheduler.schedule(now)          # host: who runs, which tokens, which pages
    handle = executor.launch(step, plan)    # device (or the simulator's virtual clock)
    result = executor.collect(handle)       # a StepResult: per-row tokens, logprobs, ...
    scheduler.postprocess(plan, result)     # host: append tokens, finish, free

The same scheduler, page manager and prefix cache serve the real executor (wall
clock) and the simulator (virtual clock). A step is split into `launch` and `finish`
so that a cancel can arrive while a step is in flight: its pages are released only
when the step completes (8.3.2).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.metrics import summarize
from jaxinfer.runtime.batcher import SeqWork, StepInput, bucket_for, pack
from jaxinfer.runtime.fast_forward import fast_forward, pending_end
from jaxinfer.runtime.pages import page_manager
from jaxinfer.runtime.prefix_cache import PrefixCache
from jaxinfer.runtime.records import StepLog, trim_requests
from jaxinfer.runtime.request import Request
from jaxinfer.runtime.request_checks import RequestChecks, RequestTooLargeError  # noqa: F401
from jaxinfer.runtime.scheduler import Scheduler, SchedulerConfig
from jaxinfer.runtime.step_plan import StepPlan
from jaxinfer.runtime.speculative import Speculator
from jaxinfer.runtime.stopping import make_stop_check
from jaxinfer.structured.step_masks import mask_filler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TokenEvent:
  """One emitted token; a failed request gets one event with token_id -1, finished True,
  finish_reason "error" (Request.error says why), and so does a request whose
  structured-output constraint allows no next token (finish_reason "constraint")."""
  request_id: object
  token_id: int
  logprob: float
  time: float
  finished: bool
  finish_reason: Optional[str]


@dataclasses.dataclass
class InFlight:
  plan: StepPlan
  handle: object
  step_id: int
  start: float
  bucket: tuple
  padded: int
  draft_s: float = 0.0
  host_s: float = 0.0  # host time before dispatch: scheduling and packing


class Engine:

  def __init__(self, executor, config: SchedulerConfig = SchedulerConfig(), *,
               buckets: BucketTable, tokenizer=None, eos_token_ids: Sequence[int] = (),
               max_model_len: int = 1 << 30, prefix_cache: bool = False,
               cache_eviction: str = "lru", host_cache_pages: int = 0,
               drafter=None, draft_policy=None, step_model=None,
               max_retained_requests: int = 10_000, max_step_records: int = 100_000):
    """drafter / draft_policy: speculative decoding (runtime.speculative); drafts are
    verified in the next target step. step_model: a StepTimeModel (e.g. an
    AffineStepModel fitted to measured steps) for deadline-aware admission; the simulated
    executor's own model by default. max_retained_requests / max_step_records: finished
    requests and step records kept for metrics(); older ones are dropped (never an
    unfinished request), so a long-running engine's memory stays flat."""
    if max_retained_requests < 1 or max_step_records < 1:
      raise ValueError(f"max_retained_requests ({max_retained_requests}) and "
                       f"max_step_records ({max_step_records}) must be >= 1")
    self.max_retained_requests = max_retained_requests
    self.executor = executor
    self.buckets = buckets
    self.tokenizer = tokenizer
    self.max_model_len = max_model_len
    # one page table per layer group where the executor's pool groups its layers
    windows = executor.kv_windows
    if len(windows) > 1 and prefix_cache and host_cache_pages:
      raise ValueError(f"host_cache_pages={host_cache_pages}: the prefix cache's host tier "
                       "is not kept for a model whose layers have page tables per group "
                       "(sliding-window and full-attention layers); use 0")
    self.pm = page_manager(executor.num_pages, executor.page_size, windows)
    self.cache = (PrefixCache(self.pm, eviction=cache_eviction, host_pages=host_cache_pages)
                  if prefix_cache else None)
    self.scheduler = Scheduler(config, self.pm, self.cache, max_step_tokens=buckets.max_tokens,
                               max_step_requests=buckets.max_requests,
                               step_model=step_model if step_model is not None
                               else executor.step_model)
    if executor.max_loras:  # multi-LoRA: which adapter holds which device slot (8.2.1)
      from jaxinfer.runtime.adapter_slots import AdapterSlots
      self.scheduler.adapters = AdapterSlots(executor.max_loras)
    self.disabled_loras: Dict[str, str] = {}  # adapter -> why it was taken out of service
    self.stop_check = make_stop_check(tokenizer, eos_token_ids)
    self.eos_token_ids = tuple(eos_token_ids)
    self.requests: Dict[object, Request] = {}
    self.steps = StepLog(max_step_records)  # metrics.StepRecord per finished step
    self._next_id = 0
    self._vclock = 0.0
    self._t0 = time.perf_counter()
    self._in_flight: Optional[InFlight] = None
    self._owner: Optional[int] = None
    self._launching_step: Optional[int] = None
    self._failed: List[TokenEvent] = []  # end events (error / constraint), for step()
    self.drafter = drafter
    self.speculator = None
    if drafter is not None:
      drafter.bind(self.scheduler, executor, buckets)
      self.speculator = Speculator(drafter, draft_policy, buckets, max_model_len,
                                   executor.step_model)
    self.checks = RequestChecks(self)
    self.mask_time_s = 0.0  # host time spent filling structured-output token masks
    self._ff_stretch = None  # decode rounds fast_forward planned (runtime/fast_forward.py)
    # ids of the requests that fast_forward ended (it emits no TokenEvents): the caller
    # takes them with take_fast_forward_finished()
    self.finished_by_fast_forward: List = []

  # --- clock -------------------------------------------------------------------------------
  def now(self) -> float:
    if self.executor.virtual_clock:
      return self._vclock
    return time.perf_counter() - self._t0

  def hold_until(self, t: float) -> None:
    """A simulated engine starts no step before t (a fleet's replica still starting)."""
    if not self.executor.virtual_clock:
      raise RuntimeError("hold_until is for engines on a virtual clock")
    self._wait_until(t)

  def _wait_until(self, t: float) -> None:
    if self.executor.virtual_clock:
      self._vclock = max(self._vclock, t)
    else:
      time.sleep(max(0.0, t - self.now()))

  # --- requests ------------------------------------------------------------------------------
  def add_request(self, prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None,
                  *, request_id=None, arrival_time: Optional[float] = None,
                  deadline_s: Optional[float] = None, priority: int = 0,
                  prompt: Optional[str] = None, imported_tokens: int = 0) -> Request:
    """Queue a request; raises RequestTooLargeError (and changes nothing) if it can never run.
    imported_tokens: the prompt's first tokens whose K/V come with the request, computed
    by another engine (a disaggregated prefill replica); a simulated executor only, since
    nothing writes those pages here."""
    self._check_owner()
    sampling = sampling or SamplingParams()
    ids = self.validate_request(prompt_token_ids, sampling)
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
      raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
    for name, v in (("arrival_time", arrival_time), ("deadline_s", deadline_s)):
      if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                            or not math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number or None, got {v!r}")
    if deadline_s is not None and deadline_s <= 0:
      raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    if imported_tokens:
      if (isinstance(imported_tokens, bool) or not isinstance(imported_tokens, numbers.Integral)
          or not 0 < imported_tokens < len(ids)):
        raise ValueError(f"imported_tokens must be an integer in [0, {len(ids) - 1}] (the "
                         f"prompt's last token is computed here), got {imported_tokens!r}")
      if not self.executor.virtual_clock:
        raise ValueError("imported_tokens needs a simulated executor: a real one would read "
                         "K/V pages nothing wrote")
    if request_id is None:
      request_id = self._next_id
      self._next_id += 1
    if request_id in self.requests:
      raise ValueError(f"request id {request_id!r} is already in use")
    seed = sampling.seed if sampling.seed is not None else int(np.random.randint(2**31))
    grammar = None
    if sampling.constraint is not None and not self.executor.virtual_clock:
      grammar = self.grammar_compiler().matcher(*sampling.constraint)
    r = Request(request_id=request_id, prompt_token_ids=ids, sampling=sampling,
                arrival_time=self.now() if arrival_time is None else arrival_time,
                deadline_s=deadline_s, priority=priority, seed=seed, prompt=prompt,
                grammar=grammar, imported_tokens=int(imported_tokens))
    self.requests[request_id] = r
    self.scheduler.add(r)
    self._ff_stretch = None
    return r

  def validate_request(self, prompt_token_ids, sampling: SamplingParams) -> List[int]:
    """Every check add_request makes, with no state changed (RequestChecks.validate)."""
    return self.checks.validate(prompt_token_ids, sampling)

  def check_request(self, n_prompt: int, sp: SamplingParams) -> None:
    """Raise RequestTooLargeError if such a request could never run."""
    self.checks.check_size(n_prompt, sp)

  def grammar_compiler(self):
    """The structured-output compiler for this engine's tokenizer (built once)."""
    return self.checks.grammar_compiler()

  def abort(self, request_id) -> bool:
    """Cancel a request at once (its pages return when no launched step reads them).
    Returns False, changing nothing, for an unknown or already finished request id."""
    self._check_owner()
    r = self.requests.get(request_id)
    if r is None or r.state.done:
      return False
    self.scheduler.abort(r, self.now())
    self._ff_stretch = None
    if self.tokenizer is not None:
      r.text = self.tokenizer.decode(r.output_token_ids)
    return True

  def abort_requests(self, request_ids) -> None:
    """Leave the engine as if these requests had never run: the step in flight (if any) is
    finished first, then each unfinished one is aborted. For callers that stop early (an
    exception or KeyboardInterrupt in LLM.generate, a client that went away)."""
    if self._in_flight is not None:
      self.finish(self._in_flight)
    for rid in request_ids:
      self.abort(rid)

  def _check_owner(self) -> None:
    """One thread owns an engine (the first that adds, steps or aborts): the scheduler,
    page manager and executor are not thread-safe. Other threads talk to it through
    queues (the server's engine thread does)."""
    me = threading.get_ident()
    if self._owner is None:
      self._owner = me
    elif self._owner != me:
      raise RuntimeError("this Engine is owned by another thread; call it only from the "
                         "thread that first used it (hand requests over through a queue)")

  def _fail(self, plan, error: BaseException, step_id=None) -> None:
    """A step raised: fail exactly its requests, free their pages, keep serving."""
    msg = f"{type(error).__name__}: {error}"
    log.error("step failed; failing its %d requests: %s", len(plan.seqs), msg)
    if step_id is not None:
      self.pm.complete_step(step_id)
    self._in_flight = None
    now = self.now()
    for s in plan.seqs:
      self._fail_request(s.request, msg, now)

  def _fail_request(self, r: Request, msg: str, now: float) -> None:
    if r.state.done:
      return
    self.scheduler.fail(r, now, msg)
    self._failed.append(TokenEvent(r.request_id, -1, 0.0, now, True, "error"))
    self._ff_stretch = None

  def _fail_non_finite(self, plan: StepPlan, finite: np.ndarray, now: float) -> None:
    """Fail the requests whose logits rows hold NaN or Inf. When each of them ran an
    adapter while the step's base-model rows stayed finite, the fault is the adapters':
    each is disabled (every request using it fails, its slot is zeroed, new requests are
    refused until add_lora registers it again)."""
    msg = "non-finite logits (NaN or Inf) in the model output"
    row, bad_adapters, base_bad = 0, set(), False
    for s in plan.seqs:
      if not finite[row:row + s.num_logits].all():
        self._fail_request(s.request, msg, now)
        if s.request.sampling.lora:
          bad_adapters.add(s.request.sampling.lora)
        else:
          base_bad = True
      row += s.num_logits
    if not base_bad:
      for name in sorted(bad_adapters):
        self.disable_lora(name, f"its requests' logits were non-finite ({msg})")

  def disable_lora(self, name: str, why: str) -> None:
    """Take adapter `name` out of service: its unfinished requests fail, its device slot is
    zeroed and it is forgotten, so requests naming it are refused until re-registered."""
    self._check_owner()
    log.error("disabling LoRA adapter %r: %s", name, why)
    now = self.now()
    for r in list(self.scheduler.running) + list(self.scheduler.waiting):
      if r.sampling.lora == name:
        self._fail_request(r, f"LoRA adapter {name!r} was disabled: {why}", now)
    slots = self.scheduler.adapters
    slot = slots.slot_of.get(name, 0) if slots is not None else 0
    if slots is not None:
      slots.forget(name)
    self.executor.unload_lora(name, slot)
    self.disabled_loras[name] = why

  @property
  def config(self) -> SchedulerConfig:
    return self.scheduler.config

  def set_policy(self, policy: str) -> None:
    """Schedule with `policy` from the next iteration on (the server turns an offline
    engine's policy to chunked); only while no request is unfinished."""
    if self.has_unfinished():
      raise RuntimeError(f"set_policy({policy!r}): the engine has unfinished requests")
    self.scheduler.config = dataclasses.replace(self.scheduler.config, policy=policy)

  def has_unfinished(self) -> bool:
    return self.scheduler.has_work() or self._in_flight is not None

  @property
  def num_steps(self) -> int:
    """Steps finished so far (the last record's index + 1; records may be trimmed)."""
    return self.steps.count

  @property
  def replicas(self) -> list:
    """The engines serving requests: this one (a Router has several)."""
    return [self]

  def warmup(self, progress: bool = False, structured: bool = False) -> float:
    """Compile every shape this configuration can run ahead of time; seconds spent
    (runtime/warmup.py)."""
    from jaxinfer.runtime.warmup import warm_up
    return warm_up(self, progress, structured)

  # --- steps ---------------------------------------------------------------------------------
  def launch(self) -> Optional[InFlight]:
    """Schedule and start one step. None when nothing can run now."""
    self._check_owner()
    if self._in_flight is not None:
      raise RuntimeError("a step is in flight: finish() it before launching another")
    draft_s = 0.0
    if self.speculator is not None:
      t0 = time.perf_counter()
      self.speculator.draft(self.scheduler.running)
      draft_s = time.perf_counter() - t0
    t_host = time.perf_counter()
    now = self.now()
    plan = self.scheduler.schedule(now)
    if plan.empty:
      return None
    try:
      return self._launch_plan(plan, now, draft_s, t_host)
    except Exception as e:  # noqa: BLE001 -- any fault fails this step's requests only
      self._fail(plan, e, self._launching_step)
      return None

  def _launch_plan(self, plan, now: float, draft_s: float, t_host: float) -> InFlight:
    self._launching_step = None
    ex = self.executor
    if plan.offloads:
      ex.offload_pages(plan.offloads)
    if plan.fetches:
      ex.fetch_pages(plan.fetches)
    if plan.copies:
      ex.copy_pages(plan.copies)
    if self.scheduler.adapters is not None:  # adapters the plan admitted, into their slots
      self.scheduler.adapters.load_pending(ex.load_lora)
    if ex.virtual_clock:  # no arrays: the simulator sees the bucket only
      b = bucket_for(((s.num_step_tokens, s.start, s.num_logits) for s in plan.seqs),
                     self.buckets, self.pm.page_size)
      step = StepInput(arrays={}, bucket=b, logits_rows=[], num_tokens=plan.num_tokens)
    else:
      step = pack(self._works(plan), self.buckets, self.pm.page_size, self.pm.num_pages,
                  vocab_size=ex.vocab_size or 0)
      b = step.bucket
      step.mask_fn = self._mask_fn(plan, b.num_logits)
    step_id = self._launching_step = self.pm.begin_step([s.request.request_id
                                                         for s in plan.seqs])
    host_s = time.perf_counter() - t_host
    handle = ex.launch(step, plan)
    self._in_flight = InFlight(plan, handle, step_id, now,
                               (b.num_tokens, b.num_requests, b.pages_per_request, b.max_query_len,
                                b.prefill_slots),
                               b.num_tokens - plan.num_tokens, draft_s, host_s)
    return self._in_flight

  def _works(self, plan: StepPlan) -> List[SeqWork]:
    """What the executor's step arrays are packed from, per scheduled request."""
    return [SeqWork(token_ids=s.token_ids, cached_len=s.start,
                     page_table=self.pm.page_table(s.request.request_id),
                     num_logits=s.num_logits, temperature=s.request.sampling.temperature,
                     top_k=s.request.sampling.top_k, top_p=s.request.sampling.top_p,
                     seed=s.request.seed, sample_index=len(s.request.output_token_ids),
                     num_draft=len(s.draft),
                     sampling=s.request.sampling if s.request.sampling.processes_logits
                     else None, prompt_ids=s.request.prompt_token_ids,
                     output_ids=s.request.output_token_ids,
                     top_logprobs=bool(s.request.sampling.logprobs),
                     lora_slot=s.request.lora_slot)
             for s in plan.seqs]

  def _mask_fn(self, plan: StepPlan, num_rows: int) -> Optional[Callable[[], np.ndarray]]:
    """The step's token-mask filler (structured/step_masks.py), timed into mask_time_s;
    None when no request in the step is constrained."""
    fill = mask_filler(plan.seqs, num_rows, self.executor.vocab_size, self.grammar_compiler,
                       self.eos_token_ids, self._end_unsatisfiable)
    if fill is None:
      return None

    def timed() -> np.ndarray:
      t0 = time.perf_counter()
      mask = fill()
      self.mask_time_s += time.perf_counter() - t0
      return mask

    return timed

  def _end_unsatisfiable(self, r: Request, why: str) -> None:
    log.warning("request %s: %s", r.request_id, why)
    now = self.now()
    self.scheduler.end_unsatisfiable(r, now, why)
    self._failed.append(TokenEvent(r.request_id, -1, 0.0, now, True, "constraint"))

  def finish(self, f: InFlight) -> List[TokenEvent]:
    self._check_owner()
    ex = self.executor
    try:
      result = ex.collect(f.handle)
    except Exception as e:  # noqa: BLE001 -- the step's requests fail, the engine serves on
      self._fail(f.plan, e, f.step_id)
      return self._take_failed()
    t_post = time.perf_counter()
    if ex.virtual_clock:
      self._vclock = f.start + result.duration_s
    end = self.now()
    self.pm.complete_step(f.step_id)
    self._in_flight = None
    n_rows = sum(s.num_logits for s in f.plan.seqs)
    sampled = result.rows(n_rows)
    finite = np.isfinite(result.logprobs[:n_rows])
    if not finite.all():  # non-finite logits (damaged weights, overflow) fail the request
      self._fail_non_finite(f.plan, finite, end)
    emitted = self.scheduler.postprocess(f.plan, sampled, end, self.stop_check)
    if self.speculator is not None:
      self.speculator.observe(f.bucket[0], result.duration_s)
    record = self.steps.record(f.start, end, f.plan, f.padded, f.bucket, f.draft_s, emitted)
    events = []
    for r, n in emitted:
      for j in range(len(r.output_token_ids) - n, len(r.output_token_ids)):
        last = j == len(r.output_token_ids) - 1
        events.append(TokenEvent(r.request_id, r.output_token_ids[j], r.logprobs[j], end,
                                 r.state.done and last, r.finish_reason if last else None))
    record.host_s = f.host_s + time.perf_counter() - t_post
    trim_requests(self.requests, self.max_retained_requests, self.scheduler.forget)
    return self._take_failed() + events

  def _take_failed(self) -> List[TokenEvent]:
    out, self._failed = self._failed, []
    return out

  def step(self) -> List[TokenEvent]:
    """One iteration; if nothing can run, wait for the next arrival first."""
    f = self.launch()
    if f is None:
      nxt = self.scheduler.next_arrival()
      if nxt is None or self._failed:
        return self._take_failed()
      self._wait_until(nxt)
      f = self.launch()
      if f is None:
        return self._take_failed()
    return self.finish(f)

  def fast_forward(self, until: float = math.inf, plan: bool = True) -> int:
    """Simulated engines: run the plain decode rounds that start before `until` as one
    event while nothing can change the batch (runtime/fast_forward.py), leaving the
    requests as step() would; returns the rounds run (0: step() is needed). Rounds
    planned past `until` wait for the next call (plan=False: run only those). Emits no
    TokenEvents: the requests it ends are listed by take_fast_forward_finished()."""
    self._check_owner()
    return fast_forward(self, until, plan)

  def take_fast_forward_finished(self) -> List:
    """The ids of the requests fast_forward ended since the last call, in the order it
    ended them."""
    out, self.finished_by_fast_forward = self.finished_by_fast_forward, []
    return out

  def planned_until(self) -> float:
    """The clock after the decode rounds fast_forward planned and has not run yet (now,
    when none are)."""
    return pending_end(self)

  def stream(self) -> Iterator[TokenEvent]:
    """Step until no work is left, yielding every event. If the consumer stops early (or an
    exception lands mid-step), the step in flight is finished, so the engine can go on."""
    try:
      while self.has_unfinished():
        yield from self.step()
    finally:
      if self._in_flight is not None:
        self.finish(self._in_flight)

  def run(self) -> List[Request]:
    for _ in self.stream():
      pass
    return list(self.requests.values())

  def metrics(self, correct=None) -> Dict:
    m = summarize(list(self.requests.values()), self.steps, correct)
    m["memory"] = self.executor.memory_report()
    return m

  # --- deadline-aware admission (8.6.1) --------------------------------------------------------
  def set_step_model(self, model) -> None:
    """Use `model` (StepTimeModel) for deadline-aware admission from now on."""
    self.scheduler.step_model = model
