"""HF safetensors directories (config.json + weights) of every family in ModelConfig ->
params and ModelConfig: each family's config fields and tensor names mapped here."""
from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.errors import ModelLoadError

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
          "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
          "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
          "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3_moe",
          "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    # Phi-3 keeps q, k, v and gate, up side by side (split at load: split_fused)
    "self_attn.qkv_proj.weight": "wq+wk+wv", "mlp.gate_up_proj.weight": "w_gate+w_up",
    # mixtures of experts: the router (each expert's matrices: _EXPERT_NAMES)
    "mlp.gate.weight": "router", "block_sparse_moe.gate.weight": "router",
    "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.shared_experts.gate_proj.weight": "shared_gate",
    "mlp.shared_experts.up_proj.weight": "shared_up",
    "mlp.shared_experts.down_proj.weight": "shared_down",
    # multi-head latent attention (DeepSeek)
    "self_attn.q_a_proj.weight": "wq_a", "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "wq_b", "self_attn.kv_a_proj_with_mqa.weight": "wkv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "wkv_b",
}
# "<layer>.<mlp>.experts.<j>.<name>" -> the stacked [E, ...] weight it is row j of
_EXPERT_NAMES = {"gate_proj.weight": "experts_gate", "up_proj.weight": "experts_up",
                 "down_proj.weight": "experts_down", "w1.weight": "experts_gate",
                 "w3.weight": "experts_up", "w2.weight": "experts_down"}
# Gemma 2/3 norm the attention and MLP outputs too: their post_attention_layernorm is the
# attention output's, pre_feedforward_layernorm the MLP input's
_SANDWICH_NAMES = dict(_LAYER_NAMES, **{
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm"})


def _rope(params: dict | None, where: str, max_position: int | None = None):
  """(theta, scaling tuple) from an HF rope_parameters / rope_scaling dict (max_position:
  the config's, YaRN's factor where the dict leaves it out)."""
  params = params or {}
  kind = params.get("rope_type", params.get("type", "default"))
  theta = params.get("rope_theta")
  if kind == "default":
    return theta, ()
  if kind == "linear":
    return theta, ("linear", float(params["factor"]))
  if kind == "llama3":
    return theta, ("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]),
                   float(params["original_max_position_embeddings"]))
  if kind == "yarn":
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if original is None or (factor is None and not max_position):
      raise ModelLoadError(f"YaRN RoPE in {where} needs original_max_position_embeddings "
                           "and a factor (or max_position_embeddings)")
    factor = float(factor if factor is not None else max_position / original)

    def mscale(scale, m=1.0):  # YaRN's attention temperature
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = params.get("attention_factor")
    if af is None:
      m, m_all = params.get("mscale"), params.get("mscale_all_dim")
      af = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return theta, ("yarn", factor, float(original), float(params.get("beta_fast") or 32),
                   float(params.get("beta_slow") or 1), float(af),
                   bool(params.get("truncate", True)))
  raise ModelLoadError(f"RoPE type {kind!r} in {where} is not supported; supported: "
                       "default, linear, llama3, yarn")


def config_from_hf(path: str, name: str | None = None) -> ModelConfig:
  f = os.path.join(path, "config.json")
  if not os.path.isfile(f):
    raise ModelLoadError(f"no config.json in {path!r}; expected an HF model directory")
  with open(f) as fh:
    c = json.load(fh)
  archs = c.get("architectures") or []
  family = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
  if family is None:
    raise ModelLoadError(
        f"architecture {archs} in {f!r} is not supported; supported: {sorted(_ARCHS)}")
  rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
  local_theta = None
  if "full_attention" in rope:  # Gemma 3: one RoPE per layer type
    local_theta = _rope(rope.get("sliding_attention"), f)[0]
    rope = rope["full_attention"]
  theta, scaling = _rope(rope, f, c.get("max_position_embeddings"))
  theta = c.get("rope_theta") or theta or 10000.0
  if family == "gemma3" and local_theta is None:
    local_theta = c.get("rope_local_base_freq", 10000.0)
  partial = float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
  L = c["num_hidden_layers"]
  window = c.get("sliding_window") or 0
  if family == "qwen2" and not c.get("use_sliding_window", False):
    window = 0
  types = c.get("layer_types")
  if types and window:
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
  else:
    windows = (window,) * L if window else ()
  gemma = family in ("gemma2", "gemma3")
  N = c["num_attention_heads"]
  eos = c.get("eos_token_id")
  eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
  act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
  acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
  if act not in acts:
    raise ModelLoadError(f"activation {act!r} in {f!r} is not supported; supported: "
                         f"{sorted(acts)}")
  qpas = c.get("query_pre_attn_scalar")
  moe = _moe_fields(c, family, L, f)
  mla = _mla_fields(c, rope) if family == "deepseek_v3" else {}
  return ModelConfig(
      name=name or os.path.basename(os.path.normpath(path)), family=family,
      vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
      intermediate_size=c["intermediate_size"], num_layers=L,
      num_heads=N, num_kv_heads=N if mla else c.get("num_key_value_heads", N),
      head_dim=mla.pop("head_dim", None) or c.get("head_dim") or c["hidden_size"] // N,
      rope_theta=float(theta),
      rms_norm_eps=c.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
      max_position=c.get("max_position_embeddings", 4096),
      qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"), bos_token_id=c.get("bos_token_id"),
      eos_token_ids=eos, qkv_bias=family == "qwen2", hidden_act=acts[act],
      norm_offset=1.0 if gemma else 0.0, embed_scale=gemma, sandwich_norms=gemma,
      query_scale=float(qpas) ** -0.5 if gemma and qpas else mla.pop("query_scale", None),
      attn_softcap=c.get("attn_logit_softcapping") if gemma else None,
      final_softcap=c.get("final_logit_softcapping") if gemma else None,
      layer_windows=windows, rope_local_theta=local_theta, rope_scaling=scaling,
      partial_rotary=partial, **moe, **mla)


def _mla_fields(c: dict, rope: dict) -> dict:
  """DeepSeek's latent attention: ranks and head widths; the scores' scale (YaRN's
  mscale_all_dim scales it by the squared temperature, as DeepSeek does)."""
  dn, dr = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
  scale = (dn + dr) ** -0.5
  m_all = rope.get("mscale_all_dim") if rope.get("rope_type", rope.get("type")) == "yarn" \
      else None
  if m_all and rope.get("factor", 1) > 1:
    scale *= (0.1 * m_all * math.log(rope["factor"]) + 1.0) ** 2
  return dict(head_dim=dn + dr, kv_lora_rank=c["kv_lora_rank"], qk_rope_head_dim=dr,
              v_head_dim=c["v_head_dim"], q_lora_rank=c.get("q_lora_rank") or 0,
              query_scale=scale)


def _moe_fields(c: dict, family: str, L: int, where: str) -> dict:
  """ModelConfig's mixture-of-experts fields from an HF config (none for a dense family)."""
  if family == "mixtral":  # every layer an MoE of num_local_experts, renormalised top-k
    return dict(num_experts=c["num_local_experts"], experts_per_token=c["num_experts_per_tok"],
                moe_intermediate_size=c["intermediate_size"], norm_topk_prob=True)
  if family == "deepseek_v3":  # sigmoid, group-limited router; shared experts; dense first
    return dict(num_experts=c["n_routed_experts"], experts_per_token=c["num_experts_per_tok"],
                moe_intermediate_size=c["moe_intermediate_size"], router="sigmoid",
                norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
                expert_groups=c.get("n_group") or 1, expert_groups_kept=c.get("topk_group") or 1,
                shared_expert_size=c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0),
                first_dense_layers=min(c.get("first_k_dense_replace", 0), L))
  if family != "qwen3_moe":
    return {}
  step = c.get("decoder_sparse_step", 1) or 1
  dense = [i for i in range(L) if i in (c.get("mlp_only_layers") or []) or (i + 1) % step]
  if dense != list(range(len(dense))):
    raise ModelLoadError(f"{where}: dense MLP layers {dense} among the MoE layers; jaxinfer "
                         "runs dense layers only before the first MoE layer")
  return dict(num_experts=c.get("num_experts") or c["num_local_experts"],
              experts_per_token=c["num_experts_per_tok"],
              moe_intermediate_size=c["moe_intermediate_size"],
              norm_topk_prob=bool(c.get("norm_topk_prob", False)),
              first_dense_layers=len(dense))


def split_fused(layer: dict, cfg: ModelConfig) -> None:
  """Phi-3's fused matrices ([in, out] after the transpose) into the model's names (its
  safetensors and GGUF files both keep them fused)."""
  NH, KH, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
      cfg.intermediate_size
  for key, sizes in (("wq+wk+wv", (NH, KH, KH)), ("w_gate+w_up", (F, F))):
    if key in layer:
      w = layer.pop(key)
      parts = np.split(w, np.cumsum(sizes)[:-1], axis=-1)
      layer.update(zip(key.split("+"), parts))


def _hf_config(path: str) -> dict:
  with open(os.path.join(path, "config.json")) as fh:
    return json.load(fh)


def _deinterleave_rope(layer: dict, cfg: ModelConfig) -> None:
  """DeepSeek rotates its RoPE dims in adjacent pairs (x0, x1), (x2, x3), ...: the
  producing columns reordered evens first, odds after, so the model's rotate-half RoPE
  computes the same scores (a permutation of both q's and k's RoPE dims)."""
  dr, H, N = cfg.qk_rope_head_dim, cfg.head_dim, cfg.num_heads
  perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
  q = "wq_b" if "wq_b" in layer else "wq"
  w = layer[q].reshape(-1, N, H)
  w[..., H - dr:] = w[..., H - dr:][..., perm]
  layer[q] = w.reshape(-1, N * H)
  r = cfg.kv_lora_rank
  layer["wkv_a"][:, r:] = layer["wkv_a"][:, r:][:, perm]


def _expert_key(sub: str):
  """(stacked name, expert index) of a per-expert tensor name, or None."""
  parts = sub.split(".")
  if len(parts) == 5 and parts[1] == "experts" and parts[2].isdigit():
    name = _EXPERT_NAMES.get(".".join(parts[3:]))
    return None if name is None else (name, int(parts[2]))
  return None


def _stack_experts(layer: dict, cfg: ModelConfig, path: str) -> None:
  """Each expert matrix's per-expert rows ({j: [in, out]}) stacked [E, in, out]."""
  for name in ("experts_gate", "experts_up", "experts_down"):
    rows = layer.get(name)
    if rows is None:
      continue
    if sorted(rows) != list(range(cfg.num_experts)):
      raise ModelLoadError(f"{path!r}: {name} holds experts {sorted(rows)}, expected "
                           f"0..{cfg.num_experts - 1}")
    layer[name] = np.stack([rows[j] for j in range(cfg.num_experts)])


def load_safetensors_dir(path: str, name: str | None = None):
  """Returns (params with per-layer lists of numpy float32 arrays, ModelConfig)."""
  from safetensors.numpy import load_file
  cfg = config_from_hf(path, name)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise ModelLoadError(f"no *.safetensors files in {path!r}")
  layers = [dict() for _ in range(cfg.num_layers)]
  params = {"layers": layers}
  names = _SANDWICH_NAMES if cfg.sandwich_norms else _LAYER_NAMES
  for fname in files:
    try:
      tensors = load_file(fname)
    except Exception as e:
      raise ModelLoadError(f"cannot read {fname!r}: {e}") from e
    for key, w in tensors.items():
      w = np.asarray(w, dtype=np.float32) if w.dtype != np.uint16 else _bf16(w)
      if key.startswith("model.layers."):
        rest = key[len("model.layers."):]
        i, sub = rest.split(".", 1)
        expert = _expert_key(sub)
        if expert is not None:
          name, j = expert
          layers[int(i)].setdefault(name, {})[j] = w.T
          continue
        if sub not in names:
          continue
        layers[int(i)][names[sub]] = w.T if w.ndim == 2 else w
      elif key == "model.embed_tokens.weight":
        params["embed"] = w
      elif key == "model.norm.weight":
        params["final_norm"] = w
      elif key == "lm_head.weight" and not cfg.tie_embeddings:
        params["lm_head"] = w.T
  interleaved = cfg.mla and _hf_config(path).get("rope_interleave", True)
  for layer in layers:
    split_fused(layer, cfg)
    _stack_experts(layer, cfg, path)
    if interleaved:
      _deinterleave_rope(layer, cfg)
  if "embed" not in params or "final_norm" not in params:
    raise ModelLoadError(f"{path!r} lacks model.embed_tokens.weight or model.norm.weight")
  return params, cfg


def _bf16(w):
  return (w.astype(np.uint32) << 16).view(np.float32)
