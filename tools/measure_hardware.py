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
import numpy as np

from jaxinfer import benchmarking as bm
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("output", "", "write the profile JSON here (default: print only)")
flags.DEFINE_integer("read_mib", 1024, "array size for the read-bandwidth test")
flags.DEFINE_integer("matmul_n", 2048, "square matmul size for the FLOP/s test")
flags.DEFINE_integer("repeats", 10, "timed repeats (median reported)")
flags.DEFINE_bool("calibrate", False, "also time SmolLM2 decode / prefill steps and write "
                  "configs/calibration/local-cpu.json (MBU / MFU table)")
flags.DEFINE_list("batches", ["1", "4", "16"], "calibration batch sizes")
flags.DEFINE_integer("context", 512, "calibration decode context")


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


def calibrate(prof, batches, context, repeats):
  """Measured SmolLM2 f32 steps -> the local-cpu MBU / MFU table, and predicted vs
  measured decode times (roofline floor and leave-one-out calibration)."""
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.loading import load_model
  m = load_model("smollm2-135m-instruct")
  costs = ModelCosts(m.cfg, 4.0, "f32", 16)
  decode, prefill = [], []
  for b in batches:
    t = _step_times(m, b, context, 1, repeats)
    decode.append({"batch": b, "context": context, "bytes": costs.step_bytes([(1, context)] * b),
                   "round_ms": 1e3 * t})
  for n in (64, 256):
    t = _step_times(m, 1, 0, n, max(3, repeats // 3))
    f = costs.step_flops([(n, 0)])
    prefill.append({"batch": 1, "input": n, "cached": 0, "seconds": t,
                    "mfu": f / (t * prof["peak_tflops_f32"] * 1e12)})
  return {"hardware": "local-cpu", "model": "smollm2-135m-instruct", "kv_format": "f32",
          "bytes_per_param": 4, "source": "tools/measure_hardware.py --calibrate",
          "decode": decode, "prefill": prefill}


def main(argv):
  del argv
  prof = measure(FLAGS.read_mib, FLAGS.matmul_n, FLAGS.repeats)
  print(strict_json.dumps(prof, indent=1))
  if FLAGS.output:
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    with open(FLAGS.output, "w") as f:
      strict_json.dump(prof, f, indent=1)
  if FLAGS.calibrate:
    cal = calibrate(prof, [int(b) for b in FLAGS.batches], FLAGS.context, FLAGS.repeats)
    bw = prof["memory_bandwidth_gbs"] * 1e9
    print(f"{'batch':>5} {'bytes MB':>9} {'floor ms':>9} {'measured ms':>12} {'MBU':>6} "
          f"{'leave-one-out ms':>17}")
    dec = cal["decode"]
    for i, e in enumerate(dec):
      others = [x for j, x in enumerate(dec) if j != i]
      mbus = [x["bytes"] / (bw * x["round_ms"] / 1e3) for x in others]
      mbu_i = float(np.interp(e["bytes"], [x["bytes"] for x in others], mbus))
      print(f"{e['batch']:>5} {e['bytes'] / 1e6:>9.0f} {1e3 * e['bytes'] / bw:>9.1f} "
            f"{e['round_ms']:>12.1f} {e['bytes'] / (bw * e['round_ms'] / 1e3):>6.2f} "
            f"{1e3 * e['bytes'] / (bw * mbu_i):>17.1f}")
    for e in cal["prefill"]:
      print(f"prefill {e['input']} tokens: {1e3 * e['seconds']:.1f} ms, MFU {e['mfu']:.2f}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                        "calibration", "local-cpu.json")
    with open(path, "w") as f:
      strict_json.dump(cal, f, indent=1)


if __name__ == "__main__":
  app.run(main)
