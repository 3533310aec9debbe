"""Ragged paged attention as a Pallas kernel (Triton backend on NVIDIA GPUs; interpret
mode on CPU). Same arguments and semantics as `reference.py`.

Grid (KV head, request slot, split): each program takes one request's queries for one
KV head — its G query heads x up to Q new tokens, padded to a power of two >= 16 rows
(Triton's dot minimum) — and walks its share of the request's pages with an online
softmax; the last split also attends causally to the step's own new tokens. Splits
(split-K over pages, for long contexts) are merged outside with their (max, sum).

KV formats are dequantized in the kernel from the byte layout of `kv_codec`: the head
dim is processed in column chunks — the whole head for f32 / bf16 / fp8, one 32-value
group for q8_0, one half group (one nibble plane) for q4_0 — each chunk loaded with ref
slices, scaled, and fed to its own dots, so no value slicing, gathers or concatenation
reach Triton. Masked keys are dropped from the softmax and their V rows zeroed, so stale
pages holding NaN never contribute.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import kv_codec
from pallas_kernels.paged_attention import common

# jax 0.10 moved pl.dot to the Triton module (plgpu.dot), where 0.11 keeps it.
_dot = plgpu.dot

_NEG = -1e30


def _pow2(n: int, lo: int = 1) -> int:
  return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _chunks(fmt: kv_codec.KVFormat, H: int):
  """(first column, width, code column, group index, nibble shift) per column chunk."""
  if fmt.name == "q8_0":
    return [(g * 32, 32, g * 32, g, None) for g in range(H // 32)]
  if fmt.name == "q4_0":
    return [(g * 32 + 16 * h, 16, g * 16, g, 4 * h) for g in range(H // 32) for h in (0, 1)]
  return [(0, H, 0, None, None)]


def _load_chunk(fmt, refs, name, layer, kvh, page_ids, chunk, page_size):
  """Dequantized K or V columns of one chunk for a block of pages: [PB * page, width]."""
  col, width, code_col, group, shift = chunk
  codes_ref = refs[name]
  PB = page_ids.shape[0]
  if fmt.name == "q4_0":
    b = codes_ref[layer, kvh, page_ids, :, pl.ds(code_col, 16)]  # [PB, page, 16] uint8
    x = ((b >> shift) & 0xF).astype(jnp.float32) - 8.0
  elif fmt.name == "q8_0":
    x = codes_ref[layer, kvh, page_ids, :, pl.ds(code_col, width)].astype(jnp.float32)
  else:
    x = codes_ref[layer, kvh, page_ids]  # [PB, page, H]
    x = kv_codec.decode(fmt, x, None) if fmt.name != "fp8" else \
        kv_codec.bits_to_fp8(x).astype(jnp.float32)
  if fmt.group_scales:
    sc = refs[name + "_gs"][layer, kvh, page_ids, :, group]  # [PB, page] uint16
    x = x * kv_codec.bits_to_f16(sc).astype(jnp.float32)[:, :, None]
  elif fmt.page_scales:
    sc = refs[name + "_ps"][layer, kvh, page_ids]  # [PB]
    x = x * sc[:, None, None]
  return x.reshape(PB * page_size, width)


def _kernel(meta_ref, layer_ref, pt_ref, q_ref, kn_ref, vn_ref, *rest, fmt, names, G,
            page_size, pages_per_block, pages_per_split, num_splits, windowed, softcap):
  n_in = len(names)
  refs = dict(zip(names, rest[:n_in]))
  o_ref, m_ref, l_ref = rest[n_in:]
  kvh, split = pl.program_id(0), pl.program_id(2)
  cached, qlen, window = meta_ref[0], meta_ref[1], meta_ref[2]
  layer = layer_ref[0]
  RB, H = q_ref.shape
  QB = kn_ref.shape[0]
  chunks = _chunks(fmt, H)
  qs = [q_ref[:, pl.ds(c[0], c[1])].astype(jnp.float32) for c in chunks]
  rows = jnp.arange(RB, dtype=jnp.int32)
  row_ok = rows < qlen * G
  qpos = cached + rows // G  # each row's query position

  def update(carry, logits, mask, vs):
    m_prev, l_prev, accs = carry
    if softcap is not None:  # Gemma 2's score cap: cap * tanh(s / cap)
      logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(mask, logits, _NEG)
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1))
    corr = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = corr * l_prev + jnp.sum(p, axis=-1)
    accs = [a * corr[:, None] + _dot(p, v) for a, v in zip(accs, vs)]
    return m_next, l_next, accs

  BK = pages_per_block * page_size
  n_pages = (cached + page_size - 1) // page_size
  first = split * pages_per_split
  last = jnp.minimum(first + pages_per_split, n_pages)
  if windowed:  # a sliding window: start at the block holding the first query's first
    # key (pages wholly behind it may be released and reused); blocks stay aligned to the
    # split's, so none reaches into the next split's pages
    lo = jnp.maximum(cached - window + 1, 0) // page_size
    first = jnp.maximum(first, first + (lo - first) // pages_per_block * pages_per_block)
  n_blocks = jnp.maximum(last - first + pages_per_block - 1, 0) // pages_per_block

  def body(i, carry):
    p0 = first + i * pages_per_block
    page_ids = pt_ref[pl.ds(p0, pages_per_block)]
    pos = p0 * page_size + jnp.arange(BK, dtype=jnp.int32)
    key_ok = pos < cached
    if windowed:  # keys behind every row's window hold stale data: V zeroed as well
      key_ok &= pos > cached - window
    logits = jnp.zeros((RB, BK), jnp.float32)
    for q, c in zip(qs, chunks):
      k = _load_chunk(fmt, refs, "k", layer, kvh, page_ids, c, page_size)
      logits += _dot(q, k, trans_b=True)
    vs = [jnp.where(key_ok[:, None],
                    _load_chunk(fmt, refs, "v", layer, kvh, page_ids, c, page_size), 0.0)
          for c in chunks]
    mask = row_ok[:, None] & key_ok[None, :]
    if windowed:
      mask &= pos[None, :] > qpos[:, None] - window
    return update(carry, logits, mask, vs)

  carry = (jnp.full((RB,), _NEG, jnp.float32), jnp.zeros((RB,), jnp.float32),
           [jnp.zeros((RB, c[1]), jnp.float32) for c in chunks])
  carry = jax.lax.fori_loop(0, n_blocks, body, carry)

  # The step's own tokens, causally, once (in the last split).
  last_split = split == num_splits - 1
  j = jnp.arange(QB, dtype=jnp.int32)
  mask = (row_ok & last_split)[:, None] & (j[None, :] <= (rows // G)[:, None]) & (
      j[None, :] < qlen)
  if windowed:
    mask &= (cached + j)[None, :] > qpos[:, None] - window
  logits = jnp.zeros((RB, QB), jnp.float32)
  vs = []
  for q, c in zip(qs, chunks):
    logits += _dot(q, kn_ref[:, pl.ds(c[0], c[1])].astype(jnp.float32), trans_b=True)
    vs.append(jnp.where((j < qlen)[:, None], vn_ref[:, pl.ds(c[0], c[1])].astype(jnp.float32),
                        0.0))
  m, l, accs = update(carry, logits, mask, vs)
  for a, c in zip(accs, chunks):
    o_ref[:, pl.ds(c[0], c[1])] = a
  m_ref[...] = m
  l_ref[...] = l


def _group(q, k_new, v_new, pool, layer, page_table, query_start, query_len, cached_len, Q,
           scale, fmt, pages_per_block, num_splits, interpret, num_warps, num_stages,
           window=None, softcap=None):
  """One group of request slots with up to Q new tokens each -> (out [R, Q, N, H], flat)."""
  T, N, H = q.shape
  K = k_new.shape[1]
  G = N // K
  R, Pmax = page_table.shape
  page_size = pool["k"].shape[3]
  qpos = jnp.arange(Q, dtype=jnp.int32)
  qidx = jnp.clip(query_start[:, None] + qpos[None, :], 0, T - 1)  # [R, Q]
  qvalid = qpos[None, :] < query_len[:, None]
  RB, QB = _pow2(Q * G, 16), _pow2(Q, 16)
  qg = (q[qidx].astype(jnp.float32) * scale).reshape(R, Q, K, G, H).transpose(2, 0, 1, 3, 4)
  qg = jnp.pad(qg.reshape(K, R, Q * G, H), ((0, 0), (0, 0), (0, RB - Q * G), (0, 0)))
  kn = jnp.pad(k_new[qidx].transpose(2, 0, 1, 3), ((0, 0), (0, 0), (0, QB - Q), (0, 0)))
  vn = jnp.pad(v_new[qidx].transpose(2, 0, 1, 3), ((0, 0), (0, 0), (0, QB - Q), (0, 0)))
  pb = min(pages_per_block, _pow2(Pmax))
  per_split = -(-Pmax // num_splits)
  per_split = -(-per_split // pb) * pb
  P_pad = _pow2(per_split * num_splits)
  pt = jnp.pad(page_table, ((0, 0), (0, P_pad - Pmax)))
  win = jnp.zeros_like(cached_len) if window is None else \
      jnp.broadcast_to(jnp.asarray(window, jnp.int32), cached_len.shape)  # a traced window
  meta = jnp.stack([cached_len, query_len, win, jnp.zeros_like(cached_len)],
                   axis=1).astype(jnp.int32)  # [R, 4]
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  names = sorted(pool)
  whole = lambda a: pl.BlockSpec(a.shape, lambda k, r, s, n=a.ndim: (0,) * n)  # noqa: E731
  kernel = functools.partial(_kernel, fmt=fmt, names=names, G=G, page_size=page_size,
                             pages_per_block=pb, pages_per_split=per_split,
                             num_splits=num_splits, windowed=window is not None,
                             softcap=None if softcap is None else float(softcap))
  kw = {}
  if not interpret:
    kw["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  o, m, l = pl.pallas_call(
      kernel, grid=(K, R, num_splits),
      in_specs=[pl.BlockSpec((None, 4), lambda k, r, s: (r, 0)),
                pl.BlockSpec((1,), lambda k, r, s: (0,)),
                pl.BlockSpec((None, P_pad), lambda k, r, s: (r, 0)),
                pl.BlockSpec((None, None, RB, H), lambda k, r, s: (k, r, 0, 0)),
                pl.BlockSpec((None, None, QB, H), lambda k, r, s: (k, r, 0, 0)),
                pl.BlockSpec((None, None, QB, H), lambda k, r, s: (k, r, 0, 0))] +
               [whole(pool[n]) for n in names],
      out_specs=[pl.BlockSpec((None, None, None, RB, H), lambda k, r, s: (s, k, r, 0, 0)),
                 pl.BlockSpec((None, None, None, RB), lambda k, r, s: (s, k, r, 0)),
                 pl.BlockSpec((None, None, None, RB), lambda k, r, s: (s, k, r, 0))],
      out_shape=[jax.ShapeDtypeStruct((num_splits, K, R, RB, H), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, K, R, RB), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, K, R, RB), jnp.float32)],
      interpret=interpret, name=f"ragged_paged_attention_{fmt.name}_q{Q}", **kw,
  )(meta, layer_arr, pt, qg, kn, vn, *[pool[n] for n in names])
  # Merge the splits (flash-decoding's final reduction).
  m_all = jnp.max(m, axis=0)
  w = jnp.exp(m - m_all[None])
  denom = jnp.sum(l * w, axis=0)
  o = jnp.sum(o * w[..., None], axis=0) / jnp.maximum(denom, 1e-30)[..., None]  # [K,R,RB,H]
  o = o[:, :, :Q * G].reshape(K, R, Q, G, H).transpose(1, 2, 0, 3, 4).reshape(R, Q, N, H)
  flat = jnp.where(qvalid, query_start[:, None] + qpos[None, :], T)
  return o, flat


def ragged_paged_attention(q, k_new, v_new, pool, layer, page_table, query_start, query_len,
                           cached_len, *, max_query_len: int, num_prefill_slots=None,
                           sm_scale=None, pages_per_block: int = 8, num_splits: int = 1,
                           q_precision: str = "compute", interpret=None, num_warps: int = 4,
                           num_stages: int = 2, window=None, softcap=None):
  """See reference.ragged_paged_attention (window: an int32 scalar, may be traced; a
  slot starts at the page of its first query's first key in the window; softcap: static).
  interpret: None = interpret unless on a GPU."""
  for name, v in (("pages_per_block", pages_per_block), ("num_splits", num_splits)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  def group(qr, scale, Q, meta):  # called after run_groups validated the pool
    fmt = kv_codec.get_format(kv_codec.pool_format(pool))
    return _group(qr, k_new, v_new, pool, layer, *meta, Q, scale, fmt, pages_per_block,
                  num_splits, interpret, num_warps, num_stages, window, softcap)

  return common.run_groups(q, k_new, v_new, pool, page_table, query_start, query_len,
                           cached_len, max_query_len=max_query_len,
                           num_prefill_slots=num_prefill_slots,
                           sm_scale=sm_scale, q_precision=q_precision, group=group)
