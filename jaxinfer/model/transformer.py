"""forward(params, pool, batch, cfg) -> (logits, pool) for the Llama and Qwen3 families.

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
from jaxinfer.model import layers, linear


def layer(x, p, layer, cfg, rope, pool, batch, attn_shape, backend):
  """One decoder layer."""
  h, k, v = layers.attention_block(
      layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p, cfg, rope, pool, layer, batch,
      attn_shape=attn_shape, backend=backend)
  x = x + h
  x = x + layers.mlp(layers.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), p)
  return x, k, v


def hidden_states(params, pool, batch, cfg: ModelConfig, *, attn_shape,
                  backend: str = "xla", num_layers: int | None = None):
  """Final-normed hidden states [T, D] and the step's K/V [L', T, K, H] of the layers run.

  num_layers: run only the first layers (early-exit drafting); default all.
  attn_shape: (max query tokens per prefill slot, prefill slots), static (see attention.py).
  batch["lora"] (a step carrying adapters): the adapter pool, per target a [L, in, S, r]
  and b [L, S, r, out], with the per-token index arrays of jaxinfer.lora.ops; each
  adapted weight is wrapped in linear.Adapted for its layer.
  """
  x = params["embed"][batch["token_ids"]].astype(linear.activation_dtype(params))  # [T, D]
  rope = layers.rope_tables(batch["positions"], cfg.head_dim, cfg.rope_theta)
  L = cfg.num_layers if num_layers is None else num_layers
  lora = batch.get("lora")
  index = {k: a for k, a in batch.items() if k.startswith("lora_")}

  def run(x, p, i):
    # The LoRA pool is indexed by layer inside its ops, never sliced per layer: a scanned
    # slice of it was copied whole every layer (measured: +15-20 ms per step at 8 slots).
    if lora is not None:
      p = linear.with_adapters(p, lora, i, index)
    return layer(x, p, i, cfg, rope, pool, batch, attn_shape, backend)

  # each weight in the form that serves this step's rows (static), before the scan: the
  # forms it does not use are then no scanned input
  lp = linear.for_rows(params["layers"], x.shape[0])
  if isinstance(lp, dict):  # stacked: layers under lax.scan; weights read in place by
    # layer index stay out of the scanned inputs (never sliced)
    scanned, in_place = linear.split_in_place(lp)
    if L == cfg.num_layers:

      def body(x, xs):
        p, i = xs
        x, k, v = run(x, dict(p, **{n: w.at(i) for n, w in in_place.items()}), i)
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
  x = layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  return x, ks, vs


def lm_head(params, x):
  """x [S, D] -> logits [S, V] float32 (the tied embedding where the model has no head)."""
  head = params.get("lm_head")
  head = linear.Dense(params["embed"], transposed=True) if head is None else head
  return linear.linear(x, linear.for_rows(head, x.shape[0])).astype(jnp.float32)


def forward(params, pool, batch, cfg: ModelConfig, *, attn_shape,
            backend: str = "xla"):
  """Returns (logits [S, V] f32 at batch["logits_idx"], pool with the step's K/V written)."""
  x, ks, vs = hidden_states(params, pool, batch, cfg, attn_shape=attn_shape,
                            backend=backend)
  pool = write_kv(pool, ks, vs, batch["write_page"], batch["write_offset"], backend)
  logits = lm_head(params, x[batch["logits_idx"]])
  return logits, pool
