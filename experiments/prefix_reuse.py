"""Prefix reuse across multi-round agent sessions (SPEC 8.3.3-8.3.4).

  python -m experiments.prefix_reuse --output_dir=out/prefix_reuse [--small]

A generator of agent sessions: a stable system prompt + tool definitions, then rounds
that append a tool result to the context and generate a short reply, with interfering
requests between rounds. Three context-update strategies: append (the context only
grows), rewrite_head (a changing header first: reuse stops at the first token),
summarize (every k rounds the history is replaced by a generated summary). Replayed
through the real scheduler and prefix cache with pool sizes that keep or lose the
prefix (and an optional host tier): hit tokens by tier (device / host / recomputed) and
TTFT. sim: Qwen3-8B on RTX PRO 6000 (roofline); jax: SmolLM2 on this CPU, scaled down.
"""
from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
import numpy as np

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams

FLAGS = flags.FLAGS

@dataclasses.dataclass
class SessionShape:
  system_tokens: int = 1000  # system prompt + tool definitions
  result_tokens: int = 150  # tool result appended per round
  reply_tokens: int = 40  # assistant reply per round
  header_tokens: int = 16  # rewrite_head: a header that changes every round
  summary_every: int = 4  # summarize: every k rounds
  summary_tokens: int = 300  # summarize: the summary's length (generated)
  interfering: int = 2  # unrelated requests between rounds
  interfering_tokens: int = 3000

  def scaled(self, f: float) -> "SessionShape":
    return SessionShape(*(max(1, int(round(v * f))) if k not in ("summary_every", "interfering")
                          else v for k, v in dataclasses.asdict(self).items()))


def run_session(engine, shape: SessionShape, strategy: str, rounds: int, seed: int = 0):
  """Replays one agent session (+ interference); returns per-round records."""
  rng = np.random.default_rng(seed)
  tok = lambda n: rng.integers(100, 30000, n).tolist()  # noqa: E731
  system = tok(shape.system_tokens)
  history = []  # tool results and replies after the system prompt
  records = []
  for i in range(rounds):
    history += tok(shape.result_tokens)
    head = tok(shape.header_tokens) if strategy == "rewrite_head" else []
    prompt = head + system + history
    r = engine.add_request(prompt, SamplingParams(max_tokens=shape.reply_tokens,
                                                  ignore_eos=True), arrival_time=engine.now())
    engine.run()
    history += r.output_token_ids
    if strategy == "summarize" and (i + 1) % shape.summary_every == 0:
      s = engine.add_request(system + history, SamplingParams(
          max_tokens=shape.summary_tokens, ignore_eos=True), arrival_time=engine.now())
      engine.run()
      history = list(s.output_token_ids)
    for _ in range(shape.interfering):
      engine.add_request(tok(shape.interfering_tokens), SamplingParams(max_tokens=8,
                         ignore_eos=True), arrival_time=engine.now())
    engine.run()
    records.append({"round": i, "prompt_tokens": len(prompt), "cached_tokens": r.cached_tokens,
                    "ttft_s": r.ttft})
  return records


def sim_engine(pool_gib: float, host_pages: int):
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  pages = int(pool_gib * 2**30 // (rm.costs.kv_bytes_per_token * 16))
  ex = SimExecutor(rm, num_pages=pages, page_size=16, token_id=7)
  return Engine(ex, SchedulerConfig("chunked", 8, 8192, 8192,
                                    cache_key=("qwen3-8b", "", "bf16")),
                buckets=BucketTable.default(1 << 14, 8, 4096), prefix_cache=True,
                host_cache_pages=host_pages)


def jax_engine(model, pool_tokens: int, host_pages: int):
  from jaxinfer.llm import LLM
  llm = LLM(model, num_pages=pool_tokens // 16,
            buckets=BucketTable.default(max_tokens=256, max_requests=4, max_pages=128),
            prefix_cache=True)
  eng = llm.engine
  if host_pages:
    from jaxinfer.runtime.prefix_cache import PrefixCache
    eng.cache = PrefixCache(eng.pm, host_pages=host_pages)
    eng.scheduler.cache = eng.cache
  return eng


def summarize_run(engine, records):
  st = engine.cache.stats
  return {"input_tokens": st.lookup_tokens, "device_hit_tokens": st.device_hit_tokens,
          "host_hit_tokens": st.host_hit_tokens, "recomputed_tokens": st.recomputed_tokens,
          "session_cached_tokens": sum(r["cached_tokens"] for r in records),
          "session_prompt_tokens": sum(r["prompt_tokens"] for r in records),
          "mean_ttft_s": float(np.mean([r["ttft_s"] for r in records])),
          "rounds": records}


def define_flags():
  """Flags are defined only when run as a binary, so tests can import the module's
  functions next to other binaries' (absl refuses duplicate flag names)."""
  flags.DEFINE_enum("executor", "sim", ["sim", "jax"], "simulated clock or the real model")
  flags.DEFINE_list("pool_gib", ["6", "1"], "sim: KV pool sizes (GiB)")
  flags.DEFINE_list("strategies", ["append", "rewrite_head", "summarize"], "context updates")
  flags.DEFINE_integer("rounds", 12, "agent rounds")
  flags.DEFINE_integer("host_pages", 0, "host-tier pages for evicted prefixes")
  flags.DEFINE_bool("small", False, "CI size")
  flags.DEFINE_string("output_dir", "", "write prefix_reuse.json here")


def main(argv):
  del argv
  rounds = 3 if FLAGS.small else FLAGS.rounds
  results = []
  if FLAGS.executor == "sim":
    shape = SessionShape()
    for gib in (float(g) for g in FLAGS.pool_gib):
      for strat in FLAGS.strategies:
        eng = sim_engine(gib, FLAGS.host_pages)
        res = summarize_run(eng, run_session(eng, shape, strat, rounds))
        results.append({"pool": f"{gib:g} GiB", "strategy": strat, **res})
  else:
    from jaxinfer.loading import load_model
    m = load_model("smollm2-135m-instruct")
    shape = SessionShape().scaled(1 / 16 if not FLAGS.small else 1 / 48)
    big = 4096 if not FLAGS.small else 1024
    for pool_tokens in (big, big // 8):  # warm-up: compile the shapes the replays use
      for strat in FLAGS.strategies:
        run_session(jax_engine(m, pool_tokens, FLAGS.host_pages), shape, strat, rounds, seed=1)
    for pool_tokens in (big, big // 8):
      for strat in FLAGS.strategies:
        eng = jax_engine(m, pool_tokens, FLAGS.host_pages)
        res = summarize_run(eng, run_session(eng, shape, strat, rounds))
        results.append({"pool": f"{pool_tokens} tokens", "strategy": strat, **res})
  print(f"{'pool':>12} {'strategy':>13} {'session in':>10} {'cached':>7} {'device hit':>10} "
        f"{'host hit':>8} {'recomputed':>10} {'mean TTFT s':>11}")
  for r in results:
    print(f"{r['pool']:>12} {r['strategy']:>13} {r['session_prompt_tokens']:>10} "
          f"{r['session_cached_tokens']:>7} {r['device_hit_tokens']:>10} "
          f"{r['host_hit_tokens']:>8} {r['recomputed_tokens']:>10} {r['mean_ttft_s']:>11.3f}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, f"prefix_reuse_{FLAGS.executor}.json"), "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
