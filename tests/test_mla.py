"""Multi-head latent attention in the pool and every attention path: the pool stores one
latent (plus its RoPE key) per token and layer, in every KV format; the reference, XLA
(with the native CPU decode call) and Pallas (interpret mode) paths give the same greedy
tokens in each format; prefix hits, preemption and speculation leave them unchanged.
(Against HF's DeepSeek-V3 itself: tests/test_families.py.)"""
import jax
import numpy as np
import pytest

from jaxinfer.buckets import BucketTable
from jaxinfer.config import DEEPSEEK_V3, SamplingParams
from jaxinfer.kv import allocate_pool, bytes_per_token

CFG = DEEPSEEK_V3.replace(
    name="tiny-mla", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=4, head_dim=32, num_experts=4, experts_per_token=2,
    moe_intermediate_size=32, expert_groups=2, expert_groups_kept=1, shared_expert_size=32,
    first_dense_layers=0, kv_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
    q_lora_rank=0, rope_scaling=(), query_scale=None, max_position=512)
TABLE = BucketTable(token_sizes=(4, 16), request_sizes=(2,), page_table_sizes=(8,))


@pytest.fixture(scope="module")
def model():
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model.params import init_params
  return LoadedModel(CFG, init_params(CFG, jax.random.PRNGKey(0), std=0.15), None, "random")


def _prompts():
  r = np.random.default_rng(0)
  return [r.integers(1, 256, n).tolist() for n in (21, 9)]


def _greedy(model, **kw):
  from jaxinfer.llm import LLM
  llm = LLM.from_loaded(model, warmup=False, num_pages=24, page_size=8, buckets=TABLE, **kw)
  outs = llm.generate(_prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
  return [o.token_ids for o in outs], llm


def test_pool_holds_one_latent_per_token_and_layer():
  """One component of [L, 1, pages, page, kv_lora_rank + qk_rope_head_dim] (no values:
  the latent serves as both), and 8.4.2's bytes: DeepSeek-V3 bf16 61 x 576 x 2 B."""
  pool = allocate_pool(CFG, "bf16", 4, 8)
  assert sorted(pool) == ["k"] and pool["k"].shape == (2, 1, 4, 8, 64)
  assert bytes_per_token(DEEPSEEK_V3, "bf16") == 61 * 576 * 2
  assert bytes_per_token(DEEPSEEK_V3, "bf16") * 8192 / 2**20 == pytest.approx(549, abs=0.5)
  q8 = allocate_pool(CFG, "q8_0", 4, 8)
  assert sorted(q8) == ["k", "k_gs"]


@pytest.mark.parametrize("kv_format", ["f32", "q8_0",
                                       pytest.param("bf16", marks=pytest.mark.slow),
                                       pytest.param("fp8", marks=pytest.mark.slow)])
def test_attention_paths_agree_in_each_kv_format(model, kv_format):
  """Greedy tokens of two requests (chunked prefill, then decode) through the XLA path
  (its native decode call on CPU) equal the reference path's in the same KV format."""
  want, _ = _greedy(model, kv_format=kv_format, attention="reference")
  got, llm = _greedy(model, kv_format=kv_format, attention="xla")
  assert got == want, kv_format
  assert "v" not in llm.engine.executor.pool


@pytest.mark.slow
def test_pallas_path_agrees(model):
  """The Pallas kernel (interpret mode on CPU) on the latent pool: the same tokens."""
  want, _ = _greedy(model, kv_format="bf16", attention="reference")
  got, _ = _greedy(model, kv_format="bf16", attention="pallas")
  assert got == want


def test_prefix_hits_preemption_and_speculation_leave_tokens_unchanged(model):
  """Requests sharing a prefix (cache hits) in a pool too small for all of them
  (preemption), and n-gram drafts verified in the target step: the same greedy tokens as
  each request alone."""
  from jaxinfer.llm import LLM
  from jaxinfer.runtime.scheduler import SchedulerConfig
  r = np.random.default_rng(3)
  shared = r.integers(1, 256, 16).tolist()
  prompts = [shared + r.integers(1, 256, 16).tolist() for _ in range(3)]
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      query_sizes=(1, 4, 16))
  alone = LLM.from_loaded(model, warmup=False, num_pages=32, page_size=8, buckets=table)
  want = [alone.generate([p], sp)[0].token_ids for p in prompts]
  sched = SchedulerConfig("chunked", 4, 16, 16, reserve="none")
  llm = LLM.from_loaded(model, warmup=False, num_pages=7, page_size=8, buckets=table,
                        prefix_cache=True, scheduler=sched)
  first = llm.generate(prompts[:1], sp)[0]
  rest = llm.generate(prompts[1:], sp)
  assert [o.token_ids for o in [first] + rest] == want
  assert all(o.cached_tokens >= 8 for o in rest)
  assert llm.engine.scheduler.num_preemptions > 0
  spec = LLM.from_loaded(model, warmup=False, num_pages=32, page_size=8, buckets=table,
                         speculative="ngram", num_draft=3)
  assert [o.token_ids for o in spec.generate(prompts, sp)] == want


def test_tensor_parallel_refuses_latent_attention():
  with pytest.raises(ValueError, match="latent"):
    CFG.check_tp(2)
