"""Shared test helpers: a plain full-recompute greedy decode (the engine's oracle)."""
from __future__ import annotations

import numpy as np

from jaxinfer.executors.jax_executor import JaxExecutor
from jaxinfer.runtime.batcher import SeqWork, pack_exact


def full_logits(cfg, params, ids, kv_format="f32"):
  """Logits at every position of `ids` from one fresh prefill (no cache reuse)."""
  n = len(ids)
  page_size = 16
  pages = -(-n // page_size)
  ex = JaxExecutor(cfg, params, num_pages=pages, page_size=page_size, kv_format=kv_format,
                   backend="reference")  # the oracle runs the plain jnp attention
  step = pack_exact([SeqWork(ids, 0, list(range(pages)))], page_size, pages)
  step = _all_positions(step, n)
  _, logits = ex.run(step, return_logits=True)
  return logits[:n]


def _all_positions(step, n):
  """Widen the logits rows of a one-request step to every position (test oracle only)."""
  import dataclasses
  a = dict(step.arrays)
  a["logits_idx"] = np.arange(n, dtype=np.int32)
  for k in ("temperature", "top_k", "top_p", "seed", "counter"):
    a[k] = np.resize(a[k], n)
  a["draft_ids"] = np.full(n, -1, np.int32)
  return dataclasses.replace(step, arrays=a)


def recompute_greedy(cfg, params, prompt_ids, n_tokens):
  """Greedy decode that recomputes the whole sequence from scratch for every token."""
  ids = list(prompt_ids)
  out = []
  for _ in range(n_tokens):
    nxt = int(np.argmax(full_logits(cfg, params, ids)[-1]))
    out.append(nxt)
    ids.append(nxt)
  return out
