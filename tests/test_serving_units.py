"""The serving parts without HTTP: the incremental detokeniser (UTF-8 and stop strings,
with the real SmolLM2 tokenizer), LLM.stream / LLM.chat, and the engine thread's queue
limit and shutdown (on the simulated executor)."""
import threading

import pytest

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig
from jaxinfer.serving.detokenizer import IncrementalDetokenizer
from jaxinfer.serving.engine_thread import EngineService, QueueFullError

TEXT = "Pizza 🍕 in Zürich costs 20 € — 東京 is far. The end."


def test_detokenizer_never_emits_half_a_character(smollm2):
  tok = smollm2.tokenizer
  ids = tok.encode(TEXT, add_special_tokens=False)
  d = IncrementalDetokenizer(tok)
  pieces = [d.push([t]) for t in ids]
  assert all("\ufffd" not in p for p in pieces)
  # some tokens end inside a multi-byte character: their text waited for the next token
  assert any(p == "" for p in pieces)
  assert "".join(pieces) + d.finish(tok.decode(ids)) == tok.decode(ids)


def test_detokenizer_holds_back_a_possible_stop_string(smollm2):
  tok = smollm2.tokenizer
  ids = tok.encode(TEXT, add_special_tokens=False)
  full = tok.decode(ids)
  stop = "is far"
  cut = full[:full.index(stop)]
  d = IncrementalDetokenizer(tok, stop=(stop,))
  shown = ""
  for t in ids:
    shown += d.push([t])
    assert cut.startswith(shown) or shown.startswith(cut)
    if stop in d.text:  # where the engine stops the request
      break
  assert cut.startswith(shown) and not shown.endswith(" is")
  assert shown + d.finish(cut) == cut


def test_llm_stream_equals_generate_and_stops_cleanly(smollm2):
  from jaxinfer.llm import LLM
  llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
            num_pages=64)
  msgs = [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Name three fruits."}]
  sp = SamplingParams(max_tokens=20)
  want = llm.chat(msgs, sp)[0]
  assert "".join(llm.stream_chat(msgs, sp)) == want.text
  gen = llm.stream_chat(msgs, SamplingParams(max_tokens=200, ignore_eos=True))
  next(gen)
  gen.close()  # the consumer stops early: the request is aborted, pages come back
  assert not llm.engine.has_unfinished() and llm.engine.pm.num_free == 64
  with pytest.raises(ValueError, match="messages"):
    llm.chat([{"role": "robot", "content": "hi"}])


class _GatedSim(SimExecutor):
  """Steps after the first wait for `gate`: the engine thread is busy while requests
  pile up."""

  def __init__(self):
    super().__init__(AffineStepModel(), num_pages=64, page_size=4)
    self.gate = threading.Event()
    self.free_steps = 1

  def execute(self, step, plan):
    if self.free_steps:
      self.free_steps -= 1
    else:
      assert self.gate.wait(30)
    return super().execute(step, plan)


def _gated_service(max_queue, free_steps=None):
  """A continuous-batching engine of 2 slots on the gated simulator, served by an
  EngineService thread (started)."""
  ex = _GatedSim()
  if free_steps is not None:
    ex.free_steps = free_steps
  eng = Engine(ex, SchedulerConfig(policy="continuous", max_running=2),
               buckets=BucketTable.default(max_tokens=32, max_requests=2, max_pages=16))
  return ex, eng, EngineService(eng, max_queue=max_queue).start()


def test_queue_limit_and_shutdown_on_the_engine_thread():
  ex, eng, svc = _gated_service(max_queue=2)
  done = {}
  finished = threading.Event()

  def deliver(rid):
    def f(u):
      if u.finish_reason is not None:
        done[rid] = u.finish_reason
        if len(done) == 4:
          finished.set()
    return f

  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  first = svc.submit([1, 2, 3], sp, deliver("a"))
  for _ in range(200):  # bounded: until "a" ran its first step (the next one blocks)
    if svc.num_queued == 0:
      break
    threading.Event().wait(0.01)
  svc.submit([1, 2], sp, deliver("b"))
  svc.submit([4], sp, deliver("c"))
  with pytest.raises(QueueFullError, match="at most 2"):
    svc.submit([5], sp, deliver("x"))
  assert svc.num_queued == 2 and first == "req-0"
  ex.gate.set()
  for _ in range(500):  # bounded: the queue drains once steps run again
    if svc.num_queued == 0:
      break
    threading.Event().wait(0.01)
  svc.submit([6, 7], sp, deliver("d"))  # room again
  assert finished.wait(30), done
  assert done == {"a": "length", "b": "length", "c": "length", "d": "length"}
  svc.shutdown()
  assert not svc.alive and eng.pm.num_free == 64
  with pytest.raises(RuntimeError, match="not running"):
    svc.submit([1], sp, deliver("e"))


def test_a_dead_engine_loop_answers_every_request_it_holds():
  """If the loop itself dies, the running request and the one still in the command queue
  both get an error update (neither client waits forever), and new submits are refused."""
  ex, eng, svc = _gated_service(max_queue=4, free_steps=0)
  got = {}
  both = threading.Event()

  def deliver(name):
    def f(u):
      got[name] = (u.finish_reason, u.error)
      if len(got) == 2:
        both.set()
    return f

  def broken_step():
    assert ex.gate.wait(30)
    raise RuntimeError("device lost")

  eng.step = broken_step
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  svc.submit([1, 2], sp, deliver("running"))
  for _ in range(200):  # bounded: until "running" was added and the loop sits in step()
    if eng.requests:
      break
    threading.Event().wait(0.01)
  svc.submit([3], sp, deliver("queued"))
  ex.gate.set()
  assert both.wait(30), got
  assert got["running"][0] == "error" and "device lost" in got["running"][1]
  assert got["queued"][0] == "error" and svc.num_queued == 0
  with pytest.raises(RuntimeError, match="not running"):
    svc.submit([4], sp, deliver("late"))


def test_engine_service_runs_a_data_parallel_router():
  """The server's engine thread drives a router of two replicas (simulated): every
  request finishes once, both replicas serve, and the metrics see every replica's steps
  and pages."""
  from jaxinfer.runtime.router import Router
  from jaxinfer.serving.prom import ServerMetrics

  def replica():
    return Engine(SimExecutor(AffineStepModel(), num_pages=32, page_size=4),
                  SchedulerConfig(policy="continuous", max_running=2),
                  buckets=BucketTable.default(max_tokens=32, max_requests=2, max_pages=16))

  router = Router([replica(), replica()], "round_robin")
  metrics = ServerMetrics("sim")
  svc = EngineService(router, max_queue=16, metrics=metrics).start()
  done, finished = {}, threading.Event()

  def deliver(rid):
    def f(u):
      if u.finish_reason is not None:
        done[rid] = done.get(rid, []) + [u.finish_reason]
        if len(done) == 6:
          finished.set()
    return f

  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  for i in range(6):
    svc.submit([1 + i, 2, 3], sp, deliver(i))
  assert finished.wait(30), done
  svc.shutdown()
  assert done == {i: ["length"] for i in range(6)}
  assert router.routed == [3, 3]
  assert all(e.num_steps > 0 for e in router.replicas)
  lab = {"model_name": "sim"}
  get = metrics.registry.get_sample_value
  assert get("jaxinfer:step_duration_seconds_count", lab) == router.num_steps
  assert get("jaxinfer:kv_pages_free", lab) == 64  # both replicas' pools, all free again
