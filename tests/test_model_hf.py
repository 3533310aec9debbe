"""The JAX model against HF transformers on the same weights (f32)."""

import numpy as np
import pytest

from conftest import requires_hf
from helpers import full_logits

pytestmark = requires_hf

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
  from jaxinfer.benchmarking import hf_model  # HF's own GGUF conversion, saved once a run
  return hf_model(smollm2_path)


def test_smollm2_logits_match_hf(smollm2, hf_smollm2):
  import torch
  ids = smollm2.tokenizer.encode(PROMPT)
  ours = full_logits(smollm2.cfg, smollm2.params, ids)
  with torch.no_grad():
    ref = hf_smollm2(torch.tensor([ids])).logits[0].float().numpy()
  assert _rel(ours, ref) < 1e-4


def test_hf_decode_peer_grows_its_cache_one_token_a_step(smollm2, hf_smollm2):
  """bench_decode's HF peer (benchmarking.HfDecode): every call is one timed forward of one
  token per request at the next position, on a cache that starts at `context` tokens (the
  constructor takes one untimed step), so a cell's rounds decode at a growing context as
  HF's own generate does."""
  from jaxinfer.benchmarking import HfDecode
  step = HfDecode(hf_smollm2, smollm2.cfg, 2, 16)  # one untimed step inside
  assert step.cache.get_seq_length() == 17 and step.pos == 17
  times = [step() for _ in range(2)]
  # seconds of one forward of a 135M-parameter model: above the time to read its weights at
  # 5 TB/s (a time taken around no work would fail this), and finite
  assert all(0.54e9 / 5e12 < t < float("inf") for t in times), times
  assert step.cache.get_seq_length() == 19 and step.pos == 19


@pytest.fixture(scope="module")
def hf_greedy(smollm2, hf_smollm2):
  """HF's 32 greedy tokens after PROMPT and its logits at each of them (teacher-forced),
  computed once for every weight format."""
  import torch
  ids = smollm2.tokenizer.encode(PROMPT)
  with torch.no_grad():
    ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              min_new_tokens=32)[0, len(ids):].tolist()
    logits = hf_smollm2(torch.tensor([ids + ref])).logits[0, len(ids) - 1:-1].numpy()
  return ids, ref, logits


# 8-bit activations (llama.cpp's products) move logits by up to about this much: where
# HF's own top two are this close (a near tie), the products' rounding on a given CPU may
# pick the runner-up, and the tokens after that are another continuation.
Q8_TIE_LOGITS = 0.25


@pytest.mark.parametrize("weight_format,activations", [("dense", "q8"), ("gguf", "f32"),
                                                      ("gguf", "q8")])
def test_smollm2_greedy_matches_hf(smollm2, hf_greedy, weight_format, activations):
  """gguf: the decode steps multiply by the file's own Q4_1 / Q8_0 blocks (the prompt's
  step, over 16 tokens, by the dense weights), HF by its dequantized float32 copy: the
  same 32 greedy tokens. With 8-bit activations too, up to a near tie in HF's own logits
  (Q8_TIE_LOGITS), where the token picked must be one of the tied ones."""
  from pallas_kernels.cpu import gguf
  if weight_format == "gguf" and not gguf.available():
    pytest.skip("the block matmul needs the native CPU library")
  from jaxinfer.llm import LLM
  ids, ref, logits = hf_greedy
  llm = LLM.from_loaded(smollm2, warmup=False, num_pages=64, weight_format=weight_format,
                        gguf_activations=activations)
  from jaxinfer.config import SamplingParams
  out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
  if activations == "f32" or out == ref:
    assert out == ref
    return
  i = next(k for k in range(32) if out[k] != ref[k])
  assert logits[i][out[i]] >= logits[i][ref[i]] - Q8_TIE_LOGITS, (i, logits[i][out[i]],
                                                                   logits[i][ref[i]])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  """A small random-weight Qwen3 (untied head) saved as an HF safetensors directory."""
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.manual_seed(0)
  cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                    tie_word_embeddings=False)
  model = Qwen3ForCausalLM(cfg).eval()
  with torch.no_grad():  # non-trivial norms so q/k norm bugs show
    for n, p in model.named_parameters():
      if "norm" in n:
        p.add_(0.2 * torch.randn_like(p))
  d = str(tmp_path_factory.mktemp("qwen3"))
  model.save_pretrained(d, safe_serialization=True)
  return d, model


def test_qwen3_safetensors_matches_hf(qwen3_dir):
  import torch
  from jaxinfer.loading import load_model
  d, hf = qwen3_dir
  m = load_model(d, "float32")
  assert m.cfg.family == "qwen3" and m.cfg.qk_norm and not m.cfg.tie_embeddings
  ids = list(np.random.default_rng(0).integers(0, 512, 40))
  ours = full_logits(m.cfg, m.params, ids)
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits[0].numpy()
  assert _rel(ours, ref) < 1e-4
  # Greedy 32 tokens through the paged decode path.
  from jaxinfer.llm import LLM
  from jaxinfer.config import SamplingParams
  with torch.no_grad():
    ref_ids = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          min_new_tokens=32, eos_token_id=None)[0, len(ids):].tolist()
  llm = LLM.from_loaded(m, warmup=False, num_pages=32)
  out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
  assert out.token_ids == ref_ids


def test_unrolled_steps_equal_scanned_and_never_copy_the_pool(qwen3_dir):
  """Unrolled layers compile with XLA:CPU's region-based copy insertion (step.steps_for):
  a prefill and two decode steps give the scanned layers' tokens, and the compiled step
  holds no copy of the donated pool (without the option it held two per component)."""
  from jaxinfer import benchmarking as bm
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.loading import load_model
  from jaxinfer.step import forward_inputs
  d, _ = qwen3_dir
  steps = [bm.uniform_step(3, 0, 20)[0], bm.uniform_step(3, 20, 1)[0],
           bm.uniform_step(3, 21, 1)[0]]
  pages = bm.uniform_step(3, 21, 1)[1]
  got = {}
  for scan in (False, True):
    m = load_model(d, "float32", scan_layers=scan)
    ex = JaxExecutor(m.cfg, m.params, num_pages=pages, page_size=16)
    got[scan] = [ex.execute(s).tokens for s in steps]
    if not scan:
      hlo = ex._steps.forward.lower(ex.params, ex.pool, forward_inputs(steps[1].arrays),
                                   cfg=m.cfg, attn_shape=steps[1].bucket.attn_shape,
                                   backend=ex.backend).compile().as_text()
      pool_shape = "f32[" + ",".join(map(str, ex.pool["k"].shape)) + "]"
      copies = [ln for ln in hlo.splitlines() if pool_shape in ln and " copy(" in ln]
      assert not copies, copies
  for a, b in zip(got[False], got[True]):  # scanned layers run the native panel matmul
    np.testing.assert_array_equal(a, b)  # tokens
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # and logprobs: summation order


def test_scan_layers_equal_unrolled(qwen3_dir):
  from jaxinfer.loading import load_model
  d, _ = qwen3_dir
  a = load_model(d, "float32", scan_layers=False)
  b = load_model(d, "float32", scan_layers=True)
  ids = list(range(5, 30))
  np.testing.assert_allclose(full_logits(a.cfg, a.params, ids), full_logits(b.cfg, b.params, ids),
                             rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bf16_smollm2(smollm2):
  import dataclasses
  import jax.numpy as jnp
  from jaxinfer.model.params import cast_params
  return dataclasses.replace(smollm2, params=cast_params(smollm2.params, jnp.bfloat16))


def test_bf16_weights_on_cpu_match_hf(bf16_smollm2, hf_smollm2, monkeypatch):
  """dtype="bfloat16" on CPU: the executor holds the layer weights and the LM head in AMX's
  tile layout read in place (pallas_kernels.cpu.weights.Tiles) where the CPU has AMX or
  AVX512-BF16, else the stacked layer weights as uint16 bit patterns (.Half, also with
  JAXINFER_BF16_TILES=0); both
  run float32 activations with bf16 matmul inputs, and their logits stay within bf16
  rounding of HF's float32 ones and within summation order of each other."""
  import jax.numpy as jnp
  import torch
  from jaxinfer.executors.jax_executor import JaxExecutor
  from pallas_kernels.cpu import tiles
  m = bf16_smollm2
  ids = m.tokenizer.encode(PROMPT)
  with torch.no_grad():
    ref = hf_smollm2(torch.tensor([ids])).logits[0].float().numpy()
  from pallas_kernels.cpu.weights import Half, Tiles
  layouts = {}
  for amx in ("1", "0"):
    monkeypatch.setenv("JAXINFER_BF16_TILES", amx)
    p = JaxExecutor(m.cfg, m.params, num_pages=4, page_size=16).params
    if isinstance(p["lm_head"], Tiles):
      assert amx == "1" and tiles.available() and "wq" not in p["layers"]
      assert p["layers"]["wq+wk+wv"].tiles.dtype == jnp.uint16
      name = "tiles"
    else:
      assert isinstance(p["layers"]["wq"], Half) and p["layers"]["wq"].w.dtype == jnp.uint16
      name = "bits"
    layouts[name] = full_logits(m.cfg, m.params, ids)
    assert 1e-4 < _rel(layouts[name], ref) < 3e-2, (name, _rel(layouts[name], ref))
  assert "bits" in layouts
  if tiles.available():
    assert "tiles" in layouts and _rel(layouts["tiles"], layouts["bits"]) < 5e-3


@pytest.mark.slow
def test_bf16_weights_engine_equals_recompute(bf16_smollm2):
  """A batched, chunked engine run with bf16 weights picks, at every position, the full
  recompute's argmax of the same weights (teacher-forced) or a token within 0.02 of it:
  rounding activations to bf16 at each matmul makes near-ties depend on the batch's shape
  (measured: one of 24 positions differed, by a 0.005 gap)."""
  from jaxinfer.config import SamplingParams
  from jaxinfer.llm import LLM
  m = bf16_smollm2
  ids = m.tokenizer.encode(PROMPT)
  llm = LLM.from_loaded(m, warmup=False, num_pages=64, max_num_seqs=4,
                        max_num_batched_tokens=16)
  prompts = [ids[:20], ids[:7], m.tokenizer.encode("Hello, my name is")]
  outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
  exact = 0
  for p, o in zip(prompts, outs):
    lg = full_logits(m.cfg, m.params, p + o.token_ids[:-1])[len(p) - 1:]
    for row, tok in zip(lg, o.token_ids):
      assert row[tok] >= row.max() - 0.02, (p, o.token_ids)
      exact += tok == row.argmax()
  assert exact >= 22, exact
