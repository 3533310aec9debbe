"""The mixture-of-experts MLP: the grouped expert products (ragged and the CPU slab loop)
against a per-token reference under even, skewed and one-expert routing; DeepSeek-V3's
sigmoid, group-limited router with its shared expert against HF's own MoE block; the
cost model's experts-touched arithmetic against a Monte Carlo count."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxinfer.config import QWEN3_8B
from jaxinfer.model import moe

E, D, F = 8, 32, 24


def _weights(seed=0):
  r = np.random.default_rng(seed)
  return [jnp.asarray(0.2 * r.standard_normal(s), jnp.float32)
          for s in ((E, D, F), (E, D, F), (E, F, D))]


def _per_token(x, experts, wg, wu, wd):
  act = jax.nn.silu
  return np.stack([np.asarray((act(x[i] @ wg[e]) * (x[i] @ wu[e])) @ wd[e])
                   for i, e in enumerate(np.asarray(experts))])


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("rows,skew", [(1, "even"), (7, "even"), (40, "even"),
                                       (40, "one"), (200, "skewed"), (3, "last"),
                                       (24, "padded")])
def test_grouped_experts_equal_per_token_reference(ragged, rows, skew):
  """Each sorted row through its own expert's gated MLP: the ragged product and the CPU
  slab loop equal a per-row loop, however the rows fall on the experts (one expert
  taking them all, a few experts, empty experts in between, only the last one), and
  rows of no expert (a bucket's padding, expert E) come out zero."""
  r = np.random.default_rng(rows)
  experts = {"even": r.integers(0, E, rows), "one": np.full(rows, 3),
             "skewed": np.minimum(r.geometric(0.5, rows) - 1, E - 1),
             "last": np.full(rows, E - 1),
             "padded": np.minimum(r.integers(0, E + 4, rows), E)}[skew]
  experts = np.sort(experts).astype(np.int32)
  x = jnp.asarray(r.standard_normal((rows, D)), jnp.float32)
  sizes = jnp.asarray(np.bincount(experts, minlength=E + 1)[:E], jnp.int32)
  wg, wu, wd = _weights()
  got = jax.jit(lambda x, e, s: moe.grouped_experts(x, e, s, wg, wu, wd, jax.nn.silu,
                                                     ragged=ragged))(x, experts, sizes)
  real = experts < E
  want = np.zeros((rows, D), np.float32)
  want[real] = _per_token(x[real], experts[real], wg, wu, wd)
  if skew == "padded":
    assert 0 < real.sum() < rows
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_slab_rows_bound_the_padded_slabs():
  """The CPU loop's static slab count holds every routing: the worst case pads each of
  min(E, A) touched experts by b - 1 rows."""
  for a, e in ((1, 8), (16, 8), (128, 128), (4096, 64), (7, 3)):
    b = moe.slab_rows(a, e)
    assert 8 <= b <= 64 and b & (b - 1) == 0
    worst = [a - min(e, a) + 1] + [1] * (min(e, a) - 1)  # one big group, the rest of 1
    need = sum(-(-n // b) for n in worst)
    assert need <= (a + min(e, a) * (b - 1)) // b


def test_deepseek_v3_moe_block_equals_hf():
  """DeepSeek-V3's MoE block (sigmoid scores, a selection bias, 4 groups of which 2 are
  kept, renormalised top-2 times 2.5, one shared expert) against HF's DeepseekV3MoE on the
  same random weights: the same output for 64 tokens."""
  transformers = pytest.importorskip("transformers")
  import torch
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds
  from jaxinfer.loading.safetensors_loader import _moe_fields
  conf = transformers.DeepseekV3Config(
      vocab_size=128, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=2,
      moe_intermediate_size=F, n_group=4, topk_group=2, n_shared_experts=1,
      first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
      qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True)
  torch.manual_seed(0)
  block = hf_ds.DeepseekV3MoE(conf).eval()
  with torch.no_grad():
    for p in block.parameters():
      p.copy_(0.3 * torch.randn_like(p))
    block.gate.e_score_correction_bias.copy_(0.5 * torch.randn(E))
  cfg = QWEN3_8B.replace(hidden_size=D, **_moe_fields(conf.to_dict(), "deepseek_v3", 1, "-"))
  assert (cfg.router, cfg.expert_groups, cfg.expert_groups_kept, cfg.shared_expert_size,
          cfg.routed_scaling) == ("sigmoid", 4, 2, F, 2.5)
  gu = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
  p = {"router": block.gate.weight.detach().numpy().T,
       "router_bias": block.gate.e_score_correction_bias.numpy(),
       "experts_gate": gu[:, :F].transpose(0, 2, 1), "experts_up": gu[:, F:].transpose(0, 2, 1),
       "experts_down": block.experts.down_proj.detach().numpy().transpose(0, 2, 1)}
  sh = block.shared_experts
  for ours, theirs in (("shared_gate", sh.gate_proj), ("shared_up", sh.up_proj),
                       ("shared_down", sh.down_proj)):
    p[ours] = theirs.weight.detach().numpy().T
  x = np.random.default_rng(1).standard_normal((64, D)).astype(np.float32)
  with torch.no_grad():
    want = block(torch.tensor(x)[None])[0].numpy()
  got = moe.moe_mlp(jnp.asarray(x), jax.tree_util.tree_map(jnp.asarray, p), cfg, jax.nn.silu)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_expected_experts_touched_matches_sampling():
  """E (1 - (1 - k/E)^B) against 2,000 draws of B tokens each choosing k distinct experts
  uniformly, for Qwen3-30B-A3B's 128 experts, top 8."""
  cfg = QWEN3_8B.replace(num_experts=128, experts_per_token=8, moe_intermediate_size=768)
  r = np.random.default_rng(0)
  for batch in (1, 4, 16, 64):
    counts = [len({e for _ in range(batch) for e in r.choice(128, 8, replace=False)})
              for _ in range(2000)]
    assert abs(np.mean(counts) - cfg.expected_experts_touched(batch)) < 0.5, batch
  assert cfg.expected_experts_touched(1) == 8
  assert cfg.expected_experts_touched(10_000) == pytest.approx(128)


def test_moe_decode_rounds_grow_with_the_batch_where_its_dense_twin_stays_flat():
  """The simulated batching curve of Qwen3-30B-A3B on RTX PRO 6000: at batch 1 its round
  reads what its dense twin (equal active parameters) reads; the MoE's weight bytes then
  grow with the batch up to all of its weights, so its round time outgrows the twin's."""
  from experiments.moe_batching import dense_twin, sim_curve
  from jaxinfer.config import QWEN3_30B_A3B
  from jaxinfer.costmodel import ModelCosts
  twin = dense_twin(QWEN3_30B_A3B)
  assert twin.param_count() == pytest.approx(QWEN3_30B_A3B.active_param_count(), rel=1e-3)
  moe_rows = sim_curve(QWEN3_30B_A3B, "rtx-pro-6000", 2048, [1, 8, 64, 512])
  dense_rows = sim_curve(twin, "rtx-pro-6000", 2048, [1, 8, 64, 512])
  ratios = [m["round_ms"] / d["round_ms"] for m, d in zip(moe_rows, dense_rows)]
  assert ratios[0] == pytest.approx(1.0, abs=0.02)
  assert ratios[1] > 1.5 and ratios[2] > ratios[1] * 0.9
  reads = [r["weights_read_gb"] for r in moe_rows]
  assert reads == sorted(reads)
  assert reads[-1] * 1e9 == pytest.approx(ModelCosts(QWEN3_30B_A3B).d_w, rel=1e-3)


@pytest.mark.slow
def test_moe_batching_small_binary(tmp_path):
  """The study's command on its CI size: strict JSON, the figure, one measured round per
  batch for the real MoE and its twin."""
  import json
  import subprocess
  import sys
  from experiments.common import ROOT, config_path
  subprocess.run([sys.executable, "-m", "experiments.moe_batching",
                  f"--config={config_path('moe_batching')}:small", f"--output_dir={tmp_path}"],
                 check=True, cwd=ROOT, capture_output=True, timeout=900)
  d = json.loads((tmp_path / "moe_batching.json").read_text())
  assert [r["batch"] for r in d["real"]["moe_rows"]] == [1, 8]
  assert all(r["round_ms"] > 0 for r in d["real"]["moe_rows"] + d["real"]["dense_rows"])
  assert (tmp_path / "moe_batching.png").stat().st_size > 10_000


@pytest.mark.parametrize("name,total_b,active_b", [
    ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235, 22), ("mixtral-8x7b", 46.7, 12.9),
    ("deepseek-v3", 671, 37)])
def test_moe_configs_count_their_published_parameters(name, total_b, active_b):
  """Total and active parameters from the configs' shapes, against the names' figures
  (DeepSeek-V3's 671B without its multi-token-prediction layer; 37B active)."""
  from jaxinfer.config import get_model_config
  cfg = get_model_config(name)
  assert cfg.param_count() / 1e9 == pytest.approx(total_b, rel=0.015)
  assert cfg.active_param_count() / 1e9 == pytest.approx(active_b, rel=0.03)


def test_observed_routing_counts_the_real_rows_and_prices_a_skewed_load():
  """moe.observe_routing reports each MoE call's rows per expert on the host (padding rows
  not counted); a skewed measured load reaches fewer experts than uniform routing, and
  the uniform load gives the uniform formula."""
  cfg = QWEN3_8B.replace(hidden_size=D, num_experts=E, experts_per_token=2,
                         moe_intermediate_size=F)
  wg, wu, wd = _weights()
  r = np.random.default_rng(0)
  p = {"router": jnp.asarray(r.standard_normal((D, E)), jnp.float32), "experts_gate": wg,
       "experts_up": wu, "experts_down": wd}
  x = jnp.asarray(r.standard_normal((16, D)), jnp.float32)
  real = jnp.arange(16) < 11
  seen = []
  moe.observe_routing(lambda counts: seen.append(np.asarray(counts)))
  try:
    jax.jit(lambda x: moe.moe_mlp(x, p, cfg, jax.nn.silu, real))(x).block_until_ready()
  finally:
    moe.observe_routing(None)
  assert len(seen) == 1 and seen[0].shape == (E,) and seen[0].sum() == 11 * 2
  uniform = (1 / E,) * E
  assert cfg.expected_experts_touched(5, uniform) == pytest.approx(
      cfg.expected_experts_touched(5))
  skewed = (0.4, 0.4) + (0.2 / (E - 2),) * (E - 2)
  assert cfg.expected_experts_touched(5, skewed) < cfg.expected_experts_touched(5)
