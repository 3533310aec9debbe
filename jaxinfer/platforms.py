"""Which backend room serves a platform: the one table that names them.

A room gives `prepare(params, gguf_activations)` (the weights in the forms the platform runs fastest, once,
when an executor is built on one device), `compiler_options(unrolled)` (the step
functions' XLA options) and `argmax(x)` (the sampler's greedy pick). Platforms without a
room run the generic model: dense weights, XLA's defaults, jnp.argmax.
"""
from __future__ import annotations

import importlib
import types

from jaxinfer.sampling import greedy

ROOMS = {"cpu": "pallas_kernels.cpu"}
GENERIC = types.SimpleNamespace(prepare=lambda params, gguf_activations="q8": params,
                                compiler_options=lambda unrolled: {}, argmax=greedy)


def room(platform: str):
  """The backend room of `platform` ("cpu", "gpu", ...), or GENERIC."""
  name = ROOMS.get(platform)
  return GENERIC if name is None else importlib.import_module(name)
