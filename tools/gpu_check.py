"""Kernel check for a machine with an NVIDIA GPU: every ragged paged attention variant
against its jnp reference on random inputs, timed (median of many runs after warm-up)
against the memory-bandwidth floor of the bytes it must read; and the structured-output
masked sampler against NumPy (its "reference" column: the unmasked sampler's time).
Installs nothing; prints a short table last. Run through tools/gpu_check.sh.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import QWEN3_8B  # tools/gpu_check.sh puts the checkout on PYTHONPATH
from jaxinfer.kv import allocate_pool, bytes_per_token, write_tokens
from pallas_kernels.paged_attention import kernel, reference

FORMATS = ["bf16", "fp8", "q8_0", "q4_0", "f32"]


def median_time(f, *args, warmup=3, iters=20):
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def device_bandwidth():
  x = jnp.ones((512 * 2**20 // 4,), jnp.float32)
  t = median_time(jax.jit(lambda a: jnp.sum(a)), x)
  return x.size * 4 / t


def case(fmt, reqs, page_size=16, layers=2, seed=0):
  rng = np.random.default_rng(seed)
  cfg = QWEN3_8B.replace(num_layers=layers)
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  pages = [-(-(c + n) // page_size) for c, n in reqs]
  num_pages = sum(pages) + 1
  pool = allocate_pool(cfg, fmt, num_pages, page_size)
  perm = rng.permutation(num_pages)
  off, tables, pmax = 0, [], max(pages)
  T = sum(n for _, n in reqs)
  ctx_tokens = 0
  for (cached, n), npg in zip(reqs, pages):
    pt = perm[off:off + npg]
    off += npg
    if cached:
      kv = jnp.asarray(rng.standard_normal((layers, cached, K, H)), jnp.bfloat16)
      pos = np.arange(cached)
      pool = write_tokens(pool, kv, kv, jnp.asarray(pt[pos // page_size], jnp.int32),
                          jnp.asarray(pos % page_size, jnp.int32))
    tables.append(np.pad(pt, (0, pmax - npg)))
    ctx_tokens += cached + n
  q = jnp.asarray(rng.standard_normal((T, N, H)), jnp.bfloat16)
  kn = jnp.asarray(rng.standard_normal((T, K, H)), jnp.bfloat16)
  ql = np.array([n for _, n in reqs], np.int32)
  qs = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int32)
  cl = np.array([c for c, _ in reqs], np.int32)
  args = (q, kn, kn, pool, 1, jnp.asarray(np.stack(tables), jnp.int32), jnp.asarray(qs),
          jnp.asarray(ql), jnp.asarray(cl))
  n_bytes = ctx_tokens * bytes_per_token(cfg, fmt, page_size) / layers + 2 * q.size * 2
  return args, n_bytes


def masked_sampling_check(rows) -> int:
  """Structured output on the device: a batch of 64 logits rows at Qwen3's vocabulary,
  greedy under packed token masks (the step's masked sampler) against NumPy's masked
  argmax, timed beside the unmasked sampler. Returns 1 on a mismatch."""
  from jaxinfer.step import sample_packed, sample_step
  S, V = 64, 151936
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((S, V), np.float32))
  allowed = rng.random((S, V)) < 0.01
  allowed[:, 0] = True
  bits = np.zeros((S, -(-V // 32) * 32), np.uint8)
  bits[:, :V] = allowed
  mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
  inputs = dict(temperature=jnp.zeros(S), top_k=jnp.zeros(S, jnp.int32), top_p=jnp.ones(S),
                seed=jnp.zeros(S, jnp.uint32), counter=jnp.zeros(S, jnp.int32),
                draft_ids=jnp.full(S, -1, jnp.int32))
  masked = dict(inputs, token_mask=jnp.asarray(mask))
  got = np.asarray(sample_step(logits, masked))[:, 0].astype(np.int64)
  want = np.argmax(np.where(allowed, np.asarray(logits), -np.inf), axis=1)
  ok = bool((got == want).all())
  plain = jax.jit(sample_packed)
  t_m, t_p = median_time(sample_step, logits, masked), median_time(plain, logits, inputs)
  rows.append({"case": "masked greedy sampling b64", "fmt": "f32", "ok": ok, "rel_err": 0.0,
               "kernel_us": 1e6 * t_m, "reference_us": 1e6 * t_p,
               "floor_us": 1e6 * S * V * 4 / device_bandwidth(), "x_floor": 0.0})
  rows[-1]["x_floor"] = rows[-1]["kernel_us"] / rows[-1]["floor_us"]
  return 0 if ok else 1


def main():
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
  if jax.default_backend() != "gpu":
    print("no GPU: nothing to check here (CI covers interpret mode and Triton lowering)")
    return 0
  bw = device_bandwidth()
  print(f"measured device read bandwidth: {bw / 1e9:.0f} GB/s")
  mixes = {"decode b32 ctx4096": [(4096, 1)] * 32,
           "decode b8 ctx16384 (split-K)": [(16384, 1)] * 8,
           "mixed 16 dec + 512 chunk": [(2048, 1)] * 16 + [(2048, 512)]}
  rows, failed = [], 0
  for name, reqs in mixes.items():
    n_pre = sum(n > 1 for _, n in reqs)
    Q = max(n for _, n in reqs)
    splits = 8 if "split" in name else 1
    for fmt in FORMATS:
      args, n_bytes = case(fmt, reqs)
      ref_f = jax.jit(functools.partial(reference.ragged_paged_attention, max_query_len=Q,
                                        num_prefill_slots=n_pre))
      ker_f = jax.jit(functools.partial(kernel.ragged_paged_attention, max_query_len=Q,
                                        num_prefill_slots=n_pre, num_splits=splits,
                                        interpret=False))
      try:
        ref, out = np.asarray(ref_f(*args)), np.asarray(ker_f(*args))
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        ok = bool(np.isfinite(out).all() and err < 1e-2)
        t_k, t_r = median_time(ker_f, *args), median_time(ref_f, *args)
      except Exception as e:  # report, keep checking the other variants
        print(f"{name} {fmt}: FAILED {type(e).__name__}: {str(e)[:300]}")
        rows.append({"case": name, "fmt": fmt, "ok": False})
        failed += 1
        continue
      failed += not ok
      rows.append({"case": name, "fmt": fmt, "ok": ok, "rel_err": err, "kernel_us": 1e6 * t_k,
                   "reference_us": 1e6 * t_r, "floor_us": 1e6 * n_bytes / bw,
                   "x_floor": t_k / (n_bytes / bw)})
  failed += masked_sampling_check(rows)
  with open(os.environ.get("GPU_CHECK_JSON", "gpu_check.json"), "w") as f:
    json.dump(rows, f, indent=1)
  print(f"\n{'case':<30} {'fmt':<5} {'ok':<3} {'rel err':>8} {'kernel us':>10} "
        f"{'ref us':>9} {'floor us':>9} {'x floor':>8}")
  for r in rows:
    if "kernel_us" not in r:
      print(f"{r['case']:<30} {r['fmt']:<5} NO")
      continue
    print(f"{r['case']:<30} {r['fmt']:<5} {'yes' if r['ok'] else 'NO':<3} {r['rel_err']:>8.1e} "
          f"{r['kernel_us']:>10.1f} {r['reference_us']:>9.1f} {r['floor_us']:>9.1f} "
          f"{r['x_floor']:>8.2f}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
