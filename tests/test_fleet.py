"""The fleet simulator (jaxinfer/runtime/fleet.py, experiments/fleet.py): one replica
equals one engine given the same stream up front; routing policies over simulated
replicas; the request streams and trace readers."""
import dataclasses
import gc
import json

import numpy as np
import pytest

from experiments import streams


def _config(**kw):
  from configs.studies.fleet import get_config
  c = get_config("small")
  c.update(kw)
  return c


def test_one_replica_fleet_equals_one_engine():
  """A fleet of one replica, handed each request at its arrival, gives every request the
  same token times as one engine holding the whole stream from the start (the engine
  admits a request only once its arrival time has come)."""
  from experiments.fleet import make_replicas, make_stream
  from jaxinfer.runtime.fleet import Fleet
  from jaxinfer.runtime.routing import make_policy
  c = _config()
  c.bursty.num_requests = 60
  arrivals = make_stream(c, "bursty")
  got = Fleet(make_replicas(c, 1), make_policy("round_robin")).run(arrivals)
  eng = make_replicas(c, 1)[0]
  want = [eng.add_request(list(a.prompt_token_ids), a.sampling, arrival_time=a.time)
          for a in arrivals]
  eng.run()
  assert len(got) == len(want) == 60
  for g, w in zip(got, want):
    assert g.token_times == pytest.approx(w.token_times, abs=1e-9)
    assert g.finished_at == pytest.approx(w.finished_at, abs=1e-9)


@pytest.mark.parametrize("stream,policy", [("bursty", "least_loaded"), ("sessions", "slo"),
                                           ("bursty", "power_of_two"),
                                           ("sessions", "round_robin")])
def test_fast_forward_keeps_every_timeline(stream, policy):
  """Replicas that plan their plain decode rounds ahead and run them as events (up to an
  arrival, when the router reads the replica, or when due) give every request the same
  token times (exactly) and the router the same choices as stepping round by round, in
  far fewer events; policies that read every replica, two of them or none."""
  from experiments.fleet import make_replicas, make_stream
  from jaxinfer.runtime.fleet import Fleet
  from jaxinfer.runtime.routing import make_policy
  c = _config()
  c.bursty.num_requests, c.sessions.num_sessions, c.sessions.turns = 120, 8, 3
  runs = []
  for ff in (False, True):
    fleet = Fleet(make_replicas(c, c.replicas), make_policy(policy, seed=c.seed),
                  fast_forward=ff)
    reqs = fleet.run(make_stream(c, stream))
    runs.append((fleet, [r.token_times for r in reqs], [e.steps.count for e in fleet.replicas]))
  (slow, t_slow, n_slow), (fast, t_fast, n_fast) = runs
  assert t_fast == t_slow and fast.placement == slow.placement and n_fast == n_slow
  assert fast.steps == slow.steps == slow.events
  assert fast.events < slow.events / 2, (fast.events, slow.events)


def test_compact_run_keeps_every_requests_times():
  """run(compact=True) on a lazily made stream keeps, for each finished request, exactly
  the times and sizes the full Requests hold, and the study's summary is the same; the
  run leaves no reference cycles (it runs with the cyclic collector paused)."""
  from experiments.fleet import make_replicas, make_stream, summarize
  from jaxinfer.runtime.fleet import Fleet, Served
  from jaxinfer.runtime.routing import make_policy
  c = _config()
  c.bursty.num_requests = 80
  full_fleet = Fleet(make_replicas(c, 2), make_policy("least_loaded"))
  full = full_fleet.run(make_stream(c, "bursty"))
  small_fleet = Fleet(make_replicas(c, 2), make_policy("least_loaded"))
  gc.collect()
  small = small_fleet.run(make_stream(c, "bursty", lazy=True), compact=True)
  assert gc.isenabled() and gc.collect() == 0  # run() pauses the collector: no cycles made
  assert all(isinstance(s, Served) for s in small) and len(small) == len(full) == 80
  for f, s in zip(full, small):
    assert (s.state, s.arrival_time, s.num_prompt_tokens, s.cached_tokens, s.finished_at,
            s.ttft, s.latency) == (f.state, f.arrival_time, f.num_prompt_tokens,
                                   f.cached_tokens, f.finished_at, f.ttft, f.latency)
    assert s.token_times.tolist() == f.token_times
  a, b = summarize(full, full_fleet, 1.0), summarize(small, small_fleet, 1.0)
  assert a == b


@pytest.mark.parametrize("reserve", ["end", "none"])
def test_engine_fast_forward_equals_stepping(reserve):
  """One simulated engine with requests arriving over time, more than max_running at
  once, and (reserve="none") a pool small enough to preempt: fast-forwarding wherever
  it may (requests ending inside a stretch once none waits) gives the same token times,
  finish times and step records as step()."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  rng = np.random.default_rng(3)
  runs = []
  for ff in (False, True):
    e = Engine(SimExecutor(rm, num_pages=96 if reserve == "none" else 4096, page_size=16),
               SchedulerConfig("chunked", 6, 512, 256, reserve=reserve),
               buckets=BucketTable.default(512, 8, 4096), prefix_cache=True)
    rng = np.random.default_rng(3)
    reqs = [e.add_request(rng.integers(0, 1000, int(rng.integers(20, 400))).tolist(),
                          SamplingParams(max_tokens=int(rng.integers(1, 300))),
                          arrival_time=float(t))
            for t in np.cumsum(rng.exponential(0.3, 24))]
    rounds = 0
    while e.has_unfinished():
      k = e.fast_forward() if ff else 0
      rounds += k
      if not k:
        e.step()
    runs.append((reqs, e, rounds))
  (a, ea, _), (b, eb, rounds) = runs
  assert rounds > 100
  ended = eb.take_fast_forward_finished()  # ended inside stretches, nothing waiting
  assert ended and all(eb.requests[i].finish_reason == "length" for i in ended)
  assert [r.token_times for r in a] == [r.token_times for r in b]
  assert [r.finished_at for r in a] == [r.finished_at for r in b]
  assert [r.num_preemptions for r in a] == [r.num_preemptions for r in b]
  if reserve == "none":
    assert sum(r.num_preemptions for r in a) > 0
  assert ea.steps.count == eb.steps.count
  # every field of every record but the host time the step took here
  fields = lambda s: dataclasses.replace(s, host_s=0.0)  # noqa: E731
  assert [fields(s) for s in ea.steps] == [fields(s) for s in eb.steps]


def test_router_reads_planned_rounds_without_running_them():
  """What the fleet's router reads of a replica at time t (its unfinished requests and
  outstanding tokens) is told from the decode rounds it planned, without running them:
  equal to what running those rounds shows, at times inside a stretch where requests end
  (nothing waits) and past its end."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.fleet import _AsOf
  from jaxinfer.runtime.routing import load, outstanding_tokens
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  e = Engine(SimExecutor(rm, num_pages=4096, page_size=16),
             SchedulerConfig("chunked", 8, 2048, 512),
             buckets=BucketTable.default(2048, 8, 4096), prefix_cache=True)
  rng = np.random.default_rng(5)
  for n in (3, 9, 9, 40, 70, 120):
    e.add_request(rng.integers(0, 1000, int(rng.integers(20, 300))).tolist(),
                  SamplingParams(max_tokens=n))
  while any(not r.output_token_ids for r in e.requests.values()):
    e.step()  # the prompts: then the batch only decodes
  assert e.fast_forward(e.now() + 1e-9) == 1  # plans a chunk of rounds, runs the first
  end = e.planned_until()
  assert end > e.now()
  ended = 0
  for t in np.linspace(e.now(), end + 0.01, 40).tolist():
    view = _AsOf([e], t)  # what the fleet hands its router
    told = (view.load(0), view.outstanding_tokens(0))
    before = load(e)
    e.fast_forward(t, plan=False)
    assert told == (load(e), outstanding_tokens(e))
    ended += before - load(e)
  assert ended > 0  # some requests ended inside the stretch


def test_prefix_routing_keeps_sessions_warm():
  """Agent sessions over 4 simulated replicas: prefix affinity serves more prompt tokens
  from the prefix cache than round robin and gets first tokens sooner at the median."""
  from experiments.fleet import run_one
  c = _config()
  rr, prefix = run_one(c, "sessions", "round_robin"), run_one(c, "sessions", "prefix")
  assert prefix["cache_hit_share"] > rr["cache_hit_share"] + 0.03, (prefix, rr)
  assert prefix["ttft_p50_s"] < rr["ttft_p50_s"]
  assert sum(prefix["routed"]) == prefix["requests"] == c.sessions.num_sessions * \
      c.sessions.turns
  assert prefix["finished"] == prefix["requests"]


def test_streams_and_traces(tmp_path):
  """Arrival processes keep their mean rate (gamma with cv 4 burstier than Poisson);
  sessions repeat their history; the Azure, BurstGPT and JSONL layouts read as they are."""
  for proc in streams.PROCESSES:
    t = streams.arrival_times(proc, 10.0, 4000, seed=1, cv=4.0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert 4000 / t[-1] == pytest.approx(10.0, rel=0.15), proc
  gaps = {p: np.diff(streams.arrival_times(p, 10.0, 4000, seed=1, cv=4.0))
          for p in ("poisson", "gamma")}
  assert np.std(gaps["gamma"]) > 2.5 * np.std(gaps["poisson"])
  s = streams.sessions(3, 3, 1.0, 32, 8, 4, 2.0, seed=0)
  turns = [a for a in s if a.session == 0]
  assert len(s) == 9 and [len(a.prompt_token_ids) for a in turns] == [40, 52, 64]
  assert turns[2].prompt_token_ids[:52] == turns[1].prompt_token_ids  # history repeated
  other = next(a for a in s if a.session == 1)
  assert other.prompt_token_ids[:32] == turns[0].prompt_token_ids[:32]  # one system prompt
  assert other.prompt_token_ids[32:40] != turns[0].prompt_token_ids[32:40]
  azure = tmp_path / "azure.csv"
  azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.1805900,396,109\n")
  a = streams.read_trace(str(azure))
  assert [x.time for x in a] == pytest.approx([0.0, 3.5])
  assert [len(x.prompt_token_ids) for x in a] == [374, 396]
  assert [x.sampling.max_tokens for x in a] == [44, 109]
  burst = tmp_path / "burst.csv"
  burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "5,ChatGPT,472,18,490,Conversation log\n2,GPT-4,1087,10,1097,API log\n")
  b = streams.read_trace(str(burst))
  assert [x.time for x in b] == [0.0, 3.0] and len(b[0].prompt_token_ids) == 1087
  jl = tmp_path / "t.jsonl"
  jl.write_text("\n".join(json.dumps(d) for d in (
      {"time": 1.0, "input_tokens": 5, "output_tokens": 2, "session_id": 7},
      {"arrival_time": 0.5, "input_tokens": 3, "output_tokens": 1})))
  j = streams.read_trace(str(jl))
  assert [x.time for x in j] == [0.0, 0.5] and j[1].session == 7
  with pytest.raises(ValueError, match="columns"):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    streams.read_trace(str(bad))


def test_autoscaler_follows_a_diurnal_stream():
  """Over two cycles of a diurnal stream, the autoscaled fleet starts replicas as the load
  rises (each after its cold start) and drains them as it falls: fewer replica-hours than
  the fixed fleet of its maximum, every request served."""
  from experiments.fleet import run_autoscale
  c = _config()
  c.autoscale.update(num_requests=400, period_s=40.0)
  fixed, scaled = run_autoscale(c, False), run_autoscale(c, True)
  counts = [n for _, n in scaled["timeline"]]
  assert max(counts) > 1 and any(b < a for a, b in zip(counts, counts[1:])), counts
  assert scaled["replica_hours"] < 0.9 * fixed["replica_hours"], (scaled, fixed)
  assert scaled["finished"] == fixed["finished"] == 400
  assert scaled["cold_start_s"] > 20  # the warm-up plus Qwen3-8B's weights over PCIe


def test_study_conditions_in_worker_processes_equal_in_process(tmp_path):
  """The sweep's conditions run in worker processes give the rows one process gives
  (everything but the wall times), in condition order."""
  from experiments.fleet import run_study
  c = _config(policies=("round_robin", "least_loaded", "prefix"), streams=("bursty",),
              autoscaling=False, disaggregation=False)
  c.bursty.num_requests = 40
  rows = {}
  for workers in (1, 2):
    c.workers = workers
    rows[workers] = run_study(c, str(tmp_path / str(workers)))["rows"]
  strip = lambda rs: [{k: v for k, v in r.items() if "wall" not in k} for r in rs]  # noqa: E731
  assert strip(rows[2]) == strip(rows[1])
  assert [r["policy"] for r in rows[2]] == ["round_robin", "least_loaded", "prefix"]
  assert (tmp_path / "2" / "fleet.json").exists()


def test_cells_deal_the_stream_and_merge_what_each_cell_gives():
  """A fleet in cells: the cells' parts of a stream are the whole stream's times and
  lengths (sessions whole in one cell); run in worker processes, the condition's summary
  is the merge of each cell run in this process; cells must divide the replicas."""
  from experiments import fleet as study
  c = _config(replicas=4, cells=2)
  c.bursty.num_requests = 60
  whole = study.make_stream(c, "bursty")
  parts = [study.make_stream(c, "bursty", cell=k, cells=2) for k in range(2)]
  key = lambda a: (a.time, len(a.prompt_token_ids), a.sampling.max_tokens)  # noqa: E731
  assert sorted(map(key, parts[0] + parts[1])) == sorted(map(key, whole))
  assert parts[0][0].prompt_token_ids == whole[0].prompt_token_ids  # cell 0: the same draws
  sessions = [study.make_stream(c, "sessions", cell=k, cells=2) for k in range(2)]
  assert not {a.session for a in sessions[0]} & {a.session for a in sessions[1]}
  assert sum(map(len, sessions)) == len(study.make_stream(c, "sessions"))
  got = study.run_one(c, "bursty", "power_of_two")
  want = study.summary(study.merge([study._cell((c, "bursty", "power_of_two", k, 2))
                                    for k in range(2)]), got["wall_s"])
  assert {k: v for k, v in got.items() if k not in ("stream", "policy", "cells")} == \
      dict(want, sim_requests_per_wall_s=got["sim_requests_per_wall_s"])
  assert got["requests"] == got["finished"] == 60 and len(got["routed"]) == 4
  with pytest.raises(ValueError, match="cells=3.*replicas=4"):
    study.run_one(_config(replicas=4, cells=3), "bursty", "power_of_two")


@pytest.mark.parametrize("mode", ["continuous", "deadline"])
def test_one_replica_fleet_equals_the_goodput_study(mode):
  """One replica fed the goodput study's simulated window (its engine, prompts, arrival
  times and deadlines) finishes, or rejects, every request exactly when the goodput
  study's own run does."""
  from configs.studies.goodput import get_config
  from experiments import goodput
  from jaxinfer.config import SamplingParams
  from jaxinfer.runtime.fleet import Arrival, Fleet
  from jaxinfer.runtime.routing import make_policy
  c = get_config("sim")
  offsets = goodput.arrival_times("poisson", 40.0, 48, seed=3)
  want = goodput.run_sim_window(goodput.make_sim_engine(mode, c), c, mode, offsets)["requests"]
  rng, n = np.random.default_rng(c.seed), len(c.sim_prompt_tokens)
  arrivals = [Arrival(float(t), rng.integers(100, 100000, c.sim_prompt_tokens[i % n]).tolist(),
                      SamplingParams(max_tokens=c.max_tokens, ignore_eos=True), None,
                      c.deadline_s) for i, t in enumerate(offsets)]
  got = Fleet([goodput.make_sim_engine(mode, c)], make_policy("round_robin")).run(arrivals)
  assert [r.state.value for r in got] == [w["state"] for w in want]
  assert [r.finished_at for r in got] == [w["finished_s"] for w in want]
  if mode == "deadline":
    assert any(w["state"] == "rejected" for w in want)


def _disaggregated(c, prefill: int, decode: int, ff: bool = True, link_gbs: float = 50.0):
  from experiments.fleet import make_replicas
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.runtime.fleet import Fleet, KVTransfer
  from jaxinfer.runtime.routing import make_policy
  rm = RooflineStepModel.for_names(c.model, c.hardware)
  return Fleet(make_replicas(c, prefill), make_policy("least_loaded"), fast_forward=ff,
               decode_replicas=make_replicas(c, decode),
               decode_policy=make_policy("least_loaded"),
               transfer=KVTransfer(rm.costs.kv_bytes_per_token, link_gbs * 1e9, 20e-6))


def test_disaggregated_request_prefills_then_decodes_after_its_transfer():
  """One request: its first token comes from the prefill replica at the end of its
  prefill step; its K/V cross the link (latency + bytes / bandwidth); the decode replica
  imports them (its first step computes one token, not the prompt) and generates the rest
  one round at a time; no replica recomputes anything."""
  from experiments.fleet import make_replicas
  from jaxinfer.config import SamplingParams
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.runtime.fleet import Arrival
  c = _config()
  fleet = _disaggregated(c, 1, 1)
  prompt = list(range(100, 1100))
  (r,) = fleet.run([Arrival(0.5, prompt, SamplingParams(max_tokens=6, min_tokens=6,
                                                        ignore_eos=True))])
  rm = RooflineStepModel.for_names(c.model, c.hardware)
  pre, dec = fleet.replicas
  assert r.state.value == "finished" and len(r.token_times) == 6
  assert r.ttft == pytest.approx(rm.step_time([(1000, 0)]), rel=1e-9)
  xfer = 20e-6 + 1000 * rm.costs.kv_bytes_per_token / 50e9
  assert fleet.transfer_s == [pytest.approx(xfer, rel=1e-12)]
  # the decode replica: the first step computes token 1's K/V at context 1000, and each
  # round after it one token more
  gaps = np.diff(r.token_times)
  assert gaps[0] == pytest.approx(xfer + rm.step_time([(1, 1000)]), rel=1e-9)
  for k, g in enumerate(gaps[1:]):
    assert g == pytest.approx(rm.step_time([(1, 1001 + k)]), rel=1e-9)
  assert dec.num_steps == 5 and pre.num_steps == 1
  assert fleet.routed == [1, 1] and r.num_prompt_tokens == 1000
  # a fleet with no link to cross, or an imported count the prompt cannot hold: refused
  with pytest.raises(ValueError, match="decode_policy and transfer"):
    from jaxinfer.runtime.fleet import Fleet
    from jaxinfer.runtime.routing import make_policy
    Fleet(make_replicas(c, 1), make_policy("least_loaded"), decode_replicas=make_replicas(c, 1))
  with pytest.raises(ValueError, match="imported_tokens"):
    dec.add_request([1, 2, 3], SamplingParams(max_tokens=2), imported_tokens=3)


def test_disaggregated_fast_forward_keeps_every_timeline():
  """The decode pool's replicas run their rounds as events no further than a hand-off a
  prefill replica could still make: the same token times as stepping every replica."""
  from experiments.fleet import make_stream
  c = _config()
  c.bursty.num_requests = 150
  runs = [_disaggregated(c, 2, 2, ff).run(make_stream(c, "bursty")) for ff in (False, True)]
  assert len(runs[0]) == len(runs[1]) == 150
  for a, b in zip(*runs):
    assert a.state.value == b.state.value == "finished"
    np.testing.assert_array_equal(a.token_times, b.token_times)


def test_imported_kv_is_recomputed_after_a_preemption():
  """A request whose prompt K/V were imported, preempted, recomputes its whole context
  (the import is gone) and finishes with every token."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  eng = Engine(SimExecutor(AffineStepModel(), num_pages=14, page_size=16),  # 7 pages each
               SchedulerConfig("chunked", 4, 256, 256, reserve="none"),
               buckets=BucketTable.default(256, 4, 16))
  sp = SamplingParams(max_tokens=60, ignore_eos=True)
  a = eng.add_request(list(range(1, 101)), sp, imported_tokens=99)
  b = eng.add_request(list(range(1, 101)), sp, imported_tokens=99)
  eng.run()
  assert a.state.value == b.state.value == "finished"
  assert len(a.output_token_ids) == len(b.output_token_ids) == 60
  victim = a if a.num_preemptions else b
  assert victim.num_preemptions >= 1 and victim.imported_tokens == 0
  assert victim.recomputed_tokens > 99  # the imported prompt, computed here this time


def test_planner_split_and_the_disaggregated_study_small(tmp_path):
  """costmodel.disagg's split of the GPUs for each stream, and the study's disaggregated
  part at CI size: every split and the colocated fleet on each stream, the figure."""
  from experiments.fleet import plan_disagg, run_study
  c = _config(streams=(), autoscaling=False, workers=2)
  c.disagg.num_requests = 80
  for s in c.disagg.streams:
    p = plan_disagg(c, s)
    assert len(p["splits"]) == c.disagg.gpus - 1
    assert p["suggested_prefill"] is None or 1 <= p["suggested_prefill"] < c.disagg.gpus
  heavy = plan_disagg(c, "prompt_heavy")["splits"]
  assert not heavy[0]["feasible"] and heavy[0]["prefill_utilisation"] > 1  # one can't keep up
  res = run_study(c, str(tmp_path))
  rows = res["disagg"]
  assert len(rows) == len(c.disagg.streams) * c.disagg.gpus
  assert all(r["finished"] == c.disagg.num_requests for r in rows)
  assert (tmp_path / "fleet_disagg.png").stat().st_size > 10_000


def test_slo_routing_counts_a_replicas_memory():
  """Two replicas running the same requests, one with a pool whose free pages cannot hold
  another prompt (admission reserves each request's K/V to its end): the predicted first
  token there waits for running requests to finish and free pages, so the SLO-aware
  policy routes to the other, where least outstanding tokens sees a tie."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.routing import make_policy, outstanding_tokens, predicted_first_token_s
  from jaxinfer.runtime.scheduler import SchedulerConfig

  def replica(pages):
    e = Engine(SimExecutor(AffineStepModel(), num_pages=pages, page_size=16),
               SchedulerConfig("chunked", 8, 512, 512), buckets=BucketTable.default(512, 8, 64),
               step_model=AffineStepModel())
    for _ in range(2):
      e.add_request(list(range(1, 257)), SamplingParams(max_tokens=200, ignore_eos=True),
                    arrival_time=0.0)
    e.step()  # both admitted and prefilled: each reserves 29 pages to its end
    return e

  tight, roomy = replica(64), replica(512)
  assert outstanding_tokens(tight) == outstanding_tokens(roomy)
  prompt = list(range(1, 257))
  t_tight, t_roomy = (predicted_first_token_s(e, len(prompt)) for e in (tight, roomy))
  assert t_tight > t_roomy + 100 * AffineStepModel().fixed_s  # ~200 rounds for a slot's pages
  assert make_policy("slo").choose(prompt, [tight, roomy]) == 1
  assert make_policy("least_loaded").choose(prompt, [tight, roomy]) == 0


def test_slo_routing_waits_out_a_replicas_step_in_flight():
  """A simulated replica's clock runs past an arrival by the step it started before it.
  Two idle replicas, one still inside a long prefill step when the request arrives: the
  predicted first token there waits for that step to end, so the SLO-aware policy routes
  to the other replica (without the wait the two tie and the first would be chosen)."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.fleet import _AsOf
  from jaxinfer.runtime.routing import make_policy, predicted_first_token_s
  from jaxinfer.runtime.scheduler import SchedulerConfig

  def replica(prompt_len):
    e = Engine(SimExecutor(AffineStepModel(), num_pages=512, page_size=16),
               SchedulerConfig("chunked", 8, 2048, 2048),
               buckets=BucketTable.default(2048, 8, 256), step_model=AffineStepModel())
    e.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1),
                  arrival_time=0.0)
    e.step()  # one prefill step, which ends the request (one token asked)
    assert not e.has_unfinished()
    return e

  busy, free = replica(2048), replica(16)
  t = free.now()
  assert busy.now() > t
  prompt = list(range(1, 65))
  assert predicted_first_token_s(busy, len(prompt)) == predicted_first_token_s(free, len(prompt))
  view = _AsOf([busy, free], t)
  assert view.busy_s(0) == pytest.approx(busy.now() - t) and view.busy_s(1) == 0.0
  assert make_policy("slo").choose(prompt, view) == 1
  assert make_policy("slo").choose(prompt, [busy, free]) == 0  # nothing tells the wait
