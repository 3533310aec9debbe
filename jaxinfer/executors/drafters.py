"""Drafters that run on the device (8.5.3).

EarlyExitDrafter: the target's first k layers + its LM head, no extra weights. It
drafts greedily (a point-mass q, so verification is exact) one position at a time for
all decoding requests together, writing the first k layers' K/V of the drafted
positions into the target's own pages (the verify step rewrites all layers there).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np

from jaxinfer.runtime.batcher import SeqWork, pack
from jaxinfer.runtime.speculative import Drafter, FixedDrafter, NgramDrafter
from jaxinfer.step import draft_step


@dataclasses.dataclass
class EarlyExitDrafter:
  num_layers: int
  name: str = "early_exit"
  engine: object = None  # bound by the Engine

  def bind(self, engine) -> None:
    cfg = engine.executor.cfg
    if not 0 < self.num_layers < cfg.num_layers:
      raise ValueError(f"early-exit layers must be in [1, {cfg.num_layers - 1}], "
                       f"got {self.num_layers}")
    self.engine = engine

  def propose(self, requests, lengths) -> Dict[object, List[int]]:
    eng = self.engine
    pm, ex = eng.pm, eng.executor
    m_max = max((lengths.get(r.request_id, 0) for r in requests), default=0)
    drafts: Dict[object, List[int]] = {r.request_id: [] for r in requests}
    active = []
    for r in requests:
      m = lengths.get(r.request_id, 0)
      if m <= 0:
        continue
      rid, c = r.request_id, r.num_computed
      if pm.num_tokens(rid) > c:
        pm.rollback(rid, c)
      copies = pm.grow(rid, c + m)  # pages for the drafted positions c .. c + m - 1
      if copies is None:
        continue  # pool short: no drafts for this request this round
      ex.copy_pages(copies)
      active.append(r)
    for j in range(m_max):
      batch = [r for r in active if j < lengths[r.request_id]]
      if not batch:
        break
      works = []
      for r in batch:
        d = drafts[r.request_id]
        tok = d[-1] if d else r.output_token_ids[-1]
        works.append(SeqWork([tok], r.num_computed + j, pm.page_table(r.request_id),
                             sample_index=len(r.output_token_ids) + j))
      step = pack(works, eng.buckets, pm.page_size, pm.num_pages)
      sid = pm.begin_step([r.request_id for r in batch])
      out, ex.pool = draft_step(ex.params, ex.pool, step.arrays, cfg=ex.cfg,
                                attn_shape=step.bucket.attn_shape, backend=ex.backend,
                                num_layers=self.num_layers)
      toks = np.asarray(out)
      pm.complete_step(sid)
      for i, r in enumerate(batch):
        drafts[r.request_id].append(int(toks[i]))
    return drafts


DRAFTERS = ("none", "ngram", "early_exit", "fixed")


def make_drafter(name: str, *, early_exit_layers: int = 0, **kw) -> Optional[Drafter]:
  """none | ngram | early_exit (the target's first `early_exit_layers` layers) | fixed
  (simulator). The separate draft-model drafter is not built yet."""
  if name in ("none", "", None):
    return None
  if name == "ngram":
    return NgramDrafter(**kw)
  if name == "fixed":
    return FixedDrafter(**kw)
  if name == "early_exit":
    return EarlyExitDrafter(num_layers=early_exit_layers)
  raise ValueError(f"unknown drafter {name!r}; available: {DRAFTERS} (draft_model is not "
                   "built yet)")
