"""Sampling: greedy, top-k, top-p, seeds; parameters are arrays (no recompiles)."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sampling


def _args(S, t=0.0, k=0, p=1.0, seed=0):
  return (jnp.full(S, t, jnp.float32), jnp.full(S, k, jnp.int32), jnp.full(S, p, jnp.float32),
          jnp.full(S, seed, jnp.uint32), jnp.arange(S, dtype=jnp.int32))


def test_greedy_and_top_k_1_agree():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
  ids, lp = sampling.sample(logits, *_args(4))
  np.testing.assert_array_equal(ids, np.argmax(logits, -1))
  ids2, _ = sampling.sample(logits, *_args(4, t=1.5, k=1))
  np.testing.assert_array_equal(ids2, ids)
  np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(4), ids], rtol=1e-6)


def test_seed_reproducible_and_top_p_support():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 2000)), jnp.float32)
  t, k, p, _, c = _args(2000, t=1.0, p=0.7)
  seeds = jnp.asarray(rng.integers(0, 2**31, 2000), jnp.uint32)
  a, _ = sampling.sample(logits, t, k, p, seeds, c)
  b, _ = sampling.sample(logits, t, k, p, seeds, c)
  np.testing.assert_array_equal(a, b)
  a = np.asarray(a)
  assert set(a.tolist()) <= {0, 1}  # top-p 0.7 keeps the tokens ranked 0.5 and 0.3
  frac = (a == 0).mean()
  assert abs(frac - 0.5 / 0.8) < 0.05


def test_filtered_probs_sum_to_one():
  logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, 30)), jnp.float32)
  probs = sampling.filtered_probs(logits, jnp.array([0.7, 1.0, 2.0]), jnp.array([5, 0, 3]),
                                  jnp.array([1.0, 0.5, 0.9]))
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)
  assert (np.asarray(probs)[0] > 0).sum() == 5


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
  """Plain temperature rows skip the filter unless a row in the step uses top-k / top-p:
  either way a row draws the same token (its uniform is keyed by its own seed), and the
  block argmax equals jnp.argmax, ties included."""
  rng = np.random.default_rng(3)
  n, V = 64, 512
  logits = jnp.asarray(rng.standard_normal((n + 1, V)), jnp.float32)
  t, k, p, _, c = _args(n + 1, t=0.8)
  seeds = jnp.arange(n + 1, dtype=jnp.uint32)
  alone, _ = sampling.sample(logits, t, k, p, seeds, c)  # no row filters: no sort
  with_mate, _ = sampling.sample(logits, t, k.at[n].set(5), p.at[n].set(0.5), seeds, c)
  np.testing.assert_array_equal(alone[:n], with_mate[:n])
  assert len(set(np.asarray(alone).tolist())) > 10  # really sampled, not greedy
  ties = jnp.asarray(rng.integers(0, 3, (n, V)), jnp.float32)
  from pallas_kernels import cpu  # the CPU's greedy pick is jnp.argmax's, ties included
  for fn in (cpu.argmax, sampling.greedy):
    np.testing.assert_array_equal(fn(ties), jnp.argmax(ties, axis=-1))
    np.testing.assert_array_equal(fn(logits), jnp.argmax(logits, axis=-1))


def test_inverse_cdf_draws_each_token_its_share_of_evenly_spaced_quantiles():
  """N evenly spaced u give each token round(N p_i) draws within one (a float64 numpy
  cumulative sum is the oracle), across block edges and a padded last block; tokens of
  weight 0 are never drawn, and a target at the row's whole sum (u = 1, which u * sum
  can round to) gets the row's last positive token, past an empty padded tail."""
  rng = np.random.default_rng(4)
  V, N = 1000, 20000  # 4 blocks of 256, the last padded by 24
  w = rng.gamma(0.3, 1.0, V) * (rng.random(V) > 0.3)
  w[990:] = 0.0  # the last positive weight sits in the padded block's middle
  w[300:560] = 0.0  # one whole block, and more, empty
  p = w / w.sum()
  u = (np.arange(N) + 0.5) / N
  got = np.asarray(sampling.inverse_cdf(jnp.asarray(np.broadcast_to(w, (N, V)), jnp.float32),
                                        jnp.asarray(u, jnp.float32)))
  counts = np.bincount(got, minlength=V)
  assert counts[w == 0].sum() == 0
  oracle = np.bincount(np.searchsorted(np.cumsum(p), u, side="right"), minlength=V)
  assert np.abs(counts - oracle).max() <= 1
  assert np.abs(counts - N * p).max() <= 2
  last = np.flatnonzero(w)[-1]
  edge = sampling.inverse_cdf(jnp.asarray(w[None], jnp.float32),
                              jnp.asarray([1.0], jnp.float32))
  assert int(edge[0]) == last


def _kept_oracle(logits, t, k, p, min_p):
  """numpy: the tokens a row keeps under top-k, then top-p over the top-k distribution,
  then min-p relative to the most likely token (full sort, float64)."""
  z = logits.astype(np.float64) / (t if t > 0 else 1.0)
  order = np.argsort(-z, kind="stable")
  srt = z[order]
  V = len(z)
  k_eff = k if 0 < k < V else V
  keep = np.arange(V) < k_eff
  pk = np.where(keep, np.exp(srt - srt.max()), 0.0)
  pk /= pk.sum()
  keep &= (np.cumsum(pk) - pk < p) | (np.arange(V) == 0)
  if min_p > 0:
    pa = np.exp(srt - srt.max())
    keep &= (pa >= min_p * pa[0]) | (np.arange(V) == 0)
  return set(order[keep].tolist())


def test_filters_keep_the_sorted_oracles_tokens_without_a_sort():
  """Top-k / top-p / min-p are thresholds found by bisection (no vocabulary sort): the
  kept sets equal a float64 numpy oracle's that sorts, on sharp and flat rows (a
  nucleus of a few tokens or of most of the vocabulary); every row draws a kept token,
  the same one alone as beside the others, and an unfiltered row keeps every token."""
  rng = np.random.default_rng(7)
  V = 2048
  sharp = rng.standard_normal((6, V)) * 4.0  # most mass in a few tokens
  flat = rng.standard_normal((4, V)) * 0.1   # mass spread over the whole vocabulary
  logits = jnp.asarray(np.concatenate([sharp, flat]), jnp.float32)
  # (temperature, top_k, top_p, min_p) per row
  rows = [(0.8, 40, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.05), (0.7, 100, 0.8, 0.0),
          (1.0, 0, 1.0, 0.0), (0.0, 0, 0.9, 0.0),  # unfiltered, greedy
          (1.0, 0, 0.999, 0.0), (1.0, 1000, 1.0, 0.0), (1.0, 20, 0.5, 0.0), (2.0, 0, 0.3, 0.0)]
  t, k, p, mp = (jnp.asarray([r[i] for r in rows], dt) for i, dt in
                 enumerate((jnp.float32, jnp.int32, jnp.float32, jnp.float32)))
  S = len(rows)
  probs = np.asarray(jax.jit(sampling.filtered_probs)(logits, t, k, p, mp))
  sizes = []
  for i, (ti, ki, pi, mi) in enumerate(rows):
    want = _kept_oracle(np.asarray(logits[i]), ti, ki, pi, mi)
    assert set(np.flatnonzero(probs[i]).tolist()) == want, i
    sizes.append(len(want))
  assert sizes[4] == V and sizes[6] > 1500 and sizes[1] < 100, sizes  # both kinds of rows
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)

  rows_jit = jax.jit(sampling.sample_rows)  # one compile per batch size, not per op

  def draw(idx):
    sub = [jnp.asarray(a)[np.array(idx)] for a in (logits, t, k, p, mp)]
    n = len(idx)
    return np.asarray(rows_jit(
        sub[0], sub[1], sub[2], sub[3], jnp.asarray(idx, jnp.uint32), jnp.zeros(n, jnp.int32),
        jnp.full((n,), -1, jnp.int32), min_p=sub[4])[0])
  together = draw(list(range(S)))
  for i in range(S):
    assert int(together[i]) in _kept_oracle(np.asarray(logits[i]), *rows[i]), i
    assert draw([i])[0] == together[i], i


_SAMPLE = jax.jit(sampling.sample_rows)
# every legal temperature class: greedy, subnormal, tiny normals, near-greedy, ordinary
_TEMPS = (0.0, 1e-45, 1e-40, 1e-38, 1e-30, 1e-20, 1e-12, 1e-8, 1e-5, 1e-3, 0.1, 0.7, 1.0, 2.0)


def test_every_temperature_samples_an_allowed_token_whatever_the_batch():
  """Property over temperatures from 0 to 2, subnormals included: each sampled token is
  one the row's filters keep, with a finite logprob; a temperature near 0 gives greedy's
  token (a whole batch at 1e-30..1e-12 once drew the vocabulary's last token in most rows:
  jitted, the unshifted division left huge values that XLA's fused draw mishandled); and
  a row's token does not change with the rows beside it."""
  from hypothesis import given, settings, strategies as st

  V = 49152  # SmolLM2's vocabulary, where XLA's fused draw went wrong at 1e-30..1e-12
  rng = np.random.default_rng(5)
  base = jnp.asarray(rng.standard_normal((8, V)) * 3, jnp.float32)
  greedy = np.asarray(sampling.greedy(base))
  one = lambda v, dt: jnp.full(8, v, dt)  # noqa: E731
  for T in _TEMPS:  # the whole batch at one temperature, no filter
    ids, lp, _ = _SAMPLE(base, one(T, jnp.float32), one(0, jnp.int32), one(1.0, jnp.float32),
                         jnp.arange(8, dtype=jnp.uint32), one(0, jnp.int32), one(-1, jnp.int32))
    assert np.isfinite(np.asarray(lp)).all(), T
    if T <= 1e-3:
      np.testing.assert_array_equal(ids, greedy, err_msg=f"temperature {T}")

  @settings(max_examples=25, deadline=None, derandomize=True)
  @given(st.lists(st.sampled_from(_TEMPS), min_size=8, max_size=8),
         st.lists(st.sampled_from((0, 1, 5, 50)), min_size=8, max_size=8),
         st.lists(st.sampled_from((1.0, 0.9, 0.3)), min_size=8, max_size=8),
         st.integers(0, 7))
  def check(temps, ks, ps, mate):
    t = jnp.asarray(temps, jnp.float32)
    k = jnp.asarray(ks, jnp.int32)
    p = jnp.asarray(ps, jnp.float32)
    seeds = jnp.arange(8, dtype=jnp.uint32)
    c = jnp.zeros(8, jnp.int32)
    none = jnp.full(8, -1, jnp.int32)
    ids, lp, _ = map(np.asarray, _SAMPLE(base, t, k, p, seeds, c, none))
    _, keep = sampling.filter_mask(base, t, k, p)
    keep = np.asarray(keep)
    assert np.isfinite(lp).all()
    for i, T in enumerate(temps):
      assert keep[i, ids[i]] or T == 0.0, (T, ks[i], ps[i])
      if T <= 1e-3:
        assert ids[i] == greedy[i], T
    # the same rows with one batch mate's parameters changed: the other rows' tokens stay
    t2, k2, p2 = t.at[mate].set(1.0), k.at[mate].set(3), p.at[mate].set(0.5)
    ids2 = np.asarray(_SAMPLE(base, t2, k2, p2, seeds, c, none)[0])
    others = np.arange(8) != mate
    np.testing.assert_array_equal(ids2[others], ids[others])

  check()
