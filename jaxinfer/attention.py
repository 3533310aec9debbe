"""The model's one attention entry point: ragged paged attention over the KV pool.

Backends, all with the same arguments:
  "xla"        XLA ops laid out for XLA:CPU (decode slots specialised, pages gathered in
               blocks with an online softmax); the default on CPU.
  "reference"  the plain jnp oracle every other backend is tested against.
  "pallas"     pallas_kernels (compiled on GPU; interpret mode on CPU).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.sharding import TP
from pallas_kernels import kv_codec
from pallas_kernels.paged_attention import reference, xla

BACKENDS = ("xla", "reference", "pallas")


class AttentionSpec(NamedTuple):
  """What the model's attention runs: the backend and Q's precision against a quantized
  KV pool (8.4.4: "compute" keeps Q in the compute dtype; "kv" rounds Q through the KV
  format's compute path). Hashable, so it is a static argument of the jitted step."""
  backend: str = "xla"
  q_precision: str = "compute"
  tp: Optional[object] = None  # sharding.TensorParallel: run per KV-head shard (shard_map)


def check_backend(name: Union[str, AttentionSpec],
                  q_precision: str = "compute") -> AttentionSpec:
  spec = name if isinstance(name, AttentionSpec) else AttentionSpec(name, q_precision)
  if spec.backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {spec.backend!r}; choose one of {BACKENDS}")
  if spec.q_precision not in kv_codec.Q_PRECISIONS:
    raise ValueError(f"unknown Q precision {spec.q_precision!r}; choose one of "
                     f"{kv_codec.Q_PRECISIONS}")
  return spec


def write_kv(pool, ks, vs, page, offset, backend: Union[str, AttentionSpec] = "xla",
             layout=None):
  """Write the step's K/V [L', T, K, H] of every layer run into the pool (once a step);
  under tensor parallelism each device writes its own KV heads. layout: the pool's
  kv.KVLayout where its layers are grouped (page [G, T]: each group's pages)."""
  import functools
  from jaxinfer.kv import write_tokens
  write = functools.partial(write_tokens, layout=layout)
  spec = backend if isinstance(backend, AttentionSpec) else AttentionSpec(backend)
  if spec.tp is None or spec.tp.size == 1:
    return write(pool, ks, vs, page, offset)
  ax = TP
  return jax.shard_map(write, mesh=spec.tp.mesh,
                       in_specs=(P(None, ax), P(None, None, ax), P(None, None, ax), P(), P()),
                       out_specs=P(None, ax), check_vma=False)(pool, ks, vs, page, offset)


def paged_attention(q, k_new, v_new, pool, layer, batch, *, attn_shape,
                    backend: Union[str, AttentionSpec] = "xla", scale=None, window=None,
                    softcap=None):
  """q [T, N, H], k_new/v_new [T, K, H] -> [T, N, H] float32.

  scale: the scores' scale (None: 1 / sqrt(H)); window: this layer's sliding window (an
  int32 scalar, may be traced; None: full attention); softcap: scores capped smoothly at
  +-softcap (static; None: none).

  batch: the step's metadata (page_table [R, Pmax], query_start / query_len /
  cached_len [R], all int32). attn_shape = (Q, Rp), static: the last Rp request slots
  may hold up to Q new tokens (prefill chunks, or a verify window); the other slots hold
  at most one (decode). Rp = 0: a decode-only step.
  """
  max_query_len, prefill_slots = attn_shape
  spec = backend if isinstance(backend, AttentionSpec) else AttentionSpec(backend)
  if spec.tp is not None and spec.tp.size > 1:
    # Tensor parallel: each device attends with its query heads over its KV heads' pages
    # (heads split contiguously, so a local query head's KV head is local too).
    meta = {k: batch[k] for k in ("page_table", "query_start", "query_len", "cached_len")}
    heads = P(None, TP)
    local = spec._replace(tp=None)
    extra = () if window is None else (window,)  # a traced window enters as an argument
    return jax.shard_map(
        lambda q, k, v, pool, layer, meta, *w: paged_attention(
            q, k, v, pool, layer, meta, attn_shape=attn_shape, backend=local, scale=scale,
            window=w[0] if w else None, softcap=softcap),
        mesh=spec.tp.mesh, in_specs=(heads, heads, heads, heads, P(), P()) + (P(),) * len(extra),
        out_specs=heads, check_vma=False)(q, k_new, v_new, pool, layer, meta, *extra)
  args = (q, k_new, v_new, pool, layer, batch["page_table"], batch["query_start"],
          batch["query_len"], batch["cached_len"])
  kw = dict(max_query_len=max_query_len, num_prefill_slots=prefill_slots,
            q_precision=spec.q_precision, sm_scale=scale, window=window, softcap=softcap)
  if spec.backend == "xla":
    return xla.ragged_paged_attention(*args, **kw)
  if spec.backend == "reference":
    return reference.ragged_paged_attention(*args, **kw)
  if spec.backend == "pallas":
    from pallas_kernels.paged_attention import kernel  # imported lazily: heavier
    return kernel.ragged_paged_attention(*args, **kw)
  raise ValueError(f"unknown attention backend {spec.backend!r}; choose one of {BACKENDS}")
