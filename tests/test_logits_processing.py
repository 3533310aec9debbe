"""Logits processing inside the jitted sampler: min_p, presence / frequency / repetition
penalties, logit_bias, min_tokens and top-N logprobs. Each engine path is checked token
by token against a full-recompute greedy decode with the same processing applied on
the host (NumPy), in batches with free requests, chunked prefill and n-gram speculation."""
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from helpers import full_logits
from jaxinfer import sampling
from jaxinfer.config import SamplingParams


def test_min_p_keeps_tokens_above_its_share_of_the_top_probability():
  logits = jnp.asarray(np.log([0.5, 0.3, 0.15, 0.05]), jnp.float32)
  n = 20000
  f = lambda a, dt=jnp.float32: jnp.full((n,), a, dt)  # noqa: E731
  tok, _, _ = sampling.sample_rows(jnp.broadcast_to(logits, (n, 4)), f(1.0), f(0, jnp.int32),
                                  f(1.0), jnp.arange(n, dtype=jnp.uint32), f(0, jnp.int32),
                                  f(-1, jnp.int32), None, f(0.4))  # keep p >= 0.2
  counts = np.bincount(np.asarray(tok), minlength=4)
  assert counts[2:].sum() == 0
  assert stats.chisquare(counts[:2], n * np.array([0.5, 0.3]) / 0.8).pvalue > 1e-3


def test_penalties_by_hand():
  """Repetition 2 over seen tokens {0, 1}: 2 -> 1, -1 -> -2; token 2 unseen stays 0.5;
  then the additive row."""
  logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0]])
  seen = jnp.asarray([[0b0011]], jnp.int32)
  out = sampling.apply_penalties(logits, seen, jnp.asarray([2.0]),
                                 jnp.asarray([[0.0, 0.0, 0.0, -1.5]]))
  np.testing.assert_allclose(np.asarray(out), [[1.0, -2.0, 0.5, 1.5]])


def test_sampling_params_validate_the_new_fields():
  for kw, words in [(dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
                    (dict(repetition_penalty=0), "repetition_penalty"),
                    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
                    (dict(logit_bias={5: 101}), "logit_bias[5]"),
                    (dict(logit_bias={-1: 1}), "logit_bias token id"),
                    (dict(logprobs=21), "logprobs")]:
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
      SamplingParams(**kw)
  assert SamplingParams(logit_bias={7: 1, 3: -2}).logit_bias == ((3, -2.0), (7, 1.0))
  assert not SamplingParams().processes_logits


def _processed(logits, sp, prompt, outs, eos):
  """The host's version of the step's processing for one position (NumPy)."""
  V = logits.shape[-1]
  lg = logits.astype(np.float64).copy()
  seen = np.zeros(V, bool)
  seen[list(prompt) + list(outs)] = True
  r = sp.repetition_penalty
  lg = np.where(seen, np.where(lg > 0, lg / r, lg * r), lg)
  counts = np.bincount(np.asarray(outs, np.int64), minlength=V)[:V]
  lg = lg - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
  for t, b in sp.logit_bias or ():
    lg[t] += b
  if len(outs) < sp.min_tokens:
    lg[list(eos) + list(sp.stop_token_ids)] = -np.inf
  return lg


def _check(smollm2, r, eos, tie=1e-4):
  out = r.output_token_ids
  seq = r.prompt_token_ids + out[:-1]
  logits = full_logits(smollm2.cfg, smollm2.params, seq)
  n = len(r.prompt_token_ids)
  for j, tok in enumerate(out):
    lg = _processed(logits[n - 1 + j], r.sampling, r.prompt_token_ids, out[:j], eos)
    want = int(np.argmax(lg))
    assert tok == want or lg[tok] >= lg[want] - tie, (r.request_id, j, tok, want)


@pytest.mark.parametrize("speculative", [None, pytest.param("ngram", marks=pytest.mark.slow)])
def test_penalties_bias_and_min_tokens_equal_recompute(smollm2, speculative):
  """Plain, and under n-gram speculation (slow): rows with drafts count the drafts before
  them, rows without drafts are the plain path."""
  from jaxinfer import LLM
  from jaxinfer.buckets import BucketTable
  kw = dict(speculative=speculative, num_draft=3) if speculative else {}
  # one tier per bucket dimension: the steps compile a few shapes instead of fourteen (the
  # bucket choice is covered by test_buckets; this test is about the logits processors)
  one_tier = BucketTable(token_sizes=(32,), request_sizes=(8,), page_table_sizes=(16,),
                         query_sizes=(1, 32), prefill_slot_sizes=(8,))
  llm = LLM(smollm2, warmup=False, max_num_seqs=8, max_num_batched_tokens=32,
            max_model_len=256, num_pages=256, buckets=one_tier, **kw)
  tok = smollm2.tokenizer
  eos = tuple(llm.engine.eos_token_ids)
  prompts = ["List the days of the week.", "Repeat after me: la la la la la.",
             "Say yes.", "Count: 1, 2, 3, 4,", "What is the capital of France?"]
  sps = [SamplingParams(max_tokens=24, frequency_penalty=1.2, presence_penalty=0.3),
         SamplingParams(max_tokens=24, repetition_penalty=1.8),
         SamplingParams(max_tokens=24, min_tokens=12),
         SamplingParams(max_tokens=24, logit_bias={tok.encode(" 5", False)[-1]: -100.0,
                                                   tok.encode("5", False)[-1]: -100.0},
                        presence_penalty=-0.5),
         SamplingParams(max_tokens=24)]  # free, in the same batches
  free = llm.generate(prompts[-1], sps[-1], chat=True)[0].token_ids
  outs = llm.generate(prompts, sps, chat=True)
  assert outs[-1].token_ids == free
  assert len(outs[2].token_ids) >= 12
  assert not set(outs[2].token_ids[:12]) & set(eos)
  for r in llm.engine.requests.values():
    _check(smollm2, r, eos)
  if speculative:
    reqs = list(llm.engine.requests.values())
    assert sum(r.spec_drafted for r in reqs) > 0
    assert any(st.drafted == 0 and st.num_decode_tokens > 0 for st in llm.engine.steps)


def test_top_logprobs_are_the_models_most_likely_tokens(smollm2):
  from jaxinfer import LLM
  llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32)
  o, plain = llm.generate(["Name a fruit.", "Name a fruit."],
                          [SamplingParams(max_tokens=6, logprobs=5),
                           SamplingParams(max_tokens=6)], chat=True)
  assert o.token_ids == plain.token_ids and plain.top_logprobs == []
  seq = o.prompt_token_ids + o.token_ids[:-1]
  logits = full_logits(smollm2.cfg, smollm2.params, seq)
  n = len(o.prompt_token_ids)
  assert len(o.top_logprobs) == len(o.token_ids)
  for j, alts in enumerate(o.top_logprobs):
    lp = logits[n - 1 + j] - np.logaddexp.reduce(logits[n - 1 + j])
    want = np.argsort(-lp)[:5]
    assert [a for a, _ in alts][:2] == want[:2].tolist()  # ties deeper may swap
    got = np.array([v for _, v in alts])
    ref = lp[[a for a, _ in alts]]
    np.testing.assert_allclose(got, ref, atol=1e-2)  # paged decode vs one prefill (f32)
    np.testing.assert_allclose(got - got[0], ref - ref[0], atol=1e-3)
    assert np.all(np.diff(got) <= 0)
    assert alts[0][0] == o.token_ids[j] and abs(alts[0][1] - o.logprobs[j]) < 1e-4
