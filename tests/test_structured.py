"""Structured output: 20 JSON Schemas on SmolLM2 under batching, chunked prefill, prefix
hits and n-gram speculation, every output validated with `jsonschema` and checked
token by token against a constrained full-recompute greedy decode; free requests in the
same batch keep their greedy output; bad constraints fail before anything is queued."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from experiments.common import ROOT
from helpers import check_constrained_greedy
from jaxinfer import sampling
from jaxinfer.config import SamplingParams
from jaxinfer.structured import GrammarCompiler, unconstrained_rows

jsonschema = pytest.importorskip("jsonschema")

CASES = json.load(open(os.path.join(ROOT, "configs", "structured", "schemas.json")))
FREE = ["Name three planets.", "What is 7 times 6?"]


def _pack(allowed_ids, V):
  rows = np.zeros((len(allowed_ids), (V + 31) // 32), np.int32)
  for r, ids in enumerate(allowed_ids):
    bits = np.zeros(rows.shape[1] * 32, np.uint8)
    bits[list(ids)] = 1
    rows[r] = np.packbits(bits, bitorder="little").view(np.int32)
  return jnp.asarray(rows)


def test_the_mask_restricts_sampling_and_rejects_drafts_outside_it():
  """Greedy picks the best allowed token; sampling draws from the renormalized allowed
  distribution (chi-square); a draft outside the mask is never accepted, one inside is
  accepted with its masked probability; the logprob is the model's own."""
  V = 40
  logits = jnp.asarray(np.log(np.r_[[0.4, 0.3, 0.2, 0.1], np.full(V - 4, 1e-6)]), jnp.float32)
  n = 20000
  L = jnp.broadcast_to(logits, (n, V))
  f = lambda a, dt=jnp.float32: jnp.full((n,), a, dt)  # noqa: E731
  mask = jnp.broadcast_to(_pack([{1, 3, 37}], V), (n, 2))
  args = (f(0, jnp.int32), f(1.0), jnp.arange(n, dtype=jnp.uint32), f(0, jnp.int32))
  tok, lp, _ = sampling.sample_rows(L, f(0.0), *args, f(-1, jnp.int32), mask)
  assert set(np.asarray(tok).tolist()) == {1}
  np.testing.assert_allclose(np.asarray(lp), np.log(0.3), rtol=1e-4)
  tok, _, _ = sampling.sample_rows(L, f(1.0), *args, f(-1, jnp.int32), mask)
  counts = np.bincount(np.asarray(tok), minlength=V)
  assert counts[[0, 2]].sum() == 0
  p = np.array([0.3, 0.1, 1e-6]) / (0.4 + 1e-6)
  assert stats.chisquare(counts[[1, 3, 37]], n * p / p.sum()).pvalue > 1e-3
  for temp in (0.0, 1.0):  # draft 0 is the unmasked argmax but outside the mask
    tok, _, acc = sampling.sample_rows(L, f(temp), *args, f(0, jnp.int32), mask)
    assert not np.asarray(acc).any() and 0 not in set(np.asarray(tok).tolist())
  _, _, acc = sampling.sample_rows(L, f(1.0), *args, f(3, jnp.int32), mask)
  assert abs(float(jnp.mean(acc)) - 0.1 / 0.4) < 0.02


@pytest.fixture(scope="module")
def compiler(smollm2):
  return GrammarCompiler(smollm2.tokenizer, smollm2.cfg.vocab_size, smollm2.cfg.eos_token_ids)


def test_bad_constraints_fail_before_anything_is_queued(smollm2):
  from jaxinfer import LLM
  llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32)
  good = SamplingParams(max_tokens=4)
  for sp, words in [
      (SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}),
       "invalid json_schema: Invalid type: strin"),
      (SamplingParams(regex="a(b"), "invalid regex"),
      (SamplingParams(grammar="start: foo"), 'unknown name: "foo"'),
      (SamplingParams(grammar="root ::= ( "), "invalid grammar"),
      (SamplingParams(regex=r"[^\s\S]"), "regex admits no string"),
      (SamplingParams(grammar="start: start"), "grammar admits no string"),
      (SamplingParams(grammar="start: " + " | ".join(f'"o{i}"' for i in range(2100))),
       "grammar cannot be served: after 1 tokens.*max is 2000")]:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
      llm.generate(["hi", "there"], [good, sp])
    assert not llm.engine.requests and not llm.engine.has_unfinished()
  for kw, words in [(dict(json_schema="[1]"), "must be a JSON object"),
                    (dict(json_schema="{x"), "not valid JSON"),
                    (dict(choice=[]), "non-empty list"), (dict(regex=3), "non-empty string"),
                    (dict(regex="a", choice=["a"]), "at most one")]:
    with pytest.raises(ValueError, match=words):
      SamplingParams(**kw)
  # A GBNF grammar and a Lark grammar both compile; the engine follows them.
  outs = llm.generate(["Pick a letter.", "Pick a letter."],
                      [SamplingParams(max_tokens=8, grammar='root ::= "a" | "b" "c"'),
                       SamplingParams(max_tokens=8, grammar='start: "x" | "yz"')])
  assert outs[0].text in ("a", "bc") and outs[1].text in ("x", "yz")
  many = [f"o/{i}|x" for i in range(2100)] + ["é (ü)"]  # one regex lexeme: no row limit
  outs = llm.generate(["Pick one."] * 2, [SamplingParams(max_tokens=12, choice=many),
                                          SamplingParams(max_tokens=12, choice=["é (ü)"])])
  assert outs[0].text in many and outs[1].text == "é (ü)"
  assert all(o.finish_reason == "stop" for o in outs)
  assert all(o.finish_reason == "stop" for o in outs)
  # Stop strings still cut a constrained answer.
  o = llm.generate("Say something.", SamplingParams(max_tokens=16, regex="hello world[.!]",
                                                    stop=" world"))[0]
  assert o.text == "hello" and o.finish_reason == "stop"


def _run_schemas(llm, expect_free, cases):
  sps = [SamplingParams(max_tokens=160, json_schema=c["schema"]) for c in cases]
  outs = llm.generate([c["prompt"] for c in cases] + FREE,
                      sps + [SamplingParams(max_tokens=24)] * len(FREE), chat=True)
  for c, o in zip(cases, outs):
    assert o.finish_reason == "stop", (c["name"], o.text)
    jsonschema.validate(json.loads(o.text), c["schema"])
  assert [o.token_ids for o in outs[len(cases):]] == expect_free  # free greedy: unchanged
  return outs


# Every third schema by default (7 of 20, each kind of construct); all twenty, and the same
# batch again under speculation, when slow tests run (drafts under a mask are checked by
# test_the_mask_restricts_sampling_and_rejects_drafts_outside_it by default).
@pytest.mark.parametrize("every", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_schemas_batched_chunked_prefix_hits_and_speculation(smollm2, compiler, every):
  cases = CASES[::every]
  from jaxinfer import LLM
  kw = dict(warmup=False, max_num_seqs=32, max_num_batched_tokens=64, num_pages=512,
            max_model_len=512, prefix_cache=True, policy="chunked")
  base = LLM(smollm2, **kw)
  free = [o.token_ids for o in base.generate(FREE, SamplingParams(max_tokens=24), chat=True)]
  # Batched with free requests; chat prompts of ~40-60 tokens in chunks of <= 64 tokens per
  # step shared by all requests; the chat template's system text is a cached prefix.
  outs = _run_schemas(base, free, cases)
  assert sum(base.engine.requests[i].cached_tokens for i in base.engine.requests) > 0
  chunks = {}
  for st in base.engine.steps:
    for rid, _, is_prefill in st.members:
      chunks[rid] = chunks.get(rid, 0) + is_prefill
  assert max(chunks.values()) > 1  # some prompt was prefilled in several chunks
  assert base.engine.mask_time_s > 0
  reqs = [r for r in base.engine.requests.values() if r.sampling.constraint is not None]
  for r in reqs:  # token by token: the constrained full-recompute greedy decode
    check_constrained_greedy(smollm2.cfg, smollm2.params, compiler, r)
  if every != 1:
    return
  # The same under n-gram speculation (drafts verified under the mask), with masks filled
  # while the forward runs (two dispatches, an accelerator's default): identical output.
  spec = LLM(smollm2, speculative="ngram", num_draft=3, **kw)
  assert not spec.executor.overlap_masks  # XLA:CPU's default: one fused step
  spec.executor.overlap_masks = True
  outs2 = _run_schemas(spec, free, cases)
  assert [o.token_ids for o in outs2] == [o.token_ids for o in outs]
  assert sum(r.spec_drafted for r in spec.engine.requests.values()) > 0


def test_a_dead_end_constraint_ends_only_its_request(smollm2):
  """When a constraint allows no next token, the request ends (finish_reason
  "constraint", no unconstrained token emitted, pages freed) and its batch goes on."""
  from jaxinfer import LLM
  llm = LLM(smollm2, warmup=False, max_num_seqs=4, max_num_batched_tokens=32)
  llm.executor.overlap_masks = True  # the request ends after its step was dispatched
  want = llm.generate(["Count to five."], SamplingParams(max_tokens=8), chat=True)[0]
  comp = llm.engine.grammar_compiler()
  real_fill = comp.fill
  sp = SamplingParams(max_tokens=30, regex="[a-z ]+")

  def fill(rows, out):  # the constraint dead-ends after 3 tokens (fault injection)
    real_fill(rows, out)
    for g, i, _ in rows:
      if llm.engine.requests["doomed"].grammar is g and \
          len(llm.engine.requests["doomed"].output_token_ids) >= 3:
        out[i] = 0

  comp.fill = fill
  try:
    doomed = llm.engine.add_request(llm.encode_prompt("Say hi.", chat=True), sp,
                                    request_id="doomed")
    free = llm.engine.add_request(want.prompt_token_ids, SamplingParams(max_tokens=8))
    events = list(llm.engine.stream())
  finally:
    comp.fill = real_fill
  assert doomed.finish_reason == "constraint" and len(doomed.output_token_ids) == 3
  assert "no token satisfies the regex constraint" in doomed.error
  ends = [e for e in events if e.request_id == "doomed" and e.finished]
  assert len(ends) == 1 and ends[0].token_id == -1
  assert free.output_token_ids == want.token_ids
  assert llm.engine.pm.num_free == llm.engine.pm.num_pages


def test_cli_checks_a_constraint_before_loading():
  for args, words in [(["--regex", "a("], "invalid regex"),
                      (["--regex", "a", "--choice", "b"], "at most one of"),
                      (["--json_schema", "/nonexistent.json"], "--json_schema=/nonexistent")]:
    p = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and words in p.stderr, p.stderr


def test_compiler_masks_follow_the_grammar(compiler, smollm2):
  """The masks of a choice constraint, with and without drafts: after each prefix only
  the continuations of the choices are allowed, and the end of text only at the end."""
  tok = smollm2.tokenizer
  g = compiler.matcher("choice", ["yes sir", "no"])
  ids = tok.encode("yes sir", add_special_tokens=False)
  out = unconstrained_rows(len(ids) + 1, compiler.vocab_size)
  compiler.fill([(g, 0, ids)], out)
  bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")
  for j, t in enumerate(ids):
    assert bits[j, t] and bits[j].sum() < 100
  assert bits[len(ids)].nonzero()[0].tolist() == list(smollm2.cfg.eos_token_ids)
  assert g.valid_prefix(ids) == len(ids) and g.valid_prefix([ids[0], ids[0]]) == 1
  assert [g.advance(t) for t in ids] == [None] * (len(ids) - 1) + ["stop"]
