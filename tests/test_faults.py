"""A fault fails only its step's requests; an interrupt leaves the engine empty and
healthy; one thread owns an engine. Each case failed on the main before this file: the
failing request stayed running with its pages and every later step failed the same way."""
import dataclasses
import threading

import numpy as np
import pytest

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
from jaxinfer.llm import LLM
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig

TABLE = BucketTable.default(max_tokens=64, max_requests=4, max_pages=16)


class FaultySim(SimExecutor):
  """Raises in launch or collect for steps that carry a marked request (or, with
  nan_for, returns a NaN logprob for that request's rows)."""

  def __init__(self, where="collect", bad=(), nan_for=()):
    super().__init__(AffineStepModel(), num_pages=32, page_size=4)
    self.where, self.bad, self.nan_for = where, set(bad), set(nan_for)

  def _carries_bad(self, plan):
    return any(s.request.request_id in self.bad for s in plan.seqs)

  def launch(self, step, plan):
    if self.where == "launch" and self._carries_bad(plan):
      raise RuntimeError("injected launch fault")
    return plan, self.execute(step, plan)

  def collect(self, handle):
    plan, result = handle
    if self.where == "collect" and self._carries_bad(plan):
      raise RuntimeError("injected collect fault")
    logprobs = result.logprobs.copy()
    row = 0
    for s in plan.seqs:
      if s.request.request_id in self.nan_for:
        logprobs[row:row + s.num_logits] = np.nan
      row += s.num_logits
    return dataclasses.replace(result, logprobs=logprobs)


def _engine(ex, **kw):
  return Engine(ex, SchedulerConfig(policy="continuous", max_running=4), buckets=TABLE, **kw)


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_step_fault_fails_its_requests_and_the_engine_serves_on(where):
  ex = FaultySim(where, bad={"b"})
  eng = _engine(ex)
  sp = SamplingParams(max_tokens=5, ignore_eos=True)
  eng.add_request([1, 2, 3], sp, request_id="a")
  eng.run()  # "a" alone: served
  eng.add_request([4, 5], sp, request_id="b")
  eng.add_request([6, 7, 8, 9], sp, request_id="c")  # shares b's first step
  events = list(eng.stream())
  errors = {e.request_id for e in events if e.finish_reason == "error"}
  assert errors == {"b", "c"}
  assert all(e.token_id == -1 for e in events if e.finish_reason == "error")
  for rid in ("b", "c"):
    r = eng.requests[rid]
    assert r.finish_reason == "error" and f"injected {where} fault" in r.error
  assert eng.pm.num_free == ex.num_pages  # every page back
  eng.add_request([1, 2], sp, request_id="d")
  eng.run()
  assert eng.requests["d"].finish_reason == "length"
  assert len(eng.requests["d"].output_token_ids) == 5
  assert eng.pm.num_free == ex.num_pages


def test_non_finite_logits_fail_only_their_request():
  ex = FaultySim("none", nan_for={"x"})
  eng = _engine(ex)
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  eng.add_request([1, 2, 3], sp, request_id="x")
  eng.add_request([1, 2, 3], sp, request_id="y")
  eng.run()
  assert eng.requests["x"].finish_reason == "error"
  assert "non-finite" in eng.requests["x"].error
  assert eng.requests["x"].output_token_ids == []  # no NaN token was ever emitted
  assert eng.requests["y"].finish_reason == "length"
  assert eng.pm.num_free == ex.num_pages


def test_abort_unknown_or_finished_returns_false():
  eng = _engine(SimExecutor(AffineStepModel(), num_pages=32, page_size=4))
  assert eng.abort("nope") is False
  eng.add_request([1, 2], SamplingParams(max_tokens=2), request_id="q")
  assert eng.abort("q") is True
  assert eng.abort("q") is False
  assert eng.pm.num_free == 32


def test_a_second_thread_gets_a_clear_error():
  eng = _engine(SimExecutor(AffineStepModel(), num_pages=32, page_size=4))
  eng.add_request([1, 2], SamplingParams(max_tokens=2))
  errs = []

  def other():
    try:
      eng.step()
    except RuntimeError as e:
      errs.append(str(e))

  t = threading.Thread(target=other)
  t.start()
  t.join(10)
  assert errs and "owned by another thread" in errs[0]
  eng.run()  # the owner carries on


def test_interrupt_between_launch_and_finish_leaves_the_engine_empty(smollm2):
  """Ctrl-C inside LLM.generate, landing after a step was launched and before it was
  finished: its requests are aborted, no step stays in flight, every page is free, and
  the next generate gives the same tokens as an undisturbed one."""
  table = BucketTable(token_sizes=(8,), request_sizes=(2,), page_table_sizes=(4,))
  llm = LLM.from_loaded(smollm2, warmup=False, num_pages=8, buckets=table)
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  prompts = ["The capital of France is", "One, two,"]
  want = [o.token_ids for o in llm.generate(prompts, sp)]
  eng = llm.engine
  real_finish, calls = eng.finish, []

  def interrupted_finish(f):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real_finish(f)

  eng.finish = interrupted_finish
  with pytest.raises(KeyboardInterrupt):
    llm.generate(prompts, sp)
  eng.finish = real_finish
  assert not eng.has_unfinished()  # nothing queued, running or in flight
  assert eng.pm.num_free == 8
  assert [o.token_ids for o in llm.generate(prompts, sp)] == want


def test_memory_stays_flat_over_thousands_of_requests():
  """Finished requests, step records and scheduler keys are trimmed to their caps
  (they grew without bound: a long-running server would run out of memory)."""
  import tracemalloc
  ex = SimExecutor(AffineStepModel(), num_pages=256, page_size=4)
  eng = Engine(ex, SchedulerConfig(policy="chunked", max_running=16, token_budget=64,
                                   chunk_size=64), buckets=TABLE,
               max_retained_requests=200, max_step_records=300)
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  sizes = []
  tracemalloc.start()
  for block in range(6):
    for i in range(600):
      eng.add_request([1 + i % 50, 2, 3, 4, 5], sp)
      if i % 16 == 15:
        eng.step()
    eng.run()
    sizes.append(tracemalloc.get_traced_memory()[0])
  tracemalloc.stop()
  assert len(eng.requests) <= 220 and len(eng.steps) <= 330
  assert len(eng.scheduler._key) <= 220
  assert eng.num_steps > 600  # the records kept are the newest of many
  assert sizes[-1] < 1.5 * sizes[1], sizes  # flat after the first block, not 6x
