"""bfloat16 weight matmuls on Intel AMX or AVX512-BF16, the weights held in AMX's tile
layout (tiles.cc).

XLA:CPU runs a bf16 x bf16 -> f32 dot on AMX too (jaxinfer.model.linear.Dense), but a scanned
model's layer weights reach it only as a slice copied out of the stacked array, every
layer of every step (SmolLM2, bf16, batch 16: 18 ms of 58 per step), and fewer than 16
rows take a slower path; on a CPU without AMX it converts bf16 to float32 element by element
(SmolLM2, bf16, batch 1, AMD EPYC: 32 ms a step against 25 for f32 weights). Here the
stacked weights are packed once into AMX's B-tile layout and read in place by layer
index, like the GGUF blocks of `gguf`:

  pack(w [(L,) K, N] bf16)  -> tiles uint16 [(L,) N/16, K/2, 16, 2] (pairs of K per column)
  matmul(x [M, K], tiles, layer) = bf16(x) @ w, float32 accumulation and result
                            (AMX tiles; AVX512-BF16 dot products over the same layout for
                            1-4 rows, and for every call on CPUs without AMX)
  reference(...)            the jnp oracle (the same rounding of x, HIGHEST precision)

Needs K % 32 == 0 and N % 16 == 0 (`packable`), and `available()`: the native library and
either AMX-TILE and AMX-BF16 with the OS's permission for the tile state, or AVX512-BF16
(`engines()` says which).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import native

TARGET = "jaxinfer_bf16_tile_matmul"


def engines() -> tuple:
  """("amx", "dot"), ("dot",) or (): see native.tiles_engines."""
  return native.tiles_engines()


def available() -> bool:
  return bool(engines())


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


def matmul(x, tiles, layer=None, engine=None):
  """x [M, K] (any float) -> bf16(x) @ W [M, N] float32 by the native call (`available()`).
  engine "dot" runs the AVX512-BF16 dot products at every row count (where `engines()` has
  it); None lets the call choose (AMX for more than four rows where the CPU has it)."""
  if not available():
    raise RuntimeError("the bf16 tile matmul needs the native CPU library and Intel AMX "
                       "(AMX-TILE, AMX-BF16, with the OS's permission) or AVX512-BF16; "
                       "see the log")
  if engine not in (None, "dot"):
    raise ValueError(f"engine must be None or 'dot'; got {engine!r}")
  if engine == "dot" and "dot" not in engines():
    raise RuntimeError(f"engine 'dot' needs AVX512-BF16; this CPU runs {engines()}")
  return native.stacked_call(TARGET, x, tiles, layer, tiles.shape[-4] * 16,
                             dot_only=np.int32(engine == "dot"))
