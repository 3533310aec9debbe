"""jnp reference of ragged paged attention; also the model's CPU backend.

A packed step holds, for each of R request slots, query_len[r] new tokens that sit at
flat offsets query_start[r] .. +query_len[r] of the token array, following cached_len[r]
tokens already stored in the request's pages. Each new token attends to every cached
token of its request (8.3.1 paging) and causally to the new tokens of its request
before it. The new tokens' K/V are passed in directly (the pool is written once per
step, after all layers).

Shapes: T flat tokens, R request slots, Q = max query tokens per request (static),
N query heads, K KV heads, G = N / K, H head dim, S = pages per request x page size.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import kv_codec
from pallas_kernels.paged_attention import common

_NEG = -1e30


def gather_queries(q, k_new, v_new, query_start, query_len, Q, scale):
  """Each slot's up to Q new tokens out of the flat arrays, KV-head-major like the pool:
  (qpos [Q], qvalid [R, Q], scaled q [K, R, Q, G, H], k [K, R, Q, H], v [K, R, Q, H] with
  rows past query_len zeroed), all float32. Shared with the xla backend."""
  T, N, H = q.shape
  K = k_new.shape[1]
  R = query_start.shape[0]
  cdt = jnp.float32
  qpos = jnp.arange(Q, dtype=jnp.int32)
  qidx = jnp.clip(query_start[:, None] + qpos[None, :], 0, T - 1)  # [R, Q]
  qvalid = qpos[None, :] < query_len[:, None]  # [R, Q]
  qr = (q[qidx].astype(cdt) * scale).reshape(R, Q, K, N // K, H).transpose(2, 0, 1, 3, 4)
  kn = k_new[qidx].astype(cdt).transpose(2, 0, 1, 3)  # [K, R, Q, H]
  vn = jnp.where(qvalid[None, :, :, None], v_new[qidx].astype(cdt).transpose(2, 0, 1, 3), 0.0)
  return qpos, qvalid, qr, kn, vn


def attend_group(q, k_new, v_new, pool, layer, page_table, query_start, query_len, cached_len, Q,
                 scale, window=None, softcap=None):
  """Attention for a group of request slots that each hold up to Q new tokens.
  window (an int32 scalar, may be traced) / softcap (static): common.in_window, soft_cap.
  Returns (out [R, Q, N, H], flat token index [R, Q] or T where invalid)."""
  T, N, H = q.shape
  R = page_table.shape[0]
  cdt = jnp.float32
  qpos, qvalid, qr, kn, vn = gather_queries(q, k_new, v_new, query_start, query_len, Q, scale)

  kc, vc = kv_codec.gather_pages(pool, layer, page_table, cdt)  # [K, R, S, H]
  S = kc.shape[2]
  cvalid = jnp.arange(S, dtype=jnp.int32)[None, :] < cached_len[:, None]  # [R, S]
  # stale pages may hold NaN, and so may the page a released entry (behind the window)
  # reads: keys no query of the slot reads are zeroed
  read = cvalid & common.in_window(jnp.arange(S, dtype=jnp.int32)[None, :],
                                   cached_len[:, None], window)
  vc = jnp.where(read[None, :, :, None], vc, 0.0)

  s_c = common.soft_cap(jnp.einsum("krqgh,krsh->krqgs", qr, kc), softcap)  # [K, R, Q, G, S]
  s_n = common.soft_cap(jnp.einsum("krqgh,krjh->krqgj", qr, kn), softcap)  # [K, R, Q, G, Q]
  qabs = cached_len[:, None] + qpos[None, :]  # [R, Q] each query's position
  spos = jnp.arange(S, dtype=jnp.int32)
  m_c = cvalid[:, None, :] & common.in_window(spos[None, None, :], qabs[:, :, None], window)
  m_c = m_c[None, :, :, None, :]  # [1, R, Q, 1, S]
  m_n = ((qpos[None, :, None] >= qpos[None, None, :]) & qvalid[:, None, :]
         & common.in_window(qpos[None, None, :], qpos[None, :, None], window))  # [R, Q, Q]
  m_n = m_n[None, :, :, None, :]
  s_c = jnp.where(m_c, s_c, _NEG)
  s_n = jnp.where(m_n, s_n, _NEG)
  m = jnp.maximum(jnp.max(s_c, axis=-1), jnp.max(s_n, axis=-1))[..., None]
  p_c = jnp.where(m_c, jnp.exp(s_c - m), 0.0)
  p_n = jnp.where(m_n, jnp.exp(s_n - m), 0.0)
  denom = jnp.sum(p_c, axis=-1) + jnp.sum(p_n, axis=-1)  # [K, R, Q, G]
  o = jnp.einsum("krqgs,krsh->krqgh", p_c, vc) + jnp.einsum("krqgj,krjh->krqgh", p_n, vn)
  o = o / jnp.maximum(denom, 1e-30)[..., None]
  o = o.transpose(1, 2, 0, 3, 4).reshape(R, Q, N, H)
  flat = jnp.where(qvalid, query_start[:, None] + qpos[None, :], T)  # T = dropped
  return o, flat


def ragged_paged_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                           cached_len, *, max_query_len: int, num_prefill_slots=None,
                           sm_scale=None, q_precision: str = "compute", window=None,
                           softcap=None):
  """q [T, N, H], k_new/v_new [T, K, H] -> out [T, N, H] (float32 accumulation).

  pool: KV pool pytree (pallas_kernels.kv_codec layout), read at `layer`.
  page_table [R, Pmax] int32; query_start, query_len, cached_len [R] int32.
  The last `num_prefill_slots` slots hold up to max_query_len new tokens each, the
  others at most one (None: every slot may hold max_query_len). Tokens not covered by
  any request (padding) get zeros. q_precision: see kv_codec.round_q (8.4.4). window:
  sliding-window attention over the last `window` positions (an int32 scalar, may be
  traced; None: all); softcap: scores capped at +-softcap (common.soft_cap).
  Inputs are checked first (common.validate_static / validate_values).
  """

  def group(qr, scale, Q, meta):
    return attend_group(qr, k_new, v_new, pool, layer, *meta, Q, scale, window, softcap)

  return common.run_groups(q, k_new, v_new, pool, page_table, query_start, query_len,
                           cached_len, max_query_len=max_query_len,
                           num_prefill_slots=num_prefill_slots,
                           sm_scale=sm_scale, q_precision=q_precision, group=group)
