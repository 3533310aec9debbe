"""bfloat16 weight matmuls on Intel AMX, the weights held in the tile layout (cpu_amx.cc).

XLA:CPU runs a bf16 x bf16 -> f32 dot on AMX too (lora.ops.dense_matmul), but a scanned
model's layer weights reach it only as a slice copied out of the stacked array, every
layer of every step (SmolLM2, bf16, batch 16: 18 ms of 58 per step), and fewer than 16
rows take a slower path. Here the stacked weights are packed once into AMX's B-tile layout
and read in place by layer index, like the GGUF blocks of `block_matmul`:

  pack(w [(L,) K, N] bf16)  -> tiles uint16 [(L,) N/16, K/2, 16, 2] (pairs of K per column)
  matmul(x [M, K], tiles, layer) = bf16(x) @ w, float32 accumulation and result
                            (1-4 rows: AVX512-BF16 dot products over the same layout)
  reference(...)            the jnp oracle (the same rounding of x, HIGHEST precision)

Needs K % 32 == 0 and N % 16 == 0 (`packable`), and `available()`: the native library,
AMX-TILE and AMX-BF16 in the CPU, and the OS's permission for the tile state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native

TARGET = "jaxinfer_bf16_tile_matmul"


def available() -> bool:
  return native.amx_available()


def packable(w) -> bool:
  """A bf16 weight [(L,) K, N] the tile layout holds."""
  return w.dtype == jnp.bfloat16 and w.ndim in (2, 3) and w.shape[-2] % 32 == 0 \
      and w.shape[-1] % 16 == 0


def pack(w):
  """w [(L,) K, N] bf16 -> uint16 [(L,) N/16, K/2, 16, 2]: element (j, p, c, e) is
  w[2p + e, 16j + c]."""
  if not packable(w):
    raise ValueError(f"tile layout needs bf16 [(L,) K, N] with K % 32 == 0 and N % 16 == 0; "
                     f"got {w.dtype} {tuple(w.shape)}")
  bits = jax.lax.bitcast_convert_type(jnp.asarray(w), jnp.uint16)
  *lead, K, N = bits.shape
  t = bits.reshape(*lead, K // 2, 2, N // 16, 16)
  t = jnp.moveaxis(t, -2, -4)  # [..., N/16, K/2, 2, 16]
  return jnp.swapaxes(t, -1, -2)  # [..., N/16, K/2, 16, 2]


def unpack(tiles):
  """The inverse of `pack`: uint16 [(L,) N/16, K/2, 16, 2] -> bf16 [(L,) K, N]."""
  *lead, nb, half, _, _ = tiles.shape
  t = jnp.swapaxes(tiles, -1, -2)  # [..., N/16, K/2, 2, 16]
  t = jnp.moveaxis(t, -4, -2)  # [..., K/2, 2, N/16, 16]
  return jax.lax.bitcast_convert_type(t.reshape(*lead, 2 * half, nb * 16), jnp.bfloat16)


def reference(x, tiles, layer=None):
  """bf16(x) @ W in jnp, float32 products and sums: the oracle of `matmul`."""
  if tiles.ndim == 5:
    tiles = tiles[layer]
  w = unpack(tiles).astype(jnp.float32)
  xb = x.astype(jnp.bfloat16).astype(jnp.float32)
  return jnp.dot(xb, w, precision=jax.lax.Precision.HIGHEST)


def matmul(x, tiles, layer=None):
  """x [M, K] (any float) -> bf16(x) @ W [M, N] float32 by the native call (`available()`)."""
  if not available():
    raise RuntimeError("the bf16 tile matmul needs the native CPU library and Intel AMX "
                       "(AMX-TILE, AMX-BF16) with the OS's permission; see the log")
  return native.stacked_call(TARGET, x, tiles, layer, tiles.shape[-4] * 16)
