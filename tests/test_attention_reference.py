"""The jnp ragged paged attention against a dense per-request computation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import SMOLLM2_135M
from jaxinfer.kv import allocate_pool, write_tokens
from pallas_kernels.paged_attention.reference import ragged_paged_attention


def dense(q, k, v):
  """Causal attention of the last len(q) positions over k/v [S, K, H]."""
  S, K, H = k.shape
  n, N, _ = q.shape
  G = N // K
  out = np.zeros_like(q)
  for i in range(n):
    pos = S - n + i
    for h in range(N):
      s = k[:pos + 1, h // G] @ q[i, h] / np.sqrt(H)
      p = np.exp(s - s.max())
      out[i, h] = (p / p.sum()) @ v[:pos + 1, h // G]
  return out


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("prefill_slots", [None, 2])
def test_ragged_mix_with_nan_poisoned_pages(page_size, prefill_slots):
  """prefill_slots=2: slot 0 is a decode group, slots 1-2 the prefill group."""
  rng = np.random.default_rng()
  cfg = SMOLLM2_135M.replace(num_layers=1)
  num_pages = 24
  pool = allocate_pool(cfg, "f32", num_pages, page_size)
  pool = {k: jnp.full_like(a, jnp.nan) for k, a in pool.items()}  # stale data everywhere
  # Three requests: decode at context 9, a prefill chunk of 5 after 7 cached, fresh prompt of 6.
  reqs = [(9, 1), (7, 5), (0, 6)]
  perm = rng.permutation(num_pages)
  tables, off, full, writes = [], 0, [], []
  T = sum(n for _, n in reqs) + 3  # padding tokens at the end
  q = rng.standard_normal((T, 9, 64)).astype(np.float32)
  kn = rng.standard_normal((T, 3, 64)).astype(np.float32)
  vn = rng.standard_normal((T, 3, 64)).astype(np.float32)
  for cached, n in reqs:
    npages = -(-(cached + n) // page_size)
    pt = perm[off:off + npages]
    off += npages
    kc = rng.standard_normal((1, cached, 3, 64)).astype(np.float32)
    vc = rng.standard_normal((1, cached, 3, 64)).astype(np.float32)
    pos = np.arange(cached)
    writes.append((kc, vc, pt[pos // page_size], pos % page_size))
    tables.append(np.pad(pt, (0, 4 - len(pt))))
    full.append((kc[0], vc[0]))
  pool = jax.jit(write_tokens)(pool, *(np.concatenate(parts, axis=1 if i < 2 else 0)
                                       .astype(np.float32 if i < 2 else np.int32)
                                       for i, parts in enumerate(zip(*writes))))
  page_table = np.stack(tables).astype(np.int32)
  query_len = np.array([n for _, n in reqs], np.int32)
  query_start = np.concatenate([[0], np.cumsum(query_len)[:-1]]).astype(np.int32)
  cached_len = np.array([c for c, _ in reqs], np.int32)
  attend = jax.jit(functools.partial(ragged_paged_attention, max_query_len=8,
                                     num_prefill_slots=prefill_slots))  # eagerly: 400 compiles
  out = np.asarray(attend(q, kn, vn, pool, 0, page_table, query_start, query_len, cached_len))
  assert np.isfinite(out).all()
  for r, (cached, n) in enumerate(reqs):
    s = query_start[r]
    k = np.concatenate([full[r][0], kn[s:s + n]])
    v = np.concatenate([full[r][1], vn[s:s + n]])
    np.testing.assert_allclose(out[s:s + n], dense(q[s:s + n], k, v), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out[query_len.sum():], 0.0)


@pytest.mark.parametrize("backend", ["reference", "xla", "kernel"])
def test_backends_share_input_validation(backend):
  """The three backends reject the same malformed calls before any work, naming the
  argument, the value and the limit (common.validate_static / validate_values)."""
  import importlib
  fn = importlib.import_module(f"pallas_kernels.paged_attention.{backend}").ragged_paged_attention
  cfg = SMOLLM2_135M.replace(num_layers=1)
  pool = allocate_pool(cfg, "f32", 8, 4)
  T = 6
  q, kn = jnp.zeros((T, 9, 64)), jnp.zeros((T, 3, 64))
  ok = dict(page_table=np.array([[0, 1], [2, 3]], np.int32),
            query_start=np.array([0, 1], np.int32), query_len=np.array([1, 5], np.int32),
            cached_len=np.array([3, 2], np.int32))

  def call(q=q, k=kn, max_query_len=5, num_prefill_slots=1, **meta):
    m = dict(ok, **meta)
    return fn(q, k, kn, pool, 0, m["page_table"], m["query_start"], m["query_len"],
              m["cached_len"], max_query_len=max_query_len, num_prefill_slots=num_prefill_slots)

  assert call().shape == (T, 9, 64)
  bad = [(dict(q=jnp.zeros((T, 8, 64))), "multiple of KV heads"),
         (dict(k=jnp.zeros((T, 3, 32))), "k_new must be"),
         (dict(query_len=np.array([1, 5, 0], np.int32)), "query_len must be [R=2]"),
         (dict(cached_len=np.array([3.0, 2.0], np.float32)), "cached_len must hold integers"),
         (dict(num_prefill_slots=3), "num_prefill_slots must be an integer in [0, 2]"),
         (dict(max_query_len=0), "max_query_len must be an integer >= 1"),
         (dict(query_len=np.array([2, 4], np.int32)), "query_len of request slot 0 is 2"),
         (dict(query_len=np.array([1, 6], np.int32), max_query_len=6),
          "query_start of request slot 1 is 1"),
         (dict(cached_len=np.array([3, 4], np.int32)), "cached_len + query_len of request "
          "slot 1 is 9: must be <= the page table's 2 pages x 4 tokens"),
         (dict(page_table=np.array([[0, 1], [2, 8]], np.int32)), "page_table of request slot 1")]
  for kw, msg in bad:
    with pytest.raises(ValueError) as e:
      call(**kw)
    assert msg in str(e.value), (kw, str(e.value))
