"""StepPlan work -> one padded, flat StepInput (NumPy arrays at a bucket's shape).

A step packs prefill chunks and decode tokens of different requests into one flat token
array; per request slot it carries the query offset and length, the cached context
length and the page table; per logits row the sampling parameters. Shapes come from the
bucket table only (8.2.4); padding tokens write to page `num_pages`, which the device
drops. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from jaxinfer.buckets import Bucket, BucketTable
from jaxinfer.costmodel.accounting import pages_for
from jaxinfer.structured.grammar import mask_words as _row_words


@dataclasses.dataclass
class SeqWork:
  """One request's share of a step."""
  token_ids: Sequence[int]  # new tokens this step runs
  cached_len: int  # tokens of this request already in its pages
  page_table: Sequence[int]  # covers cached_len + len(token_ids) tokens (a tuple of
  # tables, one per layer group, for a grouped pool: kv.KVLayout)
  num_logits: int = 1  # trailing new tokens whose next-token logits are needed
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  sample_index: int = 0  # output index of the first sampled token (seeds the RNG stream)
  num_draft: int = 0  # trailing tokens that are drafts to verify (speculative decoding)
  # Logits processing (SamplingParams' fields of the same names); prompt / output: the
  # request's token ids so far (the penalties count them).
  sampling: Optional[object] = None  # SamplingParams, when it processes logits
  prompt_ids: Sequence[int] = ()
  output_ids: Sequence[int] = ()
  top_logprobs: bool = False  # return the 20 most likely tokens of each logits row
  lora_slot: int = 0  # the device slot of the request's LoRA adapter (0: none; 8.2.1)


@dataclasses.dataclass
class StepInput:
  arrays: Dict[str, np.ndarray]
  bucket: Bucket
  logits_rows: List[Tuple[int, int]]  # (work index, j-th logits row of that work)
  num_tokens: int  # real tokens (the rest of bucket.num_tokens is padding)
  # Structured output: returns the token_mask [bucket.num_logits, words] when called; a
  # real executor calls it after dispatching the forward, so the host fills the masks
  # while the device computes (arrays then hold no token_mask).
  mask_fn: Optional[Callable[[], np.ndarray]] = None

  @property
  def padding_tokens(self) -> int:
    return self.bucket.num_tokens - self.num_tokens


def select_bucket(works: Sequence[SeqWork], table: BucketTable, page_size: int) -> Bucket:
  return bucket_for(((len(w.token_ids), w.cached_len, w.num_logits) for w in works), table,
                    page_size)


def bucket_for(seqs: Iterable[Tuple[int, int, int]], table: BucketTable,
               page_size: int) -> Bucket:
  """The bucket of a step of (new tokens, cached tokens, logits rows) per request."""
  seqs = list(seqs)
  n_pre = sum(n > 1 for n, _, _ in seqs)
  return table.select(sum(n for n, _, _ in seqs), len(seqs) - n_pre,
                      max(-(-(h + n) // page_size) for n, h, _ in seqs),
                      max(n for n, _, _ in seqs), n_pre,
                      num_logits=sum(lg for _, _, lg in seqs))


def empty_step_arrays(b: Bucket, num_pages: int, mask_words: int = 0,
                      groups: int = 1) -> Dict[str, np.ndarray]:
  """The step layout, defined once: every input array of a bucket's shape, holding
  padding (a step of nothing: writes go to page `num_pages`, which the device drops).
  Per token [T]: token_ids, positions, write_page, write_offset; per request slot [R]:
  page_table [R, P], query_start, query_len, cached_len; per logits row [S]: logits_idx,
  temperature, top_k, top_p, seed, counter, draft_ids (-1: no draft to verify); with
  mask_words > 0 (a step of constrained requests) also token_mask [S, mask_words], all
  ones (every token allowed). groups > 1 (a pool whose layers have page tables per
  group, kv.KVLayout): page_table [G, R, P] and write_page [G, T], one per group."""
  T, R, P, S = b.num_tokens, b.num_requests, b.pages_per_request, b.num_logits
  z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
  g = (groups,) if groups > 1 else ()
  a = dict(token_ids=z(T), positions=z(T), write_page=np.full(g + (T,), num_pages, np.int32),
              write_offset=z(T), page_table=z(*g, R, P), query_start=z(R), query_len=z(R),
              cached_len=z(R), logits_idx=z(S), temperature=np.zeros(S, np.float32),
              top_k=z(S), top_p=np.ones(S, np.float32), seed=np.zeros(S, np.uint32),
              counter=z(S), draft_ids=np.full(S, -1, np.int32))
  if mask_words:
    a["token_mask"] = np.full((S, mask_words), -1, np.int32)
  return a


def pack(works: Sequence[SeqWork], table: BucketTable, page_size: int,
         num_pages: int, vocab_size: int = 0) -> StepInput:
  """vocab_size: needed when a work processes logits (penalties, logit_bias, min_p)."""
  if not works:
    raise ValueError("cannot pack an empty step")
  n_tok = sum(len(w.token_ids) for w in works)
  b = select_bucket(works, table, page_size)
  R = b.num_requests
  grouped = isinstance(works[0].page_table, tuple)  # a table per layer group
  a = empty_step_arrays(b, num_pages, groups=len(works[0].page_table) if grouped else 1)
  token_ids, positions, write_page, write_offset = (a[k] for k in (
      "token_ids", "positions", "write_page", "write_offset"))
  page_table, query_start, query_len, cached_len = (a[k] for k in (
      "page_table", "query_start", "query_len", "cached_len"))
  logits_idx, temperature, top_k, top_p, seed, counter, draft_ids = (a[k] for k in (
      "logits_idx", "temperature", "top_k", "top_p", "seed", "counter", "draft_ids"))
  rows: List[Tuple[int, int]] = []

  # One-token (decode) works take the first slots, multi-token works the last Rp slots.
  # Flat token order and logits rows follow the works' order.
  t = 0
  next_dec, next_pre = 0, R - b.prefill_slots
  slots = []
  all_prefill = b.prefill_slots == R  # every slot may take Q tokens (see BucketTable.select)
  for w in works:
    if len(w.token_ids) == 1 and not all_prefill:
      slots.append(next_dec)
      next_dec += 1
    else:
      slots.append(next_pre)
      next_pre += 1
  for r, w in zip(slots, works):
    n = len(w.token_ids)
    end = w.cached_len + n
    assert 0 < w.num_logits <= n or w.num_logits == 0
    pos = np.arange(w.cached_len, end, dtype=np.int32)
    for g, table in enumerate(w.page_table if grouped else (w.page_table,)):
      pt = np.asarray(table, np.int32)
      assert len(pt) * page_size >= end, "page table too short for the step's tokens"
      pt = pt[:-(-end // page_size)]  # pages past this step's tokens are not read
      # a released page (behind a sliding window, pages.HOLE) reads page 0, which the
      # window masks out
      (page_table[g] if grouped else page_table)[r, :len(pt)] = np.maximum(pt, 0)
      (write_page[g] if grouped else write_page)[t:t + n] = pt[pos // page_size]
    query_start[r], query_len[r], cached_len[r] = t, n, w.cached_len
    token_ids[t:t + n] = w.token_ids
    positions[t:t + n] = pos
    write_offset[t:t + n] = pos % page_size
    for j in range(w.num_logits):
      i = len(rows)
      logits_idx[i] = t + n - w.num_logits + j
      temperature[i], top_k[i], top_p[i] = w.temperature, w.top_k, w.top_p
      seed[i] = np.uint32(w.seed & 0xFFFFFFFF)
      counter[i] = w.sample_index + j
      # Row j predicts the token after position j of the logits window; when that next
      # token was drafted, the row verifies it (8.5.1).
      nxt = n - w.num_logits + j + 1
      if w.num_draft and nxt < n and nxt >= n - w.num_draft:
        draft_ids[i] = w.token_ids[nxt]
      rows.append((len(rows), j))
    t += n
  # Padding request slots point at an empty range past the real tokens.
  used = set(slots)
  for r in range(R):
    if r not in used:
      query_start[r] = t
  if any(w.sampling is not None for w in works):
    _pack_processing(a, works, b.num_logits, vocab_size)
  if any(w.lora_slot for w in works):  # per token; padding tokens take slot 0
    a["lora_slot"] = np.zeros(b.num_tokens, np.int32)
    for w, qs in zip(works, (int(query_start[r]) for r in slots)):
      a["lora_slot"][qs:qs + len(w.token_ids)] = w.lora_slot
  if any(w.top_logprobs for w in works):
    a["top_logprobs"] = np.zeros(b.num_logits, np.int32)  # a flag: its presence
  return StepInput(arrays=a, bucket=b, logits_rows=rows, num_tokens=n_tok)


def _pack_processing(a, works: Sequence[SeqWork], S: int, V: int) -> None:
  """The logits-processing group, per logits row: min_p [S], repetition [S], seen [S,
  words] (packed bits of the prompt and output tokens), logit_add [S, V] (logit_bias minus
  the presence / frequency penalties over the output). A row verifying draft j counts the
  drafts before it as output (they are, if it is reached)."""
  if V <= 0:
    raise ValueError("pack: vocab_size is needed for penalties, logit_bias or min_p")
  words = _row_words(V)
  a["min_p"] = np.zeros(S, np.float32)
  a["repetition"] = np.ones(S, np.float32)
  a["seen"] = np.zeros((S, words), np.int32)
  a["logit_add"] = np.zeros((S, V), np.float32)
  seen_bits = a["seen"].view(np.uint32)
  i = 0
  for w in works:  # sparse updates: O(tokens of the request), not O(vocabulary)
    sp = w.sampling
    if sp is None:
      i += w.num_logits
      continue
    n = len(w.token_ids)
    drafts = list(w.token_ids[n - w.num_draft:]) if w.num_draft else []
    bias = np.asarray(sp.logit_bias or (), np.float64).reshape(-1, 2)
    prompt = np.unique(np.asarray(w.prompt_ids, np.int64))
    for j in range(w.num_logits):
      toks, counts = np.unique(np.asarray(list(w.output_ids) + drafts[:j], np.int64),
                               return_counts=True)
      row = a["logit_add"][i]
      row[toks] -= sp.frequency_penalty * counts + sp.presence_penalty
      row[bias[:, 0].astype(np.int64)] += bias[:, 1]
      idx = np.union1d(prompt, toks)
      np.bitwise_or.at(seen_bits[i], idx >> 5, (1 << (idx & 31)).astype(np.uint32))
      a["min_p"][i], a["repetition"][i] = sp.min_p, sp.repetition_penalty
      i += 1


def pack_exact(works: Sequence[SeqWork], page_size: int, num_pages: int,
               pages_per_request: int = 0, vocab_size: int = 0) -> StepInput:
  """Pack works at exactly their own shape: one bucket of their tokens, request slots,
  longest query and pages per request (at least pages_per_request: a fixed width keeps
  one compiled shape while contexts grow). For benchmarks, tools and tests that run a
  fixed step outside an engine."""
  if not works:
    raise ValueError("cannot pack an empty step")
  lens = [len(w.token_ids) for w in works]
  n_pre = sum(n > 1 for n in lens)
  pages = max([pages_per_request] + [pages_for(w.cached_len + n, page_size)
                                     for w, n in zip(works, lens)])
  table = BucketTable(token_sizes=(sum(lens),), request_sizes=(len(works),),
                      page_table_sizes=(pages,), query_sizes=(max(lens),),
                      prefill_slot_sizes=(max(n_pre, 1),))
  return pack(works, table, page_size, num_pages, vocab_size)
