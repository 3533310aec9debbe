"""Micro-benchmark of the host-side KV bookkeeping: allocate / free / fork and prefix
match / insert / evict with a 100k-page pool.

  python tools/bench_pages.py --num_pages=100000
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
flags.DEFINE_bool("json", False, "emit JSON")


def main(argv):
  del argv
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
  print(strict_json.dumps(out, indent=None if FLAGS.json else 1))


if __name__ == "__main__":
  app.run(main)
