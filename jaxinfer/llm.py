"""`LLM(model=...).generate(prompts, SamplingParams(...))`: batch generation.

Until the engine (scheduler issue) lands, generation runs static batches on the jitted
step: admit as many requests as the KV pool can reserve to the end of generation
(8.1), prefill them in chunks under the largest token bucket, then decode them together
until each stops. It uses the same paged pool, page manager, batcher and bucket table as
the engine will.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import List, Optional, Sequence, Union

import numpy as np

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.runtime.batcher import SeqWork, pack
from jaxinfer.runtime.pages import PageManager

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class RequestTooLargeError(ValueError):
  """A request can never run: longer than the context window or the KV budget."""


@dataclasses.dataclass
class RequestOutput:
  request_id: int
  prompt: Optional[str]
  prompt_token_ids: List[int]
  token_ids: List[int]
  text: str
  finish_reason: Optional[str]  # "stop" | "length"
  logprobs: List[float]
  ttft_s: float = 0.0
  decode_tok_s: float = 0.0
  token_times: List[float] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("token_times")
    return d


class _Req:

  def __init__(self, rid, prompt, ids, sp: SamplingParams, seed):
    self.rid, self.prompt, self.prompt_ids, self.sp, self.seed = rid, prompt, list(ids), sp, seed
    self.out: List[int] = []
    self.logprobs: List[float] = []
    self.times: List[float] = []
    self.cached = 0  # tokens whose K/V are in the pool
    self.finish: Optional[str] = None
    self.text = ""

  @property
  def prefilled(self) -> bool:
    return self.cached >= len(self.prompt_ids)


def stop_check(tokenizer, sp: SamplingParams, eos_ids, out_ids: List[int]):
  """Returns (finish_reason or None, text). Stop strings are cut from the text."""
  last = out_ids[-1]
  text = tokenizer.decode(out_ids) if tokenizer is not None else ""
  if (last in sp.stop_token_ids) or (not sp.ignore_eos and last in eos_ids):
    return "stop", text
  for s in sp.stop:
    i = text.find(s)
    if i >= 0:
      return "stop", text[:i]
  if len(out_ids) >= sp.max_tokens:
    return "length", text
  return None, text


class LLM:
  """Load a model and generate from batches of prompts."""

  def __init__(self, model="smollm2-135m-instruct", *, dtype: str = "float32",
               kv_format: str = "f32", page_size: int = 16, num_pages: int = 1024,
               max_model_len: Optional[int] = None, attention: str = "reference",
               buckets: Optional[BucketTable] = None, scan_layers: bool = True):
    from jaxinfer.executors.jax_executor import JaxExecutor
    from jaxinfer.loading import LoadedModel, load_model
    # `model`: a name or path, or an already loaded model (LoadedModel).
    self.model = model if isinstance(model, LoadedModel) else load_model(
        model, dtype, scan_layers=scan_layers)
    self.cfg = self.model.cfg
    self.tokenizer = self.model.tokenizer
    self.page_size = page_size
    self.num_pages = num_pages
    self.max_model_len = min(max_model_len or self.cfg.max_position, self.cfg.max_position)
    self.buckets = buckets or BucketTable.default(
        max_tokens=256, max_requests=64, max_pages=-(-self.max_model_len // page_size))
    self.executor = JaxExecutor(self.cfg, self.model.params, num_pages=num_pages,
                                page_size=page_size, kv_format=kv_format, backend=attention)
    self._next_id = 0
    self._seed_rng = np.random.default_rng()

  @classmethod
  def from_loaded(cls, loaded, **kw) -> "LLM":
    return cls(loaded, **kw)

  # -- prompts ---------------------------------------------------------------------------
  def encode_prompt(self, prompt: Prompt, chat: bool = False) -> List[int]:
    if not isinstance(prompt, str):
      return list(prompt)
    if self.tokenizer is None:
      raise ValueError(f"model {self.cfg.name!r} has no tokenizer: pass prompts as token ids")
    if chat:
      prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return self.tokenizer.encode(prompt)

  def check_request(self, n_prompt: int, sp: SamplingParams) -> None:
    if n_prompt < 1:
      raise RequestTooLargeError("empty prompt: at least one token is needed")
    total = n_prompt + sp.max_tokens
    if total > self.max_model_len:
      raise RequestTooLargeError(
          f"prompt of {n_prompt} tokens + max_tokens {sp.max_tokens} = {total} exceeds the "
          f"context window of {self.max_model_len} tokens")
    pages = -(-(total - 1) // self.page_size)
    if pages > self.buckets.max_pages:
      raise RequestTooLargeError(
          f"request needs {pages} pages, more than the largest bucket of "
          f"{self.buckets.max_pages} pages per request")
    if pages > self.num_pages:
      raise RequestTooLargeError(
          f"request needs {pages} KV pages ({total - 1} tokens) but the pool has only "
          f"{self.num_pages} pages of {self.page_size} tokens")

  # -- generation ----------------------------------------------------------------------
  def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
               params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               chat: bool = False) -> List[RequestOutput]:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    params = params or SamplingParams()
    sps = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(sps) != len(prompts):
      raise ValueError(f"{len(sps)} SamplingParams for {len(prompts)} prompts")
    reqs = []
    for p, sp in zip(prompts, sps):  # validate everything before running anything
      ids = self.encode_prompt(p, chat)
      self.check_request(len(ids), sp)
      seed = sp.seed if sp.seed is not None else int(self._seed_rng.integers(2**31))
      reqs.append(_Req(self._next_id, p if isinstance(p, str) else None, ids, sp, seed))
      self._next_id += 1
    pending = list(reqs)
    while pending:
      group = self._admit(pending)
      pending = pending[len(group):]
      self._run_group(group)
    return [self._output(r) for r in reqs]

  def _admit(self, pending):
    pm = PageManager(self.num_pages, self.page_size)
    group = []
    for r in pending:
      if len(group) == self.buckets.max_requests:
        break
      # 8.1: reserve the L + G - 1 tokens the request writes by the end of generation.
      if not pm.add_sequence(r.rid, reserve_tokens=len(r.prompt_ids) + r.sp.max_tokens - 1):
        break
      group.append(r)
    self._pm = pm
    return group

  def _run_group(self, group):
    pm = self._pm
    eos = self.cfg.eos_token_ids + (self.tokenizer.eos_token_ids if self.tokenizer else ())
    t_start = time.perf_counter()
    while True:
      todo = [r for r in group if not r.prefilled]
      if todo:  # prefill chunks under the largest token bucket
        works, budget, chosen = [], self.buckets.max_tokens, []
        for r in todo:
          n = min(len(r.prompt_ids) - r.cached, budget)
          if n <= 0 or len(works) == self.buckets.max_requests:
            break
          last = r.cached + n == len(r.prompt_ids)
          works.append(self._work(r, r.prompt_ids[r.cached:r.cached + n], 1 if last else 0))
          chosen.append((r, n))
          budget -= n
      else:
        chosen = [(r, 1) for r in group if r.finish is None]
        if not chosen:
          break
        works = [self._work(r, [r.out[-1]], 1) for r, _ in chosen]
      for r, n in chosen:
        pm.grow(r.rid, r.cached + n)
      step = pack(works, self.buckets, self.page_size, self.num_pages)
      packed = self.executor.run(step)
      now = time.perf_counter()
      for i, (wi, _) in enumerate(step.logits_rows):
        r, n = chosen[wi]
        if r.cached + n < len(r.prompt_ids):
          continue
        r.out.append(int(packed[i, 0]))
        r.logprobs.append(float(packed[i, 1]))
        r.times.append(now - t_start)
        r.finish, r.text = stop_check(self.tokenizer, r.sp, eos, r.out)
      for r, n in chosen:
        r.cached += n
    for r in group:
      pm.free(r.rid)

  def _work(self, r, tokens, num_logits):
    return SeqWork(token_ids=tokens, cached_len=r.cached, page_table=self._pm.page_table(r.rid),
                   num_logits=num_logits, temperature=r.sp.temperature, top_k=r.sp.top_k,
                   top_p=r.sp.top_p, seed=r.seed, sample_index=len(r.out))

  def _output(self, r) -> RequestOutput:
    ttft = r.times[0] if r.times else 0.0
    dec = (len(r.times) - 1) / (r.times[-1] - r.times[0]) if len(r.times) > 1 else 0.0
    return RequestOutput(request_id=r.rid, prompt=r.prompt, prompt_token_ids=r.prompt_ids,
                         token_ids=r.out, text=r.text, finish_reason=r.finish,
                         logprobs=r.logprobs, ttft_s=ttft, decode_tok_s=dec, token_times=r.times)
