"""What every executor offers the engine."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence, Tuple

import numpy as np

from jaxinfer.buckets import Bucket
from jaxinfer.runtime.batcher import StepInput
from jaxinfer.runtime.scheduler import StepPlan


@dataclasses.dataclass
class StepResult:
  packed: np.ndarray  # [S, 3] float32: (token id, logprob, draft accepted) per logits row
  duration_s: float  # execution time (wall, or virtual for the simulator)


class Executor(Protocol):
  """Both executors implement all of it (the engine dispatches on nothing else)."""
  num_pages: int
  page_size: int
  virtual_clock: bool  # True: durations are modelled, the engine's clock is virtual
  vocab_size: Optional[int]  # token ids the model accepts: [0, vocab_size); None = any
  step_model: Optional[object]  # a StepTimeModel when steps are modelled, else None
  max_loras: int  # LoRA adapter slots on the device (0: no adapters, 8.2.1)
  lora_adapters: dict  # registered adapters by name (host memory)

  def copy_pages(self, copies: Sequence[Tuple[int, int]]) -> None: ...

  def offload_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def fetch_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def load_lora(self, loads: Sequence[Tuple[int, str]]) -> None:
    """Copy (slot, adapter name) adapters into their device slots before the step."""

  def unload_lora(self, name: str, slot: int) -> None:
    """Forget a registered adapter and zero its device slot (slot 0: it held none)."""

  def launch(self, step: StepInput, plan: StepPlan) -> Any:
    """Start a step; returns a handle for `collect` (a real device runs asynchronously)."""

  def collect(self, handle: Any) -> StepResult: ...

  def execute(self, step: StepInput, plan: StepPlan) -> StepResult:
    """collect(launch(step, plan))."""

  def warmup(self, buckets: Sequence[Bucket], masked: bool = False) -> float:
    """Compile the given shapes ahead of time; seconds spent (0 when nothing compiles).
    masked: the variants that take a structured-output token mask."""

  def memory_report(self) -> dict: ...
