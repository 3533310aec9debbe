"""Measure this machine's memory read bandwidth and matmul FLOP/s with JAX.

Writes the `local-cpu` hardware profile (JSON) used by the cost model and by the
decode benchmark's bandwidth floor:

  python tools/measure_hardware.py --output=configs/hardware/local-cpu.json
"""
from __future__ import annotations

import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from jaxinfer import benchmarking as bm
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("output", "", "write the profile JSON here (default: print only)")
flags.DEFINE_integer("read_mib", 1024, "array size for the read-bandwidth test")
flags.DEFINE_integer("matmul_n", 2048, "square matmul size for the FLOP/s test")
flags.DEFINE_integer("repeats", 10, "timed repeats (median reported)")
flags.DEFINE_bool("calibrate", False, "also time SmolLM2 decode / prefill steps and write "
                  "configs/calibration/local-cpu.json (MBU / MFU table)")
flags.DEFINE_list("batches", ["1", "4", "16", "64"], "calibration decode batch sizes")
flags.DEFINE_list("contexts", ["256", "1024", "4096"], "calibration decode contexts")
flags.DEFINE_list("prefill_lens", ["64", "128", "256", "512"], "calibration prefill lengths")
flags.DEFINE_float("max_pool_gib", 6.0, "calibration: skip decode points with a larger pool")


def measure(read_mib=1024, matmul_n=2048, repeats=10) -> dict:
  bw = bm.measure_read_bandwidth(read_mib, repeats)
  f32 = bm.measure_matmul_flops(matmul_n, repeats)
  bf16 = bm.measure_matmul_flops(matmul_n, max(3, repeats // 3), jnp.bfloat16)
  return {"name": "local-cpu", "compute_dtype": "float32", "memory_bandwidth_gbs": bw / 1e9,
          "peak_tflops_f32": f32 / 1e12, "peak_tflops_bf16": bf16 / 1e12,
          "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
          "jax": jax.__version__, "measured_at": time.strftime("%Y-%m-%d")}


def _step_times(llm_model, batch, context, new_tokens, repeats):
  """Median time of one step of `batch` requests, each running `new_tokens` tokens on
  `context` cached tokens (decode: new_tokens = 1)."""
  from jaxinfer.executors.jax_executor import JaxExecutor
  step, num_pages = bm.uniform_step(batch, context, new_tokens)
  ex = JaxExecutor(llm_model.cfg, llm_model.params, num_pages=num_pages, page_size=16)
  return bm.time_step(ex, step, repeats)


def calibrate(prof, batches, contexts, prefill_lens, repeats, max_pool_gib):
  """Measured SmolLM2 f32 steps -> the local-cpu MBU / MFU table: decode at every
  (batch, context) whose pool fits, prefills of one prompt of each length."""
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.kv import bytes_per_token
  from jaxinfer.loading import load_model
  m = load_model("smollm2-135m-instruct")
  costs = ModelCosts(m.cfg, 4.0, "f32", 16)
  kv_tok = bytes_per_token(m.cfg, "f32", 16)
  decode, prefill = [], []
  for ctx in contexts:
    for b in batches:
      if b * (ctx + 17) * kv_tok / 2**30 > max_pool_gib:
        continue
      t = _step_times(m, b, ctx, 1, repeats)
      decode.append({"batch": b, "context": ctx,
                     "bytes": costs.step_bytes([(1, ctx)] * b), "round_ms": 1e3 * t})
      print(f"decode batch {b} context {ctx}: {1e3 * t:.1f} ms", flush=True)
  for n in prefill_lens:
    t = _step_times(m, 1, 0, n, max(3, repeats // 3))
    f = costs.step_flops([(n, 0)])
    prefill.append({"batch": 1, "input": n, "cached": 0, "seconds": t,
                    "mfu": f / (t * prof["peak_tflops_f32"] * 1e12)})
    print(f"prefill {n}: {1e3 * t:.1f} ms", flush=True)
  return {"hardware": "local-cpu", "model": "smollm2-135m-instruct", "kv_format": "f32",
          "bytes_per_param": 4, "source": "tools/measure_hardware.py --calibrate",
          "measured_at": time.strftime("%Y-%m-%d"), "decode": decode, "prefill": prefill}


def check_calibration(cal: dict) -> list:
  """Each measured step against the roofline (local-cpu profile + this table), in sample
  (the table passes through its points; compute may still bind) and leave-one-out (the
  table without that point: how the model predicts a step it was not fitted on)."""
  from jaxinfer.costmodel import RooflineStepModel
  import json
  import tempfile
  rows = []
  points = [("decode", i) for i in range(len(cal["decode"]))] + \
           [("prefill", i) for i in range(len(cal["prefill"]))]
  with tempfile.TemporaryDirectory() as d:
    def model(table):
      path = os.path.join(d, "cal.json")
      with open(path, "w") as f:
        json.dump(table, f)
      return RooflineStepModel.for_names("smollm2-135m-instruct", "local-cpu", "f32", 16,
                                         4.0, calibration=path)
    full = model(cal)
    for kind, i in points:
      e = cal[kind][i]
      rest = dict(cal, **{kind: [x for j, x in enumerate(cal[kind]) if j != i]})
      if kind == "decode":
        seqs, meas = [(1, e["context"])] * e["batch"], e["round_ms"] / 1e3
        label = f"decode b{e['batch']} ctx {e['context']}"
      else:
        seqs, meas = [(e["input"], 0)], e["seconds"]
        label = f"prefill {e['input']}"
      loo = model(rest).step_time(seqs) if rest[kind] else None
      rows.append({"point": label, "measured_ms": 1e3 * meas,
                   "in_sample_ms": 1e3 * full.step_time(seqs),
                   "leave_one_out_ms": None if loo is None else 1e3 * loo})
  return rows


def main(argv):
  del argv
  prof = measure(FLAGS.read_mib, FLAGS.matmul_n, FLAGS.repeats)
  print(strict_json.dumps(prof, indent=1))
  if FLAGS.output:
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    with open(FLAGS.output, "w") as f:
      strict_json.dump(prof, f, indent=1)
  if FLAGS.calibrate:
    cal = calibrate(prof, [int(b) for b in FLAGS.batches], [int(c) for c in FLAGS.contexts],
                    [int(n) for n in FLAGS.prefill_lens], FLAGS.repeats, FLAGS.max_pool_gib)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                        "calibration", "local-cpu.json")
    with open(path, "w") as f:
      strict_json.dump(cal, f, indent=1)
    print(f"{'step':>24} {'measured ms':>12} {'model ms':>9} {'err':>6} {'leave-one-out':>14} "
          f"{'err':>6}")
    for r in check_calibration(cal):
      m, a, b = r["measured_ms"], r["in_sample_ms"], r["leave_one_out_ms"]
      print(f"{r['point']:>24} {m:>12.1f} {a:>9.1f} {a / m - 1:>+6.0%} "
            f"{'-' if b is None else format(b, '.1f'):>14} "
            f"{'-' if b is None else format(b / m - 1, '+.0%'):>6}")


if __name__ == "__main__":
  app.run(main)
