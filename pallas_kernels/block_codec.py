"""GGUF block-quantized weights (chapter 8.4.1) in their own format: codec and jnp oracle.

A weight W [N out, K in] is held as the file stores it, in blocks of 32 values along K:
  q4_1: codes uint8 [(L,) N, K/2] (byte j of a block: value j low nibble, j+16 high) and
        scales float16 [(L,) N, K/32, 2] = (d, m); w = d * q + m
  q8_0: codes int8 [(L,) N, K] and scales float16 [(L,) N, K/32, 1] = d; w = d * q
The scales are the file's own fp16 values, so `dequantize` (in float32) gives the very
weights a dequantizing loader would, and `matmul` multiplies by those weights (reading
0.625 / 1.0625 bytes per weight instead of 4). `reference` is the jnp oracle of
the native CPU call that multiplies by them in place (pallas_kernels.cpu.gguf). A leading
layer axis L with a `layer` index lets a scanned model read layer i in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = {"q4_1": 0, "q8_0": 1}
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0")  # read by from_gguf_blocks
BLOCK = 32
def format_of(codes, scales) -> str:
  return "q4_1" if scales.shape[-1] == 2 else "q8_0"


def from_gguf_blocks(raw: np.ndarray, fmt: str, rows: int, cols: int):
  """The raw bytes of a GGUF tensor (rows x cols values, cols along the blocks) ->
  (codes, scales) in this module's layout. q4_0 becomes q4_1 with m = -8 d (exact in
  fp16, a power-of-two multiple, and d * (q - 8) = d * q - 8 d in float32)."""
  nb = cols // BLOCK
  raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb, -1)
  if fmt == "q4_0":  # block: d fp16, 16 code bytes
    d = raw[:, :, :2].copy().view(np.float16).reshape(rows, nb)
    with np.errstate(over="raise"):  # |d| > 8190 would not stay exact
      scales = np.stack([d, d * np.float16(-8)], -1)
    codes = raw[:, :, 2:].reshape(rows, nb * 16)
  elif fmt == "q4_1":  # block: d fp16, m fp16, 16 code bytes
    scales = raw[:, :, :4].copy().view(np.float16).reshape(rows, nb, 2)
    codes = raw[:, :, 4:].reshape(rows, nb * 16)
  elif fmt == "q8_0":  # block: d fp16, 32 int8 codes
    scales = raw[:, :, :2].copy().view(np.float16).reshape(rows, nb, 1)
    codes = raw[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
  else:
    raise ValueError(f"GGUF block format {fmt!r} is not one of {GGUF_FORMATS}")
  return np.ascontiguousarray(codes), np.ascontiguousarray(scales)


def quantize(w, fmt: str):
  """float32 W [N, K] -> (codes, scales), rounding as GGML does (for random-weight models
  and tests; a GGUF file's blocks are taken as they are by from_gguf_blocks)."""
  w = np.asarray(w, np.float32)
  N, K = w.shape
  if K % BLOCK:
    raise ValueError(f"block formats need K % {BLOCK} == 0; got K={K}")
  b = w.reshape(N, K // BLOCK, BLOCK)
  if fmt == "q4_1":
    lo, hi = b.min(-1), b.max(-1)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.clip(np.round((b - m[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(N, K // 2)
    return codes, np.stack([d, m], -1).astype(np.float16)
  if fmt == "q8_0":
    d = (np.abs(b).max(-1) / 127).astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.clip(np.round(b * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(N, K), d[..., None].astype(np.float16)
  raise ValueError(f"block format {fmt!r} is not one of {sorted(FORMATS)}")


def dequantize(codes, scales):
  """(codes, scales) of one layer -> float32 W [N, K] (the jnp oracle's weights)."""
  N = codes.shape[0]
  scales = jnp.asarray(scales).astype(jnp.float32)
  if format_of(codes, scales) == "q4_1":
    c = codes.reshape(N, -1, 16).astype(jnp.int32)
    q = jnp.concatenate([c & 15, c >> 4], axis=-1).astype(jnp.float32)  # [N, nb, 32]
    w = q * scales[..., :1] + scales[..., 1:]
  else:
    w = codes.reshape(N, -1, BLOCK).astype(jnp.float32) * scales
  return w.reshape(N, -1)


def quantize_activations(x):
  """x [M, K] float32 -> (q int32 [M, K/32, 32], d [M, K/32], s [M, K/32]) quantized per
  block of 32 as the native call's activations="q8" does: d = max|x| / 127,
  q = round-half-even(x * (1 / d)), s = d * sum(q)."""
  M, K = x.shape
  b = x.astype(jnp.float32).reshape(M, K // BLOCK, BLOCK)
  d = jnp.max(jnp.abs(b), axis=-1) / jnp.float32(127)
  inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, 1), 0)
  q = jnp.round(b * inv[..., None]).astype(jnp.int32)
  return q, d, d * jnp.sum(q, axis=-1).astype(jnp.float32)


def reference(x, codes, scales, layer=None, activations: str = "f32"):
  """x [M, K] @ W^T in jnp: the oracle of `matmul`. activations="q8": x quantized per
  block first (`quantize_activations`), each block's integer sum exact, then
  y = sum_b d_w d_x sum(q_w q_x) (+ m_w s_x for q4_1)."""
  if codes.ndim == 3:
    codes, scales = codes[layer], scales[layer]
  if activations == "f32":
    w = dequantize(codes, scales)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
  N = codes.shape[0]
  scales = jnp.asarray(scales).astype(jnp.float32)
  q, d, s = quantize_activations(x)
  if format_of(codes, scales) == "q4_1":
    c = codes.reshape(N, -1, 16).astype(jnp.int32)
    qw = jnp.concatenate([c & 15, c >> 4], axis=-1)
  else:
    qw = codes.reshape(N, -1, BLOCK).astype(jnp.int32)
  isum = jnp.einsum("mbj,nbj->mnb", q, qw).astype(jnp.float32)  # exact below 2^24
  y = jnp.einsum("mnb,nb,mb->mn", isum, scales[..., 0], d, precision="highest")
  if scales.shape[-1] == 2:
    y = y + jnp.einsum("nb,mb->mn", scales[..., 1], s, precision="highest")
  return y
