"""The CPU prefill attention custom call (`prefill.cc`, built by pallas_kernels.cpu.native).

Slots of several new tokens (prompt chunks, verify windows): each query reads its slot's
cached pages where they lie and its slot's new tokens causally up to itself, in one call
whose work items hold their scores in registers, instead of XLA ops that write every
block's scores, weights and masks to memory between fusions. Same contract as
`paged_attention.xla.prefill_attention` without sliding windows and score caps (those
keep the XLA-op path); head_dim a multiple of 64 up to 256, pages of at most 64 tokens,
AVX-512F (`supported`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_codec
from pallas_kernels.cpu import decode, native

TARGET = "jaxinfer_prefill_attention"


def available() -> bool:
  return native.prefill_available()


def supported(q_shape, num_kv_heads: int, page_size: int) -> bool:
  """Shapes the call handles (prefill.cc)."""
  _, N, H = q_shape
  return H % 64 == 0 and H <= 256 and N % num_kv_heads == 0 and page_size <= 64


def prefill_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                      cached_len, Q: int, scale: float):
  """q [T, N, H], k_new / v_new [T, K, H]; per slot r its page_table [R, P], its new
  tokens at query_start[r] .. + query_len[r] after cached_len[r] cached tokens ->
  (out [R, Q, N, H] float32, zeros past each query_len; flat token index [R, Q], T where
  a row is not a real token). CPU only."""
  T, N, H = q.shape
  R = page_table.shape[0]
  fmt = kv_codec.pool_format(pool)
  ks, vs = decode.scale_operands(pool, fmt)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, Q, N, H), jnp.float32))
  out = call(q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32),
             pool["k"], pool["v"], ks, vs, jnp.asarray(layer, jnp.int32),
             page_table.astype(jnp.int32), query_start.astype(jnp.int32),
             query_len.astype(jnp.int32), cached_len.astype(jnp.int32),
             fmt=np.int32(decode.FORMATS[fmt]), scale=np.float32(scale))
  qpos = jnp.arange(Q, dtype=jnp.int32)
  flat = jnp.where(qpos[None, :] < query_len[:, None], query_start[:, None] + qpos[None, :],
                   T)
  return out, flat
