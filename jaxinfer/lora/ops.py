"""The device side of multi-LoRA (8.2.1, Punica / S-LoRA): the adapter pool and the
grouped low-rank product the model adds to an adapted projection.

Pool: per target, a [L, in, S, r] and b [L, S, r, out] (S = max_loras + 1 slots; slot 0
is all zeros = no adapter; the scaling is folded into b). The layout lets every mode read
a layer's factors without a transpose: a [in, S, r] is a [in, S * r] matrix for the
dense mode and gathers along its slot axis for the others. A step that carries adapters
gets the pool and per-token index arrays in its inputs; a step without them compiles and
runs without any of this (the inputs' structure is static).

Four ways to compute y[t] = (x[t] @ a[s_t]) @ b[s_t] for the step's tokens, chosen per
step by which index arrays it carries:
  gather  (BGMV) per-token gather of the token's A and B: `lora_slot` [T]
  segment (SGMV) tokens grouped by slot into segments of SEGMENT rows, each one
          adapter's (groups padded to whole segments), one batched matmul per factor with
          A and B gathered per segment: `lora_rows` [NB * SEGMENT], `lora_block_slot` [NB],
          `lora_inv` [T]
  ragged  (SGMV) tokens sorted by slot, lax.ragged_dot per factor:
          `lora_perm` [T], `lora_inv` [T], `lora_groups` [S]
  dense   every slot's low-rank product as two dense matmuls, masked per token:
          `lora_onehot` [T, S * r]
`tools/bench_lora.py` measures them; DECODE_MODE / PREFILL_MODE are its winners here.
"""
from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.lora.adapter import LoraAdapter, target_shape

MODES = ("gather", "segment", "ragged", "dense")
SEGMENT = 16  # rows per segment
# Chosen by tools/bench_lora.py on the 2-core CPU (see the README's LoRA section).
DECODE_MODE = "dense"
PREFILL_MODE = "segment"


def allocate(cfg: ModelConfig, targets, num_slots: int, rank: int, dtype) -> Dict:
  """Zeroed pool of num_slots adapter slots plus slot 0."""
  S = num_slots + 1
  pool = {}
  for t in targets:
    d_in, d_out = target_shape(cfg, t)
    pool[t] = {"a": jnp.zeros((cfg.num_layers, d_in, S, rank), dtype),
               "b": jnp.zeros((cfg.num_layers, S, rank, d_out), dtype)}
  return pool


def _write(pool, slot, data):
  return {t: {"a": d["a"].at[:, :, slot].set(data[t]["a"].astype(d["a"].dtype)),
              "b": d["b"].at[:, slot].set(data[t]["b"].astype(d["b"].dtype))}
          for t, d in pool.items()}


write_slot = jax.jit(_write, donate_argnums=(0,))  # in place: no copy of the pool


def slot_data(pool, adapter: LoraAdapter) -> Dict:
  """The adapter's weights padded to the pool's rank, zeros for targets it lacks."""
  out = {}
  for t, d in pool.items():
    L, d_in, _, r = d["a"].shape
    d_out = d["b"].shape[-1]
    a = np.zeros((L, d_in, r), np.float32)
    b = np.zeros((L, r, d_out), np.float32)
    if t in adapter.weights:
      wa, wb = adapter.weights[t]
      a[:, :, :wa.shape[-1]] = wa
      b[:, :wb.shape[1], :] = wb
    out[t] = {"a": a, "b": b}
  return out


def index_arrays(slot_per_token: np.ndarray, num_slots: int, mode: str,
                 rank: int) -> Dict[str, np.ndarray]:
  """The step's per-token index arrays for `mode` (host side, NumPy)."""
  s = np.asarray(slot_per_token, np.int32)
  if mode == "gather":
    return {"lora_slot": s}
  if mode == "segment":  # static size: T rows plus at most SEGMENT - 1 padding per slot
    T, S = len(s), num_slots + 1
    nb = -(-(T + S * (SEGMENT - 1)) // SEGMENT)
    rows = np.full(nb * SEGMENT, T, np.int32)  # T: a zero row (padding)
    block_slot = np.zeros(nb, np.int32)
    inv = np.zeros(T, np.int32)
    at = 0
    for slot in np.unique(s):
      toks = np.nonzero(s == slot)[0]
      rows[at:at + len(toks)] = toks
      inv[toks] = np.arange(at, at + len(toks))
      n_seg = -(-len(toks) // SEGMENT)
      block_slot[at // SEGMENT:at // SEGMENT + n_seg] = slot
      at += n_seg * SEGMENT
    return {"lora_rows": rows, "lora_block_slot": block_slot, "lora_inv": inv}
  if mode == "ragged":
    perm = np.argsort(s, kind="stable").astype(np.int32)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=np.int32)
    groups = np.bincount(s, minlength=num_slots + 1).astype(np.int32)
    return {"lora_perm": perm, "lora_inv": inv, "lora_groups": groups}
  if mode == "dense":
    onehot = np.zeros((len(s), num_slots + 1), np.float32)
    onehot[np.arange(len(s)), s] = 1.0
    onehot[:, 0] = 0.0  # slot 0 is zeros anyway
    return {"lora_onehot": np.repeat(onehot, rank, axis=1)}  # [T, S * r]
  raise ValueError(f"unknown LoRA mode {mode!r}; choose one of {MODES}")


def delta(x, a, b, layer, batch):
  """x [T, in]; a [L, in, S, r], b [L, S, r, out] (the whole pool: only what the mode
  needs of layer `layer` is read) -> the adapters' addition [T, out] (f32)."""
  xf = x.astype(jnp.float32)
  _, d_in, S, r = a.shape
  f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
  if "lora_onehot" in batch:  # all slots as two dense matmuls, masked per token
    # a select, not a product: an overflow in another slot's columns (Inf * 0) stays out
    h = jnp.where(batch["lora_onehot"] > 0, xf @ f32(a[layer]).reshape(d_in, S * r), 0.0)
    return h @ f32(b[layer]).reshape(S * r, -1)
  if "lora_rows" in batch:  # SGMV in segments: one gather of each segment's A and B
    sl = batch["lora_block_slot"]
    xp = jnp.concatenate([xf, jnp.zeros((1, d_in), xf.dtype)])[batch["lora_rows"]]
    # (a scalar and an array index around a slice: the gathered axis comes first)
    h = jnp.einsum("bki,bir->bkr", xp.reshape(sl.shape[0], -1, d_in), f32(a[layer, :, sl]))
    y = jnp.einsum("bkr,bro->bko", h, f32(b[layer, sl]))
    return y.reshape(-1, y.shape[-1])[batch["lora_inv"]]
  if "lora_perm" in batch:  # SGMV by lax.ragged_dot
    groups = batch["lora_groups"]
    h = jax.lax.ragged_dot(xf[batch["lora_perm"]], jnp.transpose(f32(a[layer]), (1, 0, 2)),
                           groups)
    return jax.lax.ragged_dot(h, f32(b[layer]), groups)[batch["lora_inv"]]
  s = batch["lora_slot"]  # BGMV
  h = jnp.einsum("ti,tir->tr", xf, f32(a[layer, :, s]))
  return jnp.einsum("tr,tro->to", h, f32(b[layer, s]))
