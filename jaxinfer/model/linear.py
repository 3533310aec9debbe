"""One linear layer for every weight form: `linear(x, w)` dispatches on w's type at trace time.

A weight is a pytree. A bare array, or `Dense`, is a dense matrix stored [in, out] (f32 or
a half precision); other forms carry their own product as a `matmul(x)` method: packed
layouts and quantized formats a platform's backend provides (`jaxinfer.platforms`), and
`Adapted` (a weight plus the step's LoRA low-rank products, 8.2.1). The model calls only
`linear` / `linear_group` and the layer helpers below; it never asks what a weight is.

Optional parts of a weight type's protocol (absent: the dense behaviour):
  in_place        class attribute: a stacked [L, ...] weight read in place by a layer index
                  (`at(i)`) instead of sliced by the layer scan
  at(i)           the weight of layer i (in-place weights)
  for_rows(rows)  the form that serves a step of `rows` rows (static): a weight may hold
                  a form for few rows and another for many
  splits          output features of each part of a fused weight (`linear_group`)
  activation_dtype  the dtype the model's activations take when this weight is present
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np


def _is_weight(w) -> bool:
  return hasattr(w, "matmul")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w"],
                   meta_fields=["transposed"])
@dataclasses.dataclass(frozen=True)
class Dense:
  """A dense weight [(L,) in, out], or [(L,) out, in] when transposed (a tied embedding
  read as the LM head). Half-precision weights multiply with float32 accumulation, rounded
  once at the end (the usual tensor-core product)."""
  w: Any
  transposed: bool = False

  @property
  def splits(self) -> Tuple[int, ...]:
    return (self.w.shape[-2] if self.transposed else self.w.shape[-1],)

  def matmul(self, x):
    spec = "md,nd->mn" if self.transposed else "md,dn->mn"
    if self.w.dtype == jnp.float32:
      return jnp.einsum(spec, x, self.w)
    y = jnp.einsum(spec, x.astype(self.w.dtype), self.w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Experts:
  """A mixture of experts' stacked matrices [(L,) E, in, out], read in place: under the
  layer scan by layer index (a scanned slice of every expert would copy them all each
  layer), and by expert by the grouped product (which reads only the experts routed to)."""
  w: Any
  layer: Any = None
  in_place = True

  def at(self, i):
    return Experts(self.w, i)

  def expert(self, e):
    """Expert e's matrix [in, out] (of this layer)."""
    return self.w[e] if self.layer is None else self.w[self.layer, e]

  def stacked(self):
    """Every expert's matrix [E, in, out] (of this layer)."""
    return self.w if self.layer is None else self.w[self.layer]


def as_weight(w):
  """A typed weight (bare arrays are `Dense`)."""
  return w if _is_weight(w) else Dense(w)


def splits_of(w) -> Tuple[int, ...]:
  return tuple(as_weight(w).splits)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["base", "deltas", "layer", "index"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Adapted:
  """`base` plus the step's adapters: deltas holds, per part of base's output, the LoRA
  pool's (a [L, in, S, r], b [L, S, r, out]) of that target or None; `index` the step's
  per-token slot arrays (jaxinfer.lora.ops.index_arrays)."""
  base: Any
  deltas: Tuple[Optional[Tuple[Any, Any]], ...]
  layer: Any
  index: Any

  @property
  def splits(self):
    return splits_of(self.base)

  def matmul(self, x):
    from jaxinfer.lora.ops import delta
    y = linear(x, self.base)
    if len(self.deltas) == 1:
      a, b = self.deltas[0]
      return y + delta(x, a, b, self.layer, self.index).astype(y.dtype)
    outs = jnp.split(y, np.cumsum(self.splits)[:-1].tolist(), axis=-1)
    outs = [o if d is None else o + delta(x, d[0], d[1], self.layer, self.index).astype(o.dtype)
            for o, d in zip(outs, self.deltas)]
    return jnp.concatenate(outs, axis=-1)


def linear(x, w):
  """x [M, in] @ w -> [M, out] in x's dtype (float32 for the packed forms' products)."""
  return as_weight(w).matmul(x)


def group_key(names) -> str:
  """The key of a fused weight holding `names`' matrices side by side ("wq+wk+wv")."""
  return "+".join(names)


def linear_group(x, p, names):
  """[x @ p[n] for n in names]: one product when the layer holds them fused
  (p["wq+wk+wv"], split by the weight's own `splits`), else one per name."""
  key = group_key(names)
  if len(names) > 1 and key in p:
    return jnp.split(linear(x, p[key]), np.cumsum(splits_of(p[key]))[:-1].tolist(), axis=-1)
  return [linear(x, p[n]) for n in names]


def with_adapters(p, pool, layer, index):
  """A layer's weights with each LoRA target in the step's adapter pool wrapped in
  `Adapted` (fused weights per part)."""
  out = dict(p)
  for key, w in p.items():
    parts = key.split("+")
    if not any(n in pool for n in parts):
      continue
    deltas = tuple((pool[n]["a"], pool[n]["b"]) if n in pool else None for n in parts)
    out[key] = Adapted(w, deltas, layer, index)
  return out


def for_rows(tree, rows: int):
  """Each weight in `tree` in the form that serves a step of `rows` rows."""
  return jax.tree_util.tree_map(
      lambda w: w.for_rows(rows) if hasattr(w, "for_rows") else w, tree, is_leaf=_is_weight)


def split_in_place(layer):
  """A stacked layer dict -> (the weights the layer scan slices, those read in place)."""
  in_place = {k: w for k, w in layer.items() if getattr(w, "in_place", False)}
  return {k: w for k, w in layer.items() if k not in in_place}, in_place


def in_place_at(in_place, i):
  """Layer i of each weight read in place (`at`)."""
  return {k: w.at(i) for k, w in in_place.items()}


def layer_at(scanned, in_place, i):
  """Layer i's weights: the sliced ones indexed (a traced i), the in-place ones by `at`."""
  return dict(jax.tree_util.tree_map(lambda a: a[i], scanned), **in_place_at(in_place, i))


def activation_dtype(params):
  """The dtype of the model's activations: the embedding's, unless a weight asks for
  another (a backend whose half-precision products take float32 inputs)."""
  for w in jax.tree_util.tree_leaves(params, is_leaf=_is_weight):
    dt = getattr(w, "activation_dtype", None)
    if dt is not None:
      return dt
  return params["embed"].dtype
