"""The GGUF block matmul (pallas_kernels/cpu/gguf.py) against its jnp oracle, the GGUF
blocks against the dense loader's weights, and weight_format="gguf" end to end."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_kernels import block_codec as bm
from pallas_kernels.cpu import gguf

pytestmark = pytest.mark.skipif(not gguf.available() or jax.default_backend() != "cpu",
                                reason="the block matmul is a native XLA:CPU call")


def _weights(rng, L, N, K, fmt):
  w = (rng.standard_normal((L, N, K)) * 0.1).astype(np.float32)
  cs = [bm.quantize(w[i], fmt) for i in range(L)]
  return np.stack([c for c, _ in cs]), np.stack([s for _, s in cs])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("fused", [True, False])
def test_matmul_matches_reference(fmt, fused):
  """Row counts the paths split on (1: four weight rows at once, 3: two, 8: one group of
  eight, 9: a group and a remainder, 17: past one group pair, 70: past the fused limit of
  64 and over three 32-row x blocks), N not a multiple of the 4-row panel, a stacked layer
  read by index."""
  rng = np.random.default_rng(0)
  codes, scales = _weights(rng, 3, 70, 96, fmt)
  for M in (1, 3, 8, 9, 17, 70):
    x = rng.standard_normal((M, 96)).astype(np.float32)
    for layer in (0, 2):
      got = np.asarray(jax.jit(lambda x, c, s, i: gguf.matmul(x, c, s, i, fused=fused))(
          x, codes, scales, layer))
      want = np.asarray(bm.reference(x, codes, scales, layer))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{fmt} M={M} layer={layer}")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_q8_activations_match_reference(fmt):
  """activations="q8": x quantized per block, integer sums (K=96: an odd last block; 576 and
  1536: SmolLM2's), against the jnp oracle that quantizes the same way; and within x's
  rounding of the float32 product."""
  rng = np.random.default_rng(3)
  for K in (96, 576, 1536):
    codes, scales = _weights(rng, 2, 70, K, fmt)
    for M in (1, 2, 3, 5, 9, 16):
      x = rng.standard_normal((M, K)).astype(np.float32)
      got = np.asarray(jax.jit(lambda x, c, s: gguf.matmul(x, c, s, 1, activations="q8"))(
          x, codes, scales))
      want = np.asarray(bm.reference(x, codes, scales, 1, activations="q8"))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5, err_msg=f"{fmt} K={K} M={M}")
      exact = np.asarray(bm.reference(x, codes, scales, 1))
      assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max(), (fmt, K, M)


def test_q8_rows_do_not_depend_on_the_batch():
  """Each x row is quantized alone and its sums run in one order whatever rows share the
  call: a request's logits are the same alone or batched (bit for bit)."""
  rng = np.random.default_rng(4)
  for fmt in ("q4_1", "q8_0"):
    codes, scales = _weights(rng, 1, 70, 576, fmt)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    many = np.asarray(gguf.matmul(x, codes[0], scales[0], activations="q8"))
    for m in (0, 4, 8):
      one = np.asarray(gguf.matmul(x[m:m + 1], codes[0], scales[0], activations="q8"))
      np.testing.assert_array_equal(one[0], many[m], err_msg=f"{fmt} row {m}")


def test_activations_are_checked():
  with pytest.raises(ValueError, match="activations must be one of .*'q4'"):
    gguf.matmul(np.zeros((1, 32), np.float32), *_weights(np.random.default_rng(0), 1, 4, 32,
                                                         "q8_0"), activations="q4")
  from jaxinfer import LLM
  with pytest.raises(ValueError, match="gguf_activations must be one of"):
    LLM("smollm2-135m-instruct", gguf_activations="int8", warmup=False)


def test_threads_agree_with_one_thread():
  """Large enough for the helper threads (a row split across the pool) and not."""
  rng = np.random.default_rng(1)
  codes, scales = _weights(rng, 1, 512, 576, "q4_1")
  x = rng.standard_normal((4, 576)).astype(np.float32)
  one = gguf.matmul(x, codes[0], scales[0], min_parallel_macs=1 << 62)
  many = gguf.matmul(x, codes[0], scales[0], min_parallel_macs=1)
  np.testing.assert_array_equal(np.asarray(one), np.asarray(many))


def test_quantize_round_trip_is_within_half_a_step():
  rng = np.random.default_rng(2)
  w = rng.standard_normal((8, 64)).astype(np.float32)
  for fmt, steps in (("q4_1", 15), ("q8_0", 254)):
    back = np.asarray(bm.dequantize(*bm.quantize(w, fmt)))
    span = np.ptp(w.reshape(8, 2, 32), axis=-1) if fmt == "q4_1" else \
        2 * np.abs(w.reshape(8, 2, 32)).max(-1)
    err = np.abs(back - w).reshape(8, 2, 32).max(-1)
    assert (err <= span / steps * 0.5 + 1e-3).all(), fmt


def test_bad_format_is_named():
  with pytest.raises(ValueError, match="q5_1"):
    bm.quantize(np.zeros((4, 32), np.float32), "q5_1")
  with pytest.raises(ValueError, match="K=33"):
    bm.quantize(np.zeros((4, 33), np.float32), "q8_0")


def test_gguf_blocks_are_the_dense_weights_bit_for_bit(smollm2):
  """Q4_1 layers (q and k rows un-permuted like the dense ones) and the Q8_0 tied head."""
  from jaxinfer.loading import gguf_loader
  reader = gguf_loader.open_gguf(smollm2.source)
  blocks = gguf_loader.load_blocks(reader, smollm2.cfg)
  lp = smollm2.params["layers"]
  assert sorted(blocks["layers"]) == sorted(["wq+wk+wv", "wo", "w_gate+w_up", "w_down"])
  for name, b in blocks["layers"].items():
    for i in (0, smollm2.cfg.num_layers - 1):
      w = np.asarray(bm.dequantize(b["codes"][i], b["scales"][i]))
      dense = np.concatenate([np.asarray(lp[n][i]) for n in name.split("+")], axis=1)
      np.testing.assert_array_equal(w.T, dense, err_msg=f"{name}[{i}]")
  head = np.asarray(bm.dequantize(blocks["lm_head"]["codes"], blocks["lm_head"]["scales"]))
  np.testing.assert_array_equal(head, np.asarray(smollm2.params["embed"]))


def test_weight_format_errors_name_the_field(smollm2, tmp_path):
  from jaxinfer import LLM
  from jaxinfer.loading.registry import with_weight_format
  with pytest.raises(ValueError, match="weight_format must be one of .*'int4'"):
    LLM(smollm2, weight_format="int4", warmup=False)
  from jaxinfer.costmodel.offload import OffloadConfig
  with pytest.raises(ValueError, match="weight_format='gguf' runs on one device without "
                     "weight offload"):
    LLM(smollm2, weight_format="gguf", offload=OffloadConfig(layers=(1,)), warmup=False)
  import dataclasses
  not_gguf = dataclasses.replace(smollm2, source=str(tmp_path))
  with pytest.raises(ValueError, match="needs a .gguf model"):
    with_weight_format(not_gguf, "gguf")
  gg = with_weight_format(smollm2, "gguf")
  assert "blocks" in gg.params and "blocks" not in smollm2.params
  assert "blocks" not in with_weight_format(gg, "dense").params


PROMPTS = [[1, 504, 3458, 282], [1, 9707, 28], [1, 5248, 314, 1862, 30, 2], [1, 2]]


def test_gguf_engine_batch_matches_full_recompute(smollm2):
  """Four short prompts at once with weight_format="gguf" and float32 activations: their
  prefill (12 tokens) and every batched decode step read the blocks; the oracle recomputes
  each sequence from scratch with the dense weights (a 64-token step), greedy."""
  from helpers import recompute_greedy
  from jaxinfer import LLM
  from jaxinfer.config import SamplingParams
  llm = LLM(smollm2, weight_format="gguf", gguf_activations="f32", warmup=False,
            num_pages=64, max_num_batched_tokens=16, max_num_seqs=4)
  assert "blocks" in llm.model.params
  outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
  for p, o in zip(PROMPTS, outs):
    assert o.token_ids == recompute_greedy(smollm2.cfg, smollm2.params, p, 6), p


def test_gguf_q8_engine_batch_matches_each_alone(smollm2):
  """With 8-bit activations (the default) the products are no longer the dense weights',
  so the oracle is the same engine run one request at a time: batching, chunking and the
  batch's padding rows change no request's tokens. (Text prompts: on the token soup above
  a near-tie flips with the last bit of an activation, which x's rounding to 8 bits can
  turn into a whole step.)"""
  from jaxinfer import LLM
  from jaxinfer.config import SamplingParams
  llm = LLM(smollm2, weight_format="gguf", warmup=False, num_pages=64,
            max_num_batched_tokens=16, max_num_seqs=4)
  prompts = [smollm2.tokenizer.encode(t) for t in (
      "The capital of France is", "One, two, three,", "Water boils at",
      "def add(a, b):")]
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  together = [o.token_ids for o in llm.generate(prompts, sp)]
  assert together == [llm.generate([p], sp)[0].token_ids for p in prompts]
