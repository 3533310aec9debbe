"""The CPU's weight forms and the one conversion that produces them (`prepare`).

Each form is a pytree with a `matmul(x)` (jaxinfer.model.linear's protocol); the stacked
ones are read in place by a layer index (`in_place`, `at`), never sliced out of the stack
by the layer scan, which XLA:CPU does by copying every layer's weights on every step:
  Panels  f32 weights in column panels (AVX-512, or AVX2 + FMA; panels.py)
  Tiles   bf16 weights in AMX's tile layout, run on AMX or AVX512-BF16 (tiles.py)
  Blocks  a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks (gguf.py) for steps of up to
          GGUF_MAX_ROWS rows, its dense copy for larger ones (`for_rows`); the products'
          activations float32 or quantized to 8 bits as llama.cpp's (`activations`)
  Half    bf16 weights XLA multiplies itself: held as uint16 bit patterns in the stack,
          because XLA:CPU copies a scanned bf16 slice element by element through float32,
          and padded to HALF_MIN_ROWS rows, because it runs a bf16 dot of fewer rows as a
          matrix-vector product that first converts the whole weight to float32 (both
          measured in docs/design.md)
Products of the packed forms take float32 inputs; Tiles and Half make the model's
activations float32 (`activation_dtype`), which XLA:CPU computes through float32 anyway.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels.cpu import gguf, panels, tiles

# Steps of at most this many rows read the GGUF blocks; larger steps the dense weights
# (XLA's matmul is faster once the weights are reused across many rows: docs/design.md).
GGUF_MAX_ROWS = 16
HALF_MIN_ROWS = 16
# Projections that read the same input, packed as one matrix (one native call per group),
# as the GGUF blocks fuse them (jaxinfer/loading/gguf_loader.py).
GROUPS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))


class _Stacked:
  """A weight [(L,) ...] read at `layer` (None: unstacked, or layer 0)."""
  in_place = True
  activation_dtype = None

  def at(self, i):
    return dataclasses.replace(self, layer=i)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["panels", "layer"],
                   meta_fields=["splits"])
@dataclasses.dataclass(frozen=True)
class Panels(_Stacked):
  panels: Any
  layer: Any = None
  splits: Tuple[int, ...] = ()

  def matmul(self, x):
    return panels.matmul(x, self.panels, self.layer)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tiles", "layer"],
                   meta_fields=["splits"])
@dataclasses.dataclass(frozen=True)
class Tiles(_Stacked):
  tiles: Any
  layer: Any = None
  splits: Tuple[int, ...] = ()
  activation_dtype = jnp.float32

  def matmul(self, x):
    return tiles.matmul(x, self.tiles, self.layer)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "scales", "layer", "dense"],
                   meta_fields=["splits", "activations"])
@dataclasses.dataclass(frozen=True)
class Blocks(_Stacked):
  """GGUF blocks, with the dense form (a jaxinfer.model.linear weight) larger steps use.
  activations: "q8" (x quantized per block of 32, integer products, as llama.cpp) or
  "f32" (float32 products equal to the dense weights')."""
  codes: Any
  scales: Any
  layer: Any = None
  dense: Any = None
  splits: Tuple[int, ...] = ()
  activations: str = "q8"

  def for_rows(self, rows: int):
    if rows <= GGUF_MAX_ROWS:
      return dataclasses.replace(self, dense=None)
    if self.dense is None:
      raise ValueError(f"a step of {rows} rows needs the dense form of a GGUF weight")
    return self.dense

  def matmul(self, x):
    return gguf.matmul(x, self.codes, self.scales, self.layer, activations=self.activations)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w"],
                   meta_fields=["transposed"])
@dataclasses.dataclass(frozen=True)
class Half:
  """bf16 weights [(L,) in, out] ([out, in] transposed) as bf16 or uint16 bit patterns."""
  w: Any
  transposed: bool = False
  activation_dtype = jnp.float32

  @property
  def splits(self):
    return (self.w.shape[-2] if self.transposed else self.w.shape[-1],)

  def matmul(self, x):
    w = self.w
    if w.dtype == jnp.uint16:
      w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    m = x.shape[0]
    pad = max(HALF_MIN_ROWS - m, 0)
    xp = jnp.pad(x.astype(w.dtype), ((0, pad), (0, 0)))
    spec = "md,nd->mn" if self.transposed else "md,dn->mn"
    return jnp.einsum(spec, xp, w, preferred_element_type=jnp.float32)[:m]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["ws"],
                   meta_fields=["transposed"])
@dataclasses.dataclass(frozen=True)
class Parts:
  """Dense weights read by one input ([in, out] each, or [out, in] transposed), their
  products side by side: the form a GGUF weight takes in steps of many rows."""
  ws: Tuple[Any, ...]
  transposed: bool = False

  @property
  def splits(self):
    return tuple(w.shape[-2] if self.transposed else w.shape[-1] for w in self.ws)

  def matmul(self, x):
    spec = "md,nd->mn" if self.transposed else "md,dn->mn"
    ys = [jnp.einsum(spec, x, w) if w.dtype == jnp.float32 else
          Half(w, self.transposed).matmul(x).astype(x.dtype) for w in self.ws]
    return ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=-1)


FORMS = (Panels, Tiles, Blocks, Half, Parts)


def kernel_for(dtype):
  """(module, form) of the native matmul that runs `dtype` weights on this CPU (bf16:
  tiles on AMX or AVX512-BF16; f32: panels on AVX-512 or AVX2), or None: the one place that maps
  a dtype to its packed layout."""
  found = {jnp.dtype(jnp.bfloat16): (tiles, Tiles),
           jnp.dtype(jnp.float32): (panels, Panels)}.get(jnp.dtype(dtype))
  return found if found is not None and found[0].available() else None


def _head(params):
  """The LM head as (matrix [D, V] or the tied embedding [V, D], transposed)."""
  if "lm_head" in params:
    return params["lm_head"], False
  return params["embed"], True


def _splits(layers, names):
  return tuple(layers[n].shape[-1] for n in names)


def _packed(params) -> Optional[dict]:
  """Stacked layer weights and the LM head in the native layout of their dtype, or None
  when the CPU lacks it or a shape does not fit."""
  layers = params["layers"]
  dtype = layers["wq"].dtype
  found = kernel_for(dtype)
  # the groups the layers hold (a mixture of experts has no dense MLP: its experts stay
  # stacked for the model's grouped product)
  groups = [g for g in GROUPS if all(n in layers for n in g)]
  names = [n for g in groups for n in g]
  if found is None or not all(layers[n].dtype == dtype for n in names):
    return None
  kernel, form = found
  head, transposed = _head(params)
  head = head.T if transposed else head
  fused = {"+".join(g): (jnp.concatenate([layers[n] for n in g], -1) if len(g) > 1
                         else layers[g[0]]) for g in groups}
  if not (head.dtype == dtype and kernel.packable(head)
          and all(kernel.packable(w) for w in fused.values())):
    return None
  out = {k: v for k, v in layers.items() if k not in names}
  for g in groups:
    out["+".join(g)] = form(kernel.pack(fused["+".join(g)]), None, _splits(layers, g))
  return dict(params, layers=out, lm_head=form(kernel.pack(head), None, (head.shape[-1],)))


def _halves(params) -> dict:
  """bf16 matmul weights as `Half` (stacked ones as bit patterns), their norms float32."""
  def layer(p, stacked):
    out = {}
    for k, v in p.items():
      if v.dtype != jnp.bfloat16:
        out[k] = v
      elif v.ndim == 1 + stacked:  # a norm: read in float32 by the model anyway
        out[k] = v.astype(jnp.float32)
      elif v.ndim > 2 + stacked:  # stacked experts: the model's grouped product reads them
        out[k] = v
      else:
        out[k] = Half(jax.lax.bitcast_convert_type(v, jnp.uint16) if stacked else v)
    return out

  layers = params["layers"]
  if isinstance(layers, dict):
    layers = layer(layers, True)
  else:
    layers = [layer(p, False) for p in layers]
  head, transposed = _head(params)
  out = dict(params, layers=layers)
  if head.dtype == jnp.bfloat16:
    out["lm_head"] = Half(head, transposed)
  return out


def _gguf(params, activations: str) -> dict:
  """params["blocks"] (jaxinfer/loading/gguf_loader.load_blocks: {"layers": {name or
  fused names: {"codes", "scales"}}, "lm_head": ...}) as `Blocks`, each over the dense
  weights it replaces."""
  blocks = params["blocks"]
  layers = params["layers"]
  stacked = isinstance(layers, dict)

  def layer(p, i):
    out = dict(p)
    for key, b in blocks["layers"].items():
      names = key.split("+")
      codes, scales = b["codes"], b["scales"]
      if not stacked:  # a per-layer dict holds its own layer's blocks
        codes, scales = codes[i], scales[i]
      dense = Parts(tuple(out.pop(n) for n in names))
      out[key] = Blocks(codes, scales, None, dense, dense.splits, activations)
    return out

  layers = layer(layers, None) if stacked else [layer(p, i) for i, p in enumerate(layers)]
  head, transposed = _head(params)
  dense = Parts((head,), transposed)
  out = {k: v for k, v in params.items() if k != "blocks"}
  out["layers"] = layers
  out["lm_head"] = Blocks(blocks["lm_head"]["codes"], blocks["lm_head"]["scales"], None,
                          dense, dense.splits, activations)
  return out


def prepare(params, gguf_activations: str = "q8"):
  """The weights a single-device CPU executor holds, converted once: GGUF blocks where the
  model carries them (their products' activations `gguf_activations`: gguf.ACTIVATIONS),
  else the stacked weights in the native layout of their dtype where this CPU runs one,
  else bf16 weights as `Half`; f32 weights without AVX2 stay dense (XLA's own dot).
  Weights already prepared, or none, are returned as they are."""
  if gguf_activations not in gguf.ACTIVATIONS:
    raise ValueError(f"gguf_activations must be one of {gguf.ACTIVATIONS}, got "
                     f"{gguf_activations!r}")
  layers = params.get("layers") if isinstance(params, dict) else None
  if layers is None or is_prepared(params):
    return params
  if "blocks" in params:
    return _gguf(params, gguf_activations)
  if isinstance(layers, dict) and "wq" in layers:
    packed = _packed(params)
    if packed is not None:
      return packed
  return _halves(params)


def is_prepared(params) -> bool:
  leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda w: isinstance(w, FORMS))
  return any(isinstance(w, FORMS) for w in leaves)
