"""What the study binaries share: the config flag, output files, progress lines."""
from __future__ import annotations

import os
import sys
import time
from jaxinfer import strict_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_path(study: str) -> str:
  return os.path.join(ROOT, "configs", "studies", f"{study}.py")


def run_binary(study: str, run_study, show) -> None:
  """A study's __main__: --config (its file in configs/studies; `path:small` for the CI
  size; fields overridable as --config.field=value) and --output_dir, then
  show(run_study(config, output_dir)). Flags are defined here, under __main__ only:
  absl refuses a flag defined twice, and the tests import several studies."""
  from absl import app, flags
  from ml_collections import config_flags
  config = config_flags.DEFINE_config_file("config", config_path(study),
                                           f"ml-collections config of the {study} study")
  flags.DEFINE_string("output_dir", f"out/{study}", "write JSON and PNG figures here")

  def main(argv):
    del argv
    show(run_study(config.value, flags.FLAGS.output_dir))

  app.run(main)


def write_json(output_dir: str, name: str, obj) -> str:
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, name)
  with open(path, "w") as f:
    strict_json.dump(obj, f, indent=1, default=str)
  return path


class Progress:
  """One line per unit of work on stderr, with elapsed time and a linear ETA."""

  def __init__(self, total: int, label: str):
    self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()

  def step(self, what: str = "") -> None:
    self.done += 1
    el = time.perf_counter() - self.t0
    eta = el / self.done * (self.total - self.done)
    print(f"[{self.label}] {self.done}/{self.total} {what} ({el:.0f}s elapsed, ~{eta:.0f}s "
          "left)", file=sys.stderr, flush=True)


def few_buckets(step_tokens: int, chunk: int, max_running: int, max_len: int,
                prefill_slots=None):
  """A few pre-compiled shapes (8.2.4), all compiled (Engine.warmup) before a measured
  run so that none of its steps pays for a compile: one request-slot size R, one page
  size, token sizes R, 2R, 4R, ... up to the largest step, prefill slots (default: powers
  of two up to R)."""
  from jaxinfer.buckets import BucketTable
  R = max_running
  sizes, t = [R], R
  while t < step_tokens:
    t = min(2 * t, step_tokens)
    sizes.append(t)
  return BucketTable(token_sizes=tuple(sizes), request_sizes=(R,),
                     page_table_sizes=(-(-max_len // 16),), query_sizes=(min(chunk, sizes[-1]),),
                     prefill_slot_sizes=tuple(prefill_slots or ()))
