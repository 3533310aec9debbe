"""Fixed vs continuous vs chunked batching on one trace (SPEC 8.2.2-8.2.4).

  python -m experiments.scheduling --workload=ch8_2_2 --policy=all --executor=sim --json \
      --output_dir=out/scheduling

sim: Qwen3-8B on the simulated clock with the affine step model of 8.2.2 (at most 2
running; chunked: 2048-token chunks, 4096-token budget). jax: the same pattern scaled
down (--token_scale, --time_scale) on SmolLM2 on this CPU. Writes one JSON and one
timeline PNG per policy.
"""
from __future__ import annotations

import json
import os

from absl import app, flags
import numpy as np

from experiments.workloads import load_workload, scale
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams, get_model_config
from jaxinfer.metrics import request_record, step_records
from jaxinfer.plotting import plot_timeline
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig

FLAGS = flags.FLAGS
flags.DEFINE_enum("policy", "all", ["fixed", "continuous", "chunked", "all"], "policy")
flags.DEFINE_string("workload", "ch8_2_2", "workload name or JSON trace path")
flags.DEFINE_enum("executor", "sim", ["sim", "jax"], "simulated clock or the real model")
flags.DEFINE_integer("max_running", 2, "requests running at once")
flags.DEFINE_integer("chunk_size", 2048, "chunked: prefill chunk (scaled by --token_scale on jax)")
flags.DEFINE_integer("token_budget", 4096, "chunked: tokens per iteration (scaled on jax)")
flags.DEFINE_string("sim_model", "qwen3-8b", "model config for the simulator's KV accounting")
flags.DEFINE_float("kv_budget_gib", 12.0, "simulator KV budget")
flags.DEFINE_string("model", "smollm2-135m-instruct", "real model (executor=jax)")
flags.DEFINE_float("token_scale", 1 / 32, "jax: prompt length scale")
flags.DEFINE_float("time_scale", 3.0, "jax: arrival time scale")
flags.DEFINE_bool("json", False, "print the results as JSON")
flags.DEFINE_string("output_dir", "", "write JSON and timeline figures here")

UNLIMITED = 1 << 20


def policy_config(policy: str, chunk: int, budget: int, max_running: int, cache_key):
  if policy == "chunked":
    return SchedulerConfig("chunked", max_running, budget, chunk, cache_key=cache_key)
  return SchedulerConfig(policy, max_running, UNLIMITED, UNLIMITED, cache_key=cache_key)


def sim_engine(policy: str, model: str, kv_budget_gib: float, chunk: int, budget: int,
               max_running: int):
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.kv import bytes_per_token
  cfg = get_model_config(model)
  page = 16
  num_pages = int(kv_budget_gib * 2**30 // (bytes_per_token(cfg, "bf16") * page))
  ex = SimExecutor(AffineStepModel(), num_pages=num_pages, page_size=page)
  buckets = BucketTable.default(max_tokens=16384, max_requests=64, max_pages=4096)
  return Engine(ex, policy_config(policy, chunk, budget, max_running, (cfg.name, "", "bf16")),
                buckets=buckets, max_model_len=cfg.max_position)


def jax_engine(policy: str, llm_model, chunk: int, budget: int, max_running: int):
  from jaxinfer.llm import LLM
  buckets = BucketTable.default(max_tokens=max(256, budget), max_requests=max(4, max_running),
                                max_pages=64)
  llm = LLM(llm_model, num_pages=512, buckets=buckets,
            scheduler=policy_config(policy, chunk, budget, max_running, ("smollm2", "", "f32")))
  return llm.engine


def run_trace(engine, trace, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  t0 = engine.now()
  for i, r in enumerate(trace):
    ids = rng.integers(100, vocab - 100, r["input_tokens"]).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True),
                       request_id=i, arrival_time=t0 + r["arrival_ms"] / 1e3)
  reqs = engine.run()
  recs = [request_record(r) for r in reqs]
  for rec in recs:  # times relative to the trace start
    for k in ("arrival_s", "admitted_s", "first_token_s", "finished_s"):
      if rec[k] is not None:
        rec[k] -= t0
    rec["token_times_s"] = [t - t0 for t in rec["token_times_s"]]
  steps = step_records(engine.steps)
  for s in steps:
    s["start"] -= t0
    s["end"] -= t0
  itls = [x for r in reqs for x in r.itls]
  return {
      "makespan_ms": 1e3 * max(r.finished_at for r in reqs) - 1e3 * t0,
      "max_itl_ms": 1e3 * max(itls) if itls else None,
      "requests": recs, "steps": steps, "metrics": engine.metrics(),
  }


def main(argv):
  del argv
  trace = load_workload(FLAGS.workload)
  policies = ["fixed", "continuous", "chunked"] if FLAGS.policy == "all" else [FLAGS.policy]
  chunk, budget = FLAGS.chunk_size, FLAGS.token_budget
  llm_model = None
  if FLAGS.executor == "jax":
    trace = scale(trace, FLAGS.token_scale, FLAGS.time_scale)
    chunk = max(1, int(chunk * FLAGS.token_scale))
    budget = max(1, int(budget * FLAGS.token_scale))
    from jaxinfer.loading import load_model
    llm_model = load_model(FLAGS.model)
  results = {}
  for policy in policies:
    if FLAGS.executor == "sim":
      eng = sim_engine(policy, FLAGS.sim_model, FLAGS.kv_budget_gib, chunk, budget,
                       FLAGS.max_running)
      vocab = get_model_config(FLAGS.sim_model).vocab_size
    else:
      eng = jax_engine(policy, llm_model, chunk, budget, FLAGS.max_running)
      vocab = llm_model.cfg.vocab_size
      run_trace(eng, trace, vocab, seed=1)  # warm-up: compile the buckets this trace uses
      eng = jax_engine(policy, llm_model, chunk, budget, FLAGS.max_running)
    res = run_trace(eng, trace, vocab)
    res.update(policy=policy, executor=FLAGS.executor, workload=FLAGS.workload,
               title=f"{FLAGS.workload}: {policy} ({FLAGS.executor})")
    results[policy] = res
    if FLAGS.output_dir:
      os.makedirs(FLAGS.output_dir, exist_ok=True)
      base = os.path.join(FLAGS.output_dir, f"scheduling_{FLAGS.executor}_{policy}")
      with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
      plot_timeline(res["requests"], res["steps"], base + ".png", res["title"])
  summary = {p: {"makespan_ms": r["makespan_ms"], "max_itl_ms": r["max_itl_ms"],
                 "requests": [{k: q[k] for k in ("request_id", "arrival_s", "first_token_s",
                                                 "finished_s", "ttft_s", "max_itl_s")}
                              for q in r["requests"]]}
             for p, r in results.items()}
  if FLAGS.json:
    print(json.dumps(summary, indent=1))
    return
  print(f"{'policy':>11} {'makespan ms':>12} {'max ITL ms':>11}  per request (TTFT ms / finish ms)")
  for p, r in summary.items():
    per = "  ".join(f"r{q['request_id']}: {1e3 * q['ttft_s']:.1f}/{1e3 * q['finished_s']:.1f}"
                    for q in r["requests"])
    print(f"{p:>11} {r['makespan_ms']:>12.1f} {r['max_itl_ms']:>11.1f}  {per}")


if __name__ == "__main__":
  app.run(main)
