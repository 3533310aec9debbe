"""What an engine keeps of its past: step records (metrics.StepRecord) and finished
requests, each up to a cap, so a long-running engine's memory stays flat. Trimming is
amortized: once 10% over a cap, back down to it."""
from __future__ import annotations

from typing import Dict, List

from jaxinfer.metrics import StepRecord


class StepLog(list):
  """The newest `max_records` step records, in order; `count` steps finished so far (the
  last record's index + 1)."""

  def __init__(self, max_records: int):
    super().__init__()
    self.max_records = max_records
    self.count = 0

  def record(self, start: float, end: float, plan, padded: int, bucket, draft_s: float,
             emitted: List[tuple]) -> StepRecord:
    """Record a finished step of `plan` (emitted: (request, tokens emitted) pairs)."""
    n_prefill = sum(s.num_tokens for s in plan.seqs if s.is_prefill)
    drafted = sum(len(s.draft) for s in plan.seqs)
    emitted_n = sum(n for _, n in emitted)
    rec = StepRecord(self.count, start, end - start, len(plan.seqs), n_prefill,
                     plan.num_tokens - n_prefill, padded, bucket, len(plan.preempted),
                     [(s.request.request_id, s.num_tokens, s.is_prefill) for s in plan.seqs],
                     draft_s, drafted, max(emitted_n - len(emitted), 0) if drafted else 0,
                     emitted_n)
    return self._keep(rec)

  def record_decode(self, start: float, end: float, request_ids, padded: int,
                    bucket) -> StepRecord:
    """record() of a plain decode round: one token computed and emitted for each of
    request_ids, nothing drafted or preempted (the fast-forward's rounds), built without a
    plan."""
    b = len(request_ids)
    return self._keep(StepRecord(self.count, start, end - start, b, 0, b, padded, bucket, 0,
                                 [(rid, 1, False) for rid in request_ids], 0.0, 0, 0, b))

  def _keep(self, rec: StepRecord) -> StepRecord:
    self.count += 1
    self.append(rec)
    if len(self) > self.max_records * 1.1:
      del self[:len(self) - self.max_records]
    return rec


def trim_requests(requests: Dict, max_requests: int, forget) -> None:
  """Drop the oldest finished requests past `max_requests` (never an unfinished one);
  `forget(request_id)` tells the scheduler."""
  excess = len(requests) - max_requests
  if excess <= max_requests // 10:
    return
  drop = []
  for rid, r in requests.items():  # insertion order: oldest first
    if len(drop) >= excess:
      break
    if r.state.done:
      drop.append(rid)
  for rid in drop:
    del requests[rid]
    forget(rid)
