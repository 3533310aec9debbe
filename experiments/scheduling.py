"""Scheduling policies and the token budget (chapter 8.2.2-8.2.4), simulated and real.

  python -m experiments.scheduling --output_dir=out/scheduling
  python -m experiments.scheduling --config=configs/studies/scheduling.py:sim    # simulator only
  python -m experiments.scheduling --config=configs/studies/scheduling.py:small  # CI size

1. Policies: fixed vs continuous vs chunked on the 8.2.2 trace (a long prompt arriving
   while short ones decode; at most 2 running; chunked: 2048-token chunks, 4096-token
   budget). sim: Qwen3-8B with 8.2.2's affine step model; jax: the same pattern scaled
   down (config token_scale / time_scale) on SmolLM2 on this CPU. One JSON and one
   timeline PNG per (executor, policy).
2. Token-budget sweep (8.2.4): six requests arriving every 80 ms (scaled likewise on the
   real model), chunked prefill with budget = chunk = 512 ... 8192: the late requests'
   queueing time (arrival -> first admitted) against the max ITL, real and simulated
   side by side (scheduling_budget.png).
"""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

from experiments.common import Progress, few_buckets, run_binary, write_json
from experiments.workloads import load_workload, scale
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams, get_model_config
from jaxinfer.metrics import request_record, step_records
from jaxinfer.plotting import plot_timeline, pyplot, save
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig
from jaxinfer import strict_json

UNLIMITED = 1 << 20


def policy_config(policy: str, chunk: int, budget: int, max_running: int, cache_key):
  if policy == "chunked":
    return SchedulerConfig("chunked", max_running, budget, chunk, cache_key=cache_key)
  return SchedulerConfig(policy, max_running, UNLIMITED, UNLIMITED, cache_key=cache_key)


def sim_engine(policy: str, model: str, kv_budget_gib: float, chunk: int, budget: int,
               max_running: int, step_model: str = "affine", hardware: str = "rtx-pro-6000",
               kv_format: str = "bf16", bytes_per_param: float = 2.0, buckets=None):
  """step_model: "affine" (8.2.2's fit of 8-1 at batch 1), "roofline" (8.6.3's
  calibrated roofline of `model` on `hardware`) or a step time model itself (an
  AffineStepModel of other coefficients). buckets: charge every step at its bucket's shape
  (padding included), as the real engine runs it; default: exact shapes."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.kv import bytes_per_token
  cfg = get_model_config(model)
  page = 16
  num_pages = int(kv_budget_gib * 2**30 // (bytes_per_token(cfg, kv_format) * page))
  if isinstance(step_model, str) and step_model not in ("affine", "roofline"):
    raise ValueError(f"step_model must be 'affine' or 'roofline', got {step_model!r}")
  if not isinstance(step_model, str):
    sm = step_model
  elif step_model == "affine":
    sm = AffineStepModel()
  else:
    sm = RooflineStepModel.for_names(model, hardware, kv_format, page, bytes_per_param)
  ex = SimExecutor(sm, num_pages=num_pages, page_size=page, pad_to_buckets=buckets is not None)
  buckets = buckets or BucketTable.default(max_tokens=16384, max_requests=64, max_pages=4096)
  return Engine(ex, policy_config(policy, chunk, budget, max_running, (cfg.name, "", kv_format)),
                buckets=buckets, max_model_len=cfg.max_position)


def real_buckets(policy: str, chunk: int, budget: int, max_running: int, max_len: int,
                 max_prompt: int):
  """The compiled shapes of the real run (and of its simulation, which charges each step
  at its bucket): token sizes up to the largest step; a prefill slot's query length up to
  the chunk, or for the unchunked policies the longest prompt (wider would pad every
  prefill's attention to the whole step)."""
  step = budget if policy == "chunked" else max_len * max_running
  chunk = chunk if policy == "chunked" else max_prompt
  return few_buckets(step, chunk, max_running, max_len), chunk


def jax_engine(policy: str, llm_model, chunk: int, budget: int, max_running: int,
               max_len: int, max_prompt: int):
  """max_len: the trace's longest prompt + output (the page-table size)."""
  from jaxinfer.llm import LLM
  buckets, chunk = real_buckets(policy, chunk, budget, max_running, max_len, max_prompt)
  llm = LLM(llm_model, warmup=False, num_pages=max_running * buckets.max_pages + 8, buckets=buckets,
            scheduler=policy_config(policy, chunk, budget, max_running, ("smollm2", "", "f32")))
  llm.engine.warmup()
  return llm.engine


def run_trace(engine, trace, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  t0 = engine.now()
  for i, r in enumerate(trace):
    ids = rng.integers(100, vocab - 100, r["input_tokens"]).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True),
                       request_id=i, arrival_time=t0 + r["arrival_ms"] / 1e3)
  reqs = engine.run()
  recs = [request_record(r, t0) for r in reqs]  # times relative to the trace start
  steps = step_records(engine.steps, t0)
  itls = [x for r in reqs for x in r.itls]
  return {
      "makespan_ms": 1e3 * max(r.finished_at for r in reqs) - 1e3 * t0,
      "max_itl_ms": 1e3 * max(itls) if itls else None,
      "requests": recs, "steps": steps, "metrics": engine.metrics(),
  }


def make_engine(executor: str, policy: str, c, chunk: int, budget: int, max_running: int,
                llm_model=None, trace=(), step_model: str = "affine"):
  if executor == "sim":
    return sim_engine(policy, c.sim_model, c.kv_budget_gib, chunk, budget, max_running,
                      step_model)
  max_len = max(r["input_tokens"] + r["output_tokens"] for r in trace)
  max_prompt = max(r["input_tokens"] for r in trace)
  if executor == "sim_local":  # the real run's model, scaled trace and compiled shapes on
    # the local-cpu roofline (calibrated by tools/measure_hardware.py --calibrate)
    buckets, chunk = real_buckets(policy, chunk, budget, max_running, max_len, max_prompt)
    return sim_engine(policy, c.model, c.kv_budget_gib, chunk, budget, max_running,
                      "roofline", "local-cpu", "f32", 4.0, buckets=buckets)
  return jax_engine(policy, llm_model, chunk, budget, max_running, max_len, max_prompt)


def replay_of(trace: List[Dict], executor: str, c, llm_model):
  """(trace, token scale, vocabulary): the real model replays the trace scaled down."""
  if executor == "sim":
    return trace, 1.0, get_model_config(c.sim_model).vocab_size
  return (scale(trace, c.token_scale, c.time_scale), c.token_scale,
          get_model_config(c.model).vocab_size)


def run_policies(executor: str, c, llm_model, prog) -> Dict:
  trace, f, vocab = replay_of(load_workload(c.workload), executor, c, llm_model)
  chunk, budget = max(1, int(c.chunk_size * f)), max(1, int(c.token_budget * f))
  out = {}
  for policy in c.policies:
    eng = make_engine(executor, policy, c, chunk, budget, c.max_running, llm_model, trace)
    res = run_trace(eng, trace, vocab)
    res.update(policy=policy, executor=executor, workload=c.workload,
               title=f"{c.workload}: {policy} ({executor})")
    out[policy] = res
    prog.step(f"{executor} {policy}: makespan {res['makespan_ms']:.0f} ms")
  return out


def late_queueing_ms(res: Dict) -> Dict[str, float]:
  """8.2.4's engine queueing of the late requests (every one but the first), mean ms:
  from the first iteration boundary at or after the request's arrival (when the
  scheduler first sees it) to its admission. The wait for the iteration already in
  flight at arrival comes before that and is reported apart (inflight_wait_ms)."""
  starts = sorted(s["start"] for s in res["steps"])
  queue, inflight = [], []
  for r in res["requests"]:
    if r["request_id"] == 0:
      continue
    boundary = next((t for t in starts if t >= r["arrival_s"] - 1e-9), r["admitted_s"])
    queue.append(r["admitted_s"] - boundary)
    inflight.append(boundary - r["arrival_s"])
  return {"queueing_ms": 1e3 * float(np.mean(queue)),
          "inflight_wait_ms": 1e3 * float(np.mean(inflight))}


def sweep_trace(c) -> List[Dict]:
  if c.sweep_workload == "ch8_2_4":
    from experiments.workloads import ch8_2_4
    return ch8_2_4(c.sweep_requests, c.sweep_interval_ms, c.sweep_input_tokens,
                   c.sweep_output_tokens)
  return load_workload(c.sweep_workload)


def run_budget_sweep(executor: str, c, llm_model, prog) -> List[Dict]:
  trace, f, vocab = replay_of(sweep_trace(c), executor, c, llm_model)
  rows = []
  for b in c.sweep_budgets:
    budget = max(1, int(b * f))
    chunk = max(1, int(c.sweep_chunk * f)) if c.sweep_chunk else budget
    eng = make_engine(executor, "chunked", c, chunk, budget, c.sweep_max_running, llm_model,
                      trace, c.sweep_step_model)
    res = run_trace(eng, trace, vocab)
    ttft = [r["ttft_s"] for r in res["requests"] if r["request_id"] != 0]
    q = late_queueing_ms(res)
    rows.append({"executor": executor, "budget": b, "budget_tokens": budget,
                 "chunk_tokens": chunk, "late_queueing_ms": q["queueing_ms"],
                 "late_inflight_wait_ms": q["inflight_wait_ms"],
                 "late_ttft_ms": 1e3 * float(np.mean(ttft)), "max_itl_ms": res["max_itl_ms"],
                 "makespan_ms": res["makespan_ms"], "steps": len(res["steps"])})
    prog.step(f"{executor} budget {b}: late queueing {rows[-1]['late_queueing_ms']:.1f} ms, "
              f"max ITL {res['max_itl_ms']:.1f} ms")
  return rows


def run_study(c, output_dir: str = "") -> Dict:
  llm_model = None
  if "jax" in c.executors:
    from jaxinfer.loading import load_model
    llm_model = load_model(c.model)
  prog = Progress(len(c.executors) * (len(c.policies) + len(c.sweep_budgets)), "scheduling")
  policies, sweep = {}, []
  for ex in c.executors:
    policies[ex] = run_policies(ex, c, llm_model, prog)
    sweep += run_budget_sweep(ex, c, llm_model, prog)
  summary = {ex: {p: {"makespan_ms": r["makespan_ms"], "max_itl_ms": r["max_itl_ms"],
                      "requests": [{k: q[k] for k in ("request_id", "arrival_s", "first_token_s",
                                                      "finished_s", "ttft_s", "max_itl_s")}
                                   for q in r["requests"]]}
                  for p, r in pol.items()} for ex, pol in policies.items()}
  if output_dir:
    for ex, pol in policies.items():
      for p, res in pol.items():
        base = os.path.join(output_dir, f"scheduling_{ex}_{p}")
        write_json(output_dir, os.path.basename(base) + ".json", res)
        plot_timeline(res["requests"], res["steps"], base + ".png", res["title"])
    write_json(output_dir, "scheduling.json", {"config": c.to_dict(), "policies": summary,
                                               "budget_sweep": sweep})
    if sweep:
      plot_sweep(sweep, os.path.join(output_dir, "scheduling_budget.png"))
  return {"config": c.to_dict(), "policies": summary, "budget_sweep": sweep}


def plot_sweep(rows: List[Dict], path: str) -> None:
  plt = pyplot()
  exs = list(dict.fromkeys(r["executor"] for r in rows))
  fig, axes = plt.subplots(1, len(exs), figsize=(5.5 * len(exs), 3.8), squeeze=False)
  for ax, ex in zip(axes[0], exs):
    rs = [r for r in rows if r["executor"] == ex]
    x = [r["budget"] for r in rs]
    ax.plot(x, [r["late_queueing_ms"] for r in rs], "o-", label="late requests' queueing")
    ax.plot(x, [r["max_itl_ms"] for r in rs], "s-", label="max ITL")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget (chapter scale; real model runs it x token_scale)")
    ax.set_ylabel("ms")
    ax.set_title({"sim": "simulated Qwen3-8B (8.2.2 step model)",
                  "sim_local": "simulated SmolLM2 on local-cpu (scaled replay)",
                  "jax": "SmolLM2 on this CPU (scaled replay)"}[ex], fontsize=9)
    ax.legend(fontsize=8)
  fig.suptitle("8.2.4: six requests every 80 ms, chunked prefill, budget = chunk", fontsize=9)
  save(fig, path)


def print_tables(res: Dict) -> None:
  if res["config"]["json"]:
    print(strict_json.dumps(res, indent=1))
    return
  for ex, pol in res["policies"].items():
    print(f"[{ex}] {'policy':>11} {'makespan ms':>12} {'max ITL ms':>11}  per request "
          "(TTFT ms / finish ms)")
    for p, r in pol.items():
      per = "  ".join(f"r{q['request_id']}: {1e3 * q['ttft_s']:.1f}/{1e3 * q['finished_s']:.1f}"
                      for q in r["requests"])
      print(f"[{ex}] {p:>11} {r['makespan_ms']:>12.1f} {r['max_itl_ms']:>11.1f}  {per}")
  ranks = {ex: sorted(pol, key=lambda p: pol[p]["makespan_ms"])
           for ex, pol in res["policies"].items()}
  for ex, order in ranks.items():
    print(f"[{ex}] policies by makespan: {' < '.join(order)}")
  if "jax" in ranks and "sim_local" in ranks:
    same = ranks["jax"] == ranks["sim_local"]
    print("real and simulated (local-cpu) rank the policies "
          f"{'the same' if same else 'differently'}")
  if res["budget_sweep"]:
    c = res["config"]
    print(f"8.2.4 replay: {c['sweep_requests']} requests every {c['sweep_interval_ms']:g} ms "
          f"(the chapter's); {c['sweep_input_tokens']} prompt / {c['sweep_output_tokens']} "
          f"output tokens and chunk = {c['sweep_chunk'] or 'budget'} are this config's (the "
          "chapter leaves them open); queueing from the first iteration boundary after "
          "arrival to admission")
    print(f"{'executor':>8} {'budget':>7} {'(tokens)':>9} {'late queueing ms':>17} "
          f"{'in-flight wait ms':>18} {'late TTFT ms':>13} {'max ITL ms':>11}")
    for r in res["budget_sweep"]:
      print(f"{r['executor']:>8} {r['budget']:>7} {r['budget_tokens']:>9} "
            f"{r['late_queueing_ms']:>17.1f} {r['late_inflight_wait_ms']:>18.1f} "
            f"{r['late_ttft_ms']:>13.1f} {r['max_itl_ms']:>11.1f}")


if __name__ == "__main__":
  run_binary("scheduling", run_study, print_tables)
