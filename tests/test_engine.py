"""The engine on SmolLM2: every path equals a plain full-recompute greedy decode; a warm
engine never recompiles; the simulator makes the same scheduling decisions."""
import numpy as np
import pytest

from helpers import recompute_greedy
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.executors.jax_executor import JaxExecutor
from jaxinfer.executors.sim_executor import AffineStepModel, SimExecutor
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig
from jaxinfer.step import num_compiled_steps

TABLE = BucketTable(token_sizes=(4, 16, 32), request_sizes=(4,), page_table_sizes=(8,))


def make(smollm2, num_pages=64, page_size=8, tokenizer=None, kv_format="f32", **cfg_kw):
  cfg = SchedulerConfig(**{"policy": "chunked", "max_running": 4, "token_budget": 32,
                           "chunk_size": 16, **cfg_kw})
  ex = JaxExecutor(smollm2.cfg, smollm2.params, num_pages=num_pages, page_size=page_size,
                   kv_format=kv_format)
  return Engine(ex, cfg, buckets=TABLE, prefix_cache=True, tokenizer=tokenizer)


def prompts(n, length, seed, shared=()):
  rng = np.random.default_rng(seed)
  return [list(shared) + rng.integers(100, 40000, length).tolist() for _ in range(n)]


def check_against_oracle(smollm2, reqs, n_out):
  for r in reqs:
    assert r.output_token_ids == recompute_greedy(smollm2.cfg, smollm2.params,
                                                  r.prompt_token_ids, n_out), r.request_id


def test_chunked_prefix_hits_and_preemption_equal_recompute(smollm2):
  """Chunks of 16 under a 32-token budget, a second wave that hits a 16-token cached
  prefix, and a pool of 12 pages of 8 tokens without reservation: preemptions happen (the
  speculative tests' pool size: their steps compile once for both)."""
  eng = make(smollm2, num_pages=12, reserve="none")
  shared = list(range(2000, 2016))
  wave1 = prompts(3, 13, seed=1, shared=shared)
  sp = SamplingParams(max_tokens=6, ignore_eos=True)
  reqs = [eng.add_request(p, sp) for p in wave1]
  eng.run()
  reqs2 = [eng.add_request(p, sp) for p in prompts(2, 9, seed=2, shared=shared)]
  eng.run()
  assert eng.scheduler.num_preemptions > 0
  assert sum(r.cached_tokens for r in reqs2) >= 16
  check_against_oracle(smollm2, reqs + reqs2, 6)
  eng.pm.check_invariants(eng.cache.owned_refs())


@pytest.mark.parametrize("fmt", [pytest.param("fp8", marks=pytest.mark.slow),
                                 pytest.param("q8_0", marks=pytest.mark.slow), "q4_0"])
def test_quantized_kv_prefix_hit_equals_its_own_chunked_run(smollm2, fmt):
  """Quantized KV (8.4.2) has no f32 recompute oracle: a prefill chunk attends to its own
  new tokens unquantized and to earlier chunks through the pool, as vLLM's does. Its
  oracle is the same engine: with chunks aligned to pages, a request whose first 32
  tokens come from the prefix cache reads the very bytes (codes and scales) its own
  chunked run wrote, so the greedy tokens must be identical; its copy-on-write tail page
  and a concurrent neighbour must not disturb them."""
  eng = make(smollm2, page_size=16, kv_format=fmt)
  shared = list(range(3000, 3032))
  (p,) = prompts(1, 7, seed=5, shared=shared)
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  first = eng.add_request(p, sp)
  eng.run()
  again = eng.add_request(p, sp)
  other = eng.add_request(prompts(1, 20, seed=6, shared=shared)[0], sp)
  eng.run()
  assert again.cached_tokens == 32 and other.cached_tokens == 32
  assert again.output_token_ids == first.output_token_ids
  eng.pm.check_invariants(eng.cache.owned_refs())


@pytest.mark.parametrize("model", [pytest.param("smollm2", marks=pytest.mark.slow),
                                   "tiny_smollm2"])
def test_warm_engine_never_recompiles(request, model):
  """Warmed with structured=True: plain and grammar-masked steps of every shape."""
  m = request.getfixturevalue(model)
  eng = make(m, tokenizer=m.tokenizer)
  eng.warmup(structured=True)
  before = num_compiled_steps()
  rng = np.random.default_rng(3)
  constraints = [{}, {"regex": "[a-z ]+"}, {"json_object": True}]
  for i in range(9):  # mixed lengths, arrivals, sampling parameters, constraints
    eng.add_request(rng.integers(100, 40000, int(rng.integers(1, 40))).tolist(),
                    SamplingParams(max_tokens=int(rng.integers(1, 8)), temperature=0.7 * (i % 2),
                                   top_p=0.9, seed=i, ignore_eos=True, **constraints[i % 3]))
    eng.step()
  eng.run()
  assert eng.mask_time_s > 0  # masked steps ran
  assert num_compiled_steps() == before, "a warm engine compiled a new shape"


def test_sim_and_real_make_the_same_decisions(smollm2):
  trace = prompts(5, 20, seed=4)
  lens = [3, 7, 2, 5, 4]

  def decisions(eng):
    for p, n in zip(trace, lens):
      eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=0.0)
    eng.run()
    return [tuple(s.members) for s in eng.steps]

  real = decisions(make(smollm2))
  cfg = SchedulerConfig("chunked", 4, 32, 16)
  sim = decisions(Engine(SimExecutor(AffineStepModel(), num_pages=64, page_size=8), cfg,
                         buckets=TABLE, prefix_cache=True))
  assert real == sim


# Every drafter in the default suite: the draft model with adaptive draft lengths on
# SmolLM2, fixed-length n-gram and early exit on the 2-layer random model (its greedy
# output repeats itself, so drafts are accepted there too); n-gram and early exit on
# SmolLM2 in the slow suite.
@pytest.mark.parametrize("model,drafter,adaptive", [
    pytest.param("smollm2", "ngram", False, marks=pytest.mark.slow),
    pytest.param("smollm2", "ngram", True, marks=pytest.mark.slow),
    pytest.param("smollm2", "early_exit", False, marks=pytest.mark.slow),
    ("smollm2", "draft_model", True),
    ("tiny_smollm2", "ngram", False), ("tiny_smollm2", "early_exit", False)])
def test_speculative_greedy_equals_plain_greedy(request, model, drafter, adaptive):
  """Drafts verified in the target step: token-for-token the plain greedy output, under
  batching, chunking and (reserve='none', small pool) preemption."""
  from jaxinfer.executors.drafters import make_drafter
  from jaxinfer.runtime import speculative
  smollm2 = request.getfixturevalue(model)
  tok = smollm2.tokenizer
  texts = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
           "the cat sat on the mat. the cat sat on the mat. the cat",
           "Once upon a time"]
  prompts = [tok.encode(t) for t in texts]
  sp = SamplingParams(max_tokens=12, ignore_eos=True)
  plain = make(smollm2, num_pages=64)
  want = [plain.add_request(p, sp) for p in prompts]
  plain.run()
  cfg = SchedulerConfig("chunked", 4, 32, 16, reserve="none")
  ex = JaxExecutor(smollm2.cfg, smollm2.params, num_pages=12, page_size=8)
  # The draft model here is the target itself (same tokenizer): its drafts are the target's
  # own greedy choices, so nearly all are accepted.
  exit_layers = min(20, smollm2.cfg.num_layers - 1)
  d = make_drafter(drafter, early_exit_layers=exit_layers, draft_model=smollm2, draft_pages=12)
  eng = Engine(ex, cfg, buckets=TABLE, drafter=d,
               draft_policy=speculative.DraftLengthPolicy(num_draft=4, adaptive=adaptive))
  got = [eng.add_request(p, sp) for p in prompts]
  eng.run()
  for w, g in zip(want, got):
    assert g.output_token_ids == w.output_token_ids
  s = speculative.summarize(got)
  assert s["rounds"] > 0 and s["accepted"] > 0  # the repetitive prompts do accept drafts
  assert s["mean_tokens_per_round"] > 1.0
  if drafter == "draft_model":
    assert s["accepted"] >= 0.8 * s["drafted"]
    eng.drafter.pm.check_invariants()
    assert eng.drafter.pm.num_free == eng.drafter.pm.num_pages  # its KV released too
  eng.pm.check_invariants()
  assert eng.pm.num_free == eng.pm.num_pages


@pytest.mark.slow
def test_warm_speculative_engine_with_prefix_hits_and_host_tier_never_recompiles(smollm2):
  """Warm-up covers every shape the configuration runs: verify steps (logits at every
  token), the early-exit draft steps, and the host tier's page copies; a mixed run with
  prefix hits, evictions to the host tier and verified drafts then compiles nothing."""
  from jaxinfer import step as step_mod
  from jaxinfer.executors.drafters import make_drafter
  from jaxinfer.runtime import speculative
  table = BucketTable(token_sizes=(8, 16), request_sizes=(2,), page_table_sizes=(8,))
  ex = JaxExecutor(smollm2.cfg, smollm2.params, num_pages=12, page_size=8)
  eng = Engine(ex, SchedulerConfig("chunked", 2, 16, 8), buckets=table, prefix_cache=True,
               host_cache_pages=8, drafter=make_drafter("early_exit", early_exit_layers=10),
               draft_policy=speculative.DraftLengthPolicy(num_draft=3))
  eng.warmup()
  # page copies and host-tier moves compile per power-of-two count: warm the small ones
  for n in (1, 2, 4):
    ex.copy_pages([(0, 1)] * n)
    ex.offload_pages([(0, 100 + i) for i in range(n)])
    ex.fetch_pages([(100 + i, 1) for i in range(n)])
  jitted = (step_mod.copy_pages_jit, step_mod.read_pages_jit, step_mod.write_pages_jit)
  before = [num_compiled_steps()] + [f._cache_size() for f in jitted]
  shared = smollm2.tokenizer.encode("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,")
  sp = SamplingParams(max_tokens=6, ignore_eos=True)
  for i in range(5):
    eng.add_request(shared + [100 + i], sp)
    eng.step()
  eng.run()
  assert eng.cache.stats.device_hit_tokens + eng.cache.stats.host_hit_tokens > 0
  assert sum(r.spec_rounds for r in eng.requests.values()) > 0
  assert [num_compiled_steps()] + [f._cache_size() for f in jitted] == before, \
      "a warm engine compiled a new shape"
