"""LLM.generate on SmolLM2: batching and chunked prefill equal the recompute oracle."""
import pytest

from helpers import recompute_greedy
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.llm import LLM, RequestTooLargeError

# Small enough that prompts share steps and the longest prompt runs in several.
SMALL_TABLE = BucketTable(token_sizes=(4, 16, 32), request_sizes=(4,), page_table_sizes=(8,))

PROMPTS = ["The capital of France is", "List three primary colors:",
           "def fibonacci(n):\n    ", "Water boils at"]


@pytest.fixture(scope="module")
def llm(smollm2):
  return LLM.from_loaded(smollm2, warmup=False, num_pages=64, buckets=SMALL_TABLE)


LONG = "Summarize: " + "the quick brown fox jumps over the lazy dog, " * 6  # > 32 tokens


@pytest.mark.parametrize("policy", ["auto", "chunked"])
def test_batched_generate_equals_recompute(llm, smollm2, policy):
  """The offline default (auto: prefills first, 8.1.1) and chunked prefill (8.2.2); a
  prompt longer than the largest step runs in steps of the budget under both."""
  assert llm.engine.config.policy == "separate"
  eng = llm if policy == "auto" else LLM.from_loaded(
      smollm2, warmup=False, num_pages=64, policy=policy, buckets=SMALL_TABLE)
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  prompts = PROMPTS[:3] + [LONG]
  assert len(smollm2.tokenizer.encode(LONG)) > 32
  outs = eng.generate(prompts, sp)  # prompts > 4 tokens; largest bucket 32 forces sharing
  assert any(s.num_prefill_tokens and s.num_decode_tokens for s in eng.engine.steps) == (
      policy == "chunked")  # separate never mixes a prefill into a decode step
  for p, o in zip(prompts, outs):
    ids = smollm2.tokenizer.encode(p)
    assert o.prompt_token_ids == ids
    assert o.token_ids == recompute_greedy(smollm2.cfg, smollm2.params, ids, 8), p
    assert o.finish_reason == "length"


@pytest.mark.parametrize("model", [pytest.param("smollm2", marks=pytest.mark.slow),
                                   "tiny_smollm2"])
def test_warm_up_compiles_every_shape_the_engine_then_runs(request, model):
  """LLM(warmup=True) compiles the default table's every shape at construction: a batch of
  prompts (prefill chunks, mixed and decode steps) then compiles nothing, and a different
  table pads differently but decodes the same greedy tokens."""
  from jaxinfer.step import num_compiled, num_compiled_steps
  m = request.getfixturevalue(model)
  table = BucketTable.default(max_tokens=32, max_requests=4, max_pages=8)
  warm = LLM.from_loaded(m, num_pages=64, buckets=table)
  shapes = len(list(table.all_buckets()))
  assert warm.warmup_s > 0 and num_compiled("forward") >= shapes
  before = num_compiled_steps()
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  outs = warm.generate(PROMPTS + ["Hi"], sp)
  assert num_compiled_steps() == before, "a step compiled after warm-up"
  assert {s.bucket for s in warm.engine.steps} <= {
      (b.num_tokens, b.num_requests, b.pages_per_request, b.max_query_len, b.prefill_slots)
      for b in table.all_buckets()}
  other = LLM.from_loaded(m, warmup=False, num_pages=64, buckets=SMALL_TABLE)
  ref = other.generate(PROMPTS + ["Hi"], sp)
  assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_rejected_request_leaves_llm_healthy(llm):
  with pytest.raises(RequestTooLargeError, match="more than the largest bucket of 8 pages"):
    llm.generate(["hello " * 200], SamplingParams(max_tokens=4))
  out = llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0]
  assert len(out.token_ids) == 2


def test_stop_string_cuts_text(llm):
  full = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
  assert "5" in full.text
  cut = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=8, stop=("5",)))[0]
  assert cut.finish_reason == "stop" and "5" not in cut.text and cut.text == full.text.split("5")[0]


def test_seeded_sampling_is_reproducible(llm):
  sp = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
  a = llm.generate(["Once upon a time"], sp)[0].token_ids
  b = llm.generate(["Once upon a time", "Another prompt here"], [sp, sp])[0].token_ids
  assert a == b


def test_kv_pool_too_small_is_an_error(smollm2):
  small = LLM.from_loaded(smollm2, warmup=False, num_pages=2, page_size=4,
                          buckets=BucketTable(token_sizes=(8,), request_sizes=(1,),
                                              page_table_sizes=(64,)))
  with pytest.raises(RequestTooLargeError, match="pool has only 2 pages of 4 tokens"):
    small.generate(["The capital of France is"], SamplingParams(max_tokens=8))


@pytest.mark.parametrize("model", [pytest.param("smollm2", marks=pytest.mark.slow),
                                   "tiny_smollm2"])
def test_backends_greedy_equal_reference(request, model):
  """--attention=pallas (interpret mode on CPU) and xla give the reference's greedy tokens."""
  m = request.getfixturevalue(model)
  table = BucketTable(token_sizes=(8,), request_sizes=(1,), page_table_sizes=(4,))
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  outs = {}
  for backend in ("reference", "pallas", "xla"):
    llm = LLM.from_loaded(m, warmup=False, num_pages=8, buckets=table, attention=backend)
    outs[backend] = llm.generate(["The capital of France is"], sp)[0].token_ids
  assert outs["pallas"] == outs["reference"] == outs["xla"]


@pytest.mark.parametrize("buffers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_weight_offload_equals_plain(smollm2, buffers):
  """8.4.3: every 3rd layer's FFN streamed from host memory, 1 or 2 prefetch buffers:
  the same greedy tokens, and the copies are counted every step."""
  from jaxinfer.costmodel.offload import OffloadConfig, ffn_set_bytes
  table = SMALL_TABLE
  sp = SamplingParams(max_tokens=5, ignore_eos=True)
  plain = LLM.from_loaded(smollm2, warmup=False, num_pages=64,
                          buckets=table).generate(PROMPTS[:2], sp)
  off = OffloadConfig.every_kth(smollm2.cfg.num_layers, 3, buffers)
  llm = LLM.from_loaded(smollm2, warmup=False, num_pages=64, buckets=table, offload=off)
  outs = llm.generate(PROMPTS[:2], sp)
  assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
  st = llm.executor.streamer
  steps = len(llm.engine.steps)
  set_bytes = ffn_set_bytes(smollm2.cfg, 4)
  assert st.bytes_moved == steps * len(off.layers) * set_bytes
  mem = llm.engine.metrics()["memory"]
  assert mem["net_bytes"] == (len(off.layers) - buffers) * set_bytes
  # The saving went to the KV pool: more pages than the plain engine's 64.
  assert llm.executor.num_pages == 64 + mem["net_bytes"] // (46080 * 16)


@pytest.mark.slow
def test_q_precision_reaches_attention(smollm2):
  """8.4.4's storage-vs-compute split is plumbed to the attention: rounding Q through
  q4_0 changes the logprobs against the same q4_0 pool; against an f32 pool it is a
  no-op; an unknown precision is a clear error."""
  table = BucketTable(token_sizes=(16,), request_sizes=(1,), page_table_sizes=(4,))
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  lps = {}
  for fmt in ("f32", "q4_0"):
    for qp in ("compute", "kv"):
      llm = LLM.from_loaded(smollm2, warmup=False, num_pages=8, buckets=table, kv_format=fmt,
                            q_precision=qp)
      lps[fmt, qp] = llm.generate(["The capital of France is"], sp)[0].logprobs
  assert lps["f32", "compute"] == lps["f32", "kv"]
  assert lps["q4_0", "compute"] != lps["q4_0", "kv"]
  with pytest.raises(ValueError,
                     match=r"q_precision must be one of \('compute', 'kv'\), got 'fp4'"):
    LLM.from_loaded(smollm2, warmup=False, num_pages=8, buckets=table, q_precision="fp4")


def test_policy_auto_is_chunked_when_served_and_explicit_policies_stay(smollm2):
  """policy="auto": separate offline, chunked once the server takes the LLM (make_app);
  an explicit policy is the user's, served as given; switching mid-job is refused."""
  from jaxinfer.serving.server import make_app
  table = SMALL_TABLE
  auto = LLM.from_loaded(smollm2, warmup=False, num_pages=64, buckets=table)
  assert auto.engine.config.policy == "separate"
  make_app(auto, model_name="m")
  assert auto.engine.config.policy == "chunked"
  out = auto.generate(PROMPTS[:2] + [LONG], SamplingParams(max_tokens=4, ignore_eos=True))
  assert any(s.num_prefill_tokens and s.num_decode_tokens for s in auto.engine.steps)
  assert [len(o.token_ids) for o in out] == [4, 4, 4]
  mine = LLM.from_loaded(smollm2, warmup=False, num_pages=64, buckets=table,
                         policy="separate")
  make_app(mine, model_name="m")
  assert mine.engine.config.policy == "separate"
  mine.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
  with pytest.raises(RuntimeError, match="unfinished requests"):
    mine.engine.set_policy("chunked")
  mine.engine.run()
  assert mine.engine.config.policy == "separate"


def test_auto_pool_holds_max_num_seqs_requests():
  """num_pages=None: room for max_num_seqs requests of 512 tokens, at least 1024 pages, at
  most 4 GiB of KV; an explicit num_pages is taken as given."""
  from jaxinfer.engine_config import EngineConfig
  page = 46080 * 16  # SmolLM2-135M's f32 KV page of 16 tokens
  assert EngineConfig().pool_pages(page, 1) == 1024
  assert EngineConfig().pool_pages(page, 64) == 64 * 32
  assert EngineConfig().pool_pages(page, 256) == (4 << 30) // page
  assert EngineConfig().pool_pages(64 << 20, 256) == 1024  # the cap never goes below 1024
  assert EngineConfig(num_pages=77).pool_pages(page, 64) == 77
  with pytest.raises(ValueError, match="num_pages must be an integer >= 1, got 0"):
    EngineConfig(num_pages=0).validate()
