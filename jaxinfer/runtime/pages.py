"""PageManager: the paged KV pool's host-side bookkeeping (8.1, 8.3.1, 8.3.2).

Pages are numbered 0..num_pages-1. Every page-table entry is a reference; the prefix
cache holds references too (`incref` / `decref`). A page returns to the free list only
when its last reference is dropped **and** every launched step that read it has
completed (deferred release keyed by step number). Writing into a shared, partially
filled tail page first copies it (copy-on-write); full shared pages stay shared.

Failures (not enough pages) are returned as values for the scheduler to act on
(wait, preempt); programming errors raise.

Which free page a sequence gets: the one after its last page when that is free, else the
lowest-numbered free page. A sequence's pages then lie in runs, which the CPU decode call
reads as streams: over pages in order it ran 1.8x faster than over shuffled ones (batch
16, context 4096). A first-in-first-out free list (the policy before) left a long-running
pool's tables shuffled: in a simulated run of 300 requests (`tools/bench_pages.py
--churn_requests=300`: prompts of 200-3000 tokens, 16 running) the share of a running
table's neighbouring pages that were consecutive fell from 0.95 to 0.10 over the run's
last tenth (median 0.33); with this policy, the same run (the same scheduling decisions,
step for step) keeps 0.46 there (median 0.48). Decode growth still interleaves: the page
after a sequence's last one is often another's by then.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Dict, Iterable, List, Optional, Tuple

from jaxinfer.costmodel.accounting import pages_for

Copy = Tuple[int, int]  # (src page, dst page) for the device to copy before the step


@dataclasses.dataclass
class SeqPages:
  pages: List[int]  # HOLE where a page behind a sliding window was released
  num_tokens: int = 0  # tokens whose K/V are (or are being) written
  reserved: int = 0  # pages promised to this sequence, not yet taken from the free list
  released: int = 0  # leading pages released (HOLE in `pages`)
  bound: int = 0  # most pages held + reserved at once (a sliding window's bound; 0: none)
  last_read: int = -1  # the last launched step that read this sequence's pages


# A page-table entry whose page was released: every token in it lies behind the model's
# sliding window, so no query reads it again (the device reads page 0 there, masked out).
HOLE = -1


class PageManager:
  windows: Tuple[int, ...] = ()  # per page-table group (GroupedPages); (): one table

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1:
      raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.num_pages = num_pages
    self.page_size = page_size
    self._free = set(range(num_pages))
    self._free_heap = list(range(num_pages))  # candidates for the lowest free page: may
    # hold pages since taken (skipped when popped), never misses a free one
    self._refs = [0] * num_pages
    self._last_read = [-1] * num_pages  # step number of the last launched step reading it
    self._pending: Dict[int, int] = {}  # page -> step that must complete before reuse
    self._seqs: Dict[object, SeqPages] = {}
    self._reserved_total = 0
    self._next_step = 0
    self._completed_step = -1
    self.num_cow_copies = 0

  # --- sizes ------------------------------------------------------------------------
  def pages_for(self, num_tokens: int) -> int:
    """ceil(num_tokens / page_size) (8.3.1)."""
    return pages_for(num_tokens, self.page_size)

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_pending(self) -> int:
    return len(self._pending)

  @property
  def num_available(self) -> int:
    """Free pages not promised to any sequence's reservation."""
    return len(self._free) - self._reserved_total

  @property
  def num_used(self) -> int:
    return self.num_pages - len(self._free) - len(self._pending)

  def refcount(self, page: int) -> int:
    return self._refs[page]

  def has(self, seq_id) -> bool:
    return seq_id in self._seqs

  def page_table(self, seq_id) -> List[int]:
    return self._seqs[seq_id].pages

  def num_tokens(self, seq_id) -> int:
    return self._seqs[seq_id].num_tokens

  def sequences(self):
    return self._seqs.keys()

  # --- sequences --------------------------------------------------------------------
  def can_add(self, reserve_tokens: int, num_shared_pages: int = 0) -> bool:
    return self.pages_for(reserve_tokens) - num_shared_pages <= self.num_available

  def reserve_pages(self, reserve_tokens: int, bound_pages: int = 0) -> int:
    """Pages a sequence reserving `reserve_tokens` holds at most: all of them, or
    `bound_pages` when a sliding window releases pages behind it as it advances."""
    n = self.pages_for(reserve_tokens)
    return min(n, bound_pages) if bound_pages else n

  def admission_pages(self, reserve_tokens: int, bound_pages=0, num_shared: int = 0) -> int:
    """Free pages add_sequence takes (reserves) for a sequence starting on num_shared
    shared pages."""
    return max(PageManager.reserve_pages(self, reserve_tokens, bound_pages) - num_shared, 0)

  def shortfall(self, seq_id, new_num_tokens: int) -> int:
    """Pages grow(seq_id, new_num_tokens) takes from the free list beyond the sequence's
    reservation (0: it cannot fail)."""
    s = self._seqs[seq_id]
    need = max(self.pages_for(new_num_tokens) - len(s.pages), 0)
    need += int(new_num_tokens > s.num_tokens and PageManager.shares_tail(self, seq_id))
    return max(need - s.reserved, 0)

  def slide(self, seq_id, next_position: int, window: int) -> None:
    """Release the pages behind a sliding window of `window` tokens (0: none) for a
    sequence whose next query is at next_position."""
    if window:
      self.release_before(seq_id, next_position - window + 1)

  def cacheable_pages(self, seq_id) -> Optional[List]:
    """The sequence's pages as the prefix cache holds them, or None when one was released
    behind a window (no whole prefix to offer)."""
    s = self._seqs[seq_id]
    return None if s.released else s.pages

  def first_table(self, seq_id) -> List[int]:
    """The page table of the layers that keep the whole context."""
    return self.page_table(seq_id)

  def add_sequence(self, seq_id, shared_pages: Iterable[int] = (), num_shared_tokens: int = 0,
                   reserve_tokens: int = 0, bound_pages: int = 0) -> bool:
    """Start a sequence whose first pages are `shared_pages` (a prefix-cache hit holding
    `num_shared_tokens` tokens) and reserve pages for `reserve_tokens` tokens in total
    (8.1: admission reserves the KV needed at the end of generation). bound_pages (a
    sliding window): the sequence never holds more pages at once, so it reserves at most
    that many, and each page it releases behind the window that returns to the free list
    is promised to it again (release_before). False if they don't fit; nothing changes
    then."""
    if seq_id in self._seqs:
      raise KeyError(f"sequence {seq_id!r} already exists")
    shared = list(shared_pages)
    if num_shared_tokens > len(shared) * self.page_size:
      raise ValueError("num_shared_tokens exceeds the shared pages' capacity")
    need = max(PageManager.reserve_pages(self, reserve_tokens, bound_pages) - len(shared), 0)
    if need > self.num_available:
      return False
    for p in shared:
      self._incref(p)
    self._seqs[seq_id] = SeqPages(pages=shared, num_tokens=num_shared_tokens, reserved=need,
                                  bound=bound_pages)
    self._reserved_total += need
    return True

  def fork(self, src_id, dst_id) -> None:
    """dst shares every page of src (a branch, 8.3.2); tails are copied on first write."""
    if dst_id in self._seqs:
      raise KeyError(f"sequence {dst_id!r} already exists")
    src = self._seqs[src_id]
    for p in src.pages:
      if p != HOLE:
        self._incref(p)
    self._seqs[dst_id] = SeqPages(pages=list(src.pages), num_tokens=src.num_tokens,
                                  released=src.released, last_read=src.last_read)

  def release_before(self, seq_id, first_needed: int) -> int:
    """Release the pages whose every token lies before position `first_needed` (behind a
    sliding window: no later query reads them); their entries become HOLE. Returns how
    many were released."""
    s = self._seqs[seq_id]
    upto = min(max(first_needed, 0) // self.page_size, len(s.pages) - 1)
    n = freed = 0
    for j in range(s.released, upto):
      p = s.pages[j]
      self._drop(s, p)
      freed += p in self._free  # not still read by a step in flight, nor cached
      s.pages[j] = HOLE
      n += 1
    s.released = max(s.released, upto)
    if s.bound and freed:  # keep the window's promise: what it gave back is its again
      live = sum(p != HOLE for p in s.pages)
      add = min(freed, max(s.bound - live - s.reserved, 0))
      s.reserved += add
      self._reserved_total += add
    return n

  def grow(self, seq_id, new_num_tokens: int) -> Optional[List[Copy]]:
    """Make room to write tokens [num_tokens, new_num_tokens). Takes reserved pages first,
    then free ones; copies a shared partially filled tail page first (copy-on-write).
    Returns the page copies the device must do before writing, or None (nothing changed)
    when the pool is short."""
    s = self._seqs[seq_id]
    n0, ps, pages = s.num_tokens, self.page_size, s.pages
    if new_num_tokens < n0:
      raise ValueError(f"grow() cannot shrink ({n0} -> {new_num_tokens}); use rollback")
    held = len(pages)
    cow = new_num_tokens > n0 and self._tail_shared(s)
    if new_num_tokens <= held * ps and not cow:  # it fits the pages held (most decodes)
      s.num_tokens = new_num_tokens
      return []
    new_pages = max(pages_for(new_num_tokens, ps) - held, 0)
    need = new_pages + int(cow)
    from_reserve = min(need, s.reserved)
    if need - from_reserve > self.num_available:  # PageManager.shortfall
      return None
    s.reserved -= from_reserve
    self._reserved_total -= from_reserve
    copies: List[Copy] = []
    if cow:
      tail = n0 // ps
      old = s.pages[tail]
      new = self._take(s.pages[tail - 1] if tail > 0 else None)
      s.pages[tail] = new
      self._drop(s, old)
      copies.append((old, new))
      self.num_cow_copies += 1
    for _ in range(new_pages):
      s.pages.append(self._take(s.pages[-1] if s.pages else None))
    s.num_tokens = new_num_tokens
    return copies

  def shares_tail(self, seq_id) -> bool:
    """Whether the sequence's partially filled last page is shared (writing past its end
    copies the page first: copy-on-write)."""
    return self._tail_shared(self._seqs[seq_id])

  def _tail_shared(self, s: SeqPages) -> bool:
    tail = s.num_tokens // self.page_size
    return (s.num_tokens % self.page_size != 0 and tail < len(s.pages)
            and self._refs[s.pages[tail]] > 1)

  def rollback(self, seq_id, new_num_tokens: int) -> None:
    """Cut the sequence back to new_num_tokens; pages past the new end are released
    (speculative decoding's discarded positions, 8.5.1)."""
    s = self._seqs[seq_id]
    if new_num_tokens > s.num_tokens or new_num_tokens < 0:
      raise ValueError(f"rollback to {new_num_tokens} outside [0, {s.num_tokens}]")
    keep = self.pages_for(new_num_tokens)
    for p in s.pages[keep:]:
      if p != HOLE:
        self._drop(s, p)
    del s.pages[keep:]
    s.released = min(s.released, len(s.pages))
    s.num_tokens = new_num_tokens

  def free(self, seq_id) -> None:
    """Drop the sequence's references and its unused reservation. Pages that a launched
    step still reads are released when that step completes."""
    s = self._seqs.pop(seq_id)
    for p in s.pages:
      if p != HOLE:
        self._drop(s, p)
    self._reserved_total -= s.reserved

  def unreserve(self, seq_id) -> None:
    s = self._seqs[seq_id]
    self._reserved_total -= s.reserved
    s.reserved = 0

  # --- references held by others (the prefix cache) ------------------------------------
  def incref(self, pages: Iterable[int]) -> None:
    for p in pages:
      self._incref(p)

  def decref(self, pages: Iterable[int]) -> None:
    for p in pages:
      self._decref(p)

  def allocate_pages(self, n: int) -> Optional[List[int]]:
    """n fresh pages owned by the caller (refcount 1), e.g. the host tier's fetch target."""
    if n > self.num_available:
      return None
    out = []
    for _ in range(n):
      out.append(self._take(out[-1] if out else None))
    return out

  # --- steps: deferred release ---------------------------------------------------------
  def begin_step(self, seq_ids: Iterable = ()) -> int:
    """Number the next launched step and record that it reads the pages of seq_ids."""
    step = self._next_step
    self._next_step += 1
    for sid in seq_ids:  # per sequence: its pages take the step when it drops them
      self._seqs[sid].last_read = step
    return step

  def note_reads(self, step: int, pages: Iterable[int]) -> None:
    for p in pages:
      if p != HOLE:
        self._last_read[p] = max(self._last_read[p], step)

  def complete_step(self, step: int) -> None:
    """Every step numbered <= step has finished on the device."""
    self._completed_step = max(self._completed_step, step)
    ready = [p for p, s in self._pending.items() if s <= self._completed_step]
    for p in sorted(ready):
      del self._pending[p]
      self._release(p)

  @property
  def completed_step(self) -> int:
    return self._completed_step

  # --- internals ----------------------------------------------------------------------
  def _take(self, after: Optional[int] = None) -> int:
    """A free page: `after + 1` when that one is free, else the lowest free one."""
    if after is not None and after + 1 in self._free:
      p = after + 1
    else:
      p = heapq.heappop(self._free_heap)
      while p not in self._free:
        p = heapq.heappop(self._free_heap)
    self._free.remove(p)
    assert self._refs[p] == 0, (p, self._refs[p])
    self._refs[p] = 1
    return p

  def _incref(self, p: int) -> None:
    assert self._refs[p] > 0, f"incref of unowned page {p}"
    self._refs[p] += 1

  def _drop(self, s: SeqPages, p: int) -> None:
    """Sequence s lets go of page p: p was read by every step s was in (begin_step)."""
    if s.last_read > self._last_read[p]:
      self._last_read[p] = s.last_read
    self._decref(p)

  def _decref(self, p: int) -> None:
    assert self._refs[p] > 0, f"double free of page {p}"
    self._refs[p] -= 1
    if self._refs[p] == 0:
      if self._last_read[p] > self._completed_step:
        self._pending[p] = self._last_read[p]
      else:
        self._release(p)

  def _release(self, p: int) -> None:
    self._free.add(p)
    heapq.heappush(self._free_heap, p)
    if len(self._free_heap) > 2 * self.num_pages + 64:  # drop the stale candidates
      self._free_heap = sorted(self._free)

  def check_invariants(self, extra_refs: Optional[Dict[int, int]] = None) -> None:
    """refcount == page-table references + others' (cache) references; every page is
    exactly one of free / pending / referenced; no free page is read by an unfinished step."""
    counts = collections.Counter()
    for s in self._seqs.values():
      counts.update(p for p in s.pages if p != HOLE)
      assert all(p == HOLE for p in s.pages[:s.released]), "a released entry holds a page"
      assert len(s.pages) >= self.pages_for(s.num_tokens), "table shorter than its tokens"
      assert s.reserved >= 0
    for p, n in (extra_refs or {}).items():
      counts[p] += n
    free = self._free
    assert free <= set(self._free_heap), "a free page is missing from the heap"
    for p in range(self.num_pages):
      assert self._refs[p] == counts.get(p, 0), (p, self._refs[p], counts.get(p, 0))
      states = (p in free) + (p in self._pending) + (self._refs[p] > 0)
      assert states == 1, (f"page {p} free={p in free} pending={p in self._pending} "
                           f"refs={self._refs[p]}")
      if p in free:
        assert self._last_read[p] <= self._completed_step, f"free page {p} still read in flight"
    assert self._reserved_total == sum(s.reserved for s in self._seqs.values())
    assert self._reserved_total <= len(self._free) + 0, "reservations exceed free pages"


class GroupedPages(PageManager):
  """Page tables per layer group (kv.KVLayout: a model mixing sliding-window and
  full-attention layers), every group's pages from the one pool: a sequence is one
  sub-sequence per group, (seq_id, g), each kept by PageManager's own rules. A windowed
  group holds at most its window's pages (bound per group), the full group the whole
  context. Operations on a sequence act on all its groups, and one that takes pages
  checks first that all of them fit (nothing changes otherwise). Page tables, shared
  pages and prefix-cache pages are per group: a tuple with one entry per group."""

  def __init__(self, num_pages: int, page_size: int, windows):
    super().__init__(num_pages, page_size)
    if len(windows) < 2 or any(w < 0 for w in windows):
      raise ValueError(f"GroupedPages needs >= 2 groups' windows >= 0, got {windows}")
    self.windows = tuple(windows)

  def _sub(self, seq_id):
    return [(seq_id, g) for g in range(len(self.windows))]

  def _each(self, bound):
    return bound if isinstance(bound, tuple) else (bound,) * len(self.windows)

  def has(self, seq_id) -> bool:
    return (seq_id, 0) in self._seqs

  def page_table(self, seq_id):
    return tuple(self._seqs[k].pages for k in self._sub(seq_id))

  def first_table(self, seq_id) -> List[int]:
    return self._seqs[(seq_id, 0)].pages  # kv_layout puts the full group first

  def num_tokens(self, seq_id) -> int:
    return self._seqs[(seq_id, 0)].num_tokens

  def sequences(self):
    return [k[0] for k in self._seqs if k[1] == 0]

  def reserve_pages(self, reserve_tokens: int, bound_pages=0) -> int:
    return sum(PageManager.reserve_pages(self, reserve_tokens, b)
               for b in self._each(bound_pages))

  def admission_pages(self, reserve_tokens: int, bound_pages=0, num_shared: int = 0) -> int:
    return sum(PageManager.admission_pages(self, reserve_tokens, b, num_shared)
               for b in self._each(bound_pages))

  def add_sequence(self, seq_id, shared_pages: Iterable = (), num_shared_tokens: int = 0,
                   reserve_tokens: int = 0, bound_pages=0) -> bool:
    shared = list(shared_pages)  # a tuple of pages per group for each shared page
    if self.has(seq_id):
      raise KeyError(f"sequence {seq_id!r} already exists")
    if self.admission_pages(reserve_tokens, bound_pages, len(shared)) > self.num_available:
      return False
    for g, (k, b) in enumerate(zip(self._sub(seq_id), self._each(bound_pages))):
      ok = super().add_sequence(k, [p[g] for p in shared], num_shared_tokens,
                                reserve_tokens, b)
      assert ok
    return True

  def fork(self, src_id, dst_id) -> None:
    for a, b in zip(self._sub(src_id), self._sub(dst_id)):
      super().fork(a, b)

  def slide(self, seq_id, next_position: int, window: int = 0) -> None:
    for k, w in zip(self._sub(seq_id), self.windows):
      if w:
        self.release_before(k, next_position - w + 1)

  def shortfall(self, seq_id, new_num_tokens: int) -> int:
    return sum(super(GroupedPages, self).shortfall(k, new_num_tokens)
               for k in self._sub(seq_id))

  def grow(self, seq_id, new_num_tokens: int) -> Optional[List[Copy]]:
    if self.shortfall(seq_id, new_num_tokens) > self.num_available:
      return None
    copies = []
    for k in self._sub(seq_id):
      c = super().grow(k, new_num_tokens)
      assert c is not None
      copies += c
    return copies

  def shares_tail(self, seq_id) -> bool:
    return any(super(GroupedPages, self).shares_tail(k) for k in self._sub(seq_id))

  def rollback(self, seq_id, new_num_tokens: int) -> None:
    for k in self._sub(seq_id):
      super().rollback(k, new_num_tokens)

  def free(self, seq_id) -> None:
    for k in self._sub(seq_id):
      super().free(k)

  def unreserve(self, seq_id) -> None:
    for k in self._sub(seq_id):
      super().unreserve(k)

  def cacheable_pages(self, seq_id) -> Optional[List]:
    if any(self._seqs[k].released for k in self._sub(seq_id)):
      return None
    return list(zip(*self.page_table(seq_id)))

  def incref(self, pages: Iterable) -> None:
    super().incref(p for t in pages for p in t)

  def decref(self, pages: Iterable) -> None:
    super().decref(p for t in pages for p in t)

  def allocate_pages(self, n: int):
    raise NotImplementedError("a host tier of the prefix cache is not kept for grouped "
                              "page tables")

  def begin_step(self, seq_ids: Iterable = ()) -> int:
    return super().begin_step([k for sid in seq_ids for k in self._sub(sid)])

  def check_invariants(self, extra_refs: Optional[Dict] = None) -> None:
    flat = collections.Counter()
    for t, n in (extra_refs or {}).items():
      for p in (t if isinstance(t, tuple) else (t,)):
        flat[p] += n
    super().check_invariants(flat)


def page_manager(num_pages: int, page_size: int, windows=()) -> PageManager:
  """The page manager of a pool laid out with these groups' windows (kv.KVLayout.windows;
  one group: the plain manager, whose sliding window the scheduler applies)."""
  if len(windows) > 1:
    return GroupedPages(num_pages, page_size, windows)
  return PageManager(num_pages, page_size)
