"""A real-model serving run on this CPU: N concurrent requests with mixed prompt lengths,
static batches (policy "fixed") vs continuous batching with chunked prefill, same
requests, same run.

  python tools/bench_engine.py --num_requests=16 --output_dir=out/bench_engine
"""
from __future__ import annotations

import os

from absl import app, flags
import numpy as np
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "model")
flags.DEFINE_integer("num_requests", 16, "requests, all sent at once")
flags.DEFINE_list("prompt_lens", ["16", "64", "128", "256"], "prompt lengths, cycled")
flags.DEFINE_list("output_lens", ["32", "64"], "output lengths, cycled")
flags.DEFINE_list("policies", ["fixed", "continuous", "chunked"], "policies to compare")
flags.DEFINE_integer("max_running", 16, "requests running at once")
flags.DEFINE_integer("token_budget", 256, "chunked: tokens per iteration")
flags.DEFINE_string("output_dir", "", "write bench_engine.json here")


def trace(n, vocab, seed):
  rng = np.random.default_rng(seed)
  pl = [int(x) for x in FLAGS.prompt_lens]
  ol = [int(x) for x in FLAGS.output_lens]
  return [(rng.integers(100, vocab - 100, pl[i % len(pl)]).tolist(), ol[i % len(ol)])
          for i in range(n)]


def run(llm_model, policy, reqs):
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.llm import LLM
  from jaxinfer.runtime.scheduler import SchedulerConfig
  big = 1 << 20
  cfg = (SchedulerConfig("chunked", FLAGS.max_running, FLAGS.token_budget, FLAGS.token_budget)
         if policy == "chunked" else SchedulerConfig(policy, FLAGS.max_running, big, big))
  buckets = BucketTable.default(max_tokens=4096, max_requests=FLAGS.max_running, max_pages=32)
  llm = LLM(llm_model, warmup=False, num_pages=FLAGS.max_running * 32 + 8, buckets=buckets,
            scheduler=cfg)
  eng = llm.engine
  for ids, n in reqs:
    eng.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=eng.now())
  eng.run()
  return eng.metrics()


def main(argv):
  del argv
  from jaxinfer.loading import load_model
  m = load_model(FLAGS.model)
  results = {}
  for policy in FLAGS.policies:
    run(m, policy, trace(FLAGS.num_requests, m.cfg.vocab_size, 1))  # warm-up: compile
    results[policy] = run(m, policy, trace(FLAGS.num_requests, m.cfg.vocab_size, 0))
  print(f"{FLAGS.num_requests} requests, prompts {FLAGS.prompt_lens}, outputs {FLAGS.output_lens}")
  print(f"{'policy':>11} {'tok/s':>7} {'makespan s':>10} {'TTFT p50':>9} {'p95':>6} {'p99':>6} "
        f"{'ITL p50 ms':>10} {'p95':>6} {'p99':>6} {'max':>6} {'pad %':>6}")
  for p, r in results.items():
    t, i = r["ttft_s"], r["itl_s"]
    print(f"{p:>11} {r['throughput_tok_s']:>7.1f} {r['makespan_s']:>10.2f} {t['p50']:>9.2f} "
          f"{t['p95']:>6.2f} {t['p99']:>6.2f} {1e3 * i['p50']:>10.1f} {1e3 * i['p95']:>6.1f} "
          f"{1e3 * i['p99']:>6.1f} {1e3 * i['max']:>6.1f} {100 * r['padding_fraction']:>6.1f}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "bench_engine.json"), "w") as f:
      strict_json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
