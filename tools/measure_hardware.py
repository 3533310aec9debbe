"""Measure this machine's memory read bandwidth and matmul FLOP/s with JAX.

Writes the `local-cpu` hardware profile (JSON) used by the cost model and by the
decode benchmark's bandwidth floor:

  python tools/measure_hardware.py --output=configs/hardware/local-cpu.json
"""
from __future__ import annotations

import json
import os
import platform
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("output", "", "write the profile JSON here (default: print only)")
flags.DEFINE_integer("read_mib", 1024, "array size for the read-bandwidth test")
flags.DEFINE_integer("matmul_n", 2048, "square matmul size for the FLOP/s test")
flags.DEFINE_integer("repeats", 10, "timed repeats (median reported)")


def _median_time(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def measure_read_bandwidth(mib: int, repeats: int) -> float:
  """Best bytes/s over two read-once patterns: a full reduction, and a vector-matrix
  product x[1, D] @ W[D, n] (a decode step's weight read). The floor of a step is its
  bytes over the best rate this machine shows."""
  n = mib * 2**20 // 4
  x = jnp.asarray(np.random.default_rng(0).standard_normal(n, dtype=np.float32))
  t_sum = _median_time(jax.jit(lambda a: jnp.sum(a)), x, repeats=repeats)
  w = x.reshape(512, n // 512)
  v = jnp.ones((1, 512), jnp.float32)
  t_mv = _median_time(jax.jit(lambda a, b: a @ b), v, w, repeats=repeats)
  return n * 4 / min(t_sum, t_mv)


def measure_matmul_flops(n: int, repeats: int, dtype=jnp.float32) -> float:
  a = jnp.ones((n, n), dtype)
  b = jnp.ones((n, n), dtype)
  t = _median_time(jax.jit(lambda x, y: x @ y), a, b, repeats=repeats)
  return 2 * n**3 / t


def measure(read_mib=1024, matmul_n=2048, repeats=10) -> dict:
  bw = measure_read_bandwidth(read_mib, repeats)
  f32 = measure_matmul_flops(matmul_n, repeats)
  bf16 = measure_matmul_flops(matmul_n, max(3, repeats // 3), jnp.bfloat16)
  return {"name": "local-cpu", "memory_bandwidth_gbs": bw / 1e9,
          "peak_tflops_f32": f32 / 1e12, "peak_tflops_bf16": bf16 / 1e12,
          "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
          "jax": jax.__version__, "measured_at": time.strftime("%Y-%m-%d")}


def main(argv):
  del argv
  prof = measure(FLAGS.read_mib, FLAGS.matmul_n, FLAGS.repeats)
  print(json.dumps(prof, indent=1))
  if FLAGS.output:
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    with open(FLAGS.output, "w") as f:
      json.dump(prof, f, indent=1)


if __name__ == "__main__":
  app.run(main)
