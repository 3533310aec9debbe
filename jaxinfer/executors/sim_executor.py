"""SimExecutor: no model; a virtual clock advanced by a pluggable step-time model.

The same Scheduler / PageManager / PrefixCache drive it as the real executor, so the
chapter's full-scale scenarios (Qwen3-8B on RTX PRO 6000) run on a laptop. Sampled
tokens are placeholders (requests end at max_tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, Tuple

import numpy as np

from jaxinfer.costmodel.formulas import chunk_pairs as causal_pairs  # 8.2.3's N_pair
from jaxinfer.executors.base import StepResult
from jaxinfer.runtime.step_plan import StepPlan


class StepTimeModel(Protocol):

  def step_time(self, seqs: Sequence[Tuple[int, int]], shared_tokens: int = 0,
                sharing: Optional[int] = None, logits_rows: Optional[int] = None) -> float:
    """seqs: (new tokens, cached tokens) per request in the step -> seconds.
    shared_tokens / sharing: a prefix whose KV pages `sharing` of the requests hold in
    common (all when None); logits_rows: LM-head rows (one per request when None)."""


@dataclasses.dataclass(frozen=True)
class AffineStepModel:
  """8.2.2's iteration time, fitted to experiment 8-1 at batch 1 (Qwen3-8B, RTX PRO 6000):
  26.22 ms fixed + 30.4 us per new token + 3 ns per causal (query, key) pair."""
  fixed_s: float = 26.22e-3
  per_token_s: float = 30.4e-6
  per_pair_s: float = 3e-9

  def step_time(self, seqs, shared_tokens=0, sharing=None, logits_rows=None):
    tokens = sum(c for c, _ in seqs)
    pairs = sum(causal_pairs(c, h) for c, h in seqs)
    return self.fixed_s + self.per_token_s * tokens + self.per_pair_s * pairs

  @classmethod
  def fit(cls, steps) -> "AffineStepModel":
    """Least-squares fixed + per-token times from measured steps (the engine's
    StepRecords: duration, num_prefill_tokens + num_decode_tokens); the pair term is
    left at 0 (short contexts). Both coefficients are kept non-negative."""
    n = np.array([s.num_prefill_tokens + s.num_decode_tokens for s in steps], np.float64)
    t = np.array([s.duration for s in steps], np.float64)
    if len(steps) < 2 or np.ptp(n) == 0:
      raise ValueError(f"fitting a step model needs steps of at least two sizes; got "
                       f"{len(steps)} steps of sizes {sorted(set(n.astype(int).tolist()))}")
    a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), t, rcond=None)[0]
    if b < 0:
      a, b = float(t.mean()), 0.0
    elif a < 0:
      a, b = 0.0, float((n @ t) / (n @ n))
    return cls(fixed_s=float(a), per_token_s=float(b), per_pair_s=0.0)


class SimExecutor:
  virtual_clock = True
  kv_windows = ()  # one page table per request
  vocab_size = None  # no model: any token id is accepted

  def __init__(self, model: StepTimeModel, *, num_pages: int, page_size: int,
               token_id: int = 0, acceptance: float = 0.0, seed: int = 0,
               accepted_per_round: Optional[int] = None,
               pad_to_buckets: bool = False, compile_s: float = 0.0,
               lora_adapters=None, max_loras: int = 0, lora_cost=None):
    """acceptance: probability that each drafted position is accepted (8.5.2 model of
    independent positions); drafts are verified against it. accepted_per_round instead:
    exactly the first that many drafts of every round are accepted (a drafter with a
    stated number of tokens per round, as 8.6.3's variants give it).
    pad_to_buckets: charge each step at its bucket's token count, the padding tokens as
    one-token requests with no context (8.2.4: 17-32 rows run the 32-row graph);
    compile_s: seconds charged the first time a bucket shape runs (a compile, as the real
    engine pays without warm-up); `compiles` counts them.
    lora_adapters {name: parameter count}, max_loras, lora_cost (costmodel.lora.LoraCost):
    multi-LoRA (8.2.1) — each distinct adapter in a step reads its A and B once and every
    token runs its low-rank products; each load into a slot crosses the host link."""
    if compile_s < 0 or not np.isfinite(compile_s):
      raise ValueError(f"compile_s must be a finite number >= 0, got {compile_s!r}")
    self.step_model = model
    self.pad_to_buckets = pad_to_buckets
    self.compile_s = compile_s
    self.compiled = set()  # bucket shapes run so far
    if accepted_per_round is not None and accepted_per_round < 0:
      raise ValueError(f"accepted_per_round must be >= 0, got {accepted_per_round}")
    self.acceptance = acceptance
    self.accepted_per_round = accepted_per_round
    self._rng = np.random.default_rng(seed)
    self.num_pages = num_pages
    self.page_size = page_size
    self.token_id = token_id
    self.pages_copied = 0
    self.pages_offloaded = 0
    self.pages_fetched = 0
    self.lora_adapters = dict(lora_adapters or {})
    self.max_loras = int(max_loras)
    self.lora_cost = lora_cost
    self.lora_load_s = 0.0  # seconds charged for adapter loads (host -> device)

  def unload_lora(self, name: str, slot: int) -> None:
    self.lora_adapters.pop(name, None)

  def load_lora(self, loads):
    if self.lora_cost is not None:
      self.lora_load_s += sum(self.lora_cost.load_s(self.lora_adapters[n]) for _, n in loads)

  def copy_pages(self, copies):
    self.pages_copied += len(copies)

  def offload_pages(self, moves):
    self.pages_offloaded += len(moves)

  def fetch_pages(self, moves):
    self.pages_fetched += len(moves)

  def execute(self, step, plan: StepPlan) -> StepResult:
    """`step` carries only the bucket (no arrays are built for the simulator)."""
    seqs = [(s.num_step_tokens, s.start) for s in plan.seqs]
    extra = 0.0
    if step is not None:
      b = step.bucket
      if self.pad_to_buckets:
        seqs += [(1, 0)] * max(b.num_tokens - sum(c for c, _ in seqs), 0)
      if b not in self.compiled:
        self.compiled.add(b)
        extra = self.compile_s
    ids, accepted = [], []
    for s in plan.seqs:
      for j in range(s.num_logits):
        if self.accepted_per_round is not None:
          acc = j < min(len(s.draft), self.accepted_per_round)
        else:
          acc = j < len(s.draft) and self._rng.random() < self.acceptance
        ids.append(s.draft[j] if acc else self.token_id)
        accepted.append(acc)
    if self.lora_cost is not None:
      tokens = {}
      for s in plan.seqs:
        if s.request.sampling.lora:
          name = s.request.sampling.lora
          tokens[name] = tokens.get(name, 0) + s.num_step_tokens
      extra += sum(self.lora_cost.step_s(self.lora_adapters[n], t) for n, t in tokens.items())
      extra += self.lora_load_s
      self.lora_load_s = 0.0
    shared, sharing = plan.shared
    t = self.step_model.step_time(seqs, shared_tokens=shared, sharing=sharing,
                                  logits_rows=sum(s.num_logits for s in plan.seqs))
    return StepResult(np.array(ids, np.int32), np.zeros(len(ids), np.float32),
                      np.array(accepted, bool), t + extra)

  def decode_times(self, contexts: Sequence[int], n: int, shared_tokens: int = 0,
                   sharing: Optional[int] = None) -> Optional[np.ndarray]:
    """The durations `execute` gives n plain decode rounds of one batch (round k: one
    token per request after contexts[i] + k cached tokens, no drafts), or None where a
    round's cost depends on more than its step model (bucket padding, compiles, adapter
    costs): the engine's fast-forward then steps one by one."""
    if self.pad_to_buckets or self.compile_s or self.lora_cost is not None:
      return None
    m = self.step_model
    if hasattr(m, "decode_times"):
      return m.decode_times(contexts, n, shared_tokens, sharing)
    return np.array([m.step_time([(1, h + k) for h in contexts], shared_tokens, sharing)
                     for k in range(n)])

  def mark_run(self, buckets) -> None:
    """Bucket shapes that ran outside execute (a fast-forwarded stretch of rounds)."""
    self.compiled.update(buckets)

  @property
  def compiles(self) -> int:
    """First uses of a bucket shape (each charged compile_s)."""
    return len(self.compiled)

  def launch(self, step, plan: StepPlan) -> StepResult:
    return self.execute(step, plan)  # nothing runs asynchronously: the handle is the result

  def collect(self, handle: StepResult) -> StepResult:
    return handle

  def warmup(self, buckets, masked: bool = False) -> float:
    return 0.0  # nothing to compile (compile_s charges a shape at its first use instead)

  def memory_report(self) -> dict:
    return {"kv_pages": self.num_pages, "page_size": self.page_size}
