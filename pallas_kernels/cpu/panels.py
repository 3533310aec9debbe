"""float32 weight matmuls on AVX-512 (or AVX2 + FMA), the weights held in column panels
(panels.cc).

XLA:CPU copies a scanned layer's weights out of the stacked array before its dot, every
layer of every step (SmolLM2 f32 at batch 1: 35 ms of a 63 ms step, 540 MB written and
read again). Here the stacked weights are packed once into panels of 16 columns and read
in place by layer index, like the GGUF blocks of `gguf` and the bf16 `tiles`:

  pack(w [(L,) K, N] f32)  -> panels float32 [(L,) N/16, K, 16]
  matmul(x [M, K], panels, layer) = x @ w, float32 (FMA order: k ascending per column)
  reference(...)           the jnp oracle (HIGHEST precision)

Needs N % 16 == 0 (`packable`) and `available()`: the native library and AVX-512F, or
AVX2 and FMA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu import native

TARGET = "jaxinfer_f32_panel_matmul"


def available() -> bool:
  return native.panels_available()


def packable(w) -> bool:
  """An f32 weight [(L,) K, N] the panel layout holds."""
  return w.dtype == jnp.float32 and w.ndim in (2, 3) and w.shape[-1] % 16 == 0


def pack(w):
  """w [(L,) K, N] f32 -> [(L,) N/16, K, 16]: element (j, k, c) is w[k, 16j + c]."""
  if not packable(w):
    raise ValueError(f"panel layout needs float32 [(L,) K, N] with N % 16 == 0; got "
                     f"{w.dtype} {tuple(w.shape)}")
  *lead, K, N = w.shape
  return jnp.swapaxes(jnp.asarray(w).reshape(*lead, K, N // 16, 16), -3, -2)


def unpack(panels):
  """The inverse of `pack`."""
  *lead, nb, K, _ = panels.shape
  return jnp.swapaxes(panels, -3, -2).reshape(*lead, K, nb * 16)


def reference(x, panels, layer=None):
  """x @ W in jnp at HIGHEST precision: the oracle of `matmul`."""
  if panels.ndim == 4:
    panels = panels[layer]
  return jnp.dot(x.astype(jnp.float32), unpack(panels), precision=jax.lax.Precision.HIGHEST)


def matmul(x, panels, layer=None):
  """x [M, K] -> x @ W [M, N] float32 by the native call (`available()`)."""
  if not available():
    raise RuntimeError("the f32 panel matmul needs the native CPU library and AVX-512F or "
                       "AVX2 + FMA; see the log")
  return native.stacked_call(TARGET, x, panels, layer, panels.shape[-3] * 16)
