"""KV reservation accounting (8.1, 8.3.1, 8.3.2): whole-segment, paged, paged + sharing.

Pure arithmetic over sequence lengths, so the chapter's small examples can be checked
by hand and the capacity of a KV budget computed for any model and KV format.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple


def pages_for(tokens: int, page_size: int) -> int:
  return -(-tokens // page_size)


@dataclasses.dataclass
class PolicyAccount:
  policy: str
  reserved_slots: int  # token slots set aside
  allocated_slots: int  # token slots physically taken (pages x page size)
  unused_slots: int  # allocated - distinct tokens stored
  page_table_entries: int  # references
  physical_pages: int

  @property
  def stored_tokens(self) -> int:
    """Distinct tokens whose K/V the policy actually stores (a shared prefix once)."""
    return self.allocated_slots - self.unused_slots


def account(lengths: Sequence[int], max_len: int, page_size: int,
            shares: Sequence[Tuple[int, int, int]] = ()) -> List[PolicyAccount]:
  """The three policies of 8.3.1 side by side.

  shares: (i, j, n): sequences i and j hold the same first n tokens; with sharing, the
  full pages of that prefix are stored once (a partial page is private to each).
  """
  if any(L > max_len for L in lengths):
    raise ValueError(f"a sequence length {max(lengths)} exceeds max_len {max_len}")
  n = len(lengths)
  tokens = sum(lengths)
  seg_pages = n * pages_for(max_len, page_size)
  whole = PolicyAccount("whole_segment", n * max_len, n * max_len, n * max_len - tokens, n,
                        seg_pages)
  refs = sum(pages_for(L, page_size) for L in lengths)
  paged = PolicyAccount("paged", refs * page_size, refs * page_size, refs * page_size - tokens,
                        refs, refs)
  saved_pages, saved_tokens = 0, 0
  for i, j, s in shares:
    if s > min(lengths[i], lengths[j]):
      raise ValueError(f"shared prefix {s} longer than sequence {i} or {j}")
    full = s // page_size
    saved_pages += full
    saved_tokens += full * page_size
  phys = refs - saved_pages
  shared = PolicyAccount("paged_shared", phys * page_size, phys * page_size,
                         phys * page_size - (tokens - saved_tokens), refs, phys)
  return [whole, paged, shared]


def account_branches(branches: int, prefix_pages: int, private_pages: int,
                     page_size: int) -> List[PolicyAccount]:
  """8.3.2's branching example: `branches` sequences share `prefix_pages` full pages and
  each owns `private_pages` more (slots assume full pages)."""
  per = prefix_pages + private_pages
  refs = branches * per
  paged = PolicyAccount("paged", refs * page_size, refs * page_size, 0, refs, refs)
  phys = prefix_pages + branches * private_pages
  shared = PolicyAccount("paged_shared", phys * page_size, phys * page_size, 0, refs, phys)
  return [paged, shared]


def pages_held(tokens: int, page_size: int, window: int = 0) -> int:
  """Pages a sequence of `tokens` tokens holds between steps when the pages wholly behind
  its sliding window are released: the next query (position `tokens`) reads keys from
  position tokens - window + 1 on, so ceil(tokens / P) - floor((tokens - W + 1) / P)
  pages, at most ceil(W / P) + 1 (window 0: every page)."""
  n = pages_for(tokens, page_size)
  if not window or not n:
    return n
  return n - min(max(tokens - window + 1, 0) // page_size, n - 1)


def step_pages_bound(window: int, step_tokens: int, page_size: int) -> int:
  """The most pages a windowed sequence holds during a step that writes `step_tokens`
  new tokens (its window behind them, each end on a page of its own): what admission
  reserves for it."""
  return (window + step_tokens - 1) // page_size + 2


@dataclasses.dataclass
class Capacity:
  bytes_per_token: float
  page_size: int
  kv_after_prefill_bytes: int  # one request, L tokens rounded up to pages
  kv_end_bytes: int  # one request at the end: L + G - 1 tokens rounded up to pages
  shared_prefix_bytes: int  # stored once when shared
  private_end_bytes: int  # per request beyond the shared prefix
  requests_fit: int
  # Sliding windows (layer_windows given): each layer keeps the pages its window reads,
  # the layers of one window sharing page tables (a group; full-attention layers one).
  windowed_end_bytes: int = 0  # one request at the end, between steps
  windowed_step_bytes: int = 0  # its most during a step of step_tokens (what admission
  #                               reserves)
  requests_fit_windowed: int = 0


def capacity(bytes_per_token: float, budget_bytes: float, input_tokens: int, output_tokens: int,
             page_size: int = 16, shared_prefix: int = 0, layer_windows: Sequence[int] = (),
             step_tokens: int = 1) -> Capacity:
  """8.1: capacity = floor(budget / per-request reservation of L + G - 1 tokens); with a
  shared prefix (8.3.2): one copy of the prefix's full pages + per-request private parts.
  layer_windows (each layer's sliding window, 0: full): also the windowed footprint,
  each layer keeping pages_held of its window, and the requests that fit when each
  reserves its most during a step of `step_tokens` new tokens (step_pages_bound)."""
  end_tokens = input_tokens + output_tokens - 1
  slot = bytes_per_token * page_size
  after_prefill = pages_for(input_tokens, page_size) * slot
  end = pages_for(end_tokens, page_size) * slot
  shared_pages = shared_prefix // page_size
  prefix = shared_pages * slot
  private = pages_for(end_tokens - shared_pages * page_size, page_size) * slot
  fit = int((budget_bytes - prefix) // private) if budget_bytes >= prefix else 0
  if not shared_prefix:
    fit = int(budget_bytes // end)
  out = Capacity(bytes_per_token, page_size, int(after_prefill), int(end), int(prefix),
                 int(private), fit)
  if any(layer_windows):
    per_layer = slot / len(layer_windows)
    out.windowed_end_bytes = int(sum(pages_held(end_tokens, page_size, w)
                                     for w in layer_windows) * per_layer)
    most = pages_for(end_tokens, page_size)
    out.windowed_step_bytes = int(sum(
        min(most, step_pages_bound(w, step_tokens, page_size)) if w else most
        for w in layer_windows) * per_layer)
    out.requests_fit_windowed = int(budget_bytes // out.windowed_step_bytes)
  return out
