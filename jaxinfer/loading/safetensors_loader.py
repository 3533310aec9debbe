"""HF safetensors directories (Llama and Qwen3 tensor names) -> params and ModelConfig."""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.errors import ModelLoadError

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


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
  theta = c.get("rope_theta")
  if theta is None:
    theta = (c.get("rope_parameters") or c.get("rope_scaling") or {}).get("rope_theta", 10000.0)
  N = c["num_attention_heads"]
  eos = c.get("eos_token_id")
  eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
  return ModelConfig(
      name=name or os.path.basename(os.path.normpath(path)), family=family,
      vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
      intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
      num_heads=N, num_kv_heads=c.get("num_key_value_heads", N),
      head_dim=c.get("head_dim") or c["hidden_size"] // N, rope_theta=float(theta),
      rms_norm_eps=c.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      max_position=c.get("max_position_embeddings", 4096), qk_norm=family == "qwen3",
      bos_token_id=c.get("bos_token_id"), eos_token_ids=eos)


def load_safetensors_dir(path: str, name: str | None = None):
  """Returns (params with per-layer lists of numpy float32 arrays, ModelConfig)."""
  from safetensors.numpy import load_file
  cfg = config_from_hf(path, name)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise ModelLoadError(f"no *.safetensors files in {path!r}")
  layers = [dict() for _ in range(cfg.num_layers)]
  params = {"layers": layers}
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
        if sub not in _LAYER_NAMES:
          continue
        layers[int(i)][_LAYER_NAMES[sub]] = w.T if w.ndim == 2 else w
      elif key == "model.embed_tokens.weight":
        params["embed"] = w
      elif key == "model.norm.weight":
        params["final_norm"] = w
      elif key == "lm_head.weight" and not cfg.tie_embeddings:
        params["lm_head"] = w.T
  if "embed" not in params or "final_norm" not in params:
    raise ModelLoadError(f"{path!r} lacks model.embed_tokens.weight or model.norm.weight")
  return params, cfg


def _bf16(w):
  return (w.astype(np.uint32) << 16).view(np.float32)
