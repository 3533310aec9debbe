"""Sampling on device: greedy, temperature, top-k, top-p with per-row parameters.

Every parameter is an array, so a new temperature or seed never recompiles. The random
stream of a request is keyed by (seed, output index): the same request samples the same
tokens whatever else shares its batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax(x):
  """jnp.argmax over the last axis of [S, V] (the first index of each row's maximum), in
  blocks of 128 columns: each block's max, the first block holding the row's max, then the
  first index inside it. XLA:CPU runs argmax's variadic reduction about 10x slower than a
  max: over [64, 49152] logits 7.9 ms against 0.67 ms this way. (A NaN row, which the
  engine fails by its non-finite logprob, may get another index than jnp.argmax's.)"""
  S, V = x.shape
  B = next((b for b in (128, 64, 32, 16, 8) if V % b == 0 and V > b), None)
  if B is None:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  xb = x.reshape(S, V // B, B)
  blk = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
  inner = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
  return (blk * B + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


# The most likely tokens of each row that top-k / top-p / min-p filter among before any full
# sort: lax.top_k of 256 over [64, 49152] logits takes 18 ms on XLA:CPU, where argsort took
# 1.5 s (a 20-30 ms sort at batch 1, as long as the model step).
CANDIDATES = 256


def _keep(srt, k_eff, top_p, min_p, lse_k, lse_all):
  """[S, W] bool over each row's W sorted (descending) scaled logits: the tokens top-k,
  top-p and min-p keep, a prefix of every row. lse_k: logsumexp over the row's top k_eff
  (top-p's normalisation); lse_all: over the whole row (min-p's). The first CANDIDATES
  columns are summed on their own, so the candidates' decisions are the same bits whether
  W is CANDIDATES or the vocabulary."""
  W = srt.shape[-1]
  rank = jnp.arange(W)[None, :]
  keep = rank < k_eff[:, None]
  probs = jnp.where(keep, jnp.exp(srt - lse_k[:, None]), 0.0)
  C = min(W, CANDIDATES)
  cs = jnp.cumsum(probs[:, :C], axis=-1)
  if W > C:
    cs = jnp.concatenate([cs, cs[:, -1:] + jnp.cumsum(probs[:, C:], axis=-1)], axis=-1)
  # mass ranked above < top_p; top_p >= 1 filters nothing (float32 sums reach 1.0
  # before the tail's last tokens)
  keep &= (cs - probs < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
  if min_p is not None:  # relative to the most likely token, after temperature (vLLM)
    p_all = jnp.exp(srt - lse_all[:, None])
    keep &= (p_all >= min_p[:, None] * p_all[:, :1]) | (rank == 0)
  return keep


def with_filter(logits, temperature, top_k, top_p, min_p, rows, then):
  """then(masked, order): `masked` [S, W] the temperature-scaled logits of each row's
  tokens in descending order, -inf outside top-k / top-p / min-p, `order` [S, W] their
  token ids. Exact for the rows in `rows` [S] bool: W = CANDIDATES (lax.top_k) when
  every such row's kept tokens lie among its candidates, else W = V (a full argsort)."""
  V = logits.shape[-1]
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
  scaled = logits / t
  k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
  lse_all = jax.nn.logsumexp(scaled, axis=-1)
  C = min(CANDIDATES, V)
  cand, idx = jax.lax.top_k(scaled, C)
  rank = jnp.arange(C)[None, :]
  lse_cand = jax.nn.logsumexp(jnp.where(rank < k_eff[:, None], cand, -jnp.inf), axis=-1)
  small_k = k_eff <= C
  lse_fast = jnp.where(small_k, lse_cand, lse_all)

  def fast(_):
    keep = _keep(cand, k_eff, top_p, min_p, lse_fast, lse_all)
    return then(jnp.where(keep, cand, -jnp.inf), idx)

  if C == V:
    return fast(None)

  def full(_):
    order = jnp.argsort(-scaled, axis=-1)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    top = jnp.arange(V)[None, :] < k_eff[:, None]
    lse_sorted = jax.nn.logsumexp(jnp.where(top, srt, -jnp.inf), axis=-1)
    lse_k = jnp.where(small_k, lse_cand, jnp.where(k_eff == V, lse_all, lse_sorted))
    keep = _keep(srt, k_eff, top_p, min_p, lse_k, lse_all)
    return then(jnp.where(keep, srt, -jnp.inf), order)

  # A row's kept prefix ends inside its candidates when top-k does (k <= C), when the
  # candidates' mass reaches top_p (rank C is then dropped), or when the last candidate is
  # already below min_p; the candidates alone normalise top-p only for k <= C or k = V.
  probs = jnp.where(rank < k_eff[:, None], jnp.exp(cand - lse_fast[:, None]), 0.0)
  ends = small_k | ((top_p < 1.0) & (jnp.cumsum(probs, axis=-1)[:, -1] >= top_p))
  if min_p is not None:
    ends |= jnp.exp(cand[:, -1] - lse_all) < min_p * jnp.exp(cand[:, 0] - lse_all)
  covered = ends & (small_k | (k_eff == V))
  return jax.lax.cond(jnp.all(covered | ~rows), fast, full, None)


def filtered_probs(logits, temperature, top_k, top_p, min_p=None):
  """The distribution actually sampled from, [S, V] in vocabulary order (speculative
  verification applies the same filter to target and draft, 8.5.1)."""
  S, V = logits.shape

  def dense(masked, order):
    rows = jnp.arange(S)[:, None]
    return jnp.zeros((S, V), jnp.float32).at[rows, order].set(jax.nn.softmax(masked, -1))
  return with_filter(logits, temperature, top_k, top_p, min_p, jnp.ones((S,), bool), dense)


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
    # One Gumbel draw per row, indexed by token id, serves sampling and verification
    # alike: with q a point mass on x, normalize([p - q]+) is p without x, renormalised,
    # which the Gumbel-max over the support less x samples exactly. A row draws the same
    # token whichever branch runs: the sort (top-k / top-p / min-p) only masks tokens.
    keys = row_keys(seed, counter)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(keys)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)

    def unfiltered():
      scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
      at_draft = has[:, None] & (jnp.arange(V)[None, :] == d[:, None])
      lse = jax.nn.logsumexp(scaled, axis=-1)
      p_draft = jnp.exp(jnp.take_along_axis(scaled, d[:, None], axis=-1)[:, 0] - lse)
      return argmax(jnp.where(at_draft, -jnp.inf, scaled) + g), p_draft

    def pick(masked, order):  # among the kept tokens only
      at_draft = has[:, None] & (order == d[:, None])
      p_draft = jnp.sum(jnp.where(at_draft, jax.nn.softmax(masked, axis=-1), 0.0), axis=-1)
      best = argmax(jnp.where(at_draft, -jnp.inf, masked) + jnp.take_along_axis(g, order, -1))
      return jnp.take_along_axis(order, best[:, None], axis=-1)[:, 0].astype(jnp.int32), p_draft

    needs = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)
    if min_p is not None:
      needs |= min_p > 0
    needs &= temperature > 0
    plain = unfiltered()  # rows without a filter sample from the whole vocabulary
    kept = jax.lax.cond(
        jnp.any(needs),
        lambda _: with_filter(logits, temperature, top_k, top_p, min_p, needs, pick),
        lambda _: plain, None)
    ids = jnp.where(needs, kept[0], plain[0])
    p_draft = jnp.where(needs, kept[1], plain[1])
    accepted = has & (u < p_draft)  # with probability min(1, p(x) / q(x)) = p(x)
    sampled = temperature > 0
    return (jnp.where(sampled, jnp.where(accepted, d, ids), greedy_ids),
            jnp.where(sampled, accepted, greedy_accepted))

  token, accepted = jax.lax.cond(jnp.any(temperature > 0), draw,
                                 lambda _: (greedy_ids, greedy_accepted), None)
  return token, _logprob_of(raw, token), accepted  # an accepted row's token is its draft
