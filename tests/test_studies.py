"""The pieces the study binaries are built from: step-model fitting, deadline-aware
admission, the load generator, the retrieval tasks and their grading, the variant
overheads of configuration selection."""
import numpy as np
import pytest

from experiments import config_select, goodput, kv_quality
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
from jaxinfer.metrics import StepRecord
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig


def _rec(tokens, seconds):
  return StepRecord(0, 0.0, seconds, 1, tokens, 0, 0, ())


def test_affine_fit_recovers_coefficients():
  steps = [_rec(n, 0.02 + 0.001 * n) for n in (1, 4, 16, 64, 256)]
  m = AffineStepModel.fit(steps)
  assert m.fixed_s == pytest.approx(0.02) and m.per_token_s == pytest.approx(0.001)
  with pytest.raises(ValueError, match="at least two sizes"):
    AffineStepModel.fit([_rec(4, 0.1), _rec(4, 0.2)])


def test_deadline_admission_rejects_what_cannot_finish():
  """8.6.1 with a step model given to the engine: a request whose predicted finish is
  past its deadline is rejected at admission (not run late); a feasible one runs; the
  engine stays healthy."""
  ex = SimExecutor(AffineStepModel(), num_pages=64, page_size=16)
  eng = Engine(ex, SchedulerConfig("chunked", 4, 512, 512, deadline_admission=True),
               buckets=BucketTable.default(512, 4, 16), step_model=AffineStepModel())
  sp = SamplingParams(max_tokens=20, ignore_eos=True)
  late = eng.add_request([1] * 100, sp, arrival_time=0.0, deadline_s=0.1)  # ~0.55 s needed
  ok = eng.add_request([1] * 100, sp, arrival_time=0.0, deadline_s=5.0)
  eng.run()
  assert late.state.value == "rejected" and late.reject_reason == "deadline"
  assert late.output_token_ids == []
  assert ok.state.value == "finished" and ok.on_time and len(ok.output_token_ids) == 20
  eng.set_step_model(AffineStepModel(fixed_s=1.0))  # a slower machine: now too late
  again = eng.add_request([1] * 100, sp, arrival_time=eng.now(), deadline_s=5.0)
  eng.run()
  assert again.reject_reason == "deadline"


def test_deadline_estimate_counts_prompts_queued_behind():
  """Prompts that arrived behind a request share its decode rounds' token budget: a
  request that would finish in time alone misses its deadline behind three long prompts
  (checked without admission control), and the estimate sees it and rejects it."""
  sp = SamplingParams(max_tokens=20, ignore_eos=True)

  def run(backlog, admission=True):
    ex = SimExecutor(AffineStepModel(), num_pages=1024, page_size=16)
    eng = Engine(ex, SchedulerConfig("chunked", 8, 512, 512, deadline_admission=admission),
                 buckets=BucketTable.default(512, 8, 256), step_model=AffineStepModel())
    r = eng.add_request([1] * 100, sp, arrival_time=0.0, deadline_s=0.65)  # ~0.53 s alone
    for _ in range(backlog):
      eng.add_request([2] * 2000, sp, arrival_time=0.0)
    eng.run()
    return r

  assert run(0).on_time
  late = run(3, admission=False)
  assert late.state.value == "finished" and not late.on_time
  assert run(3).reject_reason == "deadline"


def test_arrival_processes():
  assert goodput.arrival_times("fixed", 4.0, 5, 0).tolist() == [0, 0.25, 0.5, 0.75, 1.0]
  p = goodput.arrival_times("poisson", 8.0, 4001, 1)
  assert p[0] == 0 and np.all(np.diff(p) >= 0)
  assert np.mean(np.diff(p)) == pytest.approx(1 / 8, rel=0.05)
  assert not np.array_equal(p[:16], goodput.arrival_times("poisson", 8.0, 16, 2))
  with pytest.raises(ValueError, match="unknown arrival process 'burst'"):
    goodput.arrival_times("burst", 1.0, 4, 0)
  with pytest.raises(ValueError, match="must be > 0"):
    goodput.arrival_times("fixed", 0.0, 4, 0)


class _OneTokenPerWord:
  def encode(self, text):
    return text.split()


def test_retrieval_tasks_and_grading():
  t1 = kv_quality.make_tasks(_OneTokenPerWord(), [8, 32], 2, seed=0)
  t2 = kv_quality.make_tasks(_OneTokenPerWord(), [8, 32], 2, seed=0)
  assert [t.name for t in t1] == ["n8-r0", "n8-r1", "n32-r0", "n32-r1"]
  assert [t.prompt for t in t1] == [t.prompt for t in t2]  # fixed task set
  for t in t1:
    key = t.prompt.rsplit("\n", 1)[1][:-1]
    assert f"{key}: {t.answer}\n" in t.prompt and len(t.answer) == 6
    assert t.prompt.count("\n") == int(t.name[1:].split("-")[0]) + 1
  assert kv_quality.is_correct(" 123456\nfoo", "123456")
  assert not kv_quality.is_correct(" 1234567", "123456")  # no partial or extended credit
  assert not kv_quality.is_correct(" 12345 123456", "123456")  # the first number counts
  with pytest.raises(ValueError, match="needs 1000 distinct keys"):
    kv_quality.make_tasks(_OneTokenPerWord(), [1000], 1, seed=0)
  assert kv_quality.parse_variant("fp8:kv") == ("fp8", "kv")
  assert kv_quality.parse_variant("q4_0") == ("q4_0", "compute")
  with pytest.raises(ValueError, match="'fp8:bf16'"):
    kv_quality.parse_variant("fp8:bf16")


def test_time_to_correct_adds_failed_attempts():
  att = [{"task": "a", "concurrency": 1, "run": 0, "correct": False, "service_s": 2.0},
         {"task": "a", "concurrency": 1, "run": 1, "correct": True, "service_s": 1.0},
         {"task": "b", "concurrency": 1, "run": 0, "correct": True, "service_s": 0.5},
         {"task": "b", "concurrency": 1, "run": 1, "correct": False, "service_s": 9.0},
         {"task": "c", "concurrency": 1, "run": 0, "correct": False, "service_s": 1.0},
         {"task": "c", "concurrency": 1, "run": 1, "correct": False, "service_s": 1.0}]
  r = kv_quality.time_to_correct(att)[1]
  assert r["mean_s"] == pytest.approx((3.0 + 0.5) / 2) and r["unsolved"] == 1


def test_variant_overheads_and_acceptance():
  a = config_select.acceptance_for(3.0, 4)
  assert sum(a**j for j in range(5)) == pytest.approx(3.0)
  with pytest.raises(ValueError, match="impossible"):
    config_select.acceptance_for(6.0, 4)
  base = AffineStepModel()
  m = config_select.OverheadModel(base, prefill_overhead=0.1, round_overhead_s=0.001,
                                  max_draft=4)
  pre, verify = [(512, 0)], [(5, 100), (1, 50)]
  # 8.2.2's affine model by hand: 26.22 ms + 512 x 30.4 us + 131,328 pairs x 3 ns = 42.18 ms,
  # +10% prefill overhead; the verify round: 26.40 ms + 1 ms round overhead
  assert m.step_time(pre) == pytest.approx(0.046397, rel=1e-4)
  assert m.step_time(verify) == pytest.approx(0.027404, rel=1e-4)


@pytest.mark.parametrize("name,fmt,share", [("A", "bf16", False), ("B", "bf16", True),
                                            ("C", "q8_0", False)])
def test_simulated_rounds_equal_the_planners(name, fmt, share):
  """One step cost for planner and simulator (8.6.3's scenario: Qwen3-8B on RTX PRO
  6000, 16 requests of 8192 tokens, the 6144-token prefix cached where shared): every
  simulated round in which all 16 decode costs the planner's decode_round at that
  context, the shared prefix read once per batch on both sides (it was charged once per
  request in the simulator: 29.9 ms against the planner's 27.7 ms for B)."""
  from jaxinfer.costmodel import RooflineStepModel
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000", fmt, 16)
  ex = SimExecutor(rm, num_pages=60_000, page_size=16)
  # As the planner: the 16 prompts' new tokens prefill together, then 16 decode together.
  eng = Engine(ex, SchedulerConfig("chunked", 16, 16 * 8192, 8192), prefix_cache=share,
               buckets=BucketTable.default(16 * 8192, 64, 1024))
  rng = np.random.default_rng(0)
  prefix = rng.integers(100, 100000, 6144).tolist()
  if share:
    eng.add_request(prefix + [7], SamplingParams(max_tokens=1, ignore_eos=True))
    eng.run()
  sp = SamplingParams(max_tokens=6, ignore_eos=True)
  reqs = [eng.add_request(prefix + rng.integers(100, 100000, 2048).tolist(), sp)
          for _ in range(16)]
  n0 = len(eng.steps)
  eng.run()
  rounds = [s for s in eng.steps[n0:] if s.num_seqs == 16 and s.num_prefill_tokens == 0]
  assert len(rounds) == 5
  if share:
    assert all(r.cached_tokens == 6144 for r in reqs)
  for i, s in enumerate(rounds):
    ctx = 8192 + i  # every request's cached context at this round
    planned = rm.decode_round(16, ctx, 6144 if share else 0)
    assert s.duration == pytest.approx(planned, rel=1e-9), (i, s.duration, planned)
