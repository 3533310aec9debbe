"""What every executor offers the engine."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from jaxinfer.buckets import Bucket
from jaxinfer.runtime.batcher import StepInput
from jaxinfer.runtime.step_plan import StepPlan


@dataclasses.dataclass
class StepResult:
  """A step's outcome per logits row (S rows: each request's new-token rows in plan
  order), decoded by the executor."""
  tokens: np.ndarray  # [S] int32: the sampled (or verified) token
  logprobs: np.ndarray  # [S] float32: its logprob; not finite when the row's logits were not
  accepted: np.ndarray  # [S] bool: the row's draft token was accepted
  duration_s: float  # execution time (wall, or virtual for the simulator)
  top_ids: Optional[np.ndarray] = None  # [S, K] int32: the K most likely tokens, when a
  top_logprobs: Optional[np.ndarray] = None  # request asked (K = sampling.TOP_LOGPROBS)

  @classmethod
  def from_packed(cls, packed: np.ndarray, duration_s: float) -> "StepResult":
    """The sampler's one device -> host array ([S, 3 + 2K] float32: token, logprob,
    accepted, then K top ids and K top logprobs; jaxinfer.step.sample_packed)."""
    k = (packed.shape[1] - 3) // 2
    return cls(packed[:, 0].astype(np.int32), packed[:, 1].astype(np.float32),
               packed[:, 2] > 0, duration_s,
               packed[:, 3:3 + k].astype(np.int32) if k else None,
               packed[:, 3 + k:] if k else None)

  def rows(self, n: int) -> List[tuple]:
    """The first n rows as (token, logprob, accepted, [(id, logprob)] top or None)."""
    out = []
    for i in range(n):
      top = None if self.top_ids is None else [
          (int(t), float(lp)) for t, lp in zip(self.top_ids[i], self.top_logprobs[i])]
      out.append((int(self.tokens[i]), float(self.logprobs[i]), bool(self.accepted[i]), top))
    return out


class Executor(Protocol):
  """What the engine, the router and the server call on every executor (real, simulated);
  the engine dispatches on nothing else."""
  num_pages: int
  page_size: int
  virtual_clock: bool  # True: durations are modelled, the engine's clock is virtual
  vocab_size: Optional[int]  # token ids the model accepts: [0, vocab_size); None = any
  step_model: Optional[object]  # a StepTimeModel when steps are modelled, else None
  max_loras: int  # LoRA adapter slots on the device (0: no adapters, 8.2.1)
  kv_windows: Tuple[int, ...]  # each page-table group's window (kv.KVLayout); (): one
  lora_adapters: dict  # registered adapters by name (host memory)

  def copy_pages(self, copies: Sequence[Tuple[int, int]]) -> None: ...

  def offload_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def fetch_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def load_lora(self, loads: Sequence[Tuple[int, str]]) -> None:
    """Copy (slot, adapter name) adapters into their device slots before the step."""

  def unload_lora(self, name: str, slot: int) -> None:
    """Forget a registered adapter and zero its device slot (slot 0: it held none)."""

  def launch(self, step: StepInput, plan: StepPlan) -> Any:
    """Start a step; returns a handle for `collect` (a real device runs asynchronously;
    the simulator prices the step from `plan`)."""

  def collect(self, handle: Any) -> StepResult: ...

  def execute(self, step: StepInput, plan: StepPlan) -> StepResult:
    """collect(launch(step, plan)): a draft model's own steps (drafters.py)."""

  def warmup(self, buckets: Sequence[Bucket], masked: bool = False) -> float:
    """Compile the given shapes ahead of time; seconds spent (0 when nothing compiles).
    masked: the variants that take a structured-output token mask."""

  def memory_report(self) -> dict: ...


class ModelExecutor(Executor, Protocol):
  """What `LLM` and the early-exit drafter call besides: an executor that holds a model."""
  lora_rank: int  # the rank the adapter slots hold (with max_loras >= 1)

  def register_lora(self, adapter) -> None:
    """Keep an adapter in host memory, ready to load into a slot (checked first)."""

  def check_draft(self, num_layers: int) -> None:
    """Raise unless early-exit draft steps of `num_layers` layers can run here."""

  def warmup_draft(self, buckets: Sequence[Bucket], num_layers: int) -> float: ...

  def draft(self, step: StepInput, num_layers: int) -> np.ndarray:
    """Greedy tokens of the first `num_layers` layers (8.5.3)."""
