"""Fleet simulator: R replicas, each the real Scheduler, page manager and prefix cache over
a SimExecutor (the cost model's clock for --config.model on --config.hardware), behind
each routing policy of jaxinfer.runtime.routing (the ones `--mesh=dp:M` uses on real
devices), under two streams:
  sessions  agent-like sessions sharing a system prompt and repeating their history:
            where routing by prefix keeps a session's cache warm;
  bursty    independent requests with gamma-distributed gaps (coefficient of variation
            cv) and lognormal lengths: where predicted-TTFT routing avoids the replicas
            a burst has queued up.

  python -m experiments.fleet --output_dir=out/fleet
  python -m experiments.fleet --config=configs/studies/fleet.py:small

Per (stream, policy): TTFT / ITL / E2E percentiles, prefix-cache hit share of prompt
tokens, requests per replica (imbalance: max over mean), simulated requests per
wall-second.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Dict, List

import numpy as np

from experiments import streams
from experiments.common import Progress, run_binary, write_json
from jaxinfer.buckets import BucketTable
from jaxinfer.plotting import pyplot, save


def make_replicas(c, n: int) -> List:
  """n simulated replicas of c.model on c.hardware, prefix cache on."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names(c.model, c.hardware)
  pages = int(c.kv_budget_gib * 2**30 // (rm.costs.kv_bytes_per_token * 16))
  out = []
  for _ in range(n):
    ex = SimExecutor(rm, num_pages=pages, page_size=16)
    out.append(Engine(ex, SchedulerConfig("chunked", c.max_running, c.token_budget,
                                          c.token_budget, cache_key=(c.model, "", "bf16")),
                      buckets=BucketTable.default(c.token_budget, c.max_running, 4096),
                      prefix_cache=True, max_retained_requests=64, max_step_records=1))
  return out


def make_stream(c, name: str, lazy: bool = False, cell: int = 0, cells: int = 1):
  """The stream `name` as a list of Arrivals (lazy: bursty's made as they are read).
  With cells > 1, the part cell `cell` takes: every cells-th request (bursty; its prompts
  drawn from the cell's own seed: the lengths and times are the whole stream's), or the
  sessions whose id is `cell` modulo cells (a session stays in one cell)."""
  if name == "sessions":
    s = c.sessions
    out = streams.sessions(s.num_sessions, s.turns, s.rate, s.system_tokens, s.user_tokens,
                           s.output_tokens, s.think_s, c.seed)
    return [a for a in out if a.session % cells == cell]
  if name == "bursty":
    b = c.bursty
    times = streams.arrival_times("gamma", b.rate, b.num_requests, c.seed, cv=b.cv)
    p = streams.lengths(b.num_requests, b.prompt_median, b.prompt_sigma, 16, b.prompt_max,
                        c.seed + 1)
    g = streams.lengths(b.num_requests, b.output_median, b.output_sigma, 1, b.output_max,
                        c.seed + 2)
    return (streams.iter_independent if lazy else streams.independent)(
        times[cell::cells], p[cell::cells], g[cell::cells], _cell_seed(c, cell))
  raise ValueError(f"unknown stream {name!r}: 'sessions' or 'bursty'")


def _cell_seed(c, cell: int):
  """A cell's seed for its prompts and its router: cell 0 keeps c.seed (one cell is the
  one-router fleet, draw for draw), the others their own."""
  return c.seed if cell == 0 else [c.seed, cell]


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def columns(reqs, fleet) -> Dict:
  """What a run's summary reads: each finished request's TTFT, E2E and gaps between its
  tokens, the prompt and cached token totals, requests per replica, steps."""
  done = [r for r in reqs if r.state.value == "finished"]
  return {"requests": len(reqs), "finished": len(done),
          "ttft": np.asarray([r.ttft for r in done if r.ttft is not None], float),
          "itl": np.concatenate([np.diff(r.token_times) for r in done]) if done else
          np.zeros(0),
          "e2e": np.asarray([r.latency for r in done if r.latency is not None], float),
          "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
          "cached_tokens": sum(r.cached_tokens for r in reqs),
          "routed": list(fleet.routed),
          "makespan_s": max(r.finished_at for r in done) if done else None,
          "steps": fleet.steps}


def merge(cols: List[Dict]) -> Dict:
  """One fleet's columns from its cells' (in cell order)."""
  ends = [c["makespan_s"] for c in cols if c["makespan_s"] is not None]
  out = {k: sum(c[k] for c in cols) for k in ("requests", "finished", "prompt_tokens",
                                               "cached_tokens", "steps")}
  out.update({k: np.concatenate([c[k] for c in cols]) for k in ("ttft", "itl", "e2e")},
             routed=[n for c in cols for n in c["routed"]],
             makespan_s=max(ends) if ends else None)
  return out


def summary(col: Dict, wall_s: float) -> Dict:
  itl, prompt = col["itl"], col["prompt_tokens"]
  routed = np.asarray(col["routed"], float)
  return {"requests": col["requests"], "finished": col["finished"],
          "ttft_p50_s": _pct(col["ttft"], 50), "ttft_p99_s": _pct(col["ttft"], 99),
          "itl_p50_ms": 1e3 * _pct(itl, 50) if len(itl) else None,
          "itl_p99_ms": 1e3 * _pct(itl, 99) if len(itl) else None,
          "e2e_p50_s": _pct(col["e2e"], 50), "e2e_p99_s": _pct(col["e2e"], 99),
          "cache_hit_share": col["cached_tokens"] / prompt if prompt else 0.0,
          "routed": col["routed"], "imbalance": float(routed.max() / routed.mean()),
          "makespan_s": col["makespan_s"], "steps": col["steps"], "wall_s": wall_s,
          "sim_requests_per_wall_s": col["requests"] / wall_s}


def summarize(reqs, fleet, wall_s: float) -> Dict:
  return summary(columns(reqs, fleet), wall_s)


def _cell(job) -> Dict:
  """One cell of a (stream, policy) run: c.replicas / cells replicas behind their own
  router, taking the cell's part of the stream; its columns (in a worker process when
  cells > 1)."""
  from jaxinfer.runtime.fleet import Fleet
  from jaxinfer.runtime.routing import make_policy
  c, stream, policy, cell, cells = job
  fleet = Fleet(make_replicas(c, c.replicas // cells),
                make_policy(policy, c.balance_threshold, seed=_cell_seed(c, cell)))
  arrivals = make_stream(c, stream, lazy=True, cell=cell, cells=cells)
  t0 = time.perf_counter()
  name = f"{stream} {policy}" + (f" cell {cell + 1}/{cells}" if cells > 1 else "")

  def progress(n: int, t: float) -> None:
    print(f"[fleet] {name}: {n:,} requests routed, {t:.0f} s simulated, "
          f"{n / (time.perf_counter() - t0):.0f} per wall-second", file=sys.stderr, flush=True)

  return columns(fleet.run(arrivals, compact=True, progress=progress), fleet)


def run_one(c, stream: str, policy: str) -> Dict:
  """One (stream, policy) condition. With c.cells > 1 the fleet is that many cells, each
  a router over c.replicas / c.cells replicas, requests dealt to the cells in turn (a
  session stays in its cell), each cell in its own process: cells share nothing, so the
  simulation runs on as many cores."""
  cells = c.cells
  if cells < 1 or c.replicas % cells:
    raise ValueError(f"cells must be >= 1 and divide replicas: got cells={cells}, "
                     f"replicas={c.replicas}")
  t0 = time.perf_counter()
  jobs = [(c, stream, policy, k, cells) for k in range(cells)]
  if cells == 1:
    col = _cell(jobs[0])
  else:
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
        cells, mp_context=multiprocessing.get_context("spawn")) as pool:
      col = merge(list(pool.map(_cell, jobs)))
  return dict(summary(col, time.perf_counter() - t0), stream=stream, policy=policy,
              cells=cells)


def run_autoscale(c, scaled: bool) -> Dict:
  """The diurnal stream on a fixed fleet of max_replicas, or autoscaled between
  min_replicas and max_replicas (cold start: the weights over the host link + warm-up)."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.runtime.fleet import Autoscaler, Fleet, cold_start_s
  from jaxinfer.runtime.routing import make_policy
  a = c.autoscale
  rm = RooflineStepModel.for_names(c.model, c.hardware)
  cold = cold_start_s(rm.costs.weight_bytes, rm.hw.link_bandwidth, a.warmup_s)
  times = streams.arrival_times("diurnal", a.rate, a.num_requests, c.seed,
                                amplitude=a.amplitude, period_s=a.period_s)
  p = streams.lengths(a.num_requests, a.prompt_median, 1.0, 16, 8192, c.seed + 1)
  g = streams.lengths(a.num_requests, a.output_median, 0.8, 1, 1024, c.seed + 2)
  arrivals = streams.independent(times, p, g, c.seed)
  policy = make_policy(a.policy, c.balance_threshold, seed=c.seed)
  if scaled:
    scaler = Autoscaler(a.min_replicas, a.max_replicas, a.target_load, a.down_fraction, cold)
    fleet = Fleet(make_replicas(c, a.min_replicas), policy, scaler,
                  lambda: make_replicas(c, 1)[0])
  else:
    fleet = Fleet(make_replicas(c, a.max_replicas), policy)
  t0 = time.perf_counter()
  reqs = fleet.run(arrivals)
  out = summarize(reqs, fleet, time.perf_counter() - t0)
  end = out["makespan_s"]
  hours = fleet.replica_seconds(end) / 3600
  good = sum(r.state.value == "finished" and r.ttft is not None and r.ttft <= c.slo_ttft_s
             for r in reqs)
  out.update(mode="autoscaled" if scaled else "fixed", replica_hours=hours, good=good,
             goodput_per_replica_hour=good / hours if hours else None,
             cost_per_1k_good=1000 * hours * c.gpu_hour_price / good if good else None,
             cold_start_s=cold, timeline=fleet.timeline)
  return out


def disagg_stream(c, name: str):
  """One of c.disagg.streams: Poisson arrivals, lognormal prompt and output lengths."""
  d = c.disagg.streams[name]
  times = streams.arrival_times("poisson", d.rate, c.disagg.num_requests, c.seed)
  p = streams.lengths(c.disagg.num_requests, d.prompt_median, 0.3, 16, 8 * d.prompt_median,
                      c.seed + 1)
  g = streams.lengths(c.disagg.num_requests, d.output_median, 0.3, 2, 8 * d.output_median,
                      c.seed + 2)
  return streams.independent(times, p, g, c.seed)


def kv_transfer(c):
  """The link a request's K/V crosses after prefill: c.disagg.link_gbs per direction."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.runtime.fleet import KVTransfer
  rm = RooflineStepModel.for_names(c.model, c.hardware)
  return KVTransfer(rm.costs.kv_bytes_per_token, c.disagg.link_gbs * 1e9,
                    c.disagg.link_latency_us * 1e-6)


def run_disagg(c, stream: str, prefill: int) -> Dict:
  """c.disagg.gpus replicas colocated (prefill = 0) or split into `prefill` prefill and
  the rest decode replicas, both pools least-loaded, on one stream; SLO attainment: a
  request finished with its TTFT and its mean inter-token time within the SLOs."""
  from jaxinfer.runtime.fleet import Fleet
  from jaxinfer.runtime.routing import make_policy
  n = c.disagg.gpus
  if prefill:
    fleet = Fleet(make_replicas(c, prefill), make_policy("least_loaded"),
                  decode_replicas=make_replicas(c, n - prefill),
                  decode_policy=make_policy("least_loaded"), transfer=kv_transfer(c))
  else:
    fleet = Fleet(make_replicas(c, n), make_policy("least_loaded"))
  t0 = time.perf_counter()
  reqs = fleet.run(disagg_stream(c, stream), compact=True)
  out = summarize(reqs, fleet, time.perf_counter() - t0)
  ok = [r.state.value == "finished" and r.ttft is not None and r.ttft <= c.disagg.slo_ttft_s
        and (len(r.token_times) < 2 or float(np.mean(np.diff(r.token_times)))
             <= c.disagg.slo_tpot_ms / 1e3) for r in reqs]
  tpot = [float(np.mean(np.diff(r.token_times))) for r in reqs if len(r.token_times) > 1]
  out.update(stream=stream, prefill=prefill, decode=n - prefill if prefill else 0,
             slo_attainment=float(np.mean(ok)), tpot_p99_ms=1e3 * _pct(tpot, 99),
             goodput_per_gpu=sum(ok) / out["makespan_s"] / n,
             transfer_ms=1e3 * float(np.mean(fleet.transfer_s)) if fleet.transfer_s else 0.0)
  return out


def plan_disagg(c, stream: str) -> Dict:
  """The planner's split of c.disagg.gpus for the stream (costmodel.disagg)."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.costmodel.disagg import plan
  d = c.disagg.streams[stream]
  splits, best = plan(RooflineStepModel.for_names(c.model, c.hardware), c.disagg.gpus, d.rate,
                      d.prompt_median, d.output_median, kv_transfer(c).seconds(d.prompt_median),
                      c.max_running, c.kv_budget_gib * 2**30, c.disagg.slo_ttft_s,
                      c.disagg.slo_tpot_ms / 1e3)
  return {"stream": stream, "suggested_prefill": best.prefill if best else None,
          "splits": [dataclasses.asdict(x) for x in splits]}


def _run(job):
  """One condition of the sweep (a worker process runs it when c.workers > 1)."""
  c, kind, a, b = job
  if kind == "disagg":
    return run_disagg(c, a, b)
  return run_one(c, a, b) if kind == "route" else run_autoscale(c, a)


def _line(r: Dict) -> str:
  if "prefill" in r:
    return (f"{r['stream']} {r['prefill']}:{r['decode'] or 'colocated'}: SLO attainment "
            f"{r['slo_attainment']:.2f}")
  if "mode" in r:
    return (f"{r['mode']}: {r['replica_hours']:.2f} replica-hours, TTFT p99 "
            f"{r['ttft_p99_s']:.2f} s")
  return (f"{r['stream']} {r['policy']}: TTFT p99 {r['ttft_p99_s']:.3f} s, hits "
          f"{r['cache_hit_share']:.2f}, {r['sim_requests_per_wall_s']:.0f} requests/wall-s")


def run_study(c, output_dir: str = "") -> Dict:
  """Every (stream, policy) of c.streams x c.policies, then (c.autoscaling) the diurnal
  stream fixed and autoscaled; conditions run in c.workers processes (0: one per CPU),
  results in condition order."""
  jobs = [(c, "route", s, p) for s in c.streams for p in c.policies]
  if c.autoscaling:
    jobs += [(c, "scale", False, None), (c, "scale", True, None)]
  if c.disaggregation:  # each stream colocated (0) and split n_p : gpus - n_p
    jobs += [(c, "disagg", s, p) for s in c.disagg.streams for p in range(c.disagg.gpus)]
  prog = Progress(len(jobs), "fleet")
  workers = min(c.workers or os.cpu_count() or 1, len(jobs))
  if c.cells > 1:  # each condition runs its cells in processes of its own
    workers = 1
  out = []
  if workers > 1:
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn")) as pool:
      for r in pool.map(_run, jobs):
        out.append(r)
        prog.step(_line(r))
  else:
    for job in jobs:
      out.append(_run(job))
      prog.step(_line(out[-1]))
  rows = [r for r in out if "mode" not in r and "prefill" not in r]
  scaling = [r for r in out if "mode" in r]
  res = {"config": c.to_dict(), "rows": rows, "autoscale": scaling,
         "disagg": [r for r in out if "prefill" in r],
         "disagg_plan": [plan_disagg(c, s) for s in c.disagg.streams] if c.disaggregation
         else []}
  if output_dir:
    write_json(output_dir, "fleet.json", res)
    plot(res, os.path.join(output_dir, "fleet.png"))
    plot_disagg(res, os.path.join(output_dir, "fleet_disagg.png"))
  return res


def plot(res: Dict, path: str) -> None:
  plt = pyplot()
  rows = res["rows"]
  if not ({"sessions", "bursty"} <= {r["stream"] for r in rows} and res.get("autoscale")):
    return  # the figure compares both streams and the autoscaler (the study's default)
  fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
  pols = list(dict.fromkeys(r["policy"] for r in rows))
  x = np.arange(len(pols))
  for ax, (stream, key, label) in zip(axes, (
      ("sessions", "cache_hit_share", "prefix-cache share of prompt tokens"),
      ("sessions", "ttft_p50_s", "TTFT p50 (s)"),
      ("bursty", "ttft_p99_s", "TTFT p99 (s)"))):
    vals = [next(r[key] for r in rows if r["stream"] == stream and r["policy"] == p)
            for p in pols]
    ax.bar(x, vals, color="tab:blue" if stream == "sessions" else "tab:orange")
    ax.set_xticks(x, pols, rotation=20, fontsize=8)
    ax.set_title(f"{stream}: {label}", fontsize=9)
  ax = axes[3]
  for r in res.get("autoscale", []):
    t, n = zip(*r["timeline"], (r["makespan_s"], r["timeline"][-1][1]))
    ax.step(t, n, where="post", label=f"{r['mode']}: {r['replica_hours']:.2f} replica-h, "
            f"TTFT p99 {r['ttft_p99_s']:.2f} s")
  ax.set_xlabel("simulated time (s)")
  ax.set_ylabel("replicas")
  ax.set_title("diurnal stream: replicas over time", fontsize=9)
  ax.legend(fontsize=7)
  c = res["config"]
  fig.suptitle(f"{c['replicas']} simulated replicas of {c['model']} on {c['hardware']}",
               fontsize=10)
  save(fig, path)


def plot_disagg(res: Dict, path: str) -> None:
  """Per stream: SLO attainment and TTFT / TPOT p99 against the prefill replicas of a
  split, colocated as a line, the planner's suggestion marked."""
  if not res.get("disagg"):
    return
  plt = pyplot()
  names = list(dict.fromkeys(r["stream"] for r in res["disagg"]))
  fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    rows = [r for r in res["disagg"] if r["stream"] == name]
    col = next(r for r in rows if not r["prefill"])
    split = [r for r in rows if r["prefill"]]
    x = [r["prefill"] for r in split]
    ax.plot(x, [r["slo_attainment"] for r in split], "o-", label="disaggregated")
    ax.axhline(col["slo_attainment"], color="tab:gray", ls="--", label="colocated")
    plan = next((p for p in res["disagg_plan"] if p["stream"] == name), None)
    if plan and plan["suggested_prefill"]:
      sp = plan["suggested_prefill"]
      ax.plot([sp], [next(r["slo_attainment"] for r in split if r["prefill"] == sp)], "r*",
              ms=14, label="planner's split")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(f"prefill replicas (of {res['config']['disagg']['gpus']} GPUs)")
    ax.set_ylabel("SLO attainment")
    d = res["config"]["disagg"]["streams"][name]
    ax.set_title(f"{name}: {d['rate']:g} req/s, ~{d['prompt_median']} in / "
                 f"~{d['output_median']} out", fontsize=9)
    ax2 = ax.twinx()
    ax2.plot(x, [r["ttft_p99_s"] for r in split], "s:", color="tab:orange", ms=4,
             label="TTFT p99 (s)")
    ax2.plot(x, [r["tpot_p99_ms"] / 1e3 for r in split], "^:", color="tab:green", ms=4,
             label="TPOT p99 (s)")
    ax2.set_yscale("log")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower center")
  c = res["config"]
  fig.suptitle(f"Colocated vs disaggregated at {c['disagg']['gpus']} GPUs: {c['model']} on "
               f"{c['hardware']} (SLO: TTFT <= {c['disagg']['slo_ttft_s']} s, TPOT <= "
               f"{c['disagg']['slo_tpot_ms']} ms)", fontsize=10)
  save(fig, path)


def print_table(res: Dict) -> None:
  c = res["config"]
  print(f"{c['replicas']} replicas of {c['model']} on {c['hardware']} (simulated)")
  print(f"{'stream':>9} {'policy':>13} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99 ms':>11} "
        f"{'E2E p99':>8} {'hits':>5} {'imbal':>6} {'req/wall-s':>11}")
  for r in res["rows"]:
    print(f"{r['stream']:>9} {r['policy']:>13} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f} "
          f"{r['itl_p99_ms']:>11.1f} {r['e2e_p99_s']:>8.2f} {r['cache_hit_share']:>5.2f} "
          f"{r['imbalance']:>6.2f} {r['sim_requests_per_wall_s']:>11.0f}")
  if res.get("disagg"):
    d = c["disagg"]
    print(f"\n{d['gpus']} GPUs colocated or split prefill:decode (K/V over "
          f"{d['link_gbs']} GB/s); SLO: TTFT <= {d['slo_ttft_s']} s and TPOT <= "
          f"{d['slo_tpot_ms']} ms")
    print(f"{'stream':>13} {'split':>9} {'SLO att.':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p99 ms':>12} {'ITL p99 ms':>11} {'good/s/GPU':>11} {'xfer ms':>8}")
    for r in res["disagg"]:
      split = f"{r['prefill']}:{r['decode']}" if r["prefill"] else "colocated"
      print(f"{r['stream']:>13} {split:>9} {r['slo_attainment']:>9.3f} {r['ttft_p50_s']:>9.3f} "
            f"{r['ttft_p99_s']:>9.3f} {r['tpot_p99_ms']:>12.1f} {r['itl_p99_ms']:>11.1f} "
            f"{r['goodput_per_gpu']:>11.3f} {r['transfer_ms']:>8.2f}")
    for p in res["disagg_plan"]:
      print(f"planner, {p['stream']}: {p['suggested_prefill']} prefill replicas")
  if res.get("autoscale"):
    print(f"\ndiurnal stream ({c['autoscale']['policy']}), good = first token within "
          f"{c['slo_ttft_s']} s, {c['gpu_hour_price']} per replica-hour")
    print(f"{'mode':>10} {'replica-h':>10} {'TTFT p99':>9} {'good':>6} {'good/replica-h':>15} "
          f"{'cost/1k good':>13} {'cold start s':>13}")
    for r in res["autoscale"]:
      print(f"{r['mode']:>10} {r['replica_hours']:>10.3f} {r['ttft_p99_s']:>9.2f} "
            f"{r['good']:>6} {r['goodput_per_replica_hour']:>15.0f} "
            f"{r['cost_per_1k_good']:>13.3f} {r['cold_start_s']:>13.1f}")


if __name__ == "__main__":
  run_binary("fleet", run_study, print_table)
