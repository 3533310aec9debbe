"""The decoder's parts: RMSNorm, RoPE, SwiGLU MLP, the attention block.

Letters: T tokens, N query heads, K KV heads, H head dim, D model dim, F ffn dim.
Every projection goes through `linear` (jaxinfer/model/linear.py), whatever form its
weight takes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer import attention
from jaxinfer.config import ModelConfig
from jaxinfer.model import moe
from jaxinfer.model.linear import linear, linear_group


def rms_norm(x, w, eps, offset: float = 0.0):
  """RMSNorm scaling by (offset + w): offset 1 in Gemma's form."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * (offset + w.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(dim: int, theta: float, scaling=()):
  """RoPE's inverse frequencies [dim/2] over the `dim` rotated dims of a head, with the
  config's scaling: ("linear", factor) divides them by the factor; ("llama3", factor, low,
  high, original_max_position) divides the low frequencies (wavelength above original /
  low) by the factor, keeps the high ones (below original / high) and blends those between
  (Llama 3.1); ("yarn", factor, original, beta_fast, beta_slow, attention_factor,
  truncate) keeps the dims that turn more than beta_fast times over the original context,
  divides those turning fewer than beta_slow times by the factor, and ramps linearly
  between (YaRN; its attention factor scales cos and sin in rope_tables)."""
  inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if not scaling:
    return inv
  if scaling[0] == "linear":
    return inv / scaling[1]
  if scaling[0] == "yarn":
    _, factor, original, fast, slow, _, truncate = scaling

    def dim_at(rotations):  # the dim whose wavelength fits `rotations` times in original
      return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_at(fast), dim_at(slow)
    if truncate:
      lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - lo) / (hi - lo), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)
  _, factor, low, high, original = scaling
  wavelen = 2 * jnp.pi / inv
  scaled = jnp.where(wavelen > original / low, inv / factor, inv)
  smooth = (original / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return jnp.where(medium, blended, scaled)


def rope_tables(positions, dim: int, theta: float, scaling=()):
  """cos, sin [T, dim/2] for absolute positions [T] over the `dim` rotated dims of a head
  (HF "rotate half" convention); YaRN's attention factor scales both."""
  inv_freq = rope_frequencies(dim, theta, scaling)
  ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  if scaling and scaling[0] == "yarn":
    cos, sin = cos * scaling[5], sin * scaling[5]
  return cos, sin


def apply_rope(x, cos, sin):
  """x [T, heads, H]; rotates the two halves of its first 2 x cos.shape[-1] dims (all of
  H, or a partial rotary share), the rest pass through."""
  h2 = cos.shape[-1]
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :h2], xf[..., h2:2 * h2], xf[..., 2 * h2:]
  c, s = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)


def activation(x, name: str):
  return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


def mlp(x, p, cfg: ModelConfig):
  """The layer's MLP: SwiGLU / GeGLU, or a mixture of experts of them (moe.py)."""
  if cfg.num_experts:
    with jax.named_scope("moe"):
      return moe.moe_mlp(x, p, cfg, lambda g: activation(g, cfg.hidden_act))
  with jax.named_scope("mlp"):
    g, u = linear_group(x, p, ("w_gate", "w_up"))  # [T, F] each
    h = (activation(g, cfg.hidden_act) * u).astype(x.dtype)
    return linear(h, p["w_down"]).astype(x.dtype)


def attention_block(x, p, cfg: ModelConfig, rope, pool, layer, batch, *, attn_shape,
                    backend, window=None):
  """x [T, D] (normed) -> (out [T, D], k [T, K, H], v [T, K, H]) for this step's tokens.
  window: this layer's sliding window (None: full attention)."""
  T = x.shape[0]
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  with jax.named_scope("qkv"):
    q, k, v = (y.astype(x.dtype) for y in linear_group(x, p, ("wq", "wk", "wv")))
    if cfg.qkv_bias:  # Qwen2
      q, k, v = (y + p[b].astype(x.dtype) for y, b in ((q, "bq"), (k, "bk"), (v, "bv")))
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
  if cfg.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm before RoPE
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
  cos, sin = rope
  q = apply_rope(q, cos, sin)
  k = apply_rope(k, cos, sin)
  with jax.named_scope("attention"):
    o = attention.paged_attention(q, k, v, pool, layer, batch, attn_shape=attn_shape,
                                  backend=backend, scale=cfg.query_scale, window=window,
                                  softcap=cfg.attn_softcap)  # [T, N, H] f32
  out = linear(o.astype(x.dtype).reshape(T, N * H), p["wo"]).astype(x.dtype)
  return out, k, v
