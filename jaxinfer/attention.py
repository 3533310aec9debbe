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
  return name


def paged_attention(q, k_new, v_new, pool, layer, batch, *, max_query_len: int,
                    backend: str = "reference"):
  """q [T, N, H], k_new/v_new [T, K, H] -> [T, N, H] float32.

  batch: the step's metadata (page_table [R, Pmax], query_start / query_len /
  cached_len [R], all int32).
  """
  args = (q, k_new, v_new, pool, layer, batch["page_table"], batch["query_start"],
          batch["query_len"], batch["cached_len"])
  if backend == "reference":
    return reference.ragged_paged_attention(*args, max_query_len=max_query_len)
  if backend == "pallas":
    from pallas_kernels.paged_attention import kernel  # imported lazily: heavier
    return kernel.ragged_paged_attention(*args, max_query_len=max_query_len)
  raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
