"""The model's one attention entry point: ragged paged attention over the KV pool.

Backends: "reference" (jnp; the CPU path) and "pallas" (pallas_kernels; interpret mode
on CPU, compiled on GPU). Both take the same arguments.
"""
from __future__ import annotations

from pallas_kernels.paged_attention import reference

BACKENDS = ("reference", "pallas")


def check_backend(name: str) -> str:
  if name not in BACKENDS:
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
  if name == "pallas":
    import importlib.util
    if importlib.util.find_spec("pallas_kernels.paged_attention.kernel") is None:
      raise ValueError("the pallas attention backend is not built yet; use 'reference'")
  return name


def paged_attention(q, k_new, v_new, pool, layer, batch, *, attn_shape,
                    backend: str = "reference"):
  """q [T, N, H], k_new/v_new [T, K, H] -> [T, N, H] float32.

  batch: the step's metadata (page_table [R, Pmax], query_start / query_len /
  cached_len [R], all int32). attn_shape = (Q, Rp), static: the last Rp request slots
  may hold up to Q new tokens (prefill chunks, or a verify window); the other slots hold
  at most one (decode). Rp = 0: a decode-only step.
  """
  max_query_len, prefill_slots = attn_shape
  args = (q, k_new, v_new, pool, layer, batch["page_table"], batch["query_start"],
          batch["query_len"], batch["cached_len"])
  if backend == "reference":
    return reference.ragged_paged_attention(*args, max_query_len=max_query_len,
                                            num_prefill_slots=prefill_slots)
  if backend == "pallas":
    from pallas_kernels.paged_attention import kernel  # imported lazily: heavier
    return kernel.ragged_paged_attention(*args, max_query_len=max_query_len,
                                         num_prefill_slots=prefill_slots)
  raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
