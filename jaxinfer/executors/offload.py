"""Layer-streamed execution with weights offloaded to host memory (8.4.3).

The chosen layers' FFN weights (gate, up, down) live in host memory — pinned host memory
(JAX memory kinds) where the backend has it, so copies are asynchronous DMA — and are
copied to the device just before their layer runs, through `prefetch_buffers` device
buffers: with one, copy and compute alternate; with two, the next offloaded set's copy is
issued as soon as the current one's layer is dispatched, so it overlaps compute. The
step runs as one jitted call per layer (one executable for every layer: the layer index
is traced) plus one for the embedding and one for the head; the math is the fused
step's, so greedy outputs are identical. Bytes moved are counted.
"""
from __future__ import annotations

import collections
import time
from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.step import sample_packed
from jaxinfer.costmodel.offload import OffloadConfig, ffn_set_bytes
from jaxinfer.model import transformer
from jaxinfer.model.params import unstack_layers

FFN = ("w_gate", "w_up", "w_down")


def _host_put(x):
  """Host copy of a weight: pinned host memory where the device offers it."""
  dev = jax.devices()[0]
  kinds = {m.kind for m in dev.addressable_memories()}
  if "pinned_host" in kinds and dev.platform != "cpu":
    s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    return jax.device_put(x, s)
  return np.asarray(x)


def _embed(params, batch, cfg):
  """The step's embeddings and its RoPE tables (computed once, read by every layer)."""
  return (transformer.embed(params, batch["token_ids"], cfg),
          transformer.layer_tables(cfg, batch["positions"]))


def _one_layer(x, p, i, tables, pool, batch, cfg, attn_shape, backend):
  return transformer.layer(x, p, i, cfg, transformer.rope_at(cfg, tables, i), pool, batch,
                           attn_shape, backend, transformer.window_at(cfg, i))


def _head(params, pool, batch, x, ks, vs, cfg):
  x = transformer.final_norm(params, x, cfg)
  pool = transformer.write_step_kv(pool, jnp.stack(ks), jnp.stack(vs), batch, cfg, "xla")
  logits = transformer.lm_head(params, x[batch["logits_idx"]], cfg)
  return sample_packed(logits, batch), pool


_embed_jit = jax.jit(_embed, static_argnames=("cfg",))
_layer_jit = jax.jit(_one_layer, static_argnames=("cfg", "attn_shape", "backend"))
_head_jit = jax.jit(_head, static_argnames=("cfg",), donate_argnums=(1,))


class LayerStreamer:
  """Runs steps layer by layer, streaming the offloaded FFN sets in."""

  def __init__(self, cfg, params, off: OffloadConfig, bytes_per_param: float):
    self.cfg, self.off = cfg, off
    params = unstack_layers(params)
    self.top = {k: v for k, v in params.items() if k != "layers"}
    self.layers: List[Dict] = []
    self.host: Dict[int, Dict] = {}
    for i, lp in enumerate(params["layers"]):
      if i in off.layers:
        self.host[i] = {k: _host_put(lp[k]) for k in FFN}
        self.layers.append({k: v for k, v in lp.items() if k not in FFN})
      else:
        self.layers.append(lp)
    self.set_bytes = ffn_set_bytes(cfg, bytes_per_param)
    self.bytes_moved = 0
    self.copy_s = 0.0

  def _fetch(self, i):
    t = time.perf_counter()
    dev = jax.devices()[0]
    w = {k: jax.device_put(v, dev) for k, v in self.host[i].items()}
    self.copy_s += time.perf_counter() - t
    self.bytes_moved += self.set_bytes
    return w

  def forward(self, pool, arrays, attn_shape, backend):
    """One step through every layer (offloaded FFN sets streamed in): (packed rows, pool)."""
    cfg = self.cfg
    x, tables = _embed_jit(self.top, arrays, cfg=cfg)
    order = [i for i in range(cfg.num_layers) if i in self.host]
    buffers = collections.OrderedDict()  # layer -> FFN weights on the device
    nxt = 0
    ks, vs = [], []
    for i in range(cfg.num_layers):
      p = self.layers[i]
      if i in self.host:
        while nxt < len(order) and len(buffers) < self.off.prefetch_buffers:
          buffers[order[nxt]] = self._fetch(order[nxt])
          nxt += 1
        p = dict(p, **buffers[i])
      x, k, v = _layer_jit(x, p, jnp.int32(i), tables, pool, arrays, cfg=cfg,
                           attn_shape=attn_shape, backend=backend)
      if i in self.host:
        del buffers[i]  # the buffer frees once its layer is dispatched
        if self.off.prefetch_buffers == 1:
          jax.block_until_ready(x)  # one buffer: the next copy waits for this compute
      ks.append(k)
      vs.append(v)
    return _head_jit(self.top, pool, arrays, x, ks, vs, cfg=cfg)
