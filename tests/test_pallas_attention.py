"""The Pallas ragged paged attention kernel against its jnp reference (interpret mode),
over KV formats x page sizes x GQA ratios x head dims x prefill/decode mixes, with
NaN-poisoned stale pages; and every variant lowered to Triton IR for CUDA."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import SMOLLM2_135M
from jaxinfer.kv import allocate_pool, write_tokens
from pallas_kernels.paged_attention import kernel, reference

FORMATS = ["f32", "bf16", "fp8", "q8_0", "q4_0"]


@functools.lru_cache(maxsize=None)
def _jitted_reference(static):
  return jax.jit(functools.partial(reference.ragged_paged_attention, **dict(static)))


def ref_attention(*args, **static):
  """The jnp reference (the oracle), jitted with its keyword arguments static: run eagerly
  its per-slot ops dispatch one by one, 6 s a case against 0.9 s jitted (same outputs to
  3e-8)."""
  return np.asarray(_jitted_reference(tuple(sorted(static.items())))(*args))


_write_tokens = jax.jit(write_tokens)

# NaN bit patterns per pool component dtype (stale data that must never be read).
_NAN = {jnp.float32: np.nan, jnp.uint16: 0x7FC0, jnp.uint8: 0x7F, jnp.int8: 0x7F}


def poisoned_pool(cfg, fmt, num_pages, page_size):
  pool = allocate_pool(cfg, fmt, num_pages, page_size)
  out = {}
  for name, a in pool.items():
    fill = np.nan if a.dtype == jnp.float32 else _NAN.get(a.dtype.type, 0)
    if name.endswith("_gs"):
      fill = 0x7E00  # fp16 NaN scale
    out[name] = jnp.full_like(a, fill)
  return out


def make_case(rng, fmt, page_size, heads, kv_heads, head_dim, reqs, layers=2):
  """reqs: (cached, new) per slot; decode slots (new == 1) first."""
  cfg = SMOLLM2_135M.replace(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim)
  pmax = max(-(-(c + n) // page_size) for c, n in reqs)
  num_pages = sum(-(-(c + n) // page_size) for c, n in reqs) + 3
  pool = poisoned_pool(cfg, fmt, num_pages, page_size)
  perm = rng.permutation(num_pages)
  off, tables = 0, []
  T = sum(n for _, n in reqs) + 2
  q = rng.standard_normal((T, heads, head_dim)).astype(np.float32)
  kn = rng.standard_normal((T, kv_heads, head_dim)).astype(np.float32)
  vn = rng.standard_normal((T, kv_heads, head_dim)).astype(np.float32)
  ks, vs, pages, offsets = [], [], [], []
  for cached, n in reqs:
    npg = -(-(cached + n) // page_size)
    pt = perm[off:off + npg]
    off += npg
    if cached:
      ks.append(rng.standard_normal((layers, cached, kv_heads, head_dim)).astype(np.float32))
      vs.append(rng.standard_normal((layers, cached, kv_heads, head_dim)).astype(np.float32))
      pos = np.arange(cached)
      pages.append(pt[pos // page_size])
      offsets.append(pos % page_size)
    tables.append(np.pad(pt, (0, pmax - len(pt)), constant_values=perm[-1]))  # stale page
  if ks:  # every request's cached tokens in one jitted write (eagerly: ~80 op compiles)
    pool = _write_tokens(pool, np.concatenate(ks, 1), np.concatenate(vs, 1),
                         np.concatenate(pages).astype(np.int32),
                         np.concatenate(offsets).astype(np.int32))
  ql = np.array([n for _, n in reqs], np.int32)
  qs = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int32)
  cl = np.array([c for c, _ in reqs], np.int32)
  return (q, kn, vn, pool, 1, np.stack(tables).astype(np.int32), qs, ql, cl)


MIXES = [[(37, 1), (5, 1), (0, 1)],  # decode only
         [(20, 1), (9, 7), (0, 12)],  # decodes + a prefill chunk + a fresh prompt
         [(0, 16)]]  # one prompt


# Every format, page size and GQA ratio appears, each format with two of the others
# (interpret mode costs ~15 s a case on 2 cores: the full 45-case product took 10 of the
# suite's minutes). JAXINFER_FULL_KERNEL_GRID=1 runs the whole product.
_ALL = [(f, p, h, k) for f in FORMATS for p in (8, 16, 64) for h, k in ((9, 3), (4, 4), (8, 1))]
_COVER = [("f32", 8, 9, 3), ("f32", 64, 8, 1), ("bf16", 16, 4, 4), ("bf16", 64, 9, 3),
          ("fp8", 8, 8, 1), ("fp8", 64, 4, 4), ("q8_0", 16, 9, 3), ("q4_0", 16, 8, 1),
          ("q4_0", 8, 4, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,page_size,heads,kv_heads",
                         _ALL if os.environ.get("JAXINFER_FULL_KERNEL_GRID") else _COVER)
def test_kernel_matches_reference(fmt, page_size, heads, kv_heads):
  rng = np.random.default_rng()
  for reqs in MIXES:
    args = make_case(rng, fmt, page_size, heads, kv_heads, 64, reqs)
    n_pre = sum(n > 1 for _, n in reqs)
    Q = max(n for _, n in reqs)
    ref = ref_attention(*args, max_query_len=Q, num_prefill_slots=n_pre)
    out = kernel.ragged_paged_attention(*args, max_query_len=Q, num_prefill_slots=n_pre,
                                        pages_per_block=2, num_splits=2, interpret=True)
    ref, out = np.asarray(ref), np.asarray(out)
    assert np.isfinite(out).all(), "a stale NaN page leaked into the output"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-5, (fmt, reqs, err)  # same quantized data on both sides


@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.slow), "q8_0"])
def test_head_dim_128_and_q_precision(fmt):
  rng = np.random.default_rng()
  args = make_case(rng, fmt, 16, 8, 2, 128, [(30, 1), (12, 9)])
  for qp in ("compute", "kv"):
    ref = ref_attention(*args, max_query_len=9, num_prefill_slots=1, q_precision=qp)
    out = kernel.ragged_paged_attention(*args, max_query_len=9, num_prefill_slots=1,
                                        q_precision=qp, interpret=True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)
  a = ref_attention(*args, max_query_len=9, num_prefill_slots=1)
  b = ref_attention(*args, max_query_len=9, num_prefill_slots=1, q_precision="kv")
  assert not np.allclose(a, b)  # the Q rounding is real (ref_attention returns numpy)


def _abstract_args(cfg, fmt, page_size, T=32, R=4, pmax=8):
  pool = jax.eval_shape(lambda: allocate_pool(cfg, fmt, 64, page_size))
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  s = jax.ShapeDtypeStruct
  return (s((T, N, H), jnp.bfloat16), s((T, K, H), jnp.bfloat16), s((T, K, H), jnp.bfloat16),
          pool, s((), jnp.int32), s((R, pmax), jnp.int32), s((R,), jnp.int32),
          s((R,), jnp.int32), s((R,), jnp.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 32, 8)])
@pytest.mark.parametrize("shape", [(1, 0), (16, 1)])
def test_every_variant_lowers_to_triton(fmt, head_dim, heads, kv_heads, shape):
  """Constructs that interpret mode accepts but Triton rejects fail here, without a GPU."""
  cfg = SMOLLM2_135M.replace(num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim)
  for page_size in (8, 64):
    f = functools.partial(kernel.ragged_paged_attention, max_query_len=shape[0],
                          num_prefill_slots=shape[1], interpret=False, num_splits=2)
    lowered = jax.jit(f).trace(*_abstract_args(cfg, fmt, page_size)).lower(
        lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_sliding_window_and_score_cap_match_reference(fmt):
  """A sliding window (traced, as a mixed layer scan passes it) and a score cap: the kernel
  starts each slot at the page of its first query's first key in the window and masks
  per row, equal to the reference; the pages wholly behind the window are poisoned (as a
  released and reused page may be) and never read; a window longer than the context (a
  global layer in a mixed scan) is full attention."""
  rng = np.random.default_rng(0)
  reqs = [(45, 1), (3, 1), (30, 9)]
  args = make_case(rng, fmt, 8, 8, 2, 64, reqs)
  q, kn, vn, pool, layer, pt, qs, ql, cl = args
  window = 12
  poison = {n: a for n, a in pool.items()}
  for r, (cached, _) in enumerate(reqs):  # pages wholly behind the first query's window
    for p in range(max(cached - window + 1, 0) // 8):
      poison = {n: a.at[:, :, int(pt[r, p])].set(jnp.full_like(a[:, :, 0], np.nan)
                                                 if a.dtype == jnp.float32 else a[:, :, 0])
                for n, a in poison.items()}
  if fmt == "f32":
    args = (q, kn, vn, poison, layer, pt, qs, ql, cl)
  clean = (q, kn, vn, pool, layer, pt, qs, ql, cl)

  def run(impl, a, w, cap, **kw):
    return np.asarray(jax.jit(lambda w, *a: impl(
        *a, max_query_len=9, num_prefill_slots=1, window=w, softcap=cap, **kw))(
        jnp.int32(w), *a))

  outs = {}
  for w, cap in ((window, 30.0), (window, None), (1 << 20, 5.0)):
    ref = run(reference.ragged_paged_attention, clean, w, cap)
    out = run(kernel.ragged_paged_attention, args if w == window else clean, w, cap,
              pages_per_block=2, num_splits=2, interpret=True)
    assert np.isfinite(out).all(), "a page behind the window was read"
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    outs[w, cap] = out
  full = ref_attention(*clean, max_query_len=9, num_prefill_slots=1)
  assert not np.allclose(full, outs[window, None])  # the window is real
  assert not np.allclose(outs[window, 30.0], outs[window, None])  # and so is the cap


def test_windowed_capped_variant_lowers_to_triton():
  cfg = SMOLLM2_135M.replace(num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)
  f = functools.partial(kernel.ragged_paged_attention, max_query_len=16, num_prefill_slots=1,
                        interpret=False, num_splits=2, softcap=50.0)
  lowered = jax.jit(lambda w, *a: f(*a, window=w)).trace(
      jax.ShapeDtypeStruct((), jnp.int32), *_abstract_args(cfg, "bf16", 16)).lower(
      lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
