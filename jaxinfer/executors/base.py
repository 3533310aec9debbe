"""What every executor offers the engine."""
from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, Tuple

import numpy as np

from jaxinfer.runtime.batcher import StepInput
from jaxinfer.runtime.scheduler import StepPlan


@dataclasses.dataclass
class StepResult:
  packed: np.ndarray  # [S, 3] float32: (token id, logprob, draft accepted) per logits row
  duration_s: float  # execution time (wall, or virtual for the simulator)


class Executor(Protocol):
  num_pages: int
  page_size: int
  virtual_clock: bool
  vocab_size: Optional[int]  # token ids the model accepts: [0, vocab_size); None = any

  def copy_pages(self, copies: Sequence[Tuple[int, int]]) -> None: ...

  def offload_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def fetch_pages(self, moves: Sequence[Tuple[int, int]]) -> None: ...

  def execute(self, step: StepInput, plan: StepPlan) -> StepResult: ...
