"""Each weight declared once (shape, logical axes); init / abstract shapes derive from it.

Matmul weights are stored [in, out] so a projection is `x @ w`. Per-layer weights are
either stacked with a leading layer axis (for `lax.scan`) or kept as a list of per-layer
dicts (unrolled; measured: slicing stacked weights inside jit copies them).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  shape: Tuple[int, ...]
  axes: Tuple[str, ...]  # logical axes, for sharding rules
  init: str = "normal"  # "normal" | "ones" | "zeros"


def uniform_layers(cfg: ModelConfig) -> bool:
  """Every layer holds the same weights (so they stack for the layer scan); a model with
  dense MLP layers before its MoE layers keeps a list of per-layer dicts."""
  return not (cfg.first_dense_layers and cfg.moe_layers)


def layer_specs(cfg: ModelConfig, i: int | None = None) -> Dict[str, WeightSpec]:
  """Layer i's weights (i None: every layer's, when they are uniform)."""
  if i is None and not uniform_layers(cfg):
    raise ValueError(f"{cfg.name}'s layers differ (dense MLP in the first "
                     f"{cfg.first_dense_layers}): ask for one layer's specs")
  D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  moe = cfg.num_experts and (i is None or i >= cfg.first_dense_layers)
  specs = {
      "attn_norm": WeightSpec((D,), ("embed",), "ones"),
      "mlp_norm": WeightSpec((D,), ("embed",), "ones"),
  }
  specs.update(mla_specs(cfg) if cfg.mla else {
      "wq": WeightSpec((D, N * H), ("embed", "q_heads")),
      "wk": WeightSpec((D, K * H), ("embed", "kv_heads")),
      "wv": WeightSpec((D, K * H), ("embed", "kv_heads")),
      "wo": WeightSpec((N * H, D), ("q_heads", "embed")),
  })
  specs.update(moe_specs(cfg) if moe else {
      "w_gate": WeightSpec((D, F), ("embed", "mlp")),
      "w_up": WeightSpec((D, F), ("embed", "mlp")),
      "w_down": WeightSpec((F, D), ("mlp", "embed")),
  })
  if cfg.qkv_bias:
    specs["bq"] = WeightSpec((N * H,), ("q_heads",))
    specs["bk"] = WeightSpec((K * H,), ("kv_heads",))
    specs["bv"] = WeightSpec((K * H,), ("kv_heads",))
  if cfg.sandwich_norms:  # after the attention output, and after the MLP output
    specs["post_attn_norm"] = WeightSpec((D,), ("embed",), "ones")
    specs["post_mlp_norm"] = WeightSpec((D,), ("embed",), "ones")
  if cfg.qk_norm:
    specs["q_norm"] = WeightSpec((H,), ("head_dim",), "ones")
    specs["k_norm"] = WeightSpec((H,), ("head_dim",), "ones")
  return specs


def mla_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
  """Multi-head latent attention: queries directly or through their own latent (wq_a, its
  norm, wq_b); the KV latent and the shared RoPE key (wkv_a), the latent's norm, its
  up-projection to each head's no-RoPE key and value (wkv_b), the output (wo)."""
  D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  r, dr, dv, qr = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
  specs = {"wkv_a": WeightSpec((D, r + dr), ("embed", "kv_lora")),
           "kv_a_norm": WeightSpec((r,), ("kv_lora",), "ones"),
           "wkv_b": WeightSpec((r, N * (H - dr + dv)), ("kv_lora", "q_heads")),
           "wo": WeightSpec((N * dv, D), ("q_heads", "embed"))}
  if qr:
    specs.update(wq_a=WeightSpec((D, qr), ("embed", "q_lora")),
                 q_a_norm=WeightSpec((qr,), ("q_lora",), "ones"),
                 wq_b=WeightSpec((qr, N * H), ("q_lora", "q_heads")))
  else:
    specs["wq"] = WeightSpec((D, N * H), ("embed", "q_heads"))
  return specs


def moe_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
  """A mixture-of-experts MLP: the router [D, E], the experts stacked [E, ...] (their
  own logical axis, for expert parallelism), a sigmoid router's selection bias and the
  shared expert where the family has them."""
  D, E, Fm, Fs = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                  cfg.shared_expert_size)
  specs = {
      "router": WeightSpec((D, E), ("embed", "expert_scores")),
      "experts_gate": WeightSpec((E, D, Fm), ("experts", "embed", "mlp")),
      "experts_up": WeightSpec((E, D, Fm), ("experts", "embed", "mlp")),
      "experts_down": WeightSpec((E, Fm, D), ("experts", "mlp", "embed")),
  }
  if cfg.router == "sigmoid":
    specs["router_bias"] = WeightSpec((E,), ("expert_scores",), "zeros")
  if Fs:
    specs["shared_gate"] = WeightSpec((D, Fs), ("embed", "mlp"))
    specs["shared_up"] = WeightSpec((D, Fs), ("embed", "mlp"))
    specs["shared_down"] = WeightSpec((Fs, D), ("mlp", "embed"))
  return specs


def weight_specs(cfg: ModelConfig) -> Dict[str, object]:
  """Top-level specs; "layers" maps to the per-layer specs with a leading layer axis, or
  (layers that differ) to a list of each layer's specs."""
  D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  if uniform_layers(cfg):
    layers = {k: WeightSpec((L,) + s.shape, ("layers",) + s.axes, s.init)
              for k, s in layer_specs(cfg).items()}
  else:
    layers = [layer_specs(cfg, i) for i in range(L)]
  specs = {
      "embed": WeightSpec((V, D), ("vocab", "embed")),
      "final_norm": WeightSpec((D,), ("embed",), "ones"),
      "layers": layers,
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = WeightSpec((D, V), ("embed", "vocab"))
  return specs


def _is_spec(x):
  return isinstance(x, WeightSpec)


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, std: float = 0.02):
  """Random weights (for tests and random-weight configs), stacked layers."""
  specs = weight_specs(cfg)
  leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, s in zip(keys, leaves):
    if s.init in ("ones", "zeros"):
      base = 1.0 if s.init == "ones" else 0.0
      out.append(base + 0.1 * jax.random.normal(k, s.shape, dtype))
    else:
      out.append((std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype),
                                weight_specs(cfg), is_leaf=_is_spec)


def cast_params(params, dtype):
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)


def unstack_layers(params):
  """Stacked layer weights -> list of per-layer dicts (the unrolled layout)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  L = next(iter(layers.values())).shape[0]
  out = dict(params)
  out["layers"] = [{k: v[i] for k, v in layers.items()} for i in range(L)]
  return out


def stack_layers(params):
  """List of per-layer dicts -> stacked layer weights (the `lax.scan` layout); layers that
  hold different weights (dense MLP layers before MoE ones) stay a list."""
  layers = params["layers"]
  if isinstance(layers, dict) or any(set(lyr) != set(layers[0]) for lyr in layers):
    return params
  out = dict(params)
  out["layers"] = {k: jnp.stack([lyr[k] for lyr in layers]) for k in layers[0]}
  return out
