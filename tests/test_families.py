"""Every model family against HF transformers itself, without downloads: a small random
model built with transformers' own config class, saved with save_pretrained, loaded by
jaxinfer; f32 logits over a prompt longer than the family's sliding window, and greedy
tokens through the engine's chunked path (by default), its prefix-hit, preempted and
speculative paths (slow)."""
import numpy as np
import pytest

from helpers import full_logits
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams

pytestmark = pytest.importorskip("transformers") and []

WINDOW = 16
PROMPT_LEN = 40  # longer than the window: windowed layers must drop the oldest tokens
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False)


def _families():
  import transformers as t
  return {
      "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
      "llama3": (t.LlamaConfig, t.LlamaForCausalLM, dict(rope_parameters={
          "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64})),
      "llama_linear": (t.LlamaConfig, t.LlamaForCausalLM, dict(rope_parameters={
          "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
      "qwen2_yarn": (t.Qwen2Config, t.Qwen2ForCausalLM, dict(rope_parameters={
          "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
          "original_max_position_embeddings": 16})),
      "phi3_partial": (t.Phi3Config, t.Phi3ForCausalLM, dict(
          pad_token_id=0, partial_rotary_factor=0.5)),
      "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=WINDOW)),
      "phi3": (t.Phi3Config, t.Phi3ForCausalLM, dict(pad_token_id=0)),
      "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(
          sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=0.1,
          final_logit_softcapping=3.0, tie_word_embeddings=True)),
      "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, dict(
          sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
      "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM, dict(
          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          norm_topk_prob=False)),
      "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, dict(
          num_local_experts=4, num_experts_per_tok=2)),
      "deepseek_v3": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM, _DEEPSEEK),
      "deepseek_v3_direct_q": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM, dict(
          _DEEPSEEK, q_lora_rank=None, first_k_dense_replace=0)),
  }


# latent attention (a latent of 48 plus a RoPE key of 16 per token) over a sigmoid,
# group-limited MoE with a shared expert, after one dense MLP layer (the direct-q variant:
# every layer MoE, so they stack for the layer scan)
_DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_group=4, topk_group=2, n_shared_experts=1,
                 first_k_dense_replace=1,
                 routed_scaling_factor=2.5, kv_lora_rank=48, q_lora_rank=32,
                 qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)


# By default the families whose math differs most (biases; sliding windows; soft caps,
# sandwich norms, offset norms, scaled embeddings, per-layer RoPE bases); the rest run in
# the slow suite, and their one difference from Llama (RoPE scalings, YaRN's included) is
# checked below without a compile.
FAMILIES = ["qwen2", "mistral", "gemma2", "gemma3", "qwen3_moe", "deepseek_v3",
            pytest.param("mixtral", marks=pytest.mark.slow),
            pytest.param("deepseek_v3_direct_q", marks=pytest.mark.slow),
            pytest.param("llama3", marks=pytest.mark.slow),
            pytest.param("llama_linear", marks=pytest.mark.slow),
            pytest.param("phi3", marks=pytest.mark.slow),
            pytest.param("qwen2_yarn", marks=pytest.mark.slow),
            pytest.param("phi3_partial", marks=pytest.mark.slow)]
_BUILT = {}


def _hf_dir(name, tmp_path_factory):
  """(directory, HF model) of a small random model of `name`, built once per run."""
  if name in _BUILT:
    return _BUILT[name]
  import torch
  conf_cls, model_cls, extra = _families()[name]
  torch.manual_seed(0)
  conf = conf_cls(**dict(COMMON, **extra))
  conf._attn_implementation = "eager"  # Gemma 2's soft cap needs HF's eager attention
  model = model_cls(conf).eval()
  with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
    for n, p in model.named_parameters():
      if "norm" in n or n.endswith("bias"):
        p.add_(0.2 * torch.randn_like(p))
    for n, b in model.named_buffers():  # DeepSeek's expert-selection bias
      if n.endswith("e_score_correction_bias"):
        b.add_(0.5 * torch.randn_like(b))
  d = str(tmp_path_factory.mktemp(name))
  model.save_pretrained(d, safe_serialization=True)
  _BUILT[name] = (d, model)
  return _BUILT[name]


def _pages(cfg, n: int) -> int:
  """Pages of the pool holding the bytes of n pages of every layer (a model mixing
  windowed and full layers pages each group of layers on its own: kv.kv_layout)."""
  from jaxinfer.kv import kv_layout
  return n * cfg.num_layers // kv_layout(cfg).slots


def _prompt(seed=0, n=PROMPT_LEN):
  return [int(i) for i in np.random.default_rng(seed).integers(1, 512, n)]


def _hf_greedy(model, ids, n):
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0, len(ids):].tolist()


def _logits_error(m, hf, ids) -> float:
  """max |ours - HF's| f32 logits over every position of `ids`, over HF's largest."""
  import torch
  ours = full_logits(m.cfg, m.params, ids)
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits[0].numpy()
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_logits_and_chunked_greedy_match_hf(name, tmp_path_factory):
  """f32 logits within 1e-4 (relative to the logits' scale) of HF's at every position of a
  40-token prompt, and 16 greedy tokens through chunks of 16 equal HF's generate."""
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  d, hf = _hf_dir(name, tmp_path_factory)
  m = load_model(d, "float32")
  ids = _prompt()
  err = _logits_error(m, hf, ids)
  assert err < 1e-4, (name, err)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(2,), page_table_sizes=(8,))
  llm = LLM.from_loaded(m, warmup=False, num_pages=32, page_size=8, buckets=table)
  out = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
  assert out.token_ids == _hf_greedy(hf, ids, 16), name
  print(f"\n{name}: logits error {err:.1e} of HF's largest; chunked greedy = HF's")


@pytest.mark.parametrize("name", ["llama3", "llama_linear", "qwen2_yarn"])
def test_rope_scaling_frequencies_equal_hf(name):
  """Llama 3.1's, linear and YaRN RoPE scaling: the inverse frequencies (and YaRN's
  attention factor) jaxinfer computes from the loaded config equal HF's own (its rope init
  functions)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from jaxinfer.loading.safetensors_loader import _rope
  from jaxinfer.model.layers import rope_frequencies
  conf_cls, _, extra = _families()[name]
  conf = conf_cls(**dict(COMMON, **extra))
  kind = conf.rope_parameters["rope_type"]
  want, factor = ROPE_INIT_FUNCTIONS[kind](conf, "cpu")
  theta, scaling = _rope(conf.rope_parameters, name, conf.max_position_embeddings)
  assert scaling[0] == kind
  head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
  got = np.asarray(rope_frequencies(head_dim, theta, scaling))
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
  if kind == "yarn":
    assert factor > 1 and abs(scaling[5] - factor) < 1e-9


def test_phi3_fused_projections_are_split_as_hf_holds_them(tmp_path_factory):
  """Phi-3's qkv_proj and gate_up_proj load as the model's wq, wk, wv, w_gate, w_up: the
  rows of HF's fused matrices, in order."""
  from jaxinfer.loading.safetensors_loader import load_safetensors_dir
  d, hf = _hf_dir("phi3", tmp_path_factory)
  params, cfg = load_safetensors_dir(d)
  attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
  qkv = attn.qkv_proj.weight.detach().numpy()
  gate_up = mlp.gate_up_proj.weight.detach().numpy()
  NH, KH, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
      cfg.intermediate_size
  lp = params["layers"][1]
  np.testing.assert_array_equal(lp["wq"], qkv[:NH].T)
  np.testing.assert_array_equal(lp["wk"], qkv[NH:NH + KH].T)
  np.testing.assert_array_equal(lp["wv"], qkv[NH + KH:].T)
  np.testing.assert_array_equal(lp["w_gate"], gate_up[:F].T)
  np.testing.assert_array_equal(lp["w_up"], gate_up[F:].T)
  assert "wq+wk+wv" not in lp and "w_gate+w_up" not in lp


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "llama3", "llama_linear", "mistral", "phi3",
                                  "gemma2", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_family_prefix_hit_preempted_and_speculative_greedy_match_hf(name, tmp_path_factory):
  """The engine's other paths on every family: requests sharing a 24-token prefix (cache
  hits), a pool too small for all of them without reservation (preemption), and n-gram
  drafts verified in the target step: each request's greedy tokens equal HF's."""
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.runtime.scheduler import SchedulerConfig
  d, hf = _hf_dir(name, tmp_path_factory)
  m = load_model(d, "float32")
  shared = _prompt(1, 24)
  prompts = [shared + _prompt(2 + i, 16) for i in range(3)]
  want = [_hf_greedy(hf, p, 12) for p in prompts]
  sp = SamplingParams(max_tokens=12, ignore_eos=True)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      query_sizes=(1, 4, 16))
  sched = SchedulerConfig("chunked", 4, 16, 16, reserve="none")
  llm = LLM.from_loaded(m, warmup=False, num_pages=_pages(m.cfg, 9), page_size=8,
                        buckets=table, prefix_cache=True, scheduler=sched)
  first = llm.generate(prompts[:1], sp)[0]
  rest = llm.generate(prompts[1:], sp)
  assert [o.token_ids for o in [first] + rest] == want, name
  assert all(o.cached_tokens >= 16 for o in rest)
  assert llm.engine.scheduler.num_preemptions > 0
  spec = LLM.from_loaded(m, warmup=False, num_pages=_pages(m.cfg, 32), page_size=8,
                         buckets=table,
                         speculative="ngram", num_draft=3)
  outs = spec.generate(prompts, sp)
  assert [o.token_ids for o in outs] == want, name
  assert sum(o.rounds for o in outs) > 0
  print(f"\n{name}: prefix-hit, preempted and speculative greedy = HF's")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "llama3", "mistral", "phi3", "gemma2", "gemma3"])
def test_generate_runs_each_family_end_to_end(name, smollm2, tmp_path):
  """`python -m jaxinfer generate --model=<HF dir>` on a random model of the family with
  SmolLM2's vocabulary, its tokenizer.json beside the weights: exit 0 and 8 tokens."""
  import json
  import subprocess
  import sys
  import torch
  conf_cls, model_cls, extra = _families()[name]
  torch.manual_seed(0)
  conf = conf_cls(**dict(COMMON, **dict(extra, vocab_size=smollm2.cfg.vocab_size,
                                        eos_token_id=list(smollm2.cfg.eos_token_ids))))
  model_cls(conf).save_pretrained(str(tmp_path), safe_serialization=True)
  smollm2.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
  out = subprocess.run(
      [sys.executable, "-m", "jaxinfer", "generate", f"--model={tmp_path}", "--prompt=Hello",
       "--max_tokens=8", "--json", "--max_num_seqs=1"],
      capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  # a one-shot job compiles only the shapes it runs: no warm-up of the whole table
  assert "(includes compilation)" in out.stderr and "compiling bucket shapes" not in out.stderr
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["finish_reason"] in ("length", "stop") and 1 <= len(r["token_ids"]) <= 8


_TP_CHECK = """
import json, sys, tempfile
sys.path.insert(0, {tests!r})
import test_families as tf
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.llm import LLM
from jaxinfer.loading import load_model

class Dirs:
  def mktemp(self, n):
    return tempfile.mkdtemp(prefix=n)

out = {{}}
for name in {names!r}:
  d, hf = tf._hf_dir(name, Dirs())
  m = load_model(d, "float32")
  ids = tf._prompt()
  table = BucketTable(token_sizes=(4, 16), request_sizes=(2,), page_table_sizes=(8,))
  llm = LLM.from_loaded(m, warmup=False, num_pages=32, page_size=8, buckets=table,
                        mesh="tp:2")
  got = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
  out[name] = got == tf._hf_greedy(hf, ids, 12)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_tensor_parallel_families_match_hf():
  """tp:2 on two virtual CPU devices (biases split with their heads, windows and soft caps
  under shard_map): the same greedy tokens as HF."""
  import json
  import os
  import pathlib
  import subprocess
  import sys
  names = ["qwen2", "mistral", "gemma2"]
  code = _TP_CHECK.format(tests=str(pathlib.Path(__file__).parent), names=names)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=900, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {n: True for n in names}


def _window_runs(tmp_path_factory, first_seed: int, n: int, num_pages: int, reserve: str):
  """Mistral (window 16 in every layer, pages of 8): `n` requests of 40 + 24 tokens run
  with the pages behind the window released (16) and kept (0), each run's greedy tokens
  checked against HF's and the page invariants after every step. Per window: (most
  requests running at once, most pages a decoding request held between steps,
  preemptions)."""
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.runtime.pages import HOLE
  from jaxinfer.runtime.scheduler import SchedulerConfig
  d, hf = _hf_dir("mistral", tmp_path_factory)
  m = load_model(d, "float32")
  prompts = [_prompt(first_seed + i) for i in range(n)]
  want = [_hf_greedy(hf, p, 24) for p in prompts]
  sp = SamplingParams(max_tokens=24, ignore_eos=True)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      query_sizes=(1, 16))
  runs = {}
  for window in (WINDOW, 0):
    llm = LLM.from_loaded(m, warmup=False, num_pages=num_pages, page_size=8, buckets=table,
                          scheduler=SchedulerConfig("chunked", 4, 16, 16, reserve=reserve,
                                                    window=window))
    eng = llm.engine
    reqs = [eng.add_request(p, sp) for p in prompts]
    running = held = 0
    while eng.has_unfinished():
      eng.step()
      running = max(running, len(eng.scheduler.running))
      for r in reqs:
        if eng.pm.has(r.request_id) and r.num_computed >= len(r.prompt_token_ids):
          held = max(held, sum(p != HOLE for p in eng.pm.page_table(r.request_id)))
      eng.pm.check_invariants()
    assert [r.output_token_ids for r in reqs] == want, window
    runs[window] = (running, held, eng.scheduler.num_preemptions)
  print(f"window release, reserve={reserve}: (most running, most pages held, "
        f"preemptions) by window:", runs)
  return runs


def test_pages_behind_a_sliding_window_are_released(tmp_path_factory):
  """As requests advance, the pages wholly behind the window are released, so each
  decoding request holds at most window / page + 1 pages; three requests run in a pool
  of 12 pages (full attention would need 24) with fewer preemptions than the same run
  keeping every page (admission reserving nothing ahead)."""
  runs = _window_runs(tmp_path_factory, 10, 3, num_pages=12, reserve="none")
  assert runs[WINDOW][1] <= WINDOW // 8 + 1, runs
  assert runs[WINDOW][2] < runs[0][2], runs


def test_a_sliding_window_bounds_what_admission_reserves(tmp_path_factory):
  """Admission reserving to the end of generation: a request of 40 + 24 tokens needs 8
  pages with full attention, but with its pages behind the window released it reserves
  only what it can hold during a step, (window + chunk - 1) / page + 2 = 5, and holds
  window / page + 1 = 3 between steps; a pool of 20 pages then runs all four requests at
  once instead of two, without a preemption."""
  runs = _window_runs(tmp_path_factory, 20, 4, num_pages=20, reserve="end")
  assert runs[WINDOW] == (4, WINDOW // 8 + 1, 0) and runs[0] == (2, 8, 0), runs


def test_gemma2_local_layers_page_their_window_and_admit_more(tmp_path_factory):
  """Gemma 2 (local window 16, global layers): each layer group has its own page tables.
  Decoding, a local group holds at most window / page + 1 pages while the global group
  holds the whole context; admission reserving to the end counts (window + chunk - 1) /
  page + 2 pages per local group, so a pool of 36 one-layer pages (the bytes of 12 pages
  of all three layers) runs two requests at once where the same model with every layer
  full-attention runs one. Greedy tokens equal HF's, page invariants hold every step."""
  import dataclasses
  from jaxinfer.kv import kv_layout
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.runtime.pages import HOLE
  from jaxinfer.runtime.scheduler import SchedulerConfig
  d, hf = _hf_dir("gemma2", tmp_path_factory)
  m = load_model(d, "float32")
  layout = kv_layout(m.cfg)
  assert layout.windows == (0, WINDOW, WINDOW) and layout.slots == 1, layout
  prompts = [_prompt(30 + i) for i in range(3)]
  sp = SamplingParams(max_tokens=24, ignore_eos=True)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      query_sizes=(1, 16))
  full = dataclasses.replace(m, cfg=dataclasses.replace(m.cfg, layer_windows=()))
  runs = {}
  for name, model, pages in (("grouped", m, 36), ("full", full, 12)):
    llm = LLM.from_loaded(model, warmup=False, num_pages=pages, page_size=8, buckets=table,
                          scheduler=SchedulerConfig("chunked", 4, 16, 16, reserve="end"))
    eng = llm.engine
    reqs = [eng.add_request(p, sp) for p in prompts]
    running, held = 0, [0] * layout.num_groups
    while eng.has_unfinished():
      eng.step()
      running = max(running, len(eng.scheduler.running))
      for r in reqs:
        if name == "grouped" and eng.pm.has(r.request_id) and r.num_computed >= 40:
          for g, table_g in enumerate(eng.pm.page_table(r.request_id)):
            held[g] = max(held[g], sum(p != HOLE for p in table_g))
      eng.pm.check_invariants()
    runs[name] = (running, held, eng.scheduler.num_preemptions)
    if name == "grouped":
      assert [r.output_token_ids for r in reqs] == [_hf_greedy(hf, p, 24) for p in prompts]
  print("Gemma 2 pages: (most running, most pages held per group, preemptions):", runs)
  assert runs["grouped"] == (2, [8, WINDOW // 8 + 1, WINDOW // 8 + 1], 0), runs
  assert runs["full"][0] == 1, runs


@pytest.mark.parametrize("name", [pytest.param("qwen2", marks=pytest.mark.slow), "gemma2",
                                  pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("phi3_partial", marks=pytest.mark.slow)])
def test_gguf_files_of_the_families_match_hf(name, tmp_path, monkeypatch):
  """A GGUF file written from a random HF model as llama.cpp writes the family (gguf-py's
  own tensor-name map; q/k rows not permuted; Gemma's norm weights stored as 1 + w, its
  window, caps, layer pattern and local RoPE base in the metadata, its query scale
  1 / sqrt(head_dim), so the HF model takes query_pre_attn_scalar = head_dim; Phi-3's
  q, k, v and gate, up fused, its rotated dims in the metadata) loads as that family and
  gives HF's f32 logits."""
  import gguf
  import torch
  from jaxinfer.loading import load_model, tokenizer
  monkeypatch.setattr(tokenizer, "tokenizer_from_gguf", lambda reader: None)
  conf_cls, model_cls, extra = _families()[name]
  if name.startswith("gemma"):
    extra = dict(extra, query_pre_attn_scalar=COMMON["head_dim"])
  torch.manual_seed(0)
  conf = conf_cls(**dict(COMMON, **extra))
  conf._attn_implementation = "eager"
  hf = model_cls(conf).eval()
  with torch.no_grad():
    for n, p in hf.named_parameters():
      if "norm" in n or n.endswith("bias"):
        p.add_(0.2 * torch.randn_like(p))
  arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "gemma2": gguf.MODEL_ARCH.GEMMA2,
          "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3_partial": gguf.MODEL_ARCH.PHI3}[name]
  rope = conf.rope_parameters  # Gemma 3: one per layer type
  L = COMMON["num_hidden_layers"]
  path = str(tmp_path / f"{name}.gguf")
  w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
  w.add_block_count(L)
  w.add_context_length(COMMON["max_position_embeddings"])
  w.add_embedding_length(COMMON["hidden_size"])
  w.add_feed_forward_length(COMMON["intermediate_size"])
  w.add_head_count(COMMON["num_attention_heads"])
  w.add_head_count_kv(COMMON["num_key_value_heads"])
  w.add_key_length(COMMON["head_dim"])
  w.add_value_length(COMMON["head_dim"])
  w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
  w.add_layer_norm_rms_eps(conf.rms_norm_eps)
  w.add_vocab_size(COMMON["vocab_size"])
  if name == "gemma2":
    w.add_sliding_window(WINDOW)
    w.add_attn_logit_softcapping(conf.attn_logit_softcapping)
    w.add_final_logit_softcapping(conf.final_logit_softcapping)
  if name == "gemma3":
    w.add_sliding_window(WINDOW)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in conf.layer_types])
    w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
  if name.startswith("phi3"):
    w.add_rope_dimension_count(int(COMMON["head_dim"] * conf.partial_rotary_factor))
  names = gguf.get_tensor_name_map(arch, L)
  for key, t in hf.state_dict().items():
    base, suffix = key.rsplit(".", 1)
    if base == "lm_head" and conf.tie_word_embeddings:
      continue
    g = names.get_name(base)
    assert g is not None, key
    a = t.float().numpy()
    if name.startswith("gemma") and base.endswith("norm"):
      a = a + 1.0
    w.add_tensor(f"{g}.{suffix}", a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  m = load_model(path, "float32", use_cache=False)
  assert m.cfg.family == name.split("_")[0]
  err = _logits_error(m, hf, _prompt())
  assert err < 1e-4, (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_windowed_families_on_the_pallas_kernel_match_hf(name, tmp_path_factory):
  """--attention=pallas (interpret mode here) on a sliding window in every layer (Mistral,
  pages behind it released) and on windowed and global layers with score caps (Gemma 2),
  a prompt longer than the window in chunks: HF's greedy tokens."""
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.runtime.scheduler import SchedulerConfig
  d, hf = _hf_dir(name, tmp_path_factory)
  m = load_model(d, "float32")
  prompt = _prompt(3, 40)
  want = _hf_greedy(hf, prompt, 6)
  table = BucketTable(token_sizes=(4, 16), request_sizes=(4,), page_table_sizes=(8,),
                      query_sizes=(1, 4, 16))
  llm = LLM.from_loaded(m, warmup=False, num_pages=16, page_size=8, buckets=table,
                        attention="pallas", scheduler=SchedulerConfig("chunked", 4, 16, 16))
  out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
  assert out.token_ids == want, name
