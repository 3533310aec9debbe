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
from jaxinfer.lora.ops import dense_matmul, half_dot, stacked_matmul
from jaxinfer.model import layers
from jaxinfer.model.params import from_bit_patterns

# weight_format="gguf" (params["blocks"], pallas_kernels.block_matmul): steps of at most this
# many tokens read the matmul weights in the file's own blocks; larger steps use the float
# weights (XLA's matmul is faster once the weights are reused across many rows; see the
# README's Performance section for the crossover measured).
BLOCK_MATMUL_MAX_TOKENS = 16


def layer(x, p, layer, cfg, rope, pool, batch, attn_shape, backend, lw=None):
  """One decoder layer; lw: (the step's LoRA pool, this layer's index) or None."""
  h, k, v = layers.attention_block(
      layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p, cfg, rope, pool, layer, batch,
      attn_shape=attn_shape, backend=backend, lw=lw)
  x = x + h
  x = x + layers.mlp(layers.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), p, lw, batch)
  return x, k, v


def hidden_states(params, pool, batch, cfg: ModelConfig, *, attn_shape,
                  backend: str = "xla", num_layers: int | None = None):
  """Final-normed hidden states [T, D] and the step's K/V [L', T, K, H] of the layers run.

  num_layers: run only the first layers (early-exit drafting); default all.
  attn_shape: (max query tokens per prefill slot, prefill slots), static (see attention.py).
  batch["lora"] (a step carrying adapters): the adapter pool, per target a [L, in, S, r]
  and b [L, S, r, out], with the per-token index arrays of jaxinfer.lora.ops.
  """
  dtype = params["embed"].dtype
  lp = params["layers"]
  bits = isinstance(lp, dict) and any(a.dtype == jnp.uint16
                                      for a in jax.tree_util.tree_leaves(lp))
  if bits or native_weights(params):  # bf16 weights as bit patterns or tiles (CPU):
    dtype = jnp.float32  # float32 activations (bf16 matmul inputs); f32 panels: float32
  x = params["embed"][batch["token_ids"]].astype(dtype)  # [T, D]
  rope = layers.rope_tables(batch["positions"], cfg.head_dim, cfg.rope_theta)
  L = cfg.num_layers if num_layers is None else num_layers
  lora = batch.get("lora")
  # The pool is indexed by layer inside the ops, never sliced per layer: a scanned slice
  # of it was copied whole every layer (measured: +15-20 ms per step at 8 slots).
  lora_i = lambda i: None if lora is None else (lora, i)  # noqa: E731
  # The block weights stay stacked and are read in place by layer index (never sliced);
  # the float copies of those weights are then left out of the scanned inputs.
  bl = block_weights(params, x.shape[0], "layers")
  with_blocks = lambda p, i: p if bl is None else dict(p, blocks=(bl, i))  # noqa: E731
  if isinstance(lp, dict) and bl is not None:
    covered = {n for key in bl for n in key.split("+")}  # "wq+wk+wv" covers wq, wk, wv
    lp = {k: v for k, v in lp.items() if k not in covered}
  if isinstance(lp, dict) and L == cfg.num_layers:  # stacked: layers under lax.scan

    def body(x, xs):
      p, i = xs
      p = from_bit_patterns(p) if bits else p
      x, k, v = layer(x, with_blocks(p, i), i, cfg, rope, pool, batch, attn_shape, backend,
                      lora_i(i))
      return x, (k, v)

    x, (ks, vs) = jax.lax.scan(body, x, (lp, jnp.arange(L, dtype=jnp.int32)))
  elif isinstance(lp, dict):  # the first L layers: index the stacked weights in the loop
    # (a static slice lp[:L] would copy L layers' weights on every call)

    def body_i(x, i):
      p = jax.tree_util.tree_map(lambda a: a[i], lp)
      p = with_blocks(from_bit_patterns(p) if bits else p, i)
      x, k, v = layer(x, p, i, cfg, rope, pool, batch, attn_shape, backend, lora_i(i))
      return x, (k, v)

    x, (ks, vs) = jax.lax.scan(body_i, x, jnp.arange(L, dtype=jnp.int32))
  else:  # unrolled over a list of per-layer dicts
    ks, vs = [], []
    for i in range(L):
      x, k, v = layer(x, with_blocks(lp[i], i), i, cfg, rope, pool, batch, attn_shape,
                      backend, lora_i(i))
      ks.append(k)
      vs.append(v)
    ks, vs = jnp.stack(ks), jnp.stack(vs)
  x = layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  return x, ks, vs


def native_weights(params) -> bool:
  """Whether params["blocks"] holds the native CPU layouts of params.as_native (bf16 tiles,
  f32 panels) rather than GGUF blocks."""
  head = params.get("blocks", {}).get("lm_head") if isinstance(params, dict) else None
  return isinstance(head, dict) and ("tiles" in head or "panels" in head)


def block_weights(params, rows: int, part: str):
  """params["blocks"][part] when this step (`rows` rows, static) reads the block weights:
  GGUF blocks up to BLOCK_MATMUL_MAX_TOKENS rows; the native layouts at every size (they
  replace the dense weights, and beat XLA's dot and its slice copies at 1-256 rows: see
  block_matmul/tiles.py and panels.py)."""
  blocks = params.get("blocks")
  if blocks is None or (rows > BLOCK_MATMUL_MAX_TOKENS and not native_weights(params)):
    return None
  return blocks.get(part)


def lm_head(params, x):
  """x [S, D] -> logits [S, V] float32."""
  head = block_weights(params, x.shape[0], "lm_head")
  if head is not None:
    logits = stacked_matmul(x, head)
  elif "lm_head" in params:
    logits = dense_matmul(x, params["lm_head"])
  elif params["embed"].dtype == jnp.float32:  # tied: the embedding's rows
    logits = jnp.einsum("sd,vd->sv", x, params["embed"])
  else:  # tied half-precision embedding: f32 accumulation, as in dense_matmul
    logits = half_dot(x, params["embed"], "sd,vd->sv")
  return logits.astype(jnp.float32)


def forward(params, pool, batch, cfg: ModelConfig, *, attn_shape,
            backend: str = "xla"):
  """Returns (logits [S, V] f32 at batch["logits_idx"], pool with the step's K/V written)."""
  x, ks, vs = hidden_states(params, pool, batch, cfg, attn_shape=attn_shape,
                            backend=backend)
  pool = write_kv(pool, ks, vs, batch["write_page"], batch["write_offset"], backend)
  logits = lm_head(params, x[batch["logits_idx"]])
  return logits, pool
