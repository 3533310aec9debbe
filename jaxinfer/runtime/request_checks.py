"""Checks of a request before it is queued: every field against the engine's limits, with
no state changed. ValueError (RequestTooLargeError for sizes) names the field, the value
and the limit."""
from __future__ import annotations

import numbers
import threading
from typing import List

import numpy as np

from jaxinfer.config import SamplingParams


class RequestTooLargeError(ValueError):
  """A request can never run: longer than the context window, a bucket or the KV pool."""


class RequestChecks:
  """The engine's request checks (and the structured-output compiler they use), reading
  the engine's executor, pages, buckets, limits and disabled adapters."""

  def __init__(self, engine):
    self.engine = engine
    self._grammars = None  # a GrammarCompiler, built at the first constrained request
    self._grammars_lock = threading.Lock()  # validate may run on other threads

  def validate(self, prompt_token_ids, sampling: SamplingParams) -> List[int]:
    """Every check add_request makes, with no state changed: the prompt ids as ints.
    ValueError (RequestTooLargeError for sizes) names the field, the value and the limit."""
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    ids = self._check_token_ids(prompt_token_ids)
    self.check_size(len(ids), sampling)
    hi = self.engine.executor.vocab_size
    for t, _ in sampling.logit_bias or ():
      if hi is not None and t >= hi:
        raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {hi})")
    if sampling.lora is not None and sampling.lora not in self.engine.executor.lora_adapters:
      known = sorted(self.engine.executor.lora_adapters)
      if sampling.lora in self.engine.disabled_loras:
        raise ValueError(f"LoRA adapter {sampling.lora!r} is disabled "
                         f"({self.engine.disabled_loras[sampling.lora]}); add it again to serve it")
      raise ValueError(f"unknown LoRA adapter {sampling.lora!r}; this engine serves "
                       f"{known if known else 'no adapters (max_loras=0)'}")
    if sampling.constraint is not None:  # compiles (cached): an invalid one is a ValueError
      self.grammar_compiler().compile(*sampling.constraint)
    return ids

  def grammar_compiler(self):
    """The structured-output compiler for this engine's tokenizer (built once)."""
    with self._grammars_lock:
      if self._grammars is None:
        from jaxinfer.structured import GrammarCompiler
        if self.engine.tokenizer is None:
          raise ValueError("structured output (json_schema / regex / grammar / choice) needs "
                           "a tokenizer; this engine has none")
        vocab = self.engine.executor.vocab_size or self.engine.tokenizer.vocab_size
        eos = list(self.engine.eos_token_ids) or list(self.engine.tokenizer.eos_token_ids)
        self._grammars = GrammarCompiler(self.engine.tokenizer, vocab, eos)
      return self._grammars

  def _check_token_ids(self, prompt_token_ids) -> List[int]:
    """Prompt ids as ints in [0, vocab): out-of-range ids were clamped or wrapped on the
    device, silently; checked here, before any state changes."""
    if isinstance(prompt_token_ids, (str, bytes)):
      raise ValueError("prompt_token_ids must be a sequence of token ids, not text "
                       "(encode it with the tokenizer, or use LLM.generate)")
    hi = self.engine.executor.vocab_size
    arr = np.asarray(prompt_token_ids) if isinstance(
        prompt_token_ids, (list, tuple, np.ndarray)) else None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu" and arr.size and \
        arr.min() >= 0 and (hi is None or arr.max() < hi):
      return arr.tolist()  # integers in range: checked at once (the loop below names the
      # first offending entry otherwise)
    ids = []
    for i, t in enumerate(prompt_token_ids):
      if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise ValueError(f"prompt_token_ids[{i}] must be an integer, got {t!r}")
      if t < 0 or (hi is not None and t >= hi):
        raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary "
                         f"[0, {hi if hi is not None else 'inf'})")
      ids.append(int(t))
    return ids

  def check_size(self, n_prompt: int, sp: SamplingParams) -> None:
    """Raise RequestTooLargeError if such a request could never run (ValueError for an
    empty prompt: nothing is too large there)."""
    if n_prompt < 1:
      raise ValueError("the prompt is empty: at least one token is needed")
    total = n_prompt + sp.max_tokens
    if total > self.engine.max_model_len:
      raise RequestTooLargeError(
          f"prompt of {n_prompt} tokens + max_tokens {sp.max_tokens} = {total} exceeds the "
          f"context window of {self.engine.max_model_len} tokens")
    if self.engine.config.policy in ("fixed", "continuous") and \
        n_prompt > self.engine.buckets.max_tokens:
      raise RequestTooLargeError(
          f"prompt of {n_prompt} tokens is longer than the largest bucket of "
          f"{self.engine.buckets.max_tokens} tokens per step (the {self.engine.config.policy} "
          "policy runs a prompt whole; use chunked or separate)")
    pages = self.engine.pm.pages_for(total - 1)
    if pages > self.engine.buckets.max_pages:
      raise RequestTooLargeError(
          f"request needs {pages} pages, more than the largest bucket of "
          f"{self.engine.buckets.max_pages} pages per request")
    pm = self.engine.pm  # a windowed group holds only its window's pages
    pool_pages = pm.reserve_pages(total - 1, self.engine.scheduler.window_pages(total - 1))
    if pool_pages > pm.num_pages:
      raise RequestTooLargeError(
          f"request needs {pool_pages} KV pages ({total - 1} tokens) but the pool has only "
          f"{pm.num_pages} pages of {pm.page_size} tokens")

