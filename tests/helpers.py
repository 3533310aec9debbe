"""Shared test helpers: a plain full-recompute greedy decode (the engine's oracle)."""
from __future__ import annotations

import numpy as np

from jaxinfer.executors.jax_executor import JaxExecutor
from jaxinfer.kv import kv_layout
from jaxinfer.runtime.batcher import SeqWork, pack_exact


PAD = 64  # oracle forwards are padded to a multiple of this many tokens: few shapes compile


def full_logits(cfg, params, ids, kv_format="f32"):
  """Logits at every position of `ids` from one fresh prefill (no cache reuse). The
  sequence is padded at its end to a multiple of PAD tokens (causal attention: the padding
  changes no earlier position), so a growing sequence reuses a handful of executables
  instead of compiling one per length."""
  n = len(ids)
  m = -(-n // PAD) * PAD
  page_size = 16
  pages = m // page_size
  groups = kv_layout(cfg).num_groups  # a page table per layer group
  table = [list(range(g * pages, (g + 1) * pages)) for g in range(groups)]
  ex = _oracle_executor(cfg, params, pages * groups, page_size, kv_format)
  step = pack_exact([SeqWork(list(ids) + [0] * (m - n), 0,
                             tuple(table) if groups > 1 else table[0])],
                    page_size, pages * groups)
  step = _all_positions(step, m)
  _, logits = ex.logits(step)
  return logits[:n]


_EXECUTORS = {}  # (id(params), kv_format, pages) -> (params, cfg, executor); newest last


def _oracle_executor(cfg, params, num_pages, page_size, kv_format):
  """A plain-attention executor over `params`, kept for the next call with the same model
  and pool size, so a token-by-token recompute prepares the weights once rather than per
  token. Reusing its pool is safe: a fresh prefill writes every position it reads. The
  entry holds `params`, so its id is not reused."""
  key = (id(params), kv_format, num_pages)
  hit = _EXECUTORS.pop(key, None)
  if hit is None or hit[0] is not params or hit[1] != cfg:
    hit = (params, cfg, JaxExecutor(cfg, params, num_pages=num_pages, page_size=page_size,
                                    kv_format=kv_format, backend="reference"))
  _EXECUTORS[key] = hit
  while len(_EXECUTORS) > 6:
    del _EXECUTORS[next(iter(_EXECUTORS))]
  return hit[2]


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


def check_constrained_greedy(cfg, params, compiler, r, tie=1e-4):
  """A finished constrained greedy request against a constrained full-recompute decode:
  one fresh forward over prompt + outputs (teacher-forced, padded to a multiple of 16),
  then at each output position the grammar's mask from a fresh matcher and the argmax of
  the allowed logits. A position where two allowed tokens are within `tie` of each other
  (f32 summation order) accepts either."""
  from jaxinfer.structured import unconstrained_rows
  out = r.output_token_ids
  seq = r.prompt_token_ids + out[:-1]
  logits = full_logits(cfg, params, seq)
  n = len(r.prompt_token_ids)
  g = compiler.matcher(*r.sampling.constraint)
  row = unconstrained_rows(1, compiler.vocab_size)
  for j, tok in enumerate(out):
    row[:] = -1
    compiler.fill([(g, 0, [])], row)
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:logits.shape[1]] > 0
    lg = np.where(allowed, logits[n - 1 + j], -np.inf)
    want = int(np.argmax(lg))
    assert allowed[tok], (r.request_id, j, tok)
    assert tok == want or lg[tok] >= lg[want] - tie, (r.request_id, j, tok, want)
    if j < len(out) - 1:
      assert g.advance(tok) is None, (r.request_id, j)
