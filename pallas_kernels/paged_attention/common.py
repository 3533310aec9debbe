"""What the three ragged paged attention backends share (reference, xla, kernel).

- `validate_static`: shapes, dtypes and static options, checked while tracing (free at
  run time); every error names the argument, its value and the limit.
- `validate_values`: the metadata's values (page ids inside the pool, query rows inside
  the packed tokens, contexts inside the page tables, one token per decode slot), checked
  when the arrays are concrete (an eager call, a test); skipped under jit.
- `run_groups`: the wrapper every backend had written out: Q rounding, the softmax
  scale, the split of the request slots into the decode group (one new token each) and
  the prefill group (up to max_query_len each), and the scatter of each group's rows
  back to the flat token order (padding tokens stay zero).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_codec


def validate_static(q, k_new, v_new, pool, page_table, query_start, query_len, cached_len, *,
                    max_query_len, num_prefill_slots, q_precision: str = "compute") -> int:
  """Raise ValueError on a malformed call; returns the number of prefill slots."""
  if q.ndim != 3:
    raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
  T, N, H = q.shape
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.ndim != 3 or x.shape[0] != T or x.shape[2] != H:
      raise ValueError(f"{name} must be [T={T}, K, H={H}], got shape {x.shape}")
  K = k_new.shape[1]
  if v_new.shape != k_new.shape:
    raise ValueError(f"v_new shape {v_new.shape} differs from k_new's {k_new.shape}")
  if K < 1 or N % K:
    raise ValueError(f"query heads ({N}) must be a multiple of KV heads ({K})")
  if "k" not in pool or "v" not in pool:
    raise ValueError(f"pool must hold 'k' and 'v' arrays, got keys {sorted(pool)}")
  if pool["k"].ndim != 5 or pool["k"].shape[1] != K:
    raise ValueError(f"pool['k'] must be [L, K={K}, pages, page_size, Hc], "
                     f"got shape {pool['k'].shape}")
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be [R, pages], got shape {page_table.shape}")
  R = page_table.shape[0]
  for name, x in (("page_table", page_table), ("query_start", query_start),
                  ("query_len", query_len), ("cached_len", cached_len)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
    if name != "page_table" and x.shape != (R,):
      raise ValueError(f"{name} must be [R={R}], got shape {x.shape}")
  if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) \
      or max_query_len < 1:
    raise ValueError(f"max_query_len must be an integer >= 1, got {max_query_len!r}")
  Rp = R if num_prefill_slots is None else num_prefill_slots
  if isinstance(Rp, bool) or not isinstance(Rp, int) or not 0 <= Rp <= R:
    raise ValueError(f"num_prefill_slots must be an integer in [0, {R}], "
                     f"got {num_prefill_slots!r}")
  if q_precision not in kv_codec.Q_PRECISIONS:
    raise ValueError(f"q_precision must be one of {kv_codec.Q_PRECISIONS}, "
                     f"got {q_precision!r}")
  return Rp


def _concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def validate_values(q, pool, page_table, query_start, query_len, cached_len, *,
                    max_query_len: int, num_prefill_slots: int) -> None:
  """Raise ValueError when the metadata points outside what the arrays hold. A no-op
  while tracing (the values are unknown then)."""
  if not _concrete(page_table, query_start, query_len, cached_len):
    return
  T = q.shape[0]
  num_pages, page_size = pool["k"].shape[2], pool["k"].shape[3]
  pt, qs, ql, cl = (np.asarray(x) for x in (page_table, query_start, query_len, cached_len))
  R, P = pt.shape
  Rd = R - num_prefill_slots
  limit = np.where(np.arange(R) < Rd, 1, max_query_len)
  used = np.arange(P)[None, :] * page_size < (cl + ql)[:, None]  # pages holding context
  for name, bad, what in (
      ("query_len", (ql < 0) | (ql > limit), "in [0, 1] for decode slots, "
       f"[0, {max_query_len}] for prefill slots"),
      ("cached_len", cl < 0, ">= 0"),
      ("query_start", (ql > 0) & ((qs < 0) | (qs + ql > T)), f"with query_len inside [0, {T}]"),
      ("cached_len + query_len", (ql > 0) & (cl + ql > P * page_size),
       f"<= the page table's {P} pages x {page_size} tokens"),
      ("page_table", (((pt < 0) | (pt >= num_pages)) & used).any(axis=1),
       f"page ids in [0, {num_pages}) where it holds the context")):
    if bad.any():
      r = int(np.argmax(bad))
      got = {"query_len": ql[r], "cached_len": cl[r], "query_start": qs[r],
             "cached_len + query_len": cl[r] + ql[r], "page_table": pt[r].tolist()}[name]
      raise ValueError(f"{name} of request slot {r} is {got}: must be {what}")


def run_groups(q, k_new, v_new, pool, page_table, query_start, query_len, cached_len, *,
               max_query_len, num_prefill_slots, sm_scale: Optional[float], q_precision: str,
               group: Callable) -> jax.Array:
  """out [T, N, H] float32, the inputs validated first. `group(q, scale, Q,
  (page_table, query_start, query_len, cached_len) of those slots)` returns (rows
  [R', Q, N, H], flat token index [R', Q], T where a row is not a real token) for one
  group of slots holding up to Q new tokens each."""
  Rp = validate_static(q, k_new, v_new, pool, page_table, query_start, query_len, cached_len,
                       max_query_len=max_query_len, num_prefill_slots=num_prefill_slots,
                       q_precision=q_precision)
  validate_values(q, pool, page_table, query_start, query_len, cached_len,
                  max_query_len=max_query_len, num_prefill_slots=Rp)
  T, N, H = q.shape
  R = page_table.shape[0]
  q = kv_codec.round_q(kv_codec.get_format(kv_codec.pool_format(pool)), q, q_precision)
  scale = (1.0 / H**0.5) if sm_scale is None else sm_scale
  meta = (page_table, query_start, query_len, cached_len)
  out = jnp.zeros((T, N, H), jnp.float32)
  for sl, Q in ((slice(0, R - Rp), 1), (slice(R - Rp, R), max_query_len)):
    if sl.stop > sl.start:
      o, flat = group(q, scale, Q, tuple(a[sl] for a in meta))
      out = place_rows(out, o, flat)
  return out


def in_window(key_pos, query_pos, window):
  """Whether a key at `key_pos` is among the last `window` positions up to a query at
  `query_pos` (sliding-window attention: key > query - window); window None: always."""
  if window is None:
    return True
  return key_pos > query_pos - window


def soft_cap(s, cap: Optional[float]):
  """Attention scores capped smoothly at +-cap (Gemma 2: cap * tanh(s / cap))."""
  return s if cap is None else cap * jnp.tanh(s / cap)


def place_rows(out, rows, flat):
  """out [T, N, H] with token flat[r, j] taking rows[r, j] (flat = T: no token), where
  each row r of `flat` is a run of consecutive tokens (query_start + j for j < its
  query_len, then T), as every group's is. A gather: each token finds the slot whose run
  holds it ([T, R'] comparisons) and reads its row. XLA:CPU's loop emitter ran the
  scatter this replaces one update at a time, five small ops per token in every layer:
  8.6 ms of a batch-64 decode step and about 150 ms of a 512-token prefill (2026-12-02)."""
  T = out.shape[0]
  Rg, Q = flat.shape
  start = flat[:, 0]
  count = jnp.sum(flat < T, axis=1)
  t = jnp.arange(T, dtype=flat.dtype)[:, None]
  holds = (t >= start[None, :]) & (t < (start + count)[None, :])  # [T, R']
  slot = jnp.sum(jnp.where(holds, jnp.arange(Rg, dtype=flat.dtype)[None, :], 0), axis=1)
  src = slot * Q + jnp.clip(t[:, 0] - start[slot], 0, Q - 1)
  got = rows.reshape(Rg * Q, *rows.shape[2:])[src]
  return jnp.where(jnp.any(holds, axis=1)[:, None, None], got, out)
