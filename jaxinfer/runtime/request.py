"""Request: its own input, output, stop condition and timestamps (8.1).

States: WAITING -> RUNNING (prefill, then decode) -> FINISHED | CANCELLED | REJECTED;
a preempted request goes back to WAITING and later recomputes its prompt plus the
tokens it already produced (8.3.2). Times are on the engine's clock (wall or virtual),
measured from the scheduled arrival (8.6.2).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional

from jaxinfer.config import SamplingParams


class State(enum.Enum):
  WAITING = "waiting"
  PREFILL = "running_prefill"
  DECODE = "running_decode"
  FINISHED = "finished"
  CANCELLED = "cancelled"
  REJECTED = "rejected"
  FAILED = "failed"  # a step carrying the request raised, or produced non-finite logits

  @property
  def done(self) -> bool:
    return self in (State.FINISHED, State.CANCELLED, State.REJECTED, State.FAILED)


_ALLOWED = {
    State.WAITING: {State.PREFILL, State.CANCELLED, State.REJECTED, State.FAILED},
    State.PREFILL: {State.PREFILL, State.DECODE, State.WAITING, State.CANCELLED, State.FINISHED,
                    State.FAILED},
    State.DECODE: {State.DECODE, State.WAITING, State.CANCELLED, State.FINISHED, State.FAILED},
}


class Timeline:
  """Times of a request from its arrival_time, token_times and finished_at (a Request,
  or what a fleet keeps of one)."""

  @property
  def ttft(self) -> Optional[float]:
    return self.token_times[0] - self.arrival_time if len(self.token_times) else None

  @property
  def itls(self) -> List[float]:
    return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

  @property
  def latency(self) -> Optional[float]:
    return None if self.finished_at is None else self.finished_at - self.arrival_time


@dataclasses.dataclass(eq=False)
class Request(Timeline):
  request_id: object
  prompt_token_ids: List[int]
  sampling: SamplingParams
  arrival_time: float = 0.0  # scheduled arrival
  deadline_s: Optional[float] = None  # arrival -> last token
  priority: int = 0  # lower runs first
  seed: int = 0
  prompt: Optional[str] = None
  grammar: Optional[object] = None  # structured output: a GrammarMatcher (jaxinfer.structured)

  state: State = State.WAITING
  output_token_ids: List[int] = dataclasses.field(default_factory=list)
  logprobs: List[float] = dataclasses.field(default_factory=list)
  top_logprobs: List[list] = dataclasses.field(default_factory=list)  # [(token, logprob)]
  # per output token, the sampling.logprobs most likely (when it asks for them)
  num_computed: int = 0  # tokens whose K/V are in this request's pages
  admitted_at: Optional[float] = None
  first_admitted_at: Optional[float] = None
  token_times: List[float] = dataclasses.field(default_factory=list)
  finished_at: Optional[float] = None
  finish_reason: Optional[str] = None  # stop | length | abort | rejected | error | constraint
  reject_reason: Optional[str] = None
  error: Optional[str] = None  # why a step failed the request (finish_reason "error"), or
  # why its constraint allowed no next token (finish_reason "constraint")
  text: str = ""
  num_preemptions: int = 0
  recomputed_tokens: int = 0  # extra tokens scheduled because of preemption
  cached_tokens: int = 0  # prompt tokens served by the prefix cache
  # prompt tokens whose K/V arrive with the request, computed elsewhere (disaggregated
  # serving: by a prefill replica); a preemption loses them, and they are recomputed
  imported_tokens: int = 0
  prefix_nodes: list = dataclasses.field(default_factory=list)
  lora_slot: int = 0  # the device slot its adapter holds while it runs (0: no adapter)
  # Speculative decoding (8.5): drafts to verify next step, and per-position statistics.
  draft: List[int] = dataclasses.field(default_factory=list)
  spec_rounds: int = 0
  spec_drafted: int = 0
  spec_accepted: int = 0
  spec_emitted: int = 0
  accepted_by_position: List[int] = dataclasses.field(default_factory=list)
  drafted_by_position: List[int] = dataclasses.field(default_factory=list)

  def set_state(self, new: State) -> None:
    if new not in _ALLOWED.get(self.state, ()):
      raise RuntimeError(f"request {self.request_id}: illegal transition {self.state} -> {new}")
    self.state = new

  @property
  def all_token_ids(self) -> List[int]:
    return self.prompt_token_ids + self.output_token_ids

  def tokens(self, start: int, end: int) -> List[int]:
    """all_token_ids[start:end] without building the whole context (per-step use)."""
    P = len(self.prompt_token_ids)
    if start >= P:
      return self.output_token_ids[start - P:end - P]
    if end <= P:
      return self.prompt_token_ids[start:end]
    return self.prompt_token_ids[start:] + self.output_token_ids[:end - P]

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def kv_tokens_at_end(self) -> int:
    """L + G - 1: the last output token's K/V is never written (8.1)."""
    return len(self.prompt_token_ids) + self.sampling.max_tokens - 1

  @property
  def num_pending(self) -> int:
    """Known tokens whose K/V are not computed yet: the prompt (or prompt + outputs after
    a preemption) during prefill, the last output token during decode."""
    return self.num_tokens - self.num_computed

  @property
  def in_prefill(self) -> bool:
    return not self.output_token_ids or self.num_pending > 1

  @property
  def queueing(self) -> Optional[float]:
    return None if self.first_admitted_at is None else self.first_admitted_at - self.arrival_time

  @property
  def on_time(self) -> bool:
    if self.deadline_s is None:
      return self.state == State.FINISHED
    return (self.state == State.FINISHED and self.finished_at is not None and
            self.finished_at - self.arrival_time <= self.deadline_s + 1e-12)
