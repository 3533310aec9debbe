"""Each weight declared once (shape, logical axes); init / abstract shapes derive from it.

Matmul weights are stored [in, out] so a projection is `x @ w`. Per-layer weights are
either stacked with a leading layer axis (for `lax.scan`) or kept as a list of per-layer
dicts (unrolled; measured: slicing stacked weights inside jit copies them).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  shape: Tuple[int, ...]
  axes: Tuple[str, ...]  # logical axes, for sharding rules
  init: str = "normal"  # "normal" | "ones"


def layer_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
  D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  specs = {
      "attn_norm": WeightSpec((D,), ("embed",), "ones"),
      "wq": WeightSpec((D, N * H), ("embed", "q_heads")),
      "wk": WeightSpec((D, K * H), ("embed", "kv_heads")),
      "wv": WeightSpec((D, K * H), ("embed", "kv_heads")),
      "wo": WeightSpec((N * H, D), ("q_heads", "embed")),
      "mlp_norm": WeightSpec((D,), ("embed",), "ones"),
      "w_gate": WeightSpec((D, F), ("embed", "mlp")),
      "w_up": WeightSpec((D, F), ("embed", "mlp")),
      "w_down": WeightSpec((F, D), ("mlp", "embed")),
  }
  if cfg.qk_norm:
    specs["q_norm"] = WeightSpec((H,), ("head_dim",), "ones")
    specs["k_norm"] = WeightSpec((H,), ("head_dim",), "ones")
  return specs


def weight_specs(cfg: ModelConfig) -> Dict[str, object]:
  """Top-level specs; "layers" maps to the per-layer specs with a leading layer axis."""
  D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  specs = {
      "embed": WeightSpec((V, D), ("vocab", "embed")),
      "final_norm": WeightSpec((D,), ("embed",), "ones"),
      "layers": {k: WeightSpec((L,) + s.shape, ("layers",) + s.axes, s.init)
                 for k, s in layer_specs(cfg).items()},
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
    if s.init == "ones":
      out.append(jnp.ones(s.shape, dtype) + 0.1 * jax.random.normal(k, s.shape, dtype))
    else:
      out.append((std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype),
                                weight_specs(cfg), is_leaf=_is_spec)


def cast_params(params, dtype):
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)


def as_bit_patterns(params):
  """The stacked bf16 layer weights held as their uint16 bit patterns (other leaves as they
  are). XLA:CPU copies each scanned layer's slice out of the stack, and copies bf16 element by
  element through float32: 30 slices of a 576 x 1536 bf16 stack and their dots took 56 ms,
  the same slices as uint16 bitcast back to bf16 inside the layer 8.9 ms (f32 weights: 16.9).
  `transformer.hidden_states` reads such weights as bf16 and keeps its activations in
  float32 (XLA:CPU also runs bf16 element-wise work through float32 conversions)."""
  layers = params.get("layers") if isinstance(params, dict) else None  # None: no weights
  if not isinstance(layers, dict) or not any(
      a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(layers)):
    return params
  bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) \
      if a.dtype == jnp.bfloat16 else a  # noqa: E731
  return dict(params, layers=jax.tree_util.tree_map(bits, layers))


# Weights packed together into one native matrix (one call per group), as the GGUF blocks
# fuse them (loading/registry.py): the projections that read the same input.
NATIVE_GROUPS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))


def native_kernel(dtype):
  """(module, layout key) of the native CPU matmul that runs `dtype` weights on this CPU
  (bf16: pallas_kernels.block_matmul.tiles on AMX or AVX512-BF16, "tiles"; f32: .panels
  on AVX-512, "panels"), or None: the one place that maps a dtype to its packed layout."""
  from pallas_kernels.block_matmul import panels, tiles
  kernel, key = {jnp.dtype(jnp.bfloat16): (tiles, "tiles"),
                 jnp.dtype(jnp.float32): (panels, "panels")}.get(jnp.dtype(dtype), (None, None))
  return (kernel, key) if kernel is not None and kernel.available() else None


def as_native(params):
  """Stacked layer weights and the LM head packed for the native CPU matmuls, read in
  place by layer index (no layer's slice is copied out of the stack, as XLA:CPU does for
  its own dot): bf16 weights into AMX's tile layout (pallas_kernels.block_matmul.tiles, run
  on Intel AMX or AVX512-BF16),
  float32 ones into AVX-512 column panels (block_matmul.panels). The packed groups go to
  params["blocks"] (the place of the GGUF blocks; transformer.py reads either) and leave
  params["layers"], which keeps the norms. None when the weights are neither, a shape does
  not fit the layout, the model already carries blocks, or the CPU lacks the instructions
  (the caller then keeps `as_bit_patterns` / the dense weights)."""
  layers = params.get("layers") if isinstance(params, dict) else None
  if not isinstance(layers, dict) or "blocks" in params or "wq" not in layers:
    return None
  names = [n for g in NATIVE_GROUPS for n in g]
  dtype = layers["wq"].dtype
  found = native_kernel(dtype)
  if found is None or not all(n in layers and layers[n].dtype == dtype for n in names):
    return None
  kernel, key = found
  head = params["lm_head"] if "lm_head" in params else params["embed"].T
  fused = {"+".join(g): (jnp.concatenate([layers[n] for n in g], -1) if len(g) > 1
                         else layers[g[0]]) for g in NATIVE_GROUPS}
  if not (head.dtype == dtype and kernel.packable(head)
          and all(kernel.packable(w) for w in fused.values())):
    return None
  blocks = {"layers": {k: {key: kernel.pack(w)} for k, w in fused.items()},
            "lm_head": {key: kernel.pack(head)}}
  rest = {k: v for k, v in layers.items() if k not in names}
  out = {k: v for k, v in params.items() if k != "lm_head"}
  return dict(out, layers=rest, blocks=blocks)


# id(the source's wq) -> (weak references to the source's leaves, the kernels available,
# the layout)
_LAYOUTS: dict = {}


def cpu_layout(params):
  """The layout a single-device CPU executor holds: `as_native` where the CPU runs it, else
  bf16 weights as bit patterns (`as_bit_patterns`) and f32 ones as they are. A layout is
  kept while its source weights live (dropped with their `wq`, which the packed layout
  does not hold) and reused only for the very same leaves, so every executor built on the
  same weights shares one packing (a test's oracle builds one per forward) and nothing
  outlives the model."""
  layers = params.get("layers") if isinstance(params, dict) else None
  if not isinstance(layers, dict) or "wq" not in layers:
    return params
  from pallas_kernels.block_matmul import panels, tiles
  kernels = (tiles.available(), panels.available())
  leaves = jax.tree_util.tree_leaves(params)
  key = id(layers["wq"])
  hit = _LAYOUTS.get(key)
  if hit is not None and hit[1] == kernels and len(hit[0]) == len(leaves) and all(
      ref() is a for ref, a in zip(hit[0], leaves)):
    return hit[2]
  out = as_native(params) or as_bit_patterns(params)
  if out is params:  # nothing converted (and caching it would keep the source alive)
    return out
  try:
    refs = [weakref.ref(a, (lambda _: _LAYOUTS.pop(key, None)) if a is layers["wq"] else None)
            for a in leaves]
  except TypeError:  # a leaf without weak references: not kept
    return out
  _LAYOUTS[key] = (refs, kernels, out)
  return out


def from_bit_patterns(p):
  """A layer's weights with uint16 bit patterns (as_bit_patterns) read back as bf16."""
  return jax.tree_util.tree_map(
      lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a,
      p)


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
  """List of per-layer dicts -> stacked layer weights (the `lax.scan` layout)."""
  layers = params["layers"]
  if isinstance(layers, dict):
    return params
  out = dict(params)
  out["layers"] = {k: jnp.stack([lyr[k] for lyr in layers]) for k in layers[0]}
  return out
