"""One mixture-of-experts MLP layer on this machine: the grouped expert products as
`jax.lax.ragged_dot` against the slab loop (jaxinfer.model.moe), per step size, beside a
dense MLP of the same active width (k experts' worth) and the experts-touched count.

  python tools/bench_moe.py [--experts=64 --top_k=4 --hidden=1024 --expert_ffn=512]
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags

flags.DEFINE_integer("experts", 64, "routed experts E")
flags.DEFINE_integer("top_k", 4, "experts per token k")
flags.DEFINE_integer("hidden", 1024, "model dim D")
flags.DEFINE_integer("expert_ffn", 512, "each expert's FFN width")
flags.DEFINE_list("tokens", ["1", "16", "64", "256", "1024"], "step sizes (tokens)")
flags.DEFINE_integer("repeats", 7, "timed calls per point (median)")
flags.DEFINE_string("output_dir", None, "write moe_bench.json here")
FLAGS = flags.FLAGS


def _time(f, *args, repeats):
  f(*args).block_until_ready()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(*args).block_until_ready()
    ts.append(time.perf_counter() - t)
  return sorted(ts)[len(ts) // 2]


def main(_):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxinfer.config import SMOLLM2_135M
  from jaxinfer.model import layers, moe
  E, k, D, F = FLAGS.experts, FLAGS.top_k, FLAGS.hidden, FLAGS.expert_ffn
  cfg = SMOLLM2_135M.replace(hidden_size=D, num_experts=E, experts_per_token=k,
                             moe_intermediate_size=F, intermediate_size=k * F)
  r = np.random.default_rng(0)
  w = lambda *s: jnp.asarray(0.02 * r.standard_normal(s), jnp.float32)  # noqa: E731
  p = {"router": w(D, E), "experts_gate": w(E, D, F), "experts_up": w(E, D, F),
       "experts_down": w(E, F, D)}
  dense = {"w_gate": w(D, k * F), "w_up": w(D, k * F), "w_down": w(k * F, D)}
  act = jax.nn.silu

  def run(ragged):
    def f(x, p):
      weights, experts = moe.route(x @ p["router"], cfg)
      flat = experts.reshape(-1)
      order = jnp.argsort(flat, stable=True)
      sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
      return moe.grouped_experts(x[order // k], flat[order], sizes, p["experts_gate"],
                                 p["experts_up"], p["experts_down"], act, ragged=ragged)
    return jax.jit(f)

  slab, ragged = run(False), run(True)
  mlp = jax.jit(lambda x, p: layers.mlp(x, p, cfg.replace(num_experts=0)))
  rows = []
  print(f"{'tokens':>6} {'touched':>8} {'slab ms':>9} {'ragged ms':>10} {'dense-k ms':>10}")
  for t in (int(v) for v in FLAGS.tokens):
    x = jnp.asarray(r.standard_normal((t, D)), jnp.float32)
    row = {"tokens": t, "experts_touched": cfg.expected_experts_touched(t),
           "slab_ms": 1e3 * _time(slab, x, p, repeats=FLAGS.repeats),
           "ragged_dot_ms": 1e3 * _time(ragged, x, p, repeats=FLAGS.repeats),
           "dense_active_ms": 1e3 * _time(mlp, x, dense, repeats=FLAGS.repeats)}
    rows.append(row)
    print(f"{t:>6} {row['experts_touched']:>8.1f} {row['slab_ms']:>9.2f} "
          f"{row['ragged_dot_ms']:>10.2f} {row['dense_active_ms']:>10.2f}")
  out = {"backend": jax.default_backend(), "experts": E, "top_k": k, "hidden": D,
         "expert_ffn": F, "rows": rows}
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "moe_bench.json"), "w") as f:
      json.dump(out, f, indent=1, allow_nan=False)


if __name__ == "__main__":
  app.run(main)
