"""Sampling on device: greedy, temperature, top-k, top-p with per-row parameters.

Every parameter is an array, so a new temperature or seed never recompiles. The random
stream of a request is keyed by (seed, output index): the same request samples the same
tokens whatever else shares its batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _order_key(x):
  """float32 -> int32 of the same order (-inf lowest; NaN excluded)."""
  b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


def _least_key(keys, weights, target, lo, hi):
  """Per row, the least int32 t in (lo, hi] with sum(weights where keys > t) < target, by
  bisection (32 halvings), given that sum >= target at lo and < target at hi (when the
  whole sum is below target: lo + 1). The sums are of integers, so exact in any order."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
    below = jnp.sum(jnp.where(keys > mid[:, None], weights, 0), axis=-1) < target
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


# Candidates: each row's most likely tokens (lax.top_k, not a sort: docs/design.md, the
# sampler). Top-k and top-p find their thresholds among them when those hold the row's
# cut, else by bisection over the whole row: the same thresholds either way.
CANDIDATES = 256
_UNIT = float(1 << 30)  # top-p sums probabilities in units of 2^-30: exact integer sums
_LOWEST = -(1 << 31)


def scale_by_temperature(logits, temperature):
  """(logits [S, V] - each row's max) / temperature [S]; greedy rows (temperature <= 0)
  only shifted. The shift leaves every softmax unchanged and bounds the scaled logits
  above by 0: the most likely tokens stay at 0 and the rest go towards -inf, so however
  small the temperature no huge value reaches the draw, and a temperature near 0 samples
  what greedy decoding picks."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
  return shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def filter_mask(logits, temperature, top_k, top_p, min_p=None, rows=None):
  """(scaled logits, keep [S, V] bool): the temperature-scaled logits and the tokens
  that top-k, then top-p over the top-k distribution, then min-p (relative to the most
  likely token, vLLM) keep, without sorting the vocabulary. Each cut is a threshold:
  top-k keeps a token when fewer than k tokens are above it, top-p when the probability
  mass above it (each token's probability floored to 2^-30) is below top_p; tied tokens
  are kept or dropped together. top_k <= 0 or >= V and top_p >= 1 filter nothing; the
  most likely token is always kept. rows [S] bool (default: all): the rows whose masks
  are used (a greedy row's is not); only they decide between candidates and bisection."""
  S, V = logits.shape
  scaled = scale_by_temperature(logits, temperature)
  key = _order_key(scaled)
  C = min(CANDIDATES, V)
  cand, _ = jax.lax.top_k(scaled, C)
  ckey = _order_key(cand)
  k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
  small_k = k_eff <= C
  lse_all = jax.nn.logsumexp(scaled, axis=-1)
  rank = jnp.arange(C)[None, :]
  # top-k's threshold: the k-th largest key (a candidate when k <= C)
  t_k_cand = jnp.take_along_axis(ckey, jnp.minimum(k_eff, C)[:, None] - 1, axis=-1)[:, 0]
  lse_cand = jax.nn.logsumexp(jnp.where(rank < k_eff[:, None], cand, -jnp.inf), axis=-1)
  lse_fast = jnp.where(small_k, lse_cand, lse_all)
  use_p = top_p < 1.0
  target = jnp.where(use_p, jnp.floor(top_p * _UNIT), 2 * _UNIT - 1).astype(jnp.int32)

  def units(vals, lse):  # probabilities in units of 2^-30 (monotone in the logits)
    return jnp.floor(jnp.exp(vals - lse[:, None]) * _UNIT).astype(jnp.int32)

  q_cand = jnp.where(ckey >= jnp.where(small_k, t_k_cand, _LOWEST)[:, None],
                     units(cand, lse_fast), 0)

  below_all = jnp.full((S,), -1, jnp.int32)  # units > -1: every token, the whole mass

  def fast(_):  # every row's cuts among its candidates
    # the same halvings as over the whole row: at or below the last candidate's units
    # both sums reach top_p (`covered`), above it they are the same integers
    t_p = _least_key(q_cand, q_cand, target, below_all, jnp.max(q_cand, axis=-1))
    return jnp.where(small_k, t_k_cand, _LOWEST), lse_fast, t_p

  def full(_):  # some row's cut lies beyond its candidates
    lo, hi = jnp.min(key, axis=-1) - 1, jnp.max(key, axis=-1)
    t_k_full = _least_key(key, jnp.ones_like(key), k_eff, lo, hi)
    t_k = jnp.where(small_k, t_k_cand, jnp.where(k_eff < V, t_k_full, _LOWEST))
    in_k = key >= t_k[:, None]
    lse_k = jax.nn.logsumexp(jnp.where(in_k, scaled, -jnp.inf), axis=-1)
    lse = jnp.where(small_k | (k_eff == V), lse_fast, lse_k)
    q = jnp.where(in_k, units(scaled, lse), 0)
    t_p = _least_key(q, q, target, below_all, jnp.max(q, axis=-1))
    return t_k, lse, t_p

  # A row's cuts lie among its candidates when top-k's does (k <= C) or top-k is off,
  # and top-p is off or the mass above the last candidate already reaches top_p (every
  # token above top-p's threshold is then a candidate).
  above_last = jnp.sum(jnp.where(q_cand > q_cand[:, -1:], q_cand, 0), axis=-1)
  covered = (small_k | (k_eff == V)) & (~use_p | (above_last >= target))
  if rows is not None:
    covered |= ~rows
  if C == V:
    t_k, lse, t_p = fast(None)
  else:
    t_k, lse, t_p = jax.lax.cond(jnp.all(covered), fast, full, None)
  keep = (key >= t_k[:, None]) & ((units(scaled, lse) >= t_p[:, None]) | ~use_p[:, None])
  top = jnp.max(scaled, axis=-1, keepdims=True)
  if min_p is not None:
    keep &= jnp.exp(scaled - top) >= min_p[:, None]  # relative to the most likely token
  return scaled, keep | (scaled == top)


def inverse_cdf(weights, u, block: int = 256):
  """Per row of weights [S, V] (>= 0, unnormalised) and u [S] in [0, 1): the token i with
  cumsum(w)[i - 1] <= u * sum(w) < cumsum(w)[i], i.e. a draw from w / sum(w) that reads
  each weight once: block sums, the block holding the target, then a cumulative sum
  inside that block only. A token of weight 0 is never returned while its row has any
  positive weight (rounding between the block sums and the in-block sums falls back to
  the last positive weight). Replaces a Gumbel-max draw, whose per-token threefry noise
  took 30-41 ms of a batch-64 step over 49,152 tokens on XLA:CPU."""
  S, V = weights.shape
  nb = -(-V // block)
  w = jnp.pad(weights, ((0, 0), (0, nb * block - V))).reshape(S, nb, block)
  bsum = jnp.sum(w, axis=-1)
  cum = jnp.cumsum(bsum, axis=-1)
  target = u * cum[:, -1]

  def last_positive(x):  # the last index of a positive entry (0 when there is none)
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[:, ::-1] > 0, axis=-1)

  j = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last_positive(bsum))
  before = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None],
                                                 axis=-1)[:, 0], 0.0)
  wj = jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0]
  inner = jnp.cumsum(wj, axis=-1)
  i = jnp.minimum(jnp.sum(inner <= (target - before)[:, None], axis=-1), last_positive(wj))
  return jnp.minimum(j * block + i, V - 1).astype(jnp.int32)


def filtered_probs(logits, temperature, top_k, top_p, min_p=None):
  """The distribution actually sampled from, [S, V] in vocabulary order (speculative
  verification applies the same filter to target and draft, 8.5.1)."""
  scaled, keep = filter_mask(logits, temperature, top_k, top_p, min_p)
  return jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def row_keys(seed, counter):
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, counter)


def _logprob_of(logits, ids):
  """log_softmax(logits)[ids] without the [S, V] log_softmax."""
  picked = jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def sample(logits, temperature, top_k, top_p, seed, counter):
  """logits [S, V] f32 -> (token ids [S] int32, logprob of each under the model [S] f32)."""
  no_draft = jnp.full(logits.shape[:1], -1, jnp.int32)
  ids, lp, _ = sample_rows(logits, temperature, top_k, top_p, seed, counter, no_draft)
  return ids, lp


def rejection_sample(p, q, draft, key):
  """Lossless speculative sampling at one position (8.5.1).

  p, q [S, V]: target and draft distributions (same temperature / top-k / top-p filter
  applied to both); draft [S]: the drafted token x ~ q. Accept x with probability
  min(1, p(x) / q(x)); otherwise sample from normalize([p - q]+). The emitted token is
  distributed exactly as p. Returns (token [S] int32, accepted [S] bool).
  """
  rows = jnp.arange(p.shape[0])
  px, qx = p[rows, draft], q[rows, draft]
  k_u, k_r = jax.random.split(key)
  u = jax.random.uniform(k_u, (p.shape[0],))
  accepted = u * qx < px  # u < p/q without dividing by a zero q
  resid = jnp.maximum(p - q, 0.0)
  total = jnp.sum(resid, axis=-1, keepdims=True)
  resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p)
  resample = jax.random.categorical(k_r, jnp.log(resid), axis=-1).astype(jnp.int32)
  return jnp.where(accepted, draft.astype(jnp.int32), resample), accepted


def unpack_bits(packed, V):
  """[S, ceil(V/32)] int32 -> [S, V] bool: bit t % 32 of word t // 32 is token t."""
  bits = (packed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  return bits.reshape(packed.shape[0], -1)[:, :V].astype(bool)


def apply_token_mask(logits, token_mask):
  """Logits of disallowed tokens -> -inf. token_mask [S, ceil(V/32)] int32 (packed bits;
  structured output and min_tokens; all ones = unconstrained)."""
  return jnp.where(unpack_bits(token_mask, logits.shape[-1]), logits, -jnp.inf)


def apply_penalties(logits, seen, repetition, logit_add):
  """The repetition penalty over every token seen (prompt and output; `seen` packed bits
  like a token mask): a positive logit is divided by it, a negative one multiplied (vLLM,
  CTRL); then `logit_add` [S, V]: the host's sum of logit_bias and the presence /
  frequency penalties, -(frequency * count + presence * [count > 0]) over the output."""
  seen = unpack_bits(seen, logits.shape[-1])
  rep = repetition[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  return logits + logit_add


TOP_LOGPROBS = 20  # most likely tokens a step returns per row when any request asks (OpenAI's max)


def greedy(x):
  """Each row's most likely token (the first index of its maximum)."""
  return jnp.argmax(x, axis=-1).astype(jnp.int32)


def sample_rows(logits, temperature, top_k, top_p, seed, counter, draft_ids, token_mask=None,
                min_p=None, raw_logits=None, argmax=greedy):
  """Sample every logits row; rows with a draft token (draft_ids >= 0) also verify it.

  token_mask (structured output): tokens outside it are never sampled and a draft
  outside it is rejected like any mismatch; the returned logprob stays the model's own
  (unmasked) log-probability of the token, as vLLM's default reports it. min_p: per-row
  min-p filter. raw_logits: the model's logits when `logits` were processed (penalties,
  logit_bias): logprobs are reported under them. argmax: the greedy pick (a platform's
  own form of it: jaxinfer.platforms).

  The drafters here draft deterministically (greedy draft model, context lookup), so q
  is a point mass on the draft token: `rejection_sample`'s rule then accepts it with
  probability p(x) and otherwise resamples from p without x, which this function does
  in the same pass as plain sampling: exact for any temperature / top-k / top-p. Greedy
  rows accept iff the draft is the target's argmax (then the argmax is the correction).
  Returns (token [S], logprob [S], accepted [S] bool)."""
  raw = logits if raw_logits is None else raw_logits
  if token_mask is not None:
    logits = apply_token_mask(logits, token_mask)
  greedy_ids = argmax(logits)
  has = draft_ids >= 0
  d = jnp.where(has, draft_ids, 0)
  greedy_accepted = has & (greedy_ids == d)
  V = logits.shape[-1]

  def draw(_):
    # One uniform per row draws by the inverse CDF over the row's probabilities, in token
    # order (`inverse_cdf`), and serves sampling and verification alike: with q a point
    # mass on x, normalize([p - q]+) is p without x, renormalised, which the same draw
    # over the weights less x samples exactly. A row draws the same token whichever
    # branch runs: the filter (top-k / top-p / min-p) only zeroes weights.
    keys = row_keys(seed, counter)
    u_draw = jax.vmap(jax.random.uniform)(keys)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)

    needs = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)
    if min_p is not None:
      needs |= min_p > 0

    def choose(filtered):
      # a row without top-k / top-p / min-p keeps every token, so the filter only masks:
      # a row draws the same token whichever branch its batch mates select
      scaled, keep = (filter_mask(logits, temperature, top_k, top_p, min_p,
                                  rows=temperature > 0) if filtered else
                      (scale_by_temperature(logits, temperature), None))
      masked = scaled if keep is None else jnp.where(keep, scaled, -jnp.inf)
      mx = jnp.max(masked, axis=-1, keepdims=True)
      w = jnp.exp(masked - jnp.where(jnp.isfinite(mx), mx, 0.0))  # 0 where dropped
      at_draft = has[:, None] & (jnp.arange(V)[None, :] == d[:, None])
      p_draft = (jnp.take_along_axis(w, d[:, None], axis=-1)[:, 0] /
                 jnp.maximum(jnp.sum(w, axis=-1), jnp.finfo(jnp.float32).tiny))
      return inverse_cdf(jnp.where(at_draft, 0.0, w), u_draw), p_draft

    ids, p_draft = jax.lax.cond(jnp.any(needs & (temperature > 0)),
                                lambda _: choose(True), lambda _: choose(False), None)
    accepted = has & (u < p_draft)  # with probability min(1, p(x) / q(x)) = p(x)
    sampled = temperature > 0
    return (jnp.where(sampled, jnp.where(accepted, d, ids), greedy_ids),
            jnp.where(sampled, accepted, greedy_accepted))

  token, accepted = jax.lax.cond(jnp.any(temperature > 0), draw,
                                 lambda _: (greedy_ids, greedy_accepted), None)
  return token, _logprob_of(raw, token), accepted  # an accepted row's token is its draft
