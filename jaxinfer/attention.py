"""The model's one attention entry point: ragged paged attention over the KV pool.

Backends, all with the same arguments:
  "xla"        XLA ops laid out for XLA:CPU (decode slots specialised, pages gathered in
               blocks with an online softmax); the default on CPU.
  "reference"  the plain jnp oracle every other backend is tested against.
  "pallas"     pallas_kernels (compiled on GPU; interpret mode on CPU).
"""
from __future__ import annotations

from typing import NamedTuple, Union

from pallas_kernels import kv_codec
from pallas_kernels.paged_attention import reference, xla

BACKENDS = ("xla", "reference", "pallas")


class AttentionSpec(NamedTuple):
  """What the model's attention runs: the backend and Q's precision against a quantized
  KV pool (8.4.4: "native" keeps Q in the compute dtype; "kv" rounds Q through the KV
  format's compute path). Hashable, so it is a static argument of the jitted step."""
  backend: str = "xla"
  q_precision: str = "native"


def check_backend(name: Union[str, AttentionSpec],
                  q_precision: str = "native") -> AttentionSpec:
  spec = name if isinstance(name, AttentionSpec) else AttentionSpec(name, q_precision)
  if spec.backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {spec.backend!r}; choose one of {BACKENDS}")
  if spec.q_precision not in kv_codec.Q_PRECISIONS:
    raise ValueError(f"unknown Q precision {spec.q_precision!r}; choose one of "
                     f"{kv_codec.Q_PRECISIONS}")
  if spec.backend == "pallas":
    import importlib.util
    if importlib.util.find_spec("pallas_kernels.paged_attention.kernel") is None:
      raise ValueError("the pallas attention backend is not built yet; use 'reference'")
  return spec


def paged_attention(q, k_new, v_new, pool, layer, batch, *, attn_shape,
                    backend: Union[str, AttentionSpec] = "xla"):
  """q [T, N, H], k_new/v_new [T, K, H] -> [T, N, H] float32.

  batch: the step's metadata (page_table [R, Pmax], query_start / query_len /
  cached_len [R], all int32). attn_shape = (Q, Rp), static: the last Rp request slots
  may hold up to Q new tokens (prefill chunks, or a verify window); the other slots hold
  at most one (decode). Rp = 0: a decode-only step.
  """
  max_query_len, prefill_slots = attn_shape
  spec = backend if isinstance(backend, AttentionSpec) else AttentionSpec(backend)
  args = (q, k_new, v_new, pool, layer, batch["page_table"], batch["query_start"],
          batch["query_len"], batch["cached_len"])
  if spec.backend == "xla":
    return xla.ragged_paged_attention(*args, max_query_len=max_query_len,
                                      num_prefill_slots=prefill_slots,
                                      q_precision=spec.q_precision)
  if spec.backend == "reference":
    return reference.ragged_paged_attention(*args, max_query_len=max_query_len,
                                            num_prefill_slots=prefill_slots,
                                            q_precision=spec.q_precision)
  if spec.backend == "pallas":
    from pallas_kernels.paged_attention import kernel  # imported lazily: heavier
    return kernel.ragged_paged_attention(*args, max_query_len=max_query_len,
                                         num_prefill_slots=prefill_slots,
                                         q_precision=spec.q_precision)
  raise ValueError(f"unknown attention backend {spec.backend!r}; choose one of {BACKENDS}")
