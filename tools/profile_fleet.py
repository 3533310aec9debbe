"""Where a fleet cell's wall time goes in steady state, without a profiler: wall-clock
timers around the engine's and scheduler's parts (a profiler's per-call cost would inflate
the many small calls), counted once the first `--start` arrivals are routed.

  python tools/profile_fleet.py                       # the scale stream's cell 0
  python tools/profile_fleet.py --requests=25000 --start=10000 --output_dir=out/fleet_prof

The cell is what `experiments.fleet --config=configs/studies/fleet.py:scale` runs in each
of its processes: `--replicas` replicas behind power of two choices, taking every
`--cells`-th request of the bursty stream. Parts nest (eviction inside scheduling inside
the step); each row is inclusive.
"""
from __future__ import annotations

import collections
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the
# repository root: configs/ and experiments/ beside jaxinfer/

FLAGS = flags.FLAGS
if __name__ == "__main__":
  flags.DEFINE_integer("requests", 25_000, "requests the cell routes")
  flags.DEFINE_integer("start", 10_000, "requests routed before the timers count "
                       "(a multiple of 10,000: the fleet's progress interval)")
  flags.DEFINE_integer("replicas", 128, "replicas in the cell")
  flags.DEFINE_integer("cells", 2, "cells the stream is dealt to (this is cell 0)")
  flags.DEFINE_string("policy", "power_of_two", "routing policy")
  flags.DEFINE_string("output_dir", "", "write fleet_profile.json here")


def _parts():
  """(owner, method name, label) of the timed parts."""
  from jaxinfer.runtime import prefix_cache, scheduler
  from jaxinfer.runtime.engine import Engine
  return [(Engine, "step", "Engine.step"),
          (scheduler.Scheduler, "schedule", "Scheduler.schedule"),
          (prefix_cache.PrefixCache, "evict", "PrefixCache.evict"),
          (scheduler.Scheduler, "postprocess", "Scheduler.postprocess"),
          (Engine, "fast_forward", "Engine.fast_forward"),
          (Engine, "add_request", "Engine.add_request"),
          (prefix_cache.PrefixCache, "insert", "PrefixCache.insert")]


def profile(requests: int, start: int, replicas: int, cells: int, policy: str) -> dict:
  from configs.studies.fleet import get_config
  from experiments import fleet as study
  from jaxinfer.runtime.fleet import Fleet
  from jaxinfer.runtime.routing import make_policy
  if start % 10_000 or not 0 < start < requests:
    raise ValueError(f"start must be a positive multiple of 10,000 below requests "
                     f"({requests}), got {start}")
  c = get_config("scale")
  c.bursty.num_requests = cells * requests
  fleet = Fleet(study.make_replicas(c, replicas), make_policy(policy, c.balance_threshold,
                                                              seed=0))
  spent, calls, on = collections.Counter(), collections.Counter(), [False]
  saved = []

  def timed(owner, name, label):
    f = getattr(owner, name)
    saved.append((owner, name, f))

    def wrapper(*args, **kw):
      if not on[0]:
        return f(*args, **kw)
      t0 = time.perf_counter()
      try:
        return f(*args, **kw)
      finally:
        spent[label] += time.perf_counter() - t0
        calls[label] += 1
    setattr(owner, name, wrapper)

  for owner, name, label in _parts() + [(type(fleet.policy), "choose", "routing")]:
    timed(owner, name, label)
  began = {}

  def progress(n, _):
    if n == start:
      on[0], began["t"] = True, time.perf_counter()

  try:
    fleet.run(study.make_stream(c, "bursty", lazy=True, cell=0, cells=cells), compact=True,
              progress=progress)
  finally:
    for owner, name, f in saved:
      setattr(owner, name, f)
  wall = time.perf_counter() - began["t"]
  n = requests - start
  return {"requests": n, "wall_s": wall, "ms_per_request": 1e3 * wall / n,
          "parts": {k: {"ms_per_request": 1e3 * spent[k] / n, "calls_per_request": calls[k] / n,
                        "us_per_call": 1e6 * spent[k] / calls[k]} for k in spent}}


def main(argv) -> int:
  del argv
  out = profile(FLAGS.requests, FLAGS.start, FLAGS.replicas, FLAGS.cells, FLAGS.policy)
  print(f"{out['requests']} requests after the first {FLAGS.start}: {out['wall_s']:.1f} s, "
        f"{out['ms_per_request']:.3f} ms per request")
  for k, v in sorted(out["parts"].items(), key=lambda kv: -kv[1]["ms_per_request"]):
    print(f"  {k:24s} {v['ms_per_request']:7.3f} ms/request  {v['calls_per_request']:5.2f} "
          f"calls/request  {v['us_per_call']:8.1f} us/call")
  if FLAGS.output_dir:
    from experiments.common import write_json
    write_json(FLAGS.output_dir, "fleet_profile.json", out)
  return 0


if __name__ == "__main__":
  app.run(main)
