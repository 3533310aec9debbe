"""forward(params, pool, batch, cfg) -> (logits, pool) for every family of ModelConfig.

One step processes a packed, ragged set of new tokens (prefill chunks and decode
tokens of many requests). Each layer attends to the request's cached pages plus the
step's own tokens; the step's K/V of all layers are written to the pool once, after the
last layer (measured: per-layer writes into a stacked pool copy it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.attention import write_kv
from jaxinfer.kv import kv_layout
from jaxinfer.model import layers, linear, moe


def layer(x, p, layer, cfg, rope, pool, batch, attn_shape, backend, window=None):
  """One decoder layer (window: its sliding window, None for full attention)."""
  norm = lambda y, w: layers.rms_norm(y, p[w], cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
  slot, kv_batch = kv_at(cfg, batch, layer)
  h, k, v = layers.attention_block(norm(x, "attn_norm"), p, cfg, rope, pool, slot, kv_batch,
                                   attn_shape=attn_shape, backend=backend, window=window)
  if cfg.sandwich_norms:  # Gemma 2/3: the attention and MLP outputs are normed too
    h = norm(h, "post_attn_norm")
  x = x + h
  # a mixture of experts routes only the step's real tokens (padding rows reach no expert)
  real = jnp.arange(x.shape[0]) < jnp.sum(batch["query_len"]) if "router" in p else None
  h = layers.mlp(norm(x, "mlp_norm"), p, cfg, real, backend)
  if cfg.sandwich_norms:
    h = norm(h, "post_mlp_norm")
  return x + h, k, v


def kv_at(cfg: ModelConfig, batch, i):
  """Where layer i's K/V live: its slot of the pool's pages and the step's metadata with
  its group's page table (kv.kv_layout; the layer itself and the one table where the
  layers are not grouped). i may be static or traced."""
  layout = kv_layout(cfg)
  if layout.num_groups == 1:
    return i, batch
  if isinstance(i, int):
    slot, group = layout.slot_of[i], layout.group_of[i]
  else:
    slot = jnp.asarray(layout.slot_of, jnp.int32)[i]
    group = jnp.asarray(layout.group_of, jnp.int32)[i]
  return slot, dict(batch, page_table=batch["page_table"][group])


def write_step_kv(pool, ks, vs, batch, cfg: ModelConfig, backend):
  """The step's K/V of the layers run, written once after the last (layer groups too)."""
  layout = kv_layout(cfg)
  return write_kv(pool, ks, vs, batch["write_page"], batch["write_offset"], backend,
                  layout if layout.num_groups > 1 else None)


# A window no context reaches: full attention in a layer scan that mixes both kinds.
_NO_WINDOW = 1 << 30


def layer_tables(cfg: ModelConfig, positions):
  """The step's RoPE tables, computed once: (cos, sin) for full-attention layers and, for
  a model whose windowed layers have a RoPE base of their own (Gemma 3), theirs; the
  second is None otherwise."""
  rope = layers.rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
  local = None
  if cfg.rope_local_theta is not None and any(cfg.windows):
    local = layers.rope_tables(positions, cfg.rotary_dim, cfg.rope_local_theta)
  return rope, local


def rope_at(cfg: ModelConfig, tables, i):
  """Layer i's (cos, sin) from `layer_tables`, for a static or a traced layer index."""
  rope, local = tables
  if local is None:
    return rope
  if isinstance(i, int):
    return local if cfg.windows[i] else rope
  is_local = jnp.asarray([w > 0 for w in cfg.windows])[i]
  return tuple(jnp.where(is_local, a, b) for a, b in zip(local, rope))


def window_at(cfg: ModelConfig, i):
  """Layer i's sliding window: None for full attention (every layer, or layer i when i is
  static); under a layer scan that mixes both, a traced int (_NO_WINDOW for full)."""
  windows = cfg.windows
  if not any(windows):
    return None
  if isinstance(i, int):
    return windows[i] or None
  return jnp.asarray([w or _NO_WINDOW for w in windows], jnp.int32)[i]


def hidden_states(params, pool, batch, cfg: ModelConfig, *, attn_shape,
                  backend: str = "xla", num_layers: int | None = None):
  """Final-normed hidden states [T, D] and the step's K/V [L', T, K, H] of the layers run.

  num_layers: run only the first layers (early-exit drafting); default all.
  attn_shape: (max query tokens per prefill slot, prefill slots), static (see attention.py).
  batch["lora"] (a step carrying adapters): the adapter pool, per target a [L, in, S, r]
  and b [L, S, r, out], with the per-token index arrays of jaxinfer.lora.ops; each
  adapted weight is wrapped in linear.Adapted for its layer.
  """
  x = embed(params, batch["token_ids"], cfg)  # [T, D]
  tables = layer_tables(cfg, batch["positions"])
  L = cfg.num_layers if num_layers is None else num_layers
  lora = batch.get("lora")
  index = {k: a for k, a in batch.items() if k.startswith("lora_")}

  def run(x, p, i):
    # The LoRA pool is indexed by layer inside its ops, never sliced per layer: a scanned
    # slice of it is a copy of the whole pool every layer (docs/design.md).
    if lora is not None:
      p = linear.with_adapters(p, lora, i, index)
    return layer(x, p, i, cfg, rope_at(cfg, tables, i), pool, batch, attn_shape, backend,
                 window_at(cfg, i))

  # each weight in the form that serves this step's rows (static), before the scan: the
  # forms it does not use are then no scanned input
  lp = linear.for_rows(params["layers"], x.shape[0])
  if isinstance(lp, dict):  # stacked: layers under lax.scan; weights read in place by
    # layer index (experts among them) stay out of the scanned inputs (never sliced)
    scanned, in_place = linear.split_in_place(moe.in_place(lp))
    if L == cfg.num_layers:

      def body(x, xs):
        p, i = xs
        x, k, v = run(x, dict(p, **linear.in_place_at(in_place, i)), i)
        return x, (k, v)

      x, (ks, vs) = jax.lax.scan(body, x, (scanned, jnp.arange(L, dtype=jnp.int32)))
    else:  # the first L layers: index the stacked weights in the loop (a static slice
      # lp[:L] would copy L layers' weights on every call)

      def body_i(x, i):
        x, k, v = run(x, linear.layer_at(scanned, in_place, i), i)
        return x, (k, v)

      x, (ks, vs) = jax.lax.scan(body_i, x, jnp.arange(L, dtype=jnp.int32))
  else:  # unrolled over a list of per-layer dicts
    ks, vs = [], []
    for i in range(L):
      x, k, v = run(x, lp[i], i)
      ks.append(k)
      vs.append(v)
    ks, vs = jnp.stack(ks), jnp.stack(vs)
  return final_norm(params, x, cfg), ks, vs


def embed(params, token_ids, cfg: ModelConfig):
  """The tokens' embeddings [T, D] in the activations' dtype."""
  x = params["embed"][token_ids].astype(linear.activation_dtype(params))
  if cfg.embed_scale:  # Gemma: sqrt(D), rounded to the activations' dtype as HF does
    x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
  return x


def final_norm(params, x, cfg: ModelConfig):
  return layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)


def lm_head(params, x, cfg: ModelConfig):
  """x [S, D] -> logits [S, V] float32 (the tied embedding where the model has no head;
  Gemma 2's final soft cap)."""
  head = params.get("lm_head")
  head = linear.Dense(params["embed"], transposed=True) if head is None else head
  logits = linear.linear(x, linear.for_rows(head, x.shape[0])).astype(jnp.float32)
  if cfg.final_softcap is not None:
    logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
  return logits


def forward(params, pool, batch, cfg: ModelConfig, *, attn_shape,
            backend: str = "xla"):
  """Returns (logits [S, V] f32 at batch["logits_idx"], pool with the step's K/V written)."""
  x, ks, vs = hidden_states(params, pool, batch, cfg, attn_shape=attn_shape,
                            backend=backend)
  pool = write_step_kv(pool, ks, vs, batch, cfg, backend)
  logits = lm_head(params, x[batch["logits_idx"]], cfg)
  return logits, pool
