"""The CPU decode attention custom call (`decode.cc`, built by pallas_kernels.cpu.native).

XLA:CPU has no way to read a page table inside a fused loop: every form of paged decode
attention written in XLA ops gathers each block of pages into a fresh buffer, masks it
and reduces it with separate fusions, so each KV byte crosses memory 3-4 times
(docs/design.md, the native CPU backend). `decode.cc` reads
the pages where they lie, once, in an XLA FFI handler that runs on XLA's own intra-op
thread pool.

Without the native library (no compiler, not Linux, JAXINFER_NATIVE=0) `available()` is
False and the `xla` backend keeps its XLA-op decode path.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_codec
from pallas_kernels.cpu import native

log = logging.getLogger(__name__)

TARGET = "jaxinfer_paged_decode"
FORMATS = {"f32": 0, "bf16": 1, "fp8": 2, "q8_0": 3, "q4_0": 4}
# Below this many (cached token, KV head) pairs a call runs on the calling thread alone:
# scheduling a helper costs more than it saves (docs/design.md, native CPU backend).
MIN_PARALLEL_TOKENS = 1024


def build() -> str:
  return native.build()


def available() -> bool:
  """Whether the custom call is registered for the CPU platform (built on first call)."""
  return native.available()


def scale_operands(pool, fmt: str):
  """The pool's K and V scale arrays for the native calls (fp8: per page, q8_0 / q4_0: per
  group), or a one-element placeholder each."""
  if fmt == "fp8":
    return pool["k_ps"], pool["v_ps"]
  if fmt in ("q8_0", "q4_0"):
    return pool["k_gs"], pool["v_gs"]
  none = jnp.zeros((1,), jnp.float32)
  return none, none


def decode_attention(q, k_new, v_new, pool, layer, page_table, cached_len, *, scale,
                     window=None, softcap=None,
                     min_parallel_tokens: int = MIN_PARALLEL_TOKENS):
  """Same contract as xla.decode_attention (q [R, N, H], k_new / v_new [R, K, H], the
  slot's page_table [R, P] and cached_len [R]; window: an int32 scalar, may be traced,
  None: all keys; softcap: static, None: none) -> [R, N, H] float32. CPU only."""
  fmt = kv_codec.pool_format(pool)
  ks, vs = scale_operands(pool, fmt)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32),
              pool["k"], pool["v"], ks, vs, jnp.asarray(layer, jnp.int32),
              page_table.astype(jnp.int32), cached_len.astype(jnp.int32),
              jnp.asarray(0 if window is None else window, jnp.int32),
              fmt=np.int32(FORMATS[fmt]), scale=np.float32(scale),
              softcap=np.float32(softcap or 0.0),
              min_parallel_tokens=np.int64(min_parallel_tokens))
