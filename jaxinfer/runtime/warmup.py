"""Warm-up: every step shape an engine's configuration can run, compiled before the first
request (8.2.4: no request then waits for a compile)."""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def warm_up(engine, progress: bool = False, structured: bool = False) -> float:
  """Compile every shape this configuration can run ahead of time (real executors): the
  table's buckets, with a drafter also the verify shapes and the drafter's own steps
  (early-exit draft steps, a draft model's executables). Seconds spent; with the
  persistent compilation cache a second process mostly reloads them. progress: a
  progress bar on stderr. structured: also the variants that take a structured-output
  token mask (and the grammar compiler), so constrained requests never compile either;
  without it each such variant compiles at its first use."""
  if engine.executor.virtual_clock:
    return 0.0
  speculative = engine.drafter is not None
  buckets = list(engine.buckets.all_buckets(verify=speculative))
  t0 = time.perf_counter()
  if structured and engine.tokenizer is not None:
    engine.grammar_compiler()
  t = time.perf_counter() - t0
  for masked in ((False, True) if structured else (False,)):
    shapes = buckets
    if progress:
      from tqdm.auto import tqdm
      shapes = tqdm(buckets, unit="shape", leave=False,
                    desc="compiling masked bucket shapes" if masked else
                    "compiling bucket shapes")
    t += engine.executor.warmup(shapes, masked=masked)
  log.info("warm-up: %d bucket shapes%s in %.1f s", len(buckets),
           " (plain and masked)" if structured else "", t)
  if speculative:  # verify shapes above; the drafter's own steps here
    t += engine.drafter.warmup(buckets)
  return t
