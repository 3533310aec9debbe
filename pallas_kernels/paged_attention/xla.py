"""Ragged paged attention in plain XLA ops, shaped for XLA:CPU (the model's CPU backend).

Same arguments and semantics as `reference.py` (the oracle this is tested against);
what differs is how the work is laid out, chosen by measuring each op on a 2-core
x86 machine (per-op profile in the README's performance section):

- Decode slots (one new token each) take their own path, written as multiply-and-reduce
  over [K, R, S, G, H] rather than as dots: XLA:CPU then fuses the page gather into the
  reductions, so no gathered copy of the KV is written and read back (a G-row dot per
  (head, request), the reference's form, also runs 4-5x under XLA:CPU's dot peak).
- With more than MAX_DOT_FORM_SLOTS decode slots, pages are gathered in blocks (about
  BLOCK_TOKENS tokens over all slots) with an online softmax (the Pallas
  kernel's algorithm, in XLA ops) under a loop whose trip count is the step's longest
  real context, not the bucket's page count: a decode step reads only the pages its
  requests hold, and each gathered block stays in cache between the gather and the dots.
  The gather takes whole page rows (`jnp.take` on [pages, page_size * Hc], clipped:
  "fill" mode adds a select to every element).
- Slots with several new tokens (prefill chunks, verify windows) go through the
  reference's grouped computation: their query rows make the dots large enough already.
  When none of them has cached tokens (fresh prompts), the cached part is skipped
  instead of computed over the bucket's page width and masked.

Masked keys are dropped from the softmax and their V rows zeroed, so stale pages that
hold NaN never contribute (tested with NaN-poisoned pools like the other two).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_codec
from pallas_kernels.paged_attention import reference

_NEG = -1e30
# Tokens gathered per block over all decode slots: R=64 -> 8 pages of 16 tokens per slot,
# R=16 -> 32, R=4 -> 128 (measured on SmolLM2's shapes: below this the loop's per-block
# overhead dominates, above it the gathered block leaves the cache).
BLOCK_TOKENS = 8192
# Up to this many decode slots the reference's one-gather dot form is faster (measured:
# R=1 at 1024 context 16.6 vs 21.9 ms over 30 layers; R=4: 47 vs 39 ms).
MAX_DOT_FORM_SLOTS = 2


def block_pages_for(num_slots: int, page_size: int, pages: int) -> int:
  return max(1, min(pages, BLOCK_TOKENS // (num_slots * page_size)))


def _gather_block(pool, fmt, layer, page_ids, dtype):
  """K and V of one layer for a block of pages: page_ids [R, B] -> two [K, R, B*page, H]."""
  codes = pool["k"]
  L, K, P, ps, Hc = codes.shape
  R, B = page_ids.shape
  # Row index of (layer, kv head, page) in the pool seen as [L*K*P, ...]: the gather
  # copies whole pages (contiguous rows), which XLA:CPU does fastest.
  rows = ((layer * K + jnp.arange(K, dtype=jnp.int32))[:, None, None] * P
          + page_ids[None]).reshape(-1)  # [K*R*B]
  out = []
  for name in ("k", "v"):
    c = jnp.take(pool[name].reshape(L * K * P, ps * Hc), rows, axis=0, mode="clip")
    c = c.reshape(K, R, B, ps, Hc)
    if fmt.group_scales:
      gs = pool[name + "_gs"]
      s = jnp.take(gs.reshape(L * K * P, ps * gs.shape[-1]), rows, axis=0, mode="clip")
      x = kv_codec.decode(fmt, c, s.reshape(K, R, B, ps, gs.shape[-1]), dtype)
    elif fmt.page_scales:
      s = jnp.take(pool[name + "_ps"].reshape(-1), rows, mode="clip").reshape(K, R, B)
      x = kv_codec.decode(fmt, c, s[..., None, None], dtype)
    else:
      x = kv_codec.decode(fmt, c, None, dtype)
    out.append(x.reshape(K, R, B * ps, x.shape[-1]))
  return out[0], out[1]


def decode_attention(q, k_new, v_new, pool, layer, page_table, cached_len, *, scale,
                     block_pages=None):
  """One new token per slot. q [R, N, H], k_new / v_new [R, K, H] (the slot's own token,
  attended after its cached_len [R] cached tokens), page_table [R, P] -> [R, N, H] f32."""
  R, N, H = q.shape
  K = k_new.shape[1]
  G = N // K
  fmt = kv_codec.get_format(kv_codec.pool_format(pool))
  ps = pool["k"].shape[3]
  cdt = jnp.float32
  qr = (q.astype(cdt) * scale).reshape(R, K, G, H).transpose(1, 0, 2, 3)  # [K, R, G, H]
  kn = k_new.astype(cdt).transpose(1, 0, 2)  # [K, R, H]
  vn = v_new.astype(cdt).transpose(1, 0, 2)
  # The slot's own token starts the online softmax: m = its score, l = 1, o = its V.
  m = jnp.einsum("krgh,krh->krg", qr, kn)  # [K, R, G]
  l = jnp.ones_like(m)
  o = jnp.broadcast_to(vn[:, :, None, :], (K, R, G, H))

  if block_pages is None:
    block_pages = block_pages_for(R, ps, page_table.shape[1])
  B = max(1, min(block_pages, page_table.shape[1]))
  P = -(-page_table.shape[1] // B) * B
  pt = jnp.pad(page_table, ((0, 0), (0, P - page_table.shape[1])))
  block = B * ps
  num_blocks = (jnp.max(cached_len) + block - 1) // block  # dynamic: the real longest

  def body(b, carry):
    m, l, o = carry
    pages = jax.lax.dynamic_slice_in_dim(pt, b * B, B, axis=1)  # [R, B]
    kc, vc = _gather_block(pool, fmt, layer, pages, cdt)  # [K, R, block, H]
    pos = b * block + jnp.arange(block, dtype=jnp.int32)
    valid = (pos[None, :] < cached_len[:, None])[None, :, :, None]  # [1, R, block, 1]
    # Multiply-and-reduce, not a dot: XLA:CPU fuses the page gather into the reduction
    # (no gathered copy is written), and a G-row dot per (head, request) is slow there.
    s = jnp.sum(kc[:, :, :, None, :] * qr[:, :, None, :, :], axis=-1)  # [K, R, block, G]
    s = jnp.where(valid, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=2))
    p = jnp.where(valid, jnp.exp(s - m_new[:, :, None, :]), 0.0)
    alpha = jnp.exp(m - m_new)
    vc = jnp.where(valid, vc, 0.0)  # stale pages may hold NaN
    pv = jnp.sum(p[..., None] * vc[:, :, :, None, :], axis=2)  # [K, R, G, H]
    return m_new, l * alpha + jnp.sum(p, axis=2), o * alpha[..., None] + pv

  m, l, o = jax.lax.fori_loop(0, num_blocks, body, (m, l, o))
  o = o / l[..., None]
  return o.transpose(1, 0, 2, 3).reshape(R, N, H)


def ragged_paged_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                           cached_len, *, max_query_len: int, num_prefill_slots=None,
                           sm_scale=None, q_precision: str = "native",
                           block_pages=None):
  """q [T, N, H], k_new/v_new [T, K, H] -> out [T, N, H] float32; see reference.py."""
  T, N, H = q.shape
  R = page_table.shape[0]
  q = kv_codec.round_q(kv_codec.get_format(kv_codec.pool_format(pool)), q, q_precision)
  Rp = R if num_prefill_slots is None else num_prefill_slots
  scale = (1.0 / H**0.5) if sm_scale is None else sm_scale
  out = jnp.zeros((T, N, H), jnp.float32)
  Rd = R - Rp
  if Rd and Rd <= MAX_DOT_FORM_SLOTS and block_pages is None:
    o, flat = reference.attend_group(q, k_new, v_new, pool, layer, page_table[:Rd],
                                     query_start[:Rd], query_len[:Rd], cached_len[:Rd], 1,
                                     scale)
    out = out.at[flat].set(o, mode="drop")
  elif Rd:
    qi = jnp.clip(query_start[:Rd], 0, T - 1)
    o = decode_attention(q[qi], k_new[qi], v_new[qi], pool, layer, page_table[:Rd],
                         cached_len[:Rd], scale=scale, block_pages=block_pages)
    flat = jnp.where(query_len[:Rd] == 1, query_start[:Rd], T)  # T = dropped
    out = out.at[flat].set(o, mode="drop")
  if Rp:
    sl = slice(Rd, R)
    qs, ql, cl = query_start[sl], query_len[sl], cached_len[sl]

    def with_cache():
      return reference.attend_group(q, k_new, v_new, pool, layer, page_table[sl], qs, ql,
                                    cl, max_query_len, scale)

    def fresh():  # no slot has cached tokens (a new prompt): skip the bucket's page width
      return reference.attend_group(q, k_new, v_new, pool, layer, page_table[sl, :1], qs,
                                    ql, cl, max_query_len, scale)

    o, flat = jax.lax.cond(jnp.max(cl) > 0, with_cache, fresh)
    out = out.at[flat].set(o, mode="drop")
  return out
