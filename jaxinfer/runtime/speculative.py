"""Speculative decoding on the host side (8.5): drafters and the draft-length policy.

A drafter proposes up to m tokens per running request each round; the engine verifies
them all in the next target step (one packed, bucketed step for every request) and the
scheduler keeps the longest accepted prefix plus the target's correction or bonus token,
rolling the KV of rejected positions back through the page manager.

Drafters here draft deterministically (a point-mass q), which `sampling.sample_rows` turns
into exact rejection sampling for any temperature / top-k / top-p.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence

from jaxinfer.costmodel.formulas import expected_tokens, should_lengthen
from jaxinfer.runtime.request import Request


class Drafter(Protocol):
  name: str

  def propose(self, requests: Sequence[Request], lengths: Dict[object, int]
              ) -> Dict[object, List[int]]:
    """Up to lengths[request_id] draft tokens per request."""

  def warmup(self, buckets) -> float:
    """Compile what drafting runs at these (non-verify) bucket shapes; seconds spent."""

  def bind(self, scheduler, executor, buckets) -> None:
    """Called once by the Engine that will use this drafter, with its three doors: the
    scheduler (page hooks for drafted positions, admission reservers), the target's
    executor (draft steps, page copies) and the bucket table. Host-side drafters need
    nothing."""


@dataclasses.dataclass
class NgramDrafter:
  """Prompt / n-gram lookup in the request's own context (prompt + output, 8.5.3): find
  the latest earlier occurrence of the context's last n tokens (n from max_ngram down to
  min_ngram) and propose what followed it."""
  max_ngram: int = 4
  min_ngram: int = 1
  name: str = "ngram"

  def warmup(self, buckets) -> float:
    return 0.0  # host-side: nothing to compile

  def bind(self, scheduler, executor, buckets) -> None:
    pass

  def propose(self, requests, lengths):
    out = {}
    for r in requests:
      m = lengths.get(r.request_id, 0)
      if m <= 0:
        continue
      ctx = r.all_token_ids
      out[r.request_id] = self.lookup(ctx, m)
    return out

  def lookup(self, ctx: Sequence[int], m: int) -> List[int]:
    n_ctx = len(ctx)
    for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
      tail = list(ctx[n_ctx - n:])
      for start in range(n_ctx - n - 1, -1, -1):  # latest earlier match first
        if list(ctx[start:start + n]) == tail:
          follow = list(ctx[start + n:start + n + m])
          if follow:
            return follow
    return []


@dataclasses.dataclass
class FixedDrafter:
  """Proposes `token` m times (for the simulator, whose acceptance is modelled)."""
  token: int = 0
  name: str = "fixed"

  def warmup(self, buckets) -> float:
    return 0.0  # host-side: nothing to compile

  def bind(self, scheduler, executor, buckets) -> None:
    pass

  def propose(self, requests, lengths):
    return {r.request_id: [self.token] * lengths.get(r.request_id, 0) for r in requests}


@dataclasses.dataclass
class DraftLengthPolicy:
  """Per request draft length (8.5.4). Fixed: num_draft. Adaptive: from the request's
  measured acceptance per position (Beta(1, 1) prior) and a round-time estimate
  round_time(m) (measured step times, or the cost model in simulation), lengthen the
  draft only while dT/dN < T/N. m = 0 is plain decoding."""
  num_draft: int = 4
  adaptive: bool = False

  def acceptance(self, r: Request) -> List[float]:
    a = []
    for j in range(self.num_draft):
      tried = r.drafted_by_position[j] if j < len(r.drafted_by_position) else 0
      ok = r.accepted_by_position[j] if j < len(r.accepted_by_position) else 0
      a.append((ok + 1.0) / (tried + 2.0))
    return a

  def length(self, r: Request, round_time: Optional[Callable[[int], float]] = None) -> int:
    if not self.adaptive or round_time is None:
      return self.num_draft
    a = self.acceptance(r)
    m = 0
    t_m, n_m = round_time(0), 1.0
    while m < self.num_draft:
      t_next, n_next = round_time(m + 1), expected_tokens(a[:m + 1])
      if not should_lengthen(t_m, n_m, t_next, n_next):
        break
      m, t_m, n_m = m + 1, t_next, n_next
    return m


class Speculator:
  """Each round's drafting (8.5.4): how many tokens every decoding request drafts (the
  policy, against the estimated time of the verify round), the drafter's proposals, and
  the cuts that max_tokens, the context window and a grammar impose. Round times come from
  the step model when there is one (simulation), else from the measured step times."""

  def __init__(self, drafter: Drafter, policy: Optional[DraftLengthPolicy], buckets,
               max_model_len: int, step_model=None):
    self.drafter = drafter
    self.policy = policy
    self.buckets = buckets
    self.max_model_len = max_model_len
    self.step_model = step_model
    self.draft_time_s = 0.0  # host + device time spent proposing
    self._step_time_by_tokens: Dict[int, float] = {}  # bucket tokens -> EMA seconds

  def observe(self, bucket_tokens: int, duration_s: float) -> None:
    """A finished step's time at its token bucket (exponential moving average)."""
    old = self._step_time_by_tokens.get(bucket_tokens)
    self._step_time_by_tokens[bucket_tokens] = duration_s if old is None else (
        0.8 * old + 0.2 * duration_s)

  def round_time(self, batch: int) -> Callable[[int], float]:
    """Estimated time of a verify step in which one request carries m drafts, the
    other batch - 1 requests one token each; padding to the next token bucket counts."""
    model, known = self.step_model, self._step_time_by_tokens

    def t(m: int) -> float:
      n = batch + m
      try:
        padded = self.buckets.pad_tokens(n)
      except ValueError:
        return float("inf")
      if model is not None:
        return model.step_time([(1 + m, 0)] + [(1, 0)] * (batch - 1)) * padded / max(n, 1)
      if padded in known:
        return known[padded]
      if known:  # nearest measured bucket, scaled by tokens
        k = min(known, key=lambda x: abs(x - padded))
        return known[k] * max(padded, 1) / max(k, 1)
      return float(padded)

    return t

  def draft(self, running: Sequence[Request]) -> None:
    """Set r.draft for every decoding request among `running`."""
    decoding = [r for r in running if not r.in_prefill and not r.state.done]
    if not decoding:
      return
    policy = self.policy
    round_time = self.round_time(len(decoding)) if policy and policy.adaptive else None
    lengths = {}
    for r in decoding:
      m = policy.length(r, round_time) if policy else 0
      # Never draft past max_tokens or the context window.
      room = min(r.sampling.max_tokens - len(r.output_token_ids) - 1,
                 self.max_model_len - r.num_tokens - 1)
      lengths[r.request_id] = max(min(m, room), 0)
    t0 = time.perf_counter()
    drafts = self.drafter.propose(decoding, lengths)
    self.draft_time_s += time.perf_counter() - t0
    for r in decoding:
      r.draft = list(drafts.get(r.request_id, []))[:lengths[r.request_id]]
      if r.grammar is not None and r.draft:  # a draft the grammar rejects cannot be accepted
        del r.draft[r.grammar.valid_prefix(r.draft):]


def summarize(requests: Sequence[Request]) -> dict:
  """rounds, accepted_per_round, mean_tokens_per_round, acceptance by position."""
  rounds = sum(r.spec_rounds for r in requests)
  drafted_pos: List[int] = []
  accepted_pos: List[int] = []
  for r in requests:
    for j, (d, a) in enumerate(zip(r.drafted_by_position, r.accepted_by_position)):
      if len(drafted_pos) <= j:
        drafted_pos.append(0)
        accepted_pos.append(0)
      drafted_pos[j] += d
      accepted_pos[j] += a
  return {
      "rounds": rounds,
      "drafted": sum(r.spec_drafted for r in requests),
      "accepted": sum(r.spec_accepted for r in requests),
      "accepted_per_round": sum(r.spec_accepted for r in requests) / max(rounds, 1),
      "mean_tokens_per_round": sum(r.spec_emitted for r in requests) / max(rounds, 1),
      "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
  }
