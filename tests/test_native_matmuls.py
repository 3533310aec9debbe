"""The native CPU matmuls over weights packed for them, each against its jnp oracle and its
layout against the weights it packs: bf16 in AMX's tile layout on AMX or AVX512-BF16
(pallas_kernels/cpu/tiles.py, tiles.cc) and f32 in column panels (AVX-512 or AVX2)
(panels.py, panels.cc), and the one conversion that packs a model's weights (weights.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu import panels, tiles

needs_tiles = pytest.mark.skipif(not tiles.available() or jax.default_backend() != "cpu",
                                 reason="the tile matmul needs Intel AMX or AVX512-BF16")


def _w(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)


def test_pack_is_the_documented_layout_and_unpack_inverts_it():
  w = _w(np.random.default_rng(0), 2, 64, 48)
  t = np.asarray(tiles.pack(w))
  bits = np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))
  assert t.shape == (2, 3, 32, 16, 2)
  for (l, j, p, c, e) in [(0, 0, 0, 0, 0), (1, 2, 31, 15, 1), (0, 1, 7, 3, 1), (1, 0, 5, 9, 0)]:
    assert t[l, j, p, c, e] == bits[l, 2 * p + e, 16 * j + c]
  assert (np.asarray(tiles.unpack(t)) == np.asarray(w)).all()


def test_unpackable_shapes_are_refused_by_name():
  with pytest.raises(ValueError, match=r"K % 32 == 0 and N % 16 == 0; got bfloat16 \(48, 32\)"):
    tiles.pack(jnp.zeros((48, 32), jnp.bfloat16))
  assert not tiles.packable(jnp.zeros((64, 40), jnp.bfloat16))
  assert not tiles.packable(jnp.zeros((64, 32), jnp.float32))


@needs_tiles
def test_matmul_matches_reference():
  """Each engine this CPU runs (the call's own choice, and the AVX512-BF16 dot products at
  every row count where the CPU has them): row counts of the dot products' passes of six
  (1-7, 13) and around the 16-row A tile (16, 17, 40), calls of more than 32 rows whose rows
  are split into two items per column group (40, 65: parts of 24 + 16, 36 + 29), column
  counts that leave 1-4 column blocks in the last group of four (16 ... 80), K of one and
  of several 32-steps, a stacked layer read by index, and an input that is not bf16-exact
  (rounded as XLA does)."""
  rng = np.random.default_rng(1)
  engines = [None] + (["dot"] if "dot" in tiles.engines() else [])
  for K, N in ((32, 16), (96, 48), (64, 80), (128, 64)):
    w = _w(rng, 3, K, N)
    t = tiles.pack(w)
    for engine in engines:
      f = jax.jit(functools.partial(tiles.matmul, engine=engine))
      for M in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 40, 65):
        x = rng.standard_normal((M, K)).astype(np.float32)
        for layer in (0, 2):
          got = np.asarray(f(x, t, layer))
          want = np.asarray(tiles.reference(x, t, layer))
          np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4,
                                     err_msg=f"{engine} K={K} N={N} M={M} layer={layer}")
  # one unstacked weight; x rounded to bf16 first: the same as rounding it by hand
  w = _w(rng, 64, 32)
  x = rng.standard_normal((3, 64)).astype(np.float32)
  xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(tiles.matmul(x, tiles.pack(w))),
                             np.asarray(tiles.matmul(xb, tiles.pack(w))), rtol=0, atol=0)


@needs_tiles
def test_the_switch_turns_the_tiles_off(monkeypatch):
  """JAXINFER_BF16_TILES=0 leaves bf16 weights to XLA's dot: no engine is offered
  (test_model_hf checks the executor's layout under the switch)."""
  with monkeypatch.context() as m:
    m.setenv("JAXINFER_BF16_TILES", "0")
    assert tiles.engines() == () and not tiles.available()
  assert tiles.engines()


@needs_tiles
def test_a_layer_outside_the_stack_fails_the_call():
  t = tiles.pack(_w(np.random.default_rng(2), 2, 32, 16))
  with pytest.raises(Exception, match="layer outside L"):
    np.asarray(tiles.matmul(np.ones((1, 32), np.float32), t, 2))
  with pytest.raises(ValueError, match="engine must be None or 'dot'; got 'amx'"):
    tiles.matmul(np.ones((1, 32), np.float32), t, 0, engine="amx")


needs_panels = pytest.mark.skipif(not panels.available() or jax.default_backend() != "cpu",
                                  reason="the panel matmul needs AVX-512F or AVX2 + FMA")


def test_panels_layout_and_refusals():
  w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 48)).astype(np.float32))
  p = np.asarray(panels.pack(w))
  assert p.shape == (2, 3, 5, 16)
  assert p[1, 2, 4, 15] == np.asarray(w)[1, 4, 47] and p[0, 1, 3, 2] == np.asarray(w)[0, 3, 18]
  assert (np.asarray(panels.unpack(p)) == np.asarray(w)).all()
  with pytest.raises(ValueError, match=r"N % 16 == 0; got float32 \(8, 40\)"):
    panels.pack(jnp.zeros((8, 40), jnp.float32))
  assert not panels.packable(jnp.zeros((8, 32), jnp.bfloat16))


@needs_panels
def test_panels_matmul_matches_reference():
  """x rows in passes of six (1, 5, 6, 7, 13, 40, 65 rows; at 40 and 65 each column group's
  rows are split into two items; 13-24 rows in K blocks, K 300 in three, the last short),
  the last group of four panels holding 1-4 (N 16 ... 80), any K, a stacked layer read by
  index."""
  rng = np.random.default_rng(4)
  f = jax.jit(panels.matmul)
  for K, N in ((5, 16), (96, 48), (64, 80), (33, 64), (300, 112)):
    p = panels.pack(jnp.asarray(rng.standard_normal((3, K, N)).astype(np.float32)))
    for M in (1, 5, 6, 7, 13, 16, 24, 25, 40, 65):
      x = rng.standard_normal((M, K)).astype(np.float32)
      for layer in (0, 2):
        np.testing.assert_allclose(np.asarray(f(x, p, layer)),
                                   np.asarray(panels.reference(x, p, layer)), rtol=1e-5,
                                   atol=1e-5 + 1e-7 * K,  # f32 sums' rounding grows with K
                                   err_msg=f"K={K} N={N} M={M} layer={layer}")
  with pytest.raises(Exception, match="layer outside L"):
    np.asarray(panels.matmul(np.ones((1, 5), np.float32), panels.pack(
        jnp.ones((1, 5, 16), jnp.float32)), 1))


@needs_panels
def test_calls_from_two_threads_at_once_agree_with_one_at_a_time():
  """Two Python threads run native calls at once: while one holds the library's spinning
  helpers, the other finds them busy and hands its items to XLA's pool (native_items.h;
  how often depends on timing: 70 of 240 calls in one counted run); every result equals
  the same call made alone, bit for bit (each item's sums run in one fixed order, whichever
  thread takes it)."""
  import threading
  rng = np.random.default_rng(6)
  p = panels.pack(jnp.asarray(rng.standard_normal((2, 576, 576)).astype(np.float32)))
  f = jax.jit(lambda x, layer: panels.matmul(panels.matmul(x, p, layer), p, 1 - layer))
  xs = [rng.standard_normal((M, 576)).astype(np.float32) for M in (1, 3, 8)]
  want = [[np.asarray(f(x, layer)) for layer in (0, 1)] for x in xs]
  bad = []

  def work(seed):
    for i in range(60):
      j, layer = (seed + i) % len(xs), (seed + i) % 2
      got = np.asarray(f(xs[j], layer))
      if not np.array_equal(got, want[j][layer]):
        bad.append((seed, i))

  threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads) and not bad


def _tiny():
  from jaxinfer.config import SMOLLM2_135M
  from jaxinfer.model import params as mp
  cfg = SMOLLM2_135M.replace(num_layers=2, hidden_size=64, intermediate_size=128,
                             num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
  return cfg, mp.init_params(cfg, jax.random.PRNGKey(1))


@needs_panels
def test_prepare_packs_each_group_once_and_keeps_prepared_weights():
  """f32 weights on AVX-512: q, k, v as one panel matrix split (64, 32, 32), gate and up as
  one, the tied embedding packed as the LM head; preparing prepared weights returns them."""
  from pallas_kernels.cpu import weights
  cfg, p = _tiny()
  a = weights.prepare(p)
  assert weights.prepare(a) is a and "wq" not in a["layers"]
  qkv = a["layers"]["wq+wk+wv"]
  assert isinstance(qkv, weights.Panels) and qkv.splits == (64, 32, 32) and qkv.in_place
  np.testing.assert_array_equal(np.asarray(panels.unpack(a["lm_head"].panels)),
                                np.asarray(p["embed"]).T)
  np.testing.assert_array_equal(np.asarray(panels.unpack(qkv.panels))[:, :, :64],
                                np.asarray(p["layers"]["wq"]))


def test_prepare_holds_bf16_weights_as_bit_patterns_without_the_tiles(monkeypatch):
  """Without the tile matmul, bf16 matmul weights are `Half` (stacked ones as uint16), the
  norms float32 (the model reads them so); the products equal XLA's bf16 dot with float32
  accumulation, at one row too (padded to HALF_MIN_ROWS inside)."""
  from jaxinfer.model import params as mp
  from jaxinfer.model.linear import Dense, linear
  from pallas_kernels.cpu import weights
  monkeypatch.setenv("JAXINFER_BF16_TILES", "0")
  cfg, p = _tiny()
  p = mp.cast_params(p, jnp.bfloat16)
  a = weights.prepare(p)
  assert weights.prepare(a) is a
  wq = a["layers"]["wq"]
  assert isinstance(wq, weights.Half) and wq.w.dtype == jnp.uint16
  assert a["layers"]["attn_norm"].dtype == jnp.float32
  assert isinstance(a["lm_head"], weights.Half) and a["lm_head"].transposed
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64)), jnp.float32)
  got = linear(x, weights.Half(wq.w[0]))
  want = linear(x.astype(jnp.bfloat16), Dense(p["layers"]["wq"][0])).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-3)
