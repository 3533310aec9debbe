"""Sampling on device: greedy, temperature, top-k, top-p with per-row parameters.

Every parameter is an array, so a new temperature or seed never recompiles. The random
stream of a request is keyed by (seed, output index): the same request samples the same
tokens whatever else shares its batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _filtered_logits(logits, temperature, top_k, top_p, min_p=None):
  """Scale by temperature and mask outside top-k / top-p (and below min_p times the most
  likely token's probability, when given). Returns (masked sorted logits, sorted token
  ids), both [S, V]."""
  V = logits.shape[-1]
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
  scaled = logits / t
  order = jnp.argsort(-scaled, axis=-1)
  srt = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(V)[None, :]
  k = jnp.where(top_k > 0, top_k, V)[:, None]
  keep = rank < k
  probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
  keep &= (before < top_p[:, None]) | (rank == 0)
  if min_p is not None:  # relative to the most likely token, after temperature (vLLM)
    p_all = jax.nn.softmax(srt, axis=-1)
    keep &= (p_all >= min_p[:, None] * p_all[:, :1]) | (rank == 0)
  return jnp.where(keep, srt, -jnp.inf), order


def filtered_probs(logits, temperature, top_k, top_p, min_p=None):
  """The distribution actually sampled from, [S, V] in vocabulary order (speculative
  verification applies the same filter to target and draft, 8.5.1)."""
  masked, order = _filtered_logits(logits, temperature, top_k, top_p, min_p)
  p_sorted = jax.nn.softmax(masked, axis=-1)
  rows = jnp.arange(logits.shape[0])[:, None]
  return jnp.zeros_like(p_sorted).at[rows, order].set(p_sorted)


def row_keys(seed, counter):
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, counter)


def _sample_ids(logits, temperature, top_k, top_p, seed, counter, min_p=None):
  """(sampled ids [S], argmax ids [S]): greedy rows take the argmax."""
  greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(_):
    masked, order = _filtered_logits(logits, temperature, top_k, top_p, min_p)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(row_keys(seed, counter))
    pick = jnp.argmax(masked + g, axis=-1)
    ids = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, ids, greedy_ids)

  return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy_ids, None), greedy_ids


def _logprob_of(logits, ids):
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ids[:, None], axis=-1)[:, 0]


def sample(logits, temperature, top_k, top_p, seed, counter):
  """logits [S, V] f32 -> (token ids [S] int32, logprob of each under the model [S] f32)."""
  ids, _ = _sample_ids(logits, temperature, top_k, top_p, seed, counter)
  return ids, _logprob_of(logits, ids)


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


TOP_LOGPROBS = 20  # alternatives a step returns per row when any request asks (OpenAI's max)


def sample_rows(logits, temperature, top_k, top_p, seed, counter, draft_ids, token_mask=None,
                min_p=None, raw_logits=None):
  """Sample every logits row; rows with a draft token (draft_ids >= 0) also verify it.

  token_mask (structured output): tokens outside it are never sampled and a draft
  outside it is rejected like any mismatch; the returned logprob stays the model's own
  (unmasked) log-probability of the token, as vLLM's default reports it. min_p: per-row
  min-p filter. raw_logits: the model's logits when `logits` were processed (penalties,
  logit_bias): logprobs are reported under them.

  The drafters here draft deterministically (greedy draft model, context lookup), so q
  is a point mass on the draft token and rejection_sample accepts it with probability
  p(x) and otherwise resamples from p without x: exact for any temperature / top-k /
  top-p. Greedy rows accept iff the draft is the target's argmax (then the argmax is
  the correction). Returns (token [S], logprob [S], accepted [S] bool)."""
  raw = logits if raw_logits is None else raw_logits
  if token_mask is not None:
    logits = apply_token_mask(logits, token_mask)
  ids, greedy_ids = _sample_ids(logits, temperature, top_k, top_p, seed, counter, min_p)
  has = draft_ids >= 0
  d = jnp.where(has, draft_ids, 0)
  greedy_ok = greedy_ids == d

  def lossless(_):
    p = filtered_probs(logits, temperature, top_k, top_p, min_p)
    q = jax.nn.one_hot(d, logits.shape[-1], dtype=p.dtype)
    keys = row_keys(seed, counter)
    tok, acc = jax.vmap(lambda pp, qq, dd, kk: rejection_sample(pp[None], qq[None], dd[None], kk))(
        p, q, d, keys)
    return tok[:, 0], acc[:, 0]

  sampled_draft = has & (temperature > 0)
  tok_s, acc_s = jax.lax.cond(jnp.any(sampled_draft), lossless, lambda _: (ids, greedy_ok), None)
  accepted = has & jnp.where(temperature > 0, acc_s, greedy_ok)
  token = jnp.where(has & (temperature > 0), tok_s, ids)
  return token, _logprob_of(raw, jnp.where(accepted, d, token)), accepted
