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
  segment (SGMV) tokens grouped by slot into blocks of BLOCK rows, each block one
          adapter's (groups padded to whole blocks), one batched matmul per factor with
          A and B gathered per block: `lora_rows` [NB * BLOCK], `lora_block_slot` [NB],
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
BLOCK = 16  # rows per segment block
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
  if mode == "segment":  # static size: T rows plus at most BLOCK - 1 padding per slot
    T, S = len(s), num_slots + 1
    nb = -(-(T + S * (BLOCK - 1)) // BLOCK)
    rows = np.full(nb * BLOCK, T, np.int32)  # T: a zero row (padding)
    block_slot = np.zeros(nb, np.int32)
    inv = np.zeros(T, np.int32)
    at = 0
    for slot in np.unique(s):
      toks = np.nonzero(s == slot)[0]
      rows[at:at + len(toks)] = toks
      inv[toks] = np.arange(at, at + len(toks))
      n_blocks = -(-len(toks) // BLOCK)
      block_slot[at // BLOCK:at // BLOCK + n_blocks] = slot
      at += n_blocks * BLOCK
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
  if "lora_rows" in batch:  # SGMV in blocks: one gather of each block's A and B
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


def dense_matmul(x, w):
  """x @ w in x's dtype. Half-precision weights (bf16) multiply with float32 accumulation,
  rounded once at the end: on XLA:CPU a bf16 x bf16 dot with a float32 result runs on the
  CPU's matrix units where there are some (Intel AMX here: 709 GFLOP/s at 64 x 576 x 1536,
  against 174 in f32 and 116 for the same dot with a bf16 result), and on GPUs it is the
  usual tensor-core product."""
  if w.dtype == jnp.float32:
    return x @ w
  return half_dot(x, w, "md,dn->mn").astype(x.dtype)


# XLA:CPU runs a bf16 dot of fewer rows as a matrix-vector product that first converts the
# whole weight to float32 (a 576 x 49152 LM head: 37 ms at one row); from 16 rows on it
# takes the matrix-unit path, so smaller products are padded to 16 rows there.
HALF_DOT_MIN_ROWS_CPU = 16


def half_dot(x, w, spec: str):
  """einsum(spec, x, w) of x [M, D] and half-precision w, float32 accumulation and result."""
  m = x.shape[0]
  pad = HALF_DOT_MIN_ROWS_CPU - m if jax.default_backend() == "cpu" else 0
  xp = jnp.pad(x.astype(w.dtype), ((0, pad), (0, 0))) if pad > 0 else x.astype(w.dtype)
  return jnp.einsum(spec, xp, w, preferred_element_type=jnp.float32)[:m]


def project(x, p, name: str, lw, batch):
  """x @ p[name], plus the adapters' low-rank addition when this step carries LoRA
  (lw = (pool, layer index)). p["blocks"] = (the stacked native weights, layer index) when
  this step reads them: the GGUF file's own blocks (weight_format="gguf"), or bf16 / f32
  weights in bf16 tiles / f32 AVX-512 panels (params.as_native); see transformer.py."""
  return project_group(x, p, (name,), None, lw, batch)[0]


def project_group(x, p, names, sizes, lw, batch):
  """[x @ p[n] (+ LoRA) for n in names], of `sizes` output features (None: equal). The
  block weights may hold the group's rows as one matrix ("wq+wk+wv", "w_gate+w_up"): one
  native call instead of several, its output split by `sizes`."""
  blocks = p.get("blocks")
  fused = "+".join(names)
  if blocks is not None and len(names) > 1 and fused in blocks[0]:
    y = stacked_matmul(x, blocks[0][fused], blocks[1]).astype(x.dtype)
    outs = jnp.split(y, len(names) if sizes is None else np.cumsum(sizes)[:-1].tolist(),
                     axis=-1)
  elif blocks is not None and all(n in blocks[0] for n in names):
    outs = [stacked_matmul(x, blocks[0][n], blocks[1]).astype(x.dtype) for n in names]
  else:
    outs = [dense_matmul(x, p[n]) for n in names]
  if lw is not None:
    pool, layer = lw
    outs = [y + delta(x, pool[n]["a"], pool[n]["b"], layer, batch).astype(y.dtype)
            if n in pool else y for n, y in zip(names, outs)]
  return outs


def stacked_matmul(x, w, layer=None):
  """x @ layer `layer` of a stacked native weight (or of an unstacked one): bf16 tiles
  ({"tiles"}), f32 panels ({"panels"}) or GGUF blocks ({"codes", "scales"})."""
  if "tiles" in w:
    from pallas_kernels.block_matmul import tiles
    return tiles.matmul(x, w["tiles"], layer)
  if "panels" in w:
    from pallas_kernels.block_matmul import panels
    return panels.matmul(x, w["panels"], layer)
  from pallas_kernels import block_matmul
  return block_matmul.matmul(x, w["codes"], w["scales"], layer)
