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


def mlp(x, p, cfg: ModelConfig, real=None, backend=None):
  """The layer's MLP: SwiGLU / GeGLU, or a mixture of experts of them (moe.py; real [T]:
  the rows that are tokens, None: all; backend: the attention spec, whose mesh a
  several-device replica's experts are split over)."""
  if "router" in p:  # this layer's MLP is a mixture of experts
    par = getattr(backend, "tp", None)
    par = par if par is not None and par.mesh.size > 1 else None
    with jax.named_scope("moe"):
      return moe.moe_mlp(x, p, cfg, lambda g: activation(g, cfg.hidden_act), real, par)
  with jax.named_scope("mlp"):
    g, u = linear_group(x, p, ("w_gate", "w_up"))  # [T, F] each
    h = (activation(g, cfg.hidden_act) * u).astype(x.dtype)
    return linear(h, p["w_down"]).astype(x.dtype)


def attention_block(x, p, cfg: ModelConfig, rope, pool, layer, batch, *, attn_shape,
                    backend, window=None):
  """x [T, D] (normed) -> (out [T, D], k [T, K, H], v [T, K, H]) for this step's tokens.
  window: this layer's sliding window (None: full attention)."""
  if cfg.mla:
    return latent_attention_block(x, p, cfg, rope, pool, layer, batch,
                                  attn_shape=attn_shape, backend=backend, window=window)
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


def latent_view(pool):
  """An MLA pool (keys only) seen as a K/V pool whose values are its keys: the same
  arrays under both names, so every backend and KV format reads the latent as both."""
  view = dict(pool)
  for name, a in pool.items():
    if name.startswith("k"):
      view["v" + name[1:]] = a
  return view


def latent_attention_block(x, p, cfg: ModelConfig, rope, pool, layer, batch, *, attn_shape,
                           backend, window=None):
  """Multi-head latent attention (DeepSeek-V2/V3) with the up-projections absorbed: each
  token stores one latent c (kv_lora_rank, normed) and one RoPE key (qk_rope_head_dim);
  a head's query is carried into the latent space (q_nope W_UK) beside its RoPE part, so
  scores are q_lat . c + q_rope . k_rope over the stored entry, attention is multi-query
  with one KV head whose values are the entry's first kv_lora_rank dims, and each head's
  output is read back out of the latent (o_lat W_UV) before wo.

  Returns (out [T, D], entry [T, 1, r + dr], an empty [T, 1, 0] value)."""
  T = x.shape[0]
  N, H = cfg.num_heads, cfg.head_dim
  r, dr, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
  dn = H - dr
  with jax.named_scope("mla_qkv"):
    if cfg.q_lora_rank:
      qa = rms_norm(linear(x, p["wq_a"]).astype(x.dtype), p["q_a_norm"], cfg.rms_norm_eps)
      q = linear(qa, p["wq_b"])
    else:
      q = linear(x, p["wq"])
    q = q.astype(x.dtype).reshape(T, N, H)
    kv = linear(x, p["wkv_a"]).astype(x.dtype)  # [T, r + dr]
    c = rms_norm(kv[:, :r], p["kv_a_norm"], cfg.rms_norm_eps)
    cos, sin = rope
    q_rope = apply_rope(q[..., dn:], cos, sin)
    k_rope = apply_rope(kv[:, None, r:], cos, sin)  # [T, 1, dr]: one per token
    wkv_b = p["wkv_b"].reshape(r, N, dn + dv)
    w_uk, w_uv = wkv_b[..., :dn], wkv_b[..., dn:]
    q_lat = jnp.einsum("tnd,rnd->tnr", q[..., :dn], w_uk.astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
    q_full = jnp.concatenate([q_lat, q_rope], axis=-1)  # [T, N, r + dr]
    entry = jnp.concatenate([c[:, None, :], k_rope], axis=-1)  # [T, 1, r + dr]
  with jax.named_scope("attention"):
    o = attention.paged_attention(q_full, entry, entry, latent_view(pool), layer, batch,
                                  attn_shape=attn_shape, backend=backend,
                                  scale=cfg.query_scale if cfg.query_scale else H ** -0.5,
                                  window=window, softcap=cfg.attn_softcap)  # [T, N, r+dr]
  o = jnp.einsum("tnr,rnd->tnd", o[..., :r].astype(x.dtype), w_uv.astype(x.dtype),
                 preferred_element_type=jnp.float32)
  out = linear(o.astype(x.dtype).reshape(T, N * dv), p["wo"]).astype(x.dtype)
  return out, entry, entry[..., :0]
