"""The XLA:CPU attention backend (pallas_kernels/paged_attention/xla.py) against the jnp
reference, on NaN-poisoned pools: every KV format, GQA ratios, page sizes, decode-only and
mixed steps, contexts spanning many page blocks, padding slots, Q precision. Decode and
prefill slots run both ways each time: XLA ops, and the native CPU custom calls (decode.cc,
prefill.cc; windows and score caps keep XLA ops for prefill slots)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import reference, xla
from test_pallas_attention import FORMATS, MIXES, make_case, ref_attention

# The machines this runs on have a C++ compiler: a failed build must fail here, not hide.
NATIVE = (False, True)

LONG = [[(300, 1), (0, 1), (129, 1), (64, 1)],  # many blocks; lengths on block edges
        [(200, 1), (31, 1), (50, 20)]]


def _check(args, reqs, block_pages, q_precision="compute"):
  n_pre = sum(n > 1 for _, n in reqs)
  Q = max(n for _, n in reqs)
  ref = ref_attention(*args, max_query_len=Q, num_prefill_slots=n_pre,
                      q_precision=q_precision)
  for native in NATIVE:
    out = jax.jit(lambda *a: xla.ragged_paged_attention(
        *a, max_query_len=Q, num_prefill_slots=n_pre, q_precision=q_precision,
        block_pages=block_pages, native=native))(*args)
    out = np.asarray(out)
    assert np.isfinite(out).all(), f"a stale NaN page leaked into the output ({native=})"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-5, (reqs, block_pages, native, err)


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_matches_reference(fmt):
  """A mixed step (decodes + prefill chunks) whose decodes span many page blocks."""
  rng = np.random.default_rng()
  reqs = LONG[1]
  _check(make_case(rng, fmt, 8, 9, 3, 64, reqs), reqs, block_pages=2)


@pytest.mark.parametrize("page_size,block_pages,heads,kv_heads,head_dim",
                         [pytest.param(16, 1, 4, 4, 64, marks=pytest.mark.slow),
                          (16, 3, 8, 1, 64), (64, 8, 9, 3, 64),
                          (8, 2, 12, 1, 48), (16, 2, 8, 2, 128)])
def test_block_sizes_and_page_sizes(page_size, block_pages, heads, kv_heads, head_dim):
  """Block counts that do not divide the page table, one-page blocks, one block for all;
  MHA, GQA 8:1, 3:1, 12:1 and 4:1; head_dim 64 and 128 (the native call's specialised
  shapes) and 48 (its generic one)."""
  rng = np.random.default_rng()
  for reqs in LONG[:1] + MIXES[:1]:
    _check(make_case(rng, "f32", page_size, heads, kv_heads, head_dim, reqs), reqs,
           block_pages)


def test_padding_slots_and_q_precision():
  rng = np.random.default_rng()
  reqs = [(40, 1), (0, 0), (17, 1), (0, 0)]  # query_len 0: padding slots in the bucket
  args = make_case(rng, "q8_0", 16, 9, 3, 64, reqs)
  for qp in ("compute", "kv"):
    _check(args, [r for r in reqs if r[1]], 2, qp)


@pytest.mark.parametrize("reqs", [[(100, 1)], [(33, 1), (70, 1), (9, 5)], [(0, 16)],
                                  [(20, 1), (0, 12), (0, 3)]])
def test_few_decode_slots_and_fresh_prompts(reqs):
  """At most MAX_DOT_FORM_SLOTS decode slots take the dot form; prefill slots none of
  which has cached tokens run no cached block."""
  assert sum(n == 1 for _, n in reqs) <= xla.MAX_DOT_FORM_SLOTS
  rng = np.random.default_rng()
  _check(make_case(rng, "bf16", 16, 9, 3, 64, reqs), reqs, block_pages=None)


def test_page_tables_wider_than_the_context_change_nothing():
  """A bucket's page tables may be far wider than any request's context (one page tier
  for the whole table): the columns past the context hold a NaN-poisoned page and must
  neither leak into the output nor change it."""
  reqs = [(70, 1), (5, 1), (40, 1), (33, 6)]
  case = make_case(np.random.default_rng(3), "f32", 16, 9, 3, 64, reqs)
  pt = case[5]
  stale = pt[1, -1]  # slot 1 (5 tokens) holds one page: its table is padded with a stale one
  wide = np.concatenate([pt, np.full((len(pt), 60), stale, pt.dtype)], axis=1)
  for bp in (None, 2):
    _check(case[:5] + (wide,) + case[6:], reqs, bp)


def test_contexts_are_data_not_shapes():
  """The block loops' trip counts follow the step's contexts as data: steps of one shape
  whose requests hold other contexts reuse the one trace (chex.assert_max_traces) and
  still equal the reference."""
  import chex
  rng = np.random.default_rng()
  reqs = LONG[0]
  q, kn, vn, pool, layer, pt, qs, ql, cl = make_case(rng, "f32", 16, 9, 3, 64, reqs)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def attend(q, kn, vn, pool, pt, qs, ql, cl):
    return xla.ragged_paged_attention(q, kn, vn, pool, layer, pt, qs, ql, cl, max_query_len=1,
                                      num_prefill_slots=0, block_pages=2)

  for ctx in ([300, 0, 129, 64], [17, 0, 128, 1], [1, 0, 5, 63]):  # within each real context
    c = np.array(ctx, np.int32)
    ref = ref_attention(q, kn, vn, pool, layer, pt, qs, ql, c, max_query_len=1,
                        num_prefill_slots=0)
    out = np.asarray(attend(q, kn, vn, pool, pt, qs, ql, c))
    chex.assert_shape(out, q.shape)
    chex.assert_tree_all_finite(out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_native_call_clips_bad_metadata_instead_of_reading_out_of_bounds():
  """Under jit nothing validates the page table's values: page ids outside the pool and
  contexts past the table must not make the native call read outside its buffers (it
  clips them, as XLA's gathers do); valid slots in the same call are unaffected."""
  reqs = [(40, 1), (20, 1), (33, 1)]
  q, kn, vn, pool, layer, pt, qs, ql, cl = make_case(np.random.default_rng(5), "f32", 16, 9,
                                                      3, 64, reqs)
  ref = ref_attention(q, kn, vn, pool, layer, pt, qs, ql, cl, max_query_len=1,
                      num_prefill_slots=0)
  bad_pt, bad_cl = pt.copy(), cl.copy()
  bad_pt[1, 0] = 10**6  # far past the pool's pages
  bad_pt[1, 1] = -7
  bad_cl[2] = 10**6  # far past slot 2's table
  out = np.asarray(jax.jit(lambda *a: xla.ragged_paged_attention(
      *a, max_query_len=1, num_prefill_slots=0, native=True))(
          q, kn, vn, pool, layer, bad_pt, qs, ql, bad_cl))
  assert out.shape == ref.shape
  np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=1e-5)  # slot 0 untouched


def test_native_fp8_decode_of_every_code():
  """The native call decodes fp8 through IEEE halves with the page scale folded into q and
  the weights: all 256 codes (subnormals included) against the codec's decode, on K and on
  V; a NaN code in the context poisons the output as the reference's does (K: every
  column, V: its own)."""
  from pallas_kernels import kv_codec
  from pallas_kernels.cpu import decode as cpu_native
  assert cpu_native.available()  # builds and registers the call (a compiler is required here)
  rng = np.random.default_rng(3)
  fmt, H, ps = kv_codec.get_format("fp8"), 64, 16
  codes = (rng.permutation(4 * ps * H) % 256).astype(np.uint8).reshape(1, 1, 4, ps, H)
  finite = np.where((codes & 0x7f) == 0x7f, 0, codes).astype(np.uint8)
  scales = jnp.asarray([[[0.75, 3.0, 0.01, 1.0]]], jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 2, H)) * 0.01, jnp.float32)
  kn = vn = jnp.zeros((1, 1, H), jnp.float32)
  pt, cl = jnp.asarray([[2, 0, 3, 1]], jnp.int32), jnp.asarray([64], jnp.int32)

  def native(k, v):
    pool = {"k": jnp.asarray(k), "v": jnp.asarray(v), "k_ps": scales, "v_ps": scales}
    return np.asarray(cpu_native.decode_attention(q, kn, vn, pool, 0, pt, cl, scale=1.0))

  def rows(c):  # decoded by the codec, in the slot's page order, then its own zero token
    x = np.asarray(kv_codec.decode(fmt, jnp.asarray(c[0, 0]), scales[0, 0][:, None, None]))
    return np.concatenate([x[np.asarray(pt[0])].reshape(-1, H), np.zeros((1, H))])

  k, v = finite, finite[:, :, ::-1].copy()
  sc = np.asarray(q[0], np.float64) @ rows(k).T
  p = np.exp(sc - sc.max(1, keepdims=True))
  ref = (p / p.sum(1, keepdims=True)) @ rows(v)
  np.testing.assert_allclose(native(k, v)[0], ref, rtol=1e-5, atol=1e-6)
  nan = finite.copy()
  nan[0, 0, 3, 5, 7] = 0xff  # page 3: the slot's third page
  assert np.isnan(native(nan, v)).all()  # a NaN score: the whole softmax
  v_nan = np.isnan(native(k, nan))
  assert v_nan[..., 7].all() and not v_nan[..., :7].any()  # a NaN value: its column


def test_native_build_failure_names_the_compiler_and_its_output(tmp_path, monkeypatch):
  """A compiler that fails is reported with its command and output; nothing half-written
  is left in the cache (the XLA-op path then runs: `available()` logs and returns False)."""
  from pallas_kernels.cpu import decode as cpu_native
  script = tmp_path / "cxx"
  script.write_text("#!/bin/sh\necho 'no such compiler here' >&2\nexit 3\n")
  script.chmod(0o755)
  monkeypatch.setenv("CXX", str(script))
  monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
  with pytest.raises(RuntimeError, match="no such compiler here"):
    cpu_native.build()
  assert not list((tmp_path / "cache" / "native").glob("*.so"))


def test_long_contexts_of_few_slots_split_the_context():
  """One decode slot with thousands of cached tokens: the native call splits its context
  into parts (flash-decoding) and merges their softmax states (4 and 2 parts here,
  lengths off page edges). Two slots split only on machines with more threads than this
  suite's two (the shorter slot then leaves empty parts): not run here."""
  rng = np.random.default_rng(5)
  for reqs in ([(2100, 1)], [(1100, 1)]):
    _check(make_case(rng, "q4_0", 16, 9, 3, 64, reqs), reqs, block_pages=8)


@pytest.mark.parametrize("window,softcap", [(7, None), (40, 0.5), (None, 0.5)])
def test_sliding_window_and_soft_cap_match_reference(window, softcap):
  """A sliding window (traced, as under the layer scan) and a score cap: the XLA backend's
  decode and prefill groups equal the reference over many page blocks of NaN-poisoned
  pools, its decode slots both ways (XLA ops and the native call); a window wider than
  every context changes nothing, a narrow one does."""
  rng = np.random.default_rng(3)
  for reqs in LONG:
    args = make_case(rng, "f32", 8, 8, 2, 64, reqs)
    n_pre = sum(n > 1 for _, n in reqs)
    Q = max(n for _, n in reqs)
    kw = dict(max_query_len=Q, num_prefill_slots=n_pre, softcap=softcap)
    w = None if window is None else jnp.int32(window)
    ref = np.asarray(jax.jit(lambda *a: reference.ragged_paged_attention(
        *a[:-1], window=a[-1], **kw))(*args, w))
    for native in NATIVE:
      out = np.asarray(jax.jit(lambda *a: xla.ragged_paged_attention(
          *a[:-1], window=a[-1], block_pages=2, native=native, **kw))(*args, w))
      assert np.isfinite(out).all(), native
      err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
      assert err < 1e-5, (reqs, window, softcap, native, err)
    plain = np.asarray(jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, max_query_len=Q, num_prefill_slots=n_pre, softcap=softcap))(*args))
    wide = np.asarray(jax.jit(lambda *a: reference.ragged_paged_attention(
        *a[:-1], window=a[-1], **kw))(*args, jnp.int32(10_000)))
    np.testing.assert_allclose(wide, plain, rtol=1e-6, atol=1e-6)
    if window == 7:
      assert np.linalg.norm(ref - plain) > 1e-3 * np.linalg.norm(plain)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_slots_run_in_query_chunks(monkeypatch, window):
  """Prefill slots longer than a query chunk (8 rows here): each chunk reads its slot's
  new tokens causally up to itself, then the cached blocks, in one online softmax; slot
  lengths off chunk edges, one with nothing cached, a bucket Q (40) past every slot's
  length, so whole chunks of rows are padding and never run."""
  monkeypatch.setattr(xla, "PREFILL_QUERY_CHUNK", 8)
  rng = np.random.default_rng(11)
  reqs = [(30, 1), (0, 20), (45, 17), (9, 3)]
  args = make_case(rng, "f32", 8, 9, 3, 64, reqs)
  w = None if window is None else jnp.int32(window)
  for Q in (20, 40):
    kw = dict(max_query_len=Q, num_prefill_slots=3)
    ref = np.asarray(jax.jit(lambda *a: reference.ragged_paged_attention(
        *a[:-1], window=a[-1], **kw))(*args, w))
    out = np.asarray(jax.jit(lambda *a: xla.ragged_paged_attention(
        *a[:-1], window=a[-1], block_pages=2, **kw))(*args, w))
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5, (Q, window)


def test_a_sliding_window_over_a_split_context():
  """One decode slot of 2,100 cached tokens under a window of 1,501 (off page edges) with
  a score cap: the native call splits the window's part of the context into parts, reads
  nothing before the page holding its first key (the pages before it hold NaN here, as
  released pages may) and equals the reference."""
  rng = np.random.default_rng(9)
  reqs = [(2100, 1)]
  q, kn, vn, pool, layer, pt, qs, ql, cl = make_case(rng, "f32", 16, 9, 3, 64, reqs)
  first_page = (2100 - 1501 + 1) // 16
  pool = dict(pool)
  for name in ("k", "v"):  # every page wholly behind the window poisoned
    pool[name] = jnp.asarray(pool[name]).at[:, :, np.asarray(pt)[0, :first_page]].set(np.nan)
  kw = dict(max_query_len=1, num_prefill_slots=0, softcap=0.5)
  args = (q, kn, vn, pool, layer, pt, qs, ql, cl)
  w = jnp.int32(1501)
  ref = np.asarray(jax.jit(lambda *a: reference.ragged_paged_attention(
      *a[:-1], window=a[-1], **kw))(*args, w))
  out = np.asarray(jax.jit(lambda *a: xla.ragged_paged_attention(
      *a[:-1], window=a[-1], native=True, **kw))(*args, w))
  assert np.isfinite(out).all()
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("fmt,head_dim", [("f32", 64), ("q4_0", 64), ("bf16", 128)])
def test_native_prefill_call_matches_reference(fmt, head_dim):
  """The CPU prefill call (prefill.cc) on prompts longer than its 64-query items and
  64-key blocks: slots with nothing cached, with cached tokens off page edges, and a
  padding slot (query_len 0) whose rows must come out zero, on NaN-poisoned pools; the
  call is in the compiled step (native=None picks it on CPU) and the XLA-op form agrees."""
  from pallas_kernels.cpu import prefill as cpu_prefill
  if not cpu_prefill.available():
    pytest.skip("the native prefill call needs AVX-512F")
  rng = np.random.default_rng(21)
  reqs = [(0, 130), (37, 70), (200, 65), (0, 0)]
  args = make_case(rng, fmt, 16, 9, 3, head_dim, reqs)
  kw = dict(max_query_len=130, num_prefill_slots=4)
  ref = ref_attention(*args, **kw)
  f = jax.jit(lambda *a: xla.ragged_paged_attention(*a, **kw))
  assert "jaxinfer_prefill_attention" in f.lower(*args).as_text()
  out = np.asarray(f(*args))
  assert np.isfinite(out).all()
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
  ops = np.asarray(jax.jit(lambda *a: xla.ragged_paged_attention(*a, native=False, **kw))(
      *args))
  np.testing.assert_allclose(out, ops, rtol=1e-4, atol=1e-4)
  # the call's own padding rows: a bucket Q past every slot's length
  q, kn, vn, pool, layer, pt, qs, ql, cl = args[:9]
  o, flat = jax.jit(lambda *a: cpu_prefill.prefill_attention(*a, Q=160, scale=0.125))(
      q, kn, vn, pool, 0, pt, qs, ql, cl)
  o = np.asarray(o)
  for r, (_, n) in enumerate(reqs):
    assert (o[r, n:] == 0).all() and (np.asarray(flat)[r, n:] == q.shape[0]).all()
