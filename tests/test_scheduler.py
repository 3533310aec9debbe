"""Scheduler and engine on the simulated clock (no model): policies, budget, memory."""
import numpy as np
import pytest

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor, causal_pairs
from jaxinfer.runtime.engine import Engine, RequestTooLargeError
from jaxinfer.runtime.request import Request, State
from jaxinfer.runtime.scheduler import SchedulerConfig

BIG = 1 << 20
TRACE = [(0.0, 2048, 8), (0.0, 2048, 2), (0.020, 8192, 2), (0.030, 2048, 4)]  # chapter 8.2.2


def engine(policy="chunked", budget=4096, chunk=2048, max_running=2, num_pages=5461,
           page_size=16, reserve="end", **kw):
  ex = SimExecutor(AffineStepModel(), num_pages=num_pages, page_size=page_size)
  cfg = SchedulerConfig(policy, max_running, budget, chunk, reserve=reserve)
  return Engine(ex, cfg, buckets=BucketTable.default(16384, 64, 4096), **kw)


def run(eng, trace):
  for i, (t, n_in, n_out) in enumerate(trace):
    eng.add_request([7] * n_in, SamplingParams(max_tokens=n_out, ignore_eos=True), request_id=i,
                    arrival_time=t)
  return eng.run()


def test_affine_model_matches_spec():
  m = AffineStepModel()
  assert m.step_time([(2048, 0)]) == pytest.approx(94.8e-3, abs=0.05e-3)  # lone 2K prefill
  assert m.step_time([(1, 2048)]) == pytest.approx(26.26e-3, abs=0.01e-3)  # decode at 2K
  assert causal_pairs(3, 10) == 3 * 10 + 6


@pytest.mark.parametrize("policy,budget,makespan,max_itl", [
    ("fixed", BIG, 870.5, 26.3),
    ("continuous", BIG, 765.6, 376.0),
    ("chunked", 4096, 844.3, 132.6),
])
def test_ch8_2_2_scenario(policy, budget, makespan, max_itl):
  """Hand-computed from the affine model: e.g. continuous admits r2's whole 8K prefill
  next to r0's decode (26.22 + 0.0304 x 8193 + 3e-6 x pairs = 376.0 ms gap); chunked
  splits it into four 2048-token chunks, the largest costing 132.6 ms."""
  reqs = run(engine(policy, budget=budget, chunk=2048 if policy == "chunked" else BIG), TRACE)
  assert 1e3 * max(r.finished_at for r in reqs) == pytest.approx(makespan, abs=0.1)
  assert 1e3 * max(x for r in reqs for x in r.itls) == pytest.approx(max_itl, abs=0.1)
  assert [len(r.output_token_ids) for r in reqs] == [8, 2, 2, 4]


def test_decode_first_and_budget_never_exceeded():
  eng = engine("chunked", budget=1000, chunk=700, max_running=4)
  run(eng, [(0.0, 3000, 6), (0.0, 2500, 6), (0.01, 1200, 3), (0.02, 64, 5)])
  for s in eng.steps:
    assert s.num_prefill_tokens + s.num_decode_tokens <= 1000
    kinds = [is_prefill for _, _, is_prefill in s.members]
    assert kinds == sorted(kinds), "decode tokens are scheduled before prefill chunks"
  assert all(r.state == State.FINISHED for r in eng.requests.values())


def test_separate_runs_prefills_in_steps_of_their_own():
  """separate (8.1.1): every step carries prefill work or decodes, never both; a prompt
  longer than the step budget goes on in steps of its own (decodes wait), and all finish."""
  eng = Engine(SimExecutor(AffineStepModel(), num_pages=4096, page_size=16),
               SchedulerConfig("separate", 4, 1000, 1000),
               buckets=BucketTable.default(1000, 8, 512))
  reqs = run(eng, [(0.0, 300, 6), (0.0, 2500, 4), (0.0, 200, 5), (0.05, 400, 3)])
  for s in eng.steps:
    assert not (s.num_prefill_tokens and s.num_decode_tokens), s.members
    assert s.num_prefill_tokens + s.num_decode_tokens <= 1000
  # r0 alone (r1's first 1000 do not fit beside it), r1 in two steps of its own, its
  # last 500 with r2's whole prompt, r3 (arrived meanwhile) before any decode
  assert [s.num_prefill_tokens for s in eng.steps[:5]] == [300, 1000, 1000, 700, 400]
  assert all(s.num_prefill_tokens == 0 for s in eng.steps[5:])
  assert [len(r.output_token_ids) for r in reqs] == [6, 4, 5, 3]
  assert all(r.state == State.FINISHED for r in reqs)


def test_fixed_batching_retires_whole_groups():
  eng = engine("fixed", budget=BIG, chunk=BIG, max_running=2)
  reqs = run(eng, [(0.0, 100, 10), (0.0, 100, 1), (0.0, 100, 1)])
  assert reqs[2].first_admitted_at >= reqs[0].finished_at  # waits for the whole group


def test_admission_reserves_kv_to_end_of_generation():
  """8.1: 10 pages of 16 tokens; each request reserves ceil((100 + 40 - 1) / 16) = 9."""
  eng = engine("continuous", budget=BIG, chunk=BIG, max_running=8, num_pages=10)
  reqs = run(eng, [(0.0, 100, 40), (0.0, 100, 40)])
  assert reqs[1].first_admitted_at >= reqs[0].finished_at
  assert eng.scheduler.num_preemptions == 0
  assert eng.pm.num_free == 10


def test_preemption_when_kv_runs_out():
  """reserve='none': requests start with what they need now; when the pool runs out the
  latest arrival is preempted, requeued and recomputed from prompt + outputs."""
  eng = engine("continuous", budget=BIG, chunk=BIG, max_running=8, num_pages=12, reserve="none")
  reqs = run(eng, [(0.0, 64, 60), (0.0, 64, 60), (0.001, 64, 60)])
  assert eng.scheduler.num_preemptions > 0
  assert sum(r.recomputed_tokens for r in reqs) > 0
  assert all(r.state == State.FINISHED and len(r.output_token_ids) == 60 for r in reqs)
  assert eng.pm.num_free == 12


def test_abort_releases_pages_after_in_flight_step():
  eng = engine("chunked")
  r = eng.add_request([5] * 100, SamplingParams(max_tokens=50, ignore_eos=True))
  eng.step()
  f = eng.launch()  # a decode step of r is in flight
  eng.abort(r.request_id)
  assert r.state == State.CANCELLED
  assert eng.pm.num_pending > 0  # not reusable while the step reads them
  eng.finish(f)
  assert eng.pm.num_pending == 0 and eng.pm.num_free == eng.pm.num_pages
  assert not eng.has_unfinished()


def test_rejected_request_leaves_engine_healthy():
  eng = engine("continuous", budget=BIG, chunk=BIG, num_pages=8)
  with pytest.raises(RequestTooLargeError, match="pool has only 8 pages"):
    eng.add_request([1] * 200, SamplingParams(max_tokens=10))
  with pytest.raises(RequestTooLargeError, match="context window"):
    Engine(eng.executor, eng.config, buckets=eng.buckets, max_model_len=64).add_request(
        [1] * 60, SamplingParams(max_tokens=10))
  assert not eng.requests
  reqs = run(eng, [(0.0, 20, 3)])
  assert reqs[0].state == State.FINISHED


def test_deadline_aware_admission_rejects_early():
  ex = SimExecutor(AffineStepModel(), num_pages=5000, page_size=16)
  eng = Engine(ex, SchedulerConfig("continuous", 1, BIG, BIG, deadline_admission=True),
               buckets=BucketTable.default(16384, 64, 4096))
  a = eng.add_request([1] * 2048, SamplingParams(max_tokens=100, ignore_eos=True), deadline_s=7.0)
  b = eng.add_request([1] * 2048, SamplingParams(max_tokens=100, ignore_eos=True), deadline_s=3.0)
  eng.run()
  assert a.state == State.FINISHED and a.on_time
  # b waits for a (~2.7 s), then could not finish 100 tokens by 3 s: rejected, not started.
  assert b.state == State.REJECTED and b.reject_reason == "deadline" and not b.output_token_ids
  m = eng.metrics()
  assert m["num_good"] == 1 and m["num_rejected"] == 1


def test_prefix_cache_skips_cached_prompt():
  eng = engine("chunked", prefix_cache=True)
  shared = list(range(1000, 1000 + 640))
  a = eng.add_request(shared + [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
  eng.run()
  b = eng.add_request(shared + [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
  eng.run()
  assert a.cached_tokens == 0 and b.cached_tokens == 640
  assert eng.metrics()["prefix_cached_tokens"] == 640


def test_littles_law_and_goodput_fields():
  """Little's law against N(t) sampled on a time grid (requests that have arrived and not
  finished, waiting ones included), goodput against deadlines checked from the requests'
  own timestamps, ITL percentiles against the token times."""
  eng = engine("chunked", max_running=2)
  trace = [(0.01 * i, 300, 5) for i in range(8)]
  for i, (t, n_in, n_out) in enumerate(trace):  # every other request: a tight deadline
    eng.add_request([7] * n_in, SamplingParams(max_tokens=n_out, ignore_eos=True),
                    request_id=i, arrival_time=t, deadline_s=0.15 if i % 2 else None)
  reqs = eng.run()
  m = eng.metrics()
  t0 = min(r.arrival_time for r in reqs)
  t1 = max(r.finished_at for r in reqs)
  grid = np.linspace(t0, t1, 200_001)[:-1] + (t1 - t0) / 400_000  # midpoints
  n_t = sum(((r.arrival_time <= grid) & (grid < r.finished_at)).astype(int) for r in reqs)
  assert n_t.max() > 2  # requests waited: N(t) counts more than the running batch
  ll = m["littles_law"]
  assert ll["mean_in_system"] == pytest.approx(n_t.mean(), rel=1e-3)
  assert ll["lambda_times_T"] == pytest.approx(n_t.mean(), rel=1e-3)
  on_time = [r for r in reqs if r.deadline_s is None or r.finished_at - r.arrival_time
             <= r.deadline_s]
  assert 4 <= len(on_time) < 8 and m["num_good"] == len(on_time)
  assert m["goodput_rps"] == pytest.approx(len(on_time) / (t1 - t0))
  assert m["completion_rps"] == pytest.approx(8 / (t1 - t0))
  gaps = np.concatenate([np.diff(r.token_times) for r in reqs])
  assert m["itl_s"]["p99"] == pytest.approx(np.percentile(gaps, 99))
  assert m["itl_s"]["max"] == pytest.approx(gaps.max())


def test_admission_never_evicts_the_prefix_it_matched():
  """A request whose cached prefix is the only evictable thing must wait, not evict the
  pages it is about to share (they are locked from the match on)."""
  eng = engine("chunked", budget=64, chunk=64, max_running=4, num_pages=12, page_size=4,
               prefix_cache=True)
  a = list(range(500, 516))  # 4 full pages once cached
  eng.add_request(a, SamplingParams(max_tokens=1, ignore_eos=True))
  eng.run()
  x = eng.add_request(list(range(900, 908)), SamplingParams(max_tokens=20, ignore_eos=True))
  r2 = eng.add_request(a + list(range(600, 608)), SamplingParams(max_tokens=1, ignore_eos=True))
  eng.run()
  assert r2.state == State.FINISHED and r2.cached_tokens == 16
  assert r2.first_admitted_at >= x.finished_at  # it waited for memory instead
  eng.pm.check_invariants(eng.cache.owned_refs())


def test_request_tokens_slices_prompt_and_output_like_the_whole_context():
  r = Request(0, [1, 2, 3, 4], SamplingParams())
  r.output_token_ids = [5, 6, 7]
  for a in range(8):
    for b in range(a, 8):
      assert r.tokens(a, b) == r.all_token_ids[a:b]


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_no_phantom_preemption_with_reserve_none(policy):
  """reserve="none" admitted requests with no page free for their first chunk and
  preempted them in the same schedule(): 50 requests on a small pool reported hundreds
  of preemptions of requests that had never computed a token. Every preemption now
  throws away computed work, and queueing ends at a real admission."""
  eng = engine(policy, budget=256, chunk=64, max_running=16, num_pages=64, page_size=16,
               reserve="none")
  lost = []
  preempt = eng.scheduler._preempt

  def spy(r, plan):
    lost.append(r.num_computed - r.cached_tokens)
    preempt(r, plan)

  eng.scheduler._preempt = spy
  run(eng, [(0.002 * i, 96 + 7 * (i % 5), 24) for i in range(50)])
  assert all(r.finish_reason == "length" for r in eng.requests.values())
  assert lost, "the pool is small enough that some preemption must happen"
  assert min(lost) > 0, f"{lost.count(0)} preemptions of requests with no computed token"
  assert eng.scheduler.num_preemptions == len(lost)
  assert eng.pm.num_free == 64


def test_waiting_head_records_one_prefix_lookup():
  """A head request that waits for memory retries admission every iteration; its prefix
  lookup counts once, when it is admitted (3 requests: 23 lookups were recorded)."""
  eng = engine("continuous", max_running=4, num_pages=12, page_size=4, prefix_cache=True)
  shared = list(range(1, 17))
  for i in range(3):
    eng.add_request(shared + [100 + i] * 4, SamplingParams(max_tokens=20, ignore_eos=True),
                    request_id=i)
  eng.run()
  st = eng.cache.stats
  assert st.lookups == 3
  assert st.device_hit_tokens <= 2 * 16  # at most the later two hit the shared 16 tokens
