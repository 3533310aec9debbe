"""Speculative decoding: exact verification, rollback, drafters, draft length (8.5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import sampling
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.costmodel.formulas import expected_tokens
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
from jaxinfer.runtime import speculative
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig


def _draw(sampler, p, q, n, seed):
  """n emitted tokens: draft x ~ q, then the sampler's accept / resample."""
  V = p.shape[0]
  key = jax.random.key(seed)
  kd, ks = jax.random.split(key)
  drafts = jax.random.categorical(kd, jnp.log(q), shape=(n,))
  keys = jax.random.split(ks, n)
  P = jnp.broadcast_to(p, (n, V))
  Q = jnp.broadcast_to(q, (n, V))
  tok, _ = jax.vmap(lambda pp, qq, d, k: sampler(pp[None], qq[None], d[None], k))(P, Q, drafts,
                                                                               keys)
  return np.bincount(np.asarray(tok[:, 0]), minlength=V)


def _broken(p, q, draft, key):
  """Resamples from p instead of normalize([p - q]+): biased."""
  rows = jnp.arange(p.shape[0])
  k1, k2 = jax.random.split(key)
  acc = jax.random.uniform(k1, (p.shape[0],)) * q[rows, draft] < p[rows, draft]
  res = jax.random.categorical(k2, jnp.log(p), axis=-1)
  return jnp.where(acc, draft, res), acc


CASES = [(np.array([0.3, 0.7]), np.array([0.8, 0.2]))]  # two symbols, q favours the wrong one
_rng = np.random.default_rng(5)
for _ in range(3):
  CASES.append((_rng.dirichlet(np.ones(6)), _rng.dirichlet(np.ones(6))))


@pytest.mark.parametrize("p,q", CASES)
def test_rejection_sampler_output_equals_target(p, q):
  n = 40000
  counts = _draw(sampling.rejection_sample, jnp.asarray(p, jnp.float32),
                 jnp.asarray(q, jnp.float32), n, seed=0)  # fixed draws: a stable test
  assert stats.chisquare(counts, n * p).pvalue > 1e-3


@pytest.mark.parametrize("p,q", CASES[:2])
def test_broken_sampler_is_caught(p, q):
  n = 40000
  counts = _draw(_broken, jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), n, seed=3)
  assert stats.chisquare(counts, n * p).pvalue < 1e-6


def test_verify_point_mass_drafts_are_exact():
  """Deterministic drafts (q = one hot) through sampling.sample_rows, temperature 0.8."""
  logits = jnp.asarray(np.log([0.5, 0.2, 0.2, 0.1]), jnp.float32)
  n = 30000
  L = jnp.broadcast_to(logits, (n, 4))
  f = lambda a: jnp.full((n,), a)  # noqa: E731
  tok, _, acc = sampling.sample_rows(L, f(1.0), f(0).astype(jnp.int32), f(1.0),
                                    jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32),
                                    jnp.full((n,), 2, jnp.int32))
  counts = np.bincount(np.asarray(tok), minlength=4)
  assert stats.chisquare(counts, n * np.array([0.5, 0.2, 0.2, 0.1])).pvalue > 1e-3
  assert abs(float(jnp.mean(acc)) - 0.2) < 0.02  # accepted with probability p(x)


def test_ngram_lookup():
  d = speculative.NgramDrafter(max_ngram=3)
  ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
  assert d.lookup(ctx, 3) == [4, 5, 9]
  assert d.lookup([7, 8, 9], 2) == []


@pytest.mark.parametrize("a,m", [(0.6, 3), (0.9, 5)])
def test_simulated_tokens_per_round_match_expectation(a, m):
  """8.5.2: independent positions with acceptance a: E[N] = 1 + a + ... + a^m."""
  ex = SimExecutor(AffineStepModel(), num_pages=4000, page_size=16, acceptance=a, seed=1)
  eng = Engine(ex, SchedulerConfig("continuous", 8, 1 << 20, 1 << 20),
               buckets=BucketTable.default(4096, 64, 256), drafter=speculative.FixedDrafter(),
               draft_policy=speculative.DraftLengthPolicy(num_draft=m))
  for i in range(8):
    eng.add_request([1] * 64, SamplingParams(max_tokens=2000, ignore_eos=True))
  reqs = eng.run()
  s = speculative.summarize(reqs)
  # Only the last round of each request is clipped by max_tokens (2000 tokens per request).
  assert s["mean_tokens_per_round"] == pytest.approx(expected_tokens(a, m), rel=0.04)
  assert all(len(r.output_token_ids) == 2000 for r in reqs)
  eng.pm.check_invariants()
  assert eng.pm.num_free == eng.pm.num_pages


def test_adaptive_length_uses_the_marginal_rule():
  pol = speculative.DraftLengthPolicy(num_draft=8, adaptive=True)
  from jaxinfer.runtime.request import Request
  r = Request(0, [1], SamplingParams())
  r.drafted_by_position = [100] * 8
  r.accepted_by_position = [90, 80, 70, 10, 5, 1, 0, 0]
  # A flat round time: drafting is free, lengthen while expected tokens still grow.
  assert pol.length(r, lambda m: 1.0) == 8
  # Each draft token costs as much as a whole plain step: never worth it.
  assert pol.length(r, lambda m: 1.0 + m) == 0
  # Moderate cost: stops where dT/dN >= T/N.
  m = pol.length(r, lambda m: 1.0 + 0.2 * m)
  assert 1 <= m <= 4
