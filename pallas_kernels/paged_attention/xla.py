"""Ragged paged attention in plain XLA ops, shaped for XLA:CPU (the model's CPU backend).

Same arguments and semantics as `reference.py` (the oracle this is tested against);
what differs is how the work is laid out, chosen by measuring each op on a 2-core
x86 machine (per-op profile in the README's performance section):

- Every part that reads cached KV loops over blocks of pages with an online softmax (the
  Pallas kernel's algorithm, in XLA ops) whose trip count is the step's longest real
  context, not the bucket's page count. A step therefore reads only the pages its
  requests hold, and its cost does not depend on how wide the bucket's page tables are:
  a bucket table needs one tier of pages per request, not a ladder (8.2.4: fewer
  compiled shapes). Each gathered block stays in cache between the gather and the dots.
- On CPU, decode slots (one new token each) run the native custom call of
  `pallas_kernels/cpu/decode.py` / `decode.cc` (sliding windows and score caps included),
  which reads each slot's pages where they lie, once,
  on XLA's thread pool: no XLA-op form avoids gathering, masking and reducing each block
  in separate passes over memory (measured 2.3x faster at batch 16, context 4096). The
  XLA-op decode path below runs on other platforms, when the library cannot be built,
  or with JAXINFER_NATIVE=0.
- Decode slots on the XLA-op path: with more than
  MAX_DOT_FORM_SLOTS slots it is written as multiply-and-reduce over [K, R, S, G, H]
  rather than as dots (a G-row dot per (head, request) runs 4-5x under XLA:CPU's dot
  peak); with one or two slots the dot form is faster. In jax 0.10.2 the reductions run
  as YNNPACK fusions over the gathered, masked copies (the gather is not fused into
  them), which is what the native call avoids.
- On CPU, slots with several new tokens run the native custom call of
  `pallas_kernels/cpu/prefill.py` / `prefill.cc` (without sliding windows and score caps):
  its work items keep each block's scores in registers, where the XLA-op form below writes
  scores, weights and masks between fusions (docs/design.md has the step times).
- Slots with several new tokens (prefill chunks, verify windows) run one after another,
  each in chunks of query rows up to its own query: each chunk scores its slot's new
  tokens causally up to itself, then that slot's cached blocks, so the work follows each
  slot's real tokens, not the bucket's padded rows nor the longest slot's (a chunked
  step's prompt tail beside the next prompt's head).
- The gather takes whole page rows (`jnp.take` on [pages, page_size * Hc], clipped:
  "fill" mode adds a select to every element).

Masked keys are dropped from the softmax and their V rows zeroed, so stale pages that
hold NaN never contribute (tested with NaN-poisoned pools like the other two). The block
loops have data-dependent trip counts: forward mode only (training differentiates through
`reference.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_codec
from pallas_kernels.cpu import decode as cpu_native
from pallas_kernels.cpu import prefill as cpu_prefill
from pallas_kernels.paged_attention import common, reference

_NEG = -1e30
# Tokens gathered per block over all decode slots: R=64 -> 8 pages of 16 tokens per slot,
# R=16 -> 32, R=4 -> 128 (measured on SmolLM2's shapes: below this the loop's per-block
# overhead dominates, above it the gathered block leaves the cache).
BLOCK_TOKENS = 8192
# Tokens per slot per block at most: with few slots a block of BLOCK_TOKENS would read
# far past a short context (the last block is read whole).
SLOT_BLOCK_TOKENS = 1024
# Up to this many decode slots dots beat multiply-and-reduce (measured: R=1 at 1024
# context 16.6 vs 21.9 ms over 30 layers; R=4: 47 vs 39 ms).
MAX_DOT_FORM_SLOTS = 2
# Prefill blocks: score elements [K, R, Q, G, block] per block at most, and tokens per
# slot per block at most (the block's scores stay in cache, and a short context does not
# pay for a long block; docs/design.md, "Prefill attention in XLA ops").
PREFILL_BLOCK_SCORES = 1 << 19
PREFILL_SLOT_BLOCK_TOKENS = 256
# Query rows of a prefill slot per chunk (prefill_attention).
PREFILL_QUERY_CHUNK = 128


def block_pages_for(num_slots: int, page_size: int, pages: int, rows_per_slot: int = 1) -> int:
  """Pages per slot per block: about BLOCK_TOKENS tokens over all slots (or
  PREFILL_BLOCK_SCORES scores when each slot has rows_per_slot query rows)."""
  per_slot = min(BLOCK_TOKENS // num_slots, SLOT_BLOCK_TOKENS)
  if rows_per_slot > 1:
    per_slot = min(per_slot, PREFILL_SLOT_BLOCK_TOKENS,
                   PREFILL_BLOCK_SCORES // (num_slots * rows_per_slot))
  return max(1, min(pages, per_slot // page_size))


def _blocks(page_table, cached_len, block_pages, page_size):
  """(padded page table, pages per block, tokens per block, dynamic number of blocks)."""
  B = max(1, min(block_pages, page_table.shape[1]))
  P = -(-page_table.shape[1] // B) * B
  pt = jnp.pad(page_table, ((0, 0), (0, P - page_table.shape[1])))
  block = B * page_size
  return pt, B, block, (jnp.max(cached_len) + block - 1) // block


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


def native_decode_supported(q_shape, num_kv_heads, page_size) -> bool:
  """Shapes the CPU custom call handles (pallas_kernels/cpu/decode.cc): head_dim a multiple
  of 8 up to 256, at most 16 query heads per KV head, pages of at most 64 tokens."""
  _, N, H = q_shape
  return H % 8 == 0 and H <= 256 and N // num_kv_heads <= 16 and page_size <= 64


def decode_attention(q, k_new, v_new, pool, layer, page_table, cached_len, *, scale,
                     block_pages=None, native=None, window=None, softcap=None):
  """One new token per slot. q [R, N, H], k_new / v_new [R, K, H] (the slot's own token,
  attended after its cached_len [R] cached tokens), page_table [R, P] -> [R, N, H] f32.

  On CPU this runs the native custom call (`cpu_native`: the pages read in place, once)
  when it is built and handles the shapes; `native=False` forces the XLA-op path below,
  which every other platform runs (window, softcap: see
  reference.ragged_paged_attention)."""
  if native is None:  # (nothing is built where the default backend is an accelerator)
    native = jax.default_backend() == "cpu" and cpu_native.available()
  elif native and not cpu_native.available():
    raise RuntimeError("native=True, but the CPU decode custom call is unavailable (the log "
                       "says why: JAXINFER_NATIVE=0, or its build "
                       "failed)")
  if native and native_decode_supported(q.shape, k_new.shape[1], pool["k"].shape[3]):
    w = () if window is None else (window,)  # a traced window enters as an argument

    def on_cpu(*args):
      return cpu_native.decode_attention(*args[:7], scale=scale, softcap=softcap,
                                         window=args[7] if w else None)

    def elsewhere(*args):
      return decode_attention(*args[:7], scale=scale, block_pages=block_pages, native=False,
                              window=args[7] if w else None, softcap=softcap)

    return jax.lax.platform_dependent(q, k_new, v_new, pool, layer, page_table, cached_len,
                                      *w, cpu=on_cpu, default=elsewhere)
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
  m = common.soft_cap(jnp.einsum("krgh,krh->krg", qr, kn), softcap)  # [K, R, G]
  l = jnp.ones_like(m)
  o = jnp.broadcast_to(vn[:, :, None, :], (K, R, G, H))

  if block_pages is None:
    block_pages = block_pages_for(R, ps, page_table.shape[1])
  pt, B, block, num_blocks = _blocks(page_table, cached_len, block_pages, ps)
  dots = R <= MAX_DOT_FORM_SLOTS

  def body(b, carry):
    m, l, o = carry
    pages = jax.lax.dynamic_slice_in_dim(pt, b * B, B, axis=1)  # [R, B]
    kc, vc = _gather_block(pool, fmt, layer, pages, cdt)  # [K, R, block, H]
    pos = b * block + jnp.arange(block, dtype=jnp.int32)
    valid = ((pos[None, :] < cached_len[:, None])  # the new token sits at cached_len
             & common.in_window(pos[None, :], cached_len[:, None], window))
    valid = valid[None, :, :, None]  # [1, R, block, 1]
    # Multiply-and-reduce, not a dot, past two slots: XLA:CPU fuses the page gather into
    # the reduction (no gathered copy is written), and a G-row dot per (head, request) is
    # slow there.
    if dots:
      s = jnp.einsum("krgh,krsh->krsg", qr, kc)
    else:
      s = jnp.sum(kc[:, :, :, None, :] * qr[:, :, None, :, :], axis=-1)  # [K, R, block, G]
    s = jnp.where(valid, common.soft_cap(s, softcap), _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=2))
    p = jnp.where(valid, jnp.exp(s - m_new[:, :, None, :]), 0.0)
    alpha = jnp.exp(m - m_new)
    vc = jnp.where(valid, vc, 0.0)  # stale pages may hold NaN
    if dots:
      pv = jnp.einsum("krsg,krsh->krgh", p, vc)
    else:
      pv = jnp.sum(p[..., None] * vc[:, :, :, None, :], axis=2)  # [K, R, G, H]
    return m_new, l * alpha + jnp.sum(p, axis=2), o * alpha[..., None] + pv

  m, l, o = jax.lax.fori_loop(0, num_blocks, body, (m, l, o))
  o = o / l[..., None]
  return o.transpose(1, 0, 2, 3).reshape(R, N, H)


def _online_softmax(carry, s, valid, v):
  """One block of keys into a running softmax (m, l, o) over [K, R, C, G] query rows:
  s [K, R, C, G, S] scores, valid broadcastable to them, v [K, R, S, H] (zero where no
  query reads it)."""
  m, l, o = carry
  s = jnp.where(valid, s, _NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  pv = jnp.einsum("krqgs,krsh->krqgh", p, v)
  return m_new, l * alpha + jnp.sum(p, axis=-1), o * alpha[..., None] + pv


def prefill_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                      cached_len, Q, scale, block_pages=None, window=None, softcap=None,
                      query_chunk=None, native=None):
  """Slots of up to Q new tokens each (as reference.attend_group), one slot at a time, in
  chunks of `query_chunk` query rows (default PREFILL_QUERY_CHUNK) up to the slot's own
  query_len: each chunk reads its slot's new tokens causally up to itself, then the
  slot's cached pages in blocks up to its own context, all in one online softmax. The work
  therefore follows each slot's real tokens, not the bucket's Q nor the longest slot's
  (a step's prompt tail and next prompt's head cost their own lengths). Returns (out
  [R, Q, N, H], flat token index [R, Q] or T where invalid).

  On CPU, without a window or a score cap, this runs the native custom call of
  `pallas_kernels/cpu/prefill.py` where it is built and handles the shapes (`native`:
  None or True = there, where available; False = these XLA ops)."""
  if native is None:
    native = jax.default_backend() == "cpu"
  if (native and window is None and not softcap and cpu_prefill.available()
      and cpu_prefill.supported(q.shape, k_new.shape[1], pool["k"].shape[3])):
    def on_cpu(*args):
      return cpu_prefill.prefill_attention(*args, Q=Q, scale=scale)

    def elsewhere(*args):
      return prefill_attention(*args, Q, scale, block_pages=block_pages,
                               query_chunk=query_chunk, native=False)

    return jax.lax.platform_dependent(q, k_new, v_new, pool, layer, page_table, query_start,
                                      query_len, cached_len, cpu=on_cpu, default=elsewhere)
  T, N, H = q.shape
  K = k_new.shape[1]
  G = N // K
  R = page_table.shape[0]
  ps = pool["k"].shape[3]
  cdt = jnp.float32
  qpos, qvalid, qr, kn, vn = reference.gather_queries(q, k_new, v_new, query_start,
                                                      query_len, Q, scale)
  C = min(Q, query_chunk or PREFILL_QUERY_CHUNK)
  Qc = -(-Q // C) * C
  if Qc > Q:  # whole chunks: the padded rows are invalid queries and keys
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Qc - Q), (0, 0), (0, 0)))
    kn, vn = (jnp.pad(x, ((0, 0), (0, 0), (0, Qc - Q), (0, 0))) for x in (kn, vn))
  if block_pages is None:
    block_pages = block_pages_for(1, ps, page_table.shape[1], rows_per_slot=C * G)
  pt, B, block, _ = _blocks(page_table, cached_len, block_pages, ps)
  args = (pool, layer, C, B, block, window, softcap)

  def slot(r, out):
    one = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, r, 1, axis)  # noqa: E731
    o = _slot_attention(one(qr, 1), one(kn, 1), one(vn, 1), one(pt, 0), one(query_len, 0),
                        one(cached_len, 0), *args)
    return jax.lax.dynamic_update_slice_in_dim(out, o, r, axis=1)

  out = jnp.zeros((K, R, Qc, G, H), cdt)
  out = slot(0, out) if R == 1 else jax.lax.fori_loop(0, R, slot, out)
  o = out[:, :, :Q].transpose(1, 2, 0, 3, 4).reshape(R, Q, N, H)
  flat = jnp.where(qvalid, query_start[:, None] + qpos[None, :], T)  # T = dropped
  return o, flat


def _slot_attention(qr, kn, vn, pt, query_len, cached_len, pool, layer, C, B, block, window,
                    softcap):
  """One slot's prefill attention: qr [K, 1, Qc, G, H], kn / vn [K, 1, Qc, H], its padded
  page table pt [1, P'] read B pages (`block` tokens) at a time -> [K, 1, Qc, G, H]; the
  loops' trip counts are this slot's chunks and cached blocks."""
  K, R, Qc, G, H = qr.shape
  fmt = kv_codec.get_format(kv_codec.pool_format(pool))
  cdt = jnp.float32
  num_blocks = (jnp.max(cached_len) + block - 1) // block
  qlen = query_len[:, None, None]  # [R, 1, 1]
  rows = jnp.arange(C, dtype=jnp.int32)

  def chunk(i, out):
    qi = jax.lax.dynamic_slice_in_dim(qr, i * C, C, axis=2)  # [K, R, C, G, H]
    qp = i * C + rows  # the chunk's positions among the slot's new tokens
    start = (jnp.full((K, R, C, G), _NEG, cdt), jnp.zeros((K, R, C, G), cdt),
             jnp.zeros((K, R, C, G, H), cdt))

    def new_keys(j, carry):  # the slot's own new tokens, causally
      kj = jax.lax.dynamic_slice_in_dim(kn, j * C, C, axis=2)  # [K, R, C, H]
      vj = jax.lax.dynamic_slice_in_dim(vn, j * C, C, axis=2)
      kp = j * C + rows
      valid = ((kp[None, None, :] <= qp[None, :, None]) & (kp[None, None, :] < qlen)
               & common.in_window(kp[None, None, :], qp[None, :, None], window))  # [R, C, C]
      s = common.soft_cap(jnp.einsum("krqgh,krsh->krqgs", qi, kj), softcap)
      return _online_softmax(carry, s, valid[None, :, :, None, :], vj)

    def cached_keys(b, carry):
      pages = jax.lax.dynamic_slice_in_dim(pt, b * B, B, axis=1)  # [R, B]
      kc, vc = _gather_block(pool, fmt, layer, pages, cdt)  # [K, R, block, H]
      pos = b * block + jnp.arange(block, dtype=jnp.int32)
      cached = pos[None, :] < cached_len[:, None]  # [R, block]
      qabs = cached_len[:, None] + qp[None, :]  # [R, C]
      valid = cached[:, None, :] & common.in_window(pos[None, None, :], qabs[:, :, None],
                                                    window)  # [R, C, block]
      # stale pages may hold NaN, and so may the page a released entry (behind the window)
      # reads: keys no query of the slot reads are zeroed
      read = cached & common.in_window(pos[None, :], cached_len[:, None], window)
      vc = jnp.where(read[None, :, :, None], vc, 0.0)
      s = common.soft_cap(jnp.einsum("krqgh,krsh->krqgs", qi, kc), softcap)
      return _online_softmax(carry, s, valid[None, :, :, None, :], vc)

    carry = jax.lax.fori_loop(0, i + 1, new_keys, start)
    _, l, o = jax.lax.fori_loop(0, num_blocks, cached_keys, carry)
    o = o / jnp.maximum(l, 1e-30)[..., None]
    return jax.lax.dynamic_update_slice_in_dim(out, o, i * C, axis=2)

  num_chunks = (jnp.max(query_len) + C - 1) // C
  return jax.lax.fori_loop(0, num_chunks, chunk, jnp.zeros((K, R, Qc, G, H), cdt))


def ragged_paged_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                           cached_len, *, max_query_len: int, num_prefill_slots=None,
                           sm_scale=None, q_precision: str = "compute",
                           block_pages=None, native=None, window=None, softcap=None):
  """q [T, N, H], k_new/v_new [T, K, H] -> out [T, N, H] float32; see reference.py.
  `native`: the decode slots' path (see decode_attention; None = the CPU custom call
  when it is available)."""
  T = q.shape[0]

  def group(qr, scale, Q, meta):
    pt, qs, ql, cl = meta
    if Q == 1:  # decode slots: one new token each
      qi = jnp.clip(qs, 0, T - 1)
      o = decode_attention(qr[qi], k_new[qi], v_new[qi], pool, layer, pt, cl, scale=scale,
                           block_pages=block_pages, native=native, window=window,
                           softcap=softcap)
      return o[:, None], jnp.where(ql == 1, qs, T)[:, None]  # T = dropped
    return prefill_attention(qr, k_new, v_new, pool, layer, pt, qs, ql, cl, Q, scale,
                             block_pages=block_pages, window=window, softcap=softcap,
                             native=native)

  return common.run_groups(q, k_new, v_new, pool, page_table, query_start, query_len,
                           cached_len, max_query_len=max_query_len,
                           num_prefill_slots=num_prefill_slots,
                           sm_scale=sm_scale, q_precision=q_precision, group=group)
