"""What one step runs: the scheduler's plan (8.2.1) — per request its new tokens after the
cached ones, and drafts to verify — with the page copies, fetches and offloads to do
before it; the executors' input. Host-side only; imports no JAX."""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

from jaxinfer.runtime.pages import HOLE, PageManager
from jaxinfer.runtime.request import Request


@dataclasses.dataclass
class ScheduledSeq:
  request: Request
  start: int  # first new token's position (= tokens already computed)
  num_tokens: int  # new known tokens this step
  draft: List[int] = dataclasses.field(default_factory=list)  # drafts verified after them
  # logits rows the step samples for it: 1 + drafts when its tokens reach the request's
  # last known one, else 0 (a prefill chunk short of it); fixed when it is scheduled
  num_logits: int = dataclasses.field(init=False)

  def __post_init__(self):
    r = self.request
    end = self.start + self.num_tokens
    self.num_logits = ((1 + len(self.draft))
                       if end == len(r.prompt_token_ids) + len(r.output_token_ids) else 0)

  @property
  def token_ids(self) -> List[int]:
    return self.request.tokens(self.start, self.start + self.num_tokens) + self.draft

  @property
  def num_step_tokens(self) -> int:
    return self.num_tokens + len(self.draft)

  @property
  def is_prefill(self) -> bool:
    return self.num_tokens > 1 or not self.request.output_token_ids


@dataclasses.dataclass
class StepPlan:
  seqs: List[ScheduledSeq]
  copies: List[Tuple[int, int]]  # copy-on-write page copies before the step
  fetches: List[Tuple[int, int]]  # host-tier (slot, page) fetches before the step
  offloads: List[Tuple[int, int]]  # (page, slot) to save to the host tier before reuse
  preempted: List[Request]
  rejected: List[Request]
  now: float
  pages: Optional[PageManager] = None  # the page tables `shared` reads

  @functools.cached_property
  def shared(self) -> Tuple[int, int]:
    """(tokens, requests): the step's largest group of requests whose page tables start
    with the same pages, and how many cached tokens those pages hold for all of them —
    read once for the group in the cost model (8.6.3). Computed only when asked (the
    simulator does; the real executor's steps never pay for it), at launch, before the
    pages change."""
    if self.pages is None:
      return (0, 0)
    return shared_prefix(self.pages, [(s.request.request_id, s.start) for s in self.seqs])

  @property
  def num_tokens(self) -> int:
    return sum(s.num_step_tokens for s in self.seqs)

  @property
  def empty(self) -> bool:
    return not self.seqs


def shared_prefix(pages: PageManager, seqs) -> Tuple[int, int]:
  """StepPlan.shared for (request id, first new token's position) pairs."""
  groups = {}
  for rid, start in seqs:
    pt = pages.first_table(rid)
    if pt and start and pt[0] != HOLE:
      groups.setdefault(pt[0], []).append((start, pt))
  group = max(groups.values(), key=len, default=[])
  if len(group) < 2:
    return (0, 0)
  common = 0
  for col in zip(*(pt for _, pt in group)):
    if col[0] == HOLE or any(p != col[0] for p in col):
      break
    common += 1
  return (min(common * pages.page_size, min(start for start, _ in group)), len(group))
