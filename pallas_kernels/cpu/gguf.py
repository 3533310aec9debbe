"""x @ W for GGUF block weights (pallas_kernels.block_codec's layout) by a native XLA:CPU
custom call (gguf.cc) that reads the blocks in place: 0.625 / 1.0625 bytes per weight
(the file's own, fp16 scales included) instead of 4. `block_codec.reference` is its oracle.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_codec import FORMATS, format_of
from pallas_kernels.cpu import native

TARGET = "jaxinfer_block_matmul"
# Below this many multiply-adds a call runs on the calling thread alone: scheduling a
# helper costs more than it saves (docs/design.md, native CPU backend).
MIN_PARALLEL_MACS = 1 << 18
ACTIVATIONS = ("f32", "q8")


def available() -> bool:
  return native.available()


def matmul(x, codes, scales, layer=None, *, min_parallel_macs: int = MIN_PARALLEL_MACS,
           fused: bool = True, activations: str = "f32"):
  """x [M, K] -> x @ W^T [M, N] float32 by the native call (CPU only; `available()`).
  fused=False: always the portable panel path (decoded rows stored, then a 2 x 4 tile),
  which otherwise runs only past 64 rows or without AVX-512 / AVX2.
  activations="q8": x quantized per block of 32 to 8 bits and multiplied in integers, as
  llama.cpp does (block_codec.reference(activations="q8") is its oracle)."""
  if activations not in ACTIVATIONS:
    raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
  if not available():  # also registers the call on first use
    raise RuntimeError("the block matmul needs the native CPU library, which could not be "
                       "built or is disabled (JAXINFER_NATIVE=0); see the log")
  fmt = format_of(codes, scales)
  N = codes.shape[-2]
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))
  layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
  return call(x.astype(jnp.float32), codes, scales.astype(jnp.float16), layer,
              fmt=np.int32(FORMATS[fmt]), min_parallel_macs=np.int64(min_parallel_macs),
              fused=bool(fused), xq8=activations == "q8")
