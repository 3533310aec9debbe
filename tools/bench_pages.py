"""Micro-benchmark of the host-side KV bookkeeping: allocate / free / fork and prefix
match / insert / evict with a 100k-page pool; and how contiguous the page tables of a
long-running engine stay (`--churn_requests`: a simulated engine serves that many
requests, prompts of 200-3000 tokens, 20-600 new tokens, 16 running; every 100 steps the
share of each running table's neighbouring pages that are consecutive, which the CPU
decode call reads as streams).

  python tools/bench_pages.py --num_pages=100000 --churn_requests=300
"""
from __future__ import annotations

import time

from absl import app, flags
import numpy as np

from jaxinfer.runtime.pages import PageManager
from jaxinfer.runtime.prefix_cache import PrefixCache
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_pages", 100_000, "pool size")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_integer("seq_tokens", 2048, "tokens per sequence")
flags.DEFINE_integer("churn_requests", 300, "requests of the contiguity run (0: none)")
flags.DEFINE_bool("json", False, "emit JSON")


def contiguity(requests: int, page_size: int, seed: int = 0) -> list:
  """The consecutive share of the running tables' neighbouring pages, every 100 steps of a
  simulated engine (the same scheduler and page manager as the real one) serving
  `requests` requests that all arrive at once."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rng = np.random.default_rng(seed)
  table = BucketTable(token_sizes=(16, 64, 256, 512), request_sizes=(16,),
                      page_table_sizes=(4096 // page_size,))
  eng = Engine(SimExecutor(AffineStepModel(), num_pages=16 * 3600 // page_size,
                           page_size=page_size), SchedulerConfig("chunked", 16, 512, 512),
               buckets=table)
  for _ in range(requests):
    prompt = rng.integers(1, 1000, int(rng.integers(200, 3000))).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(20, 600)),
                                           ignore_eos=True), arrival_time=0.0)
  shares, steps = [], 0
  while eng.has_unfinished():
    eng.step()
    steps += 1
    if steps % 100 == 0:
      tables = [eng.pm.page_table(s) for s in eng.pm.sequences()]
      pairs = sum(max(len(t) - 1, 0) for t in tables)
      if pairs:
        shares.append(sum(b == a + 1 for t in tables for a, b in zip(t, t[1:])) / pairs)
  return shares


def main(argv):
  del argv
  if FLAGS.churn_requests < 0:
    raise app.UsageError(f"--churn_requests must be >= 0, got {FLAGS.churn_requests}")
  ps, L = FLAGS.page_size, FLAGS.seq_tokens
  pm = PageManager(FLAGS.num_pages, ps)
  n_seqs = FLAGS.num_pages // (L // ps) - 1
  out = {}
  t = time.perf_counter()
  for i in range(n_seqs):
    pm.add_sequence(i, reserve_tokens=L)
    pm.grow(i, L)
  dt = time.perf_counter() - t
  out["allocate_pages_per_s"] = n_seqs * (L // ps) / dt
  t = time.perf_counter()
  for i in range(n_seqs):
    for _ in range(16):  # 16 decode appends each
      pm.grow(i, pm.num_tokens(i) + 1)
  out["append_tokens_per_s"] = n_seqs * 16 / (time.perf_counter() - t)
  used = pm.num_used
  t = time.perf_counter()
  for i in range(n_seqs):
    pm.free(i)
  out["free_pages_per_s"] = used / (time.perf_counter() - t)
  pm.check_invariants()

  cache = PrefixCache(pm)
  rng = np.random.default_rng(0)
  prefixes = [rng.integers(0, 50000, L).tolist() for _ in range(64)]
  key = ("m", "", "bf16")
  t = time.perf_counter()
  for i, p in enumerate(prefixes):
    pm.add_sequence(("s", i))
    pm.grow(("s", i), L)
    cache.insert(key, p, pm.page_table(("s", i)))
    pm.free(("s", i))
  out["insert_pages_per_s"] = len(prefixes) * (L // ps) / (time.perf_counter() - t)
  t = time.perf_counter()
  n = 0
  for _ in range(20):
    for p in prefixes:
      m = cache.match(key, p)
      n += len(m.nodes)
  out["match_pages_per_s"] = n / (time.perf_counter() - t)
  t = time.perf_counter()
  freed = cache.evict(len(prefixes) * (L // ps) // 4)
  out["evict_pages_per_s"] = freed / (time.perf_counter() - t)
  pm.check_invariants(cache.owned_refs())
  out = {k: round(v) for k, v in out.items()}
  out.update(num_pages=FLAGS.num_pages, page_size=ps, seq_tokens=L)
  if FLAGS.churn_requests:
    shares = contiguity(FLAGS.churn_requests, ps)
    tail = shares[-max(1, len(shares) // 10):]
    stat = lambda f, xs: round(float(f(xs)), 3) if xs else None  # noqa: E731 (null: a run
    # of fewer than 100 steps took no sample)
    out["contiguity"] = {"requests": FLAGS.churn_requests, "samples": len(shares),
                         "first": stat(lambda xs: xs[0], shares),
                         "median": stat(np.median, shares), "last_tenth": stat(np.mean, tail)}
  print(strict_json.dumps(out, indent=None if FLAGS.json else 1))


if __name__ == "__main__":
  app.run(main)
