"""The CPU backend: everything jaxinfer does because it runs on XLA:CPU, in one room.

Its native library (native.py: C++ XLA FFI handlers built on first use) holds the paged
decode attention call (decode.py / decode.cc) and the weight matmuls over packed layouts
(panels, tiles, GGUF blocks: weights.py). Above this room the model sees typed weights
and one attention entry point; the step asks `jaxinfer.platforms` for the room of its
platform, which gives:
  prepare(params, gguf_activations)  the weights in the forms this CPU runs fastest
                             (weights.py)
  compiler_options(unrolled) XLA:CPU options for the step functions
  argmax(x)                  the sampler's greedy pick, in a form XLA:CPU reduces fast
"""
from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from pallas_kernels.cpu.weights import prepare  # noqa: F401 (the room's door)

# XLA:CPU's loop emitters instead of its MLIR fusion emitters: steps compile faster and
# run as fast (docs/design.md, native CPU backend). JAXINFER_FUSION_EMITTERS=1 keeps XLA's
# default.
LOOP_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
# Unrolled layers (a list of per-layer weight dicts) are compiled with region-based copy
# insertion too: without it XLA:CPU copies the whole donated pool twice a step to keep the
# attention reads apart from the in-place K/V write.
UNROLLED_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.cache
def loop_emitters_known() -> bool:
  """Whether this jaxlib knows xla_cpu_use_fusion_emitters (an unknown compile option
  fails every compile that names it): one trivial compile, once per process."""
  try:
    x = jax.device_put(jnp.zeros(2), jax.devices("cpu")[0])
    jax.jit(lambda a: a + 1, compiler_options=LOOP_EMITTERS).lower(x).compile()
    return True
  except Exception as e:  # noqa: BLE001 -- any refusal: XLA's default emitters
    logging.getLogger(__name__).info("XLA:CPU default emitters (%s)", e)
    return False


def compiler_options(unrolled: bool) -> dict:
  """Compile options of the step functions for stacked (scanned) or unrolled layers."""
  if unrolled:  # the loop emitters made XLA copy the pool again (three copies a step):
    # the fusion emitters, also where XLA_FLAGS asks for the loop emitters
    return dict(UNROLLED_OPTIONS, **({"xla_cpu_use_fusion_emitters": True}
                                     if loop_emitters_known() else {}))
  if os.environ.get("JAXINFER_FUSION_EMITTERS") != "1" and loop_emitters_known():
    return dict(LOOP_EMITTERS)
  return {}


def argmax(x):
  """jnp.argmax over the last axis of [S, V] (the first index of each row's maximum), in
  groups of 128 columns: each group's max, the first group holding the row's max, then the
  first index inside it, because XLA:CPU runs argmax's variadic reduction far slower than
  a max (docs/design.md, the sampler). (A NaN row, which the engine fails by its
  non-finite logprob, may get another index than jnp.argmax's.)"""
  S, V = x.shape
  B = next((b for b in (128, 64, 32, 16, 8) if V % b == 0 and V > b), None)
  if B is None:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  xb = x.reshape(S, V // B, B)
  blk = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
  inner = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
  return (blk * B + jnp.argmax(inner, axis=-1)).astype(jnp.int32)
