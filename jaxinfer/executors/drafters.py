"""Drafters that run on the device (8.5.3).

EarlyExitDrafter: the target's first k layers + its LM head, no extra weights. It
drafts greedily (a point-mass q, so verification is exact) one position at a time for
all decoding requests together, writing the first k layers' K/V of the drafted
positions into the target's own pages (the verify step rewrites all layers there).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from jaxinfer.runtime.batcher import SeqWork, pack
from jaxinfer.runtime.speculative import Drafter, FixedDrafter, NgramDrafter


@dataclasses.dataclass
class EarlyExitDrafter:
  num_layers: int
  name: str = "early_exit"

  def bind(self, scheduler, executor, buckets) -> None:
    executor.check_draft(self.num_layers)
    self.scheduler, self.executor, self.buckets = scheduler, executor, buckets

  def warmup(self, buckets) -> float:
    """Compile the draft step at every decode-only bucket (what propose() packs)."""
    return self.executor.warmup_draft(buckets, self.num_layers)

  def propose(self, requests, lengths) -> Dict[object, List[int]]:
    sch, ex = self.scheduler, self.executor
    m_max = max((lengths.get(r.request_id, 0) for r in requests), default=0)
    drafts: Dict[object, List[int]] = {r.request_id: [] for r in requests}
    active = []
    for r in requests:
      m = lengths.get(r.request_id, 0)
      if m <= 0:
        continue
      copies = sch.draft_pages(r, m)  # pages for the drafted positions
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
        works.append(SeqWork([tok], r.num_computed + j, sch.page_table(r),
                             sample_index=len(r.output_token_ids) + j))
      step = pack(works, self.buckets, ex.page_size, ex.num_pages)
      with sch.reading(batch):
        toks = ex.draft(step, self.num_layers)
      for i, r in enumerate(batch):
        drafts[r.request_id].append(int(toks[i]))
    return drafts


DRAFTERS = ("none", "ngram", "early_exit", "draft_model", "fixed")


def make_drafter(name: str, *, early_exit_layers: int = 0, draft_model=None,
                 draft_pages: int = 1024, **kw) -> Optional[Drafter]:
  """none | ngram | early_exit (the target's first `early_exit_layers` layers) |
  draft_model (a LoadedModel sharing the tokenizer) | fixed (simulator)."""
  if name in ("none", "", None):
    return None
  if name == "ngram":
    return NgramDrafter(**kw)
  if name == "fixed":
    return FixedDrafter(**kw)
  if name == "early_exit":
    return EarlyExitDrafter(num_layers=early_exit_layers)
  if name == "draft_model":
    if draft_model is None:
      raise ValueError("the draft_model drafter needs a draft model (--draft_model=NAME|PATH)")
    return DraftModelDrafter(draft_model, num_pages=draft_pages)
  raise ValueError(f"unknown drafter {name!r}; available: {DRAFTERS}")


class DraftModelDrafter:
  """A separate, smaller model sharing the target's tokenizer (8.5.3): sequential greedy
  drafting with its own weights, its own paged KV pool and page manager. Its KV is
  reserved at admission like the target's (it registers itself with the scheduler)
  and released with the request. Each round it keeps the K/V of the longest prefix it
  already processed that the request's context still has (the accepted drafts), catches
  up on the rest in one prefill chunk, then drafts m tokens one step at a time.
  """
  name = "draft_model"

  def __init__(self, loaded, *, num_pages: int, page_size: int = 16,
               kv_format: str = "f32", backend: str = "xla"):
    from jaxinfer.executors.jax_executor import JaxExecutor
    from jaxinfer.runtime.pages import page_manager
    self.cfg = loaded.cfg
    self.executor = JaxExecutor(loaded.cfg, loaded.params, num_pages=num_pages,
                                page_size=page_size, kv_format=kv_format, backend=backend)
    self.pm = page_manager(num_pages, page_size, self.executor.kv_windows)
    self._seq: Dict[object, List[int]] = {}  # tokens whose K/V the draft pool holds
    self.buckets = None

  def bind(self, scheduler, executor, buckets) -> None:
    if executor.vocab_size != self.cfg.vocab_size:
      raise ValueError(f"draft model vocabulary {self.cfg.vocab_size} differs from the "
                       f"target's {executor.vocab_size}: they must share the tokenizer")
    self.buckets = buckets
    scheduler.add_reserver(self)

  # --- admission hooks (Scheduler.reservers) ------------------------------------------------
  def reserve(self, r) -> bool:
    if self.pm.has(r.request_id):
      return True
    ok = self.pm.add_sequence(r.request_id, reserve_tokens=r.kv_tokens_at_end)
    if ok:
      self._seq[r.request_id] = []
    return ok

  def release(self, r) -> None:
    if self.pm.has(r.request_id):
      self.pm.free(r.request_id)
    self._seq.pop(r.request_id, None)

  def warmup(self, buckets) -> float:
    """The draft model's own executables at every non-verify bucket (catch-up prefill
    chunks and one-token drafting steps use the target's bucket table)."""
    return self.executor.warmup([b for b in buckets if b.num_logits == b.num_requests])

  # --- drafting -------------------------------------------------------------------------------
  def _run(self, works):
    step = pack(works, self.buckets, self.pm.page_size, self.pm.num_pages)
    sid = self.pm.begin_step()
    self.pm.note_reads(sid, [p for w in works for p in _flat(w.page_table)])
    tokens = self.executor.execute(step).tokens
    self.pm.complete_step(sid)
    return tokens

  def _extend(self, rid, tokens) -> bool:
    """Pages for `tokens` more positions of rid (copy-on-write done); False if short."""
    copies = self.pm.grow(rid, len(self._seq[rid]) + len(tokens))
    if copies is None:
      return False
    self.executor.copy_pages(copies)
    return True

  def propose(self, requests, lengths) -> Dict[object, List[int]]:
    pm, b = self.pm, self.buckets
    drafts: Dict[object, List[int]] = {r.request_id: [] for r in requests}
    active = [r for r in requests if lengths.get(r.request_id, 0) > 0 and pm.has(r.request_id)]
    # 1. Catch up: the draft K/V must cover every context token but the last.
    pending = []
    for r in active:
      rid, ctx = r.request_id, r.all_token_ids[:-1]
      seq = self._seq[rid]
      keep = 0
      while keep < min(len(seq), len(ctx)) and seq[keep] == ctx[keep]:
        keep += 1
      del seq[keep:]
      pm.rollback(rid, keep)
      if len(ctx) > keep:
        pending.append((r, ctx[keep:]))
    while pending:
      works, used, rest = [], 0, []
      for r, toks in pending:
        room = b.max_tokens - used
        if room <= 1 or len(works) == b.max_requests:
          rest.append((r, toks))
          continue
        chunk = toks[:room]
        rid = r.request_id
        if not self._extend(rid, chunk):
          continue  # pool short: this request gets no drafts this round
        works.append(SeqWork(chunk, len(self._seq[rid]), pm.page_table(rid), num_logits=0))
        self._seq[rid].extend(chunk)
        used += len(chunk)
        if len(toks) > len(chunk):
          rest.append((r, toks[len(chunk):]))
      if not works:
        break
      self._run(works)
      pending = rest
    # 2. Draft m tokens one position at a time for all requests together.
    ready = [r for r in active if len(self._seq[r.request_id]) == r.num_tokens - 1]
    for j in range(max((lengths[r.request_id] for r in ready), default=0)):
      batch, works = [], []
      for r in ready:
        rid = r.request_id
        if j >= lengths[rid]:
          continue
        tok = drafts[rid][-1] if drafts[rid] else r.tokens(r.num_tokens - 1, r.num_tokens)[0]
        if not self._extend(rid, [tok]):
          continue
        works.append(SeqWork([tok], len(self._seq[rid]), pm.page_table(rid)))
        self._seq[rid].append(tok)
        batch.append(r)
      if not works:
        break
      tokens = self._run(works)
      for i, r in enumerate(batch):
        drafts[r.request_id].append(int(tokens[i]))
    return drafts


def _flat(table):
  """A work's pages: its table, or every group's (a grouped pool)."""
  return [p for t in table for p in t] if isinstance(table, tuple) else table
