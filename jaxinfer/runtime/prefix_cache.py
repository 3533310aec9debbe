"""PrefixCache: a radix tree over token ids whose nodes own KV pages (8.3.3, 8.3.4).

Matching is at page granularity: each edge below a node is one full page of tokens,
keyed by those tokens, and the node owns (holds a page-manager reference to) the page.
Reuse needs the same model, adapter and KV format, so each such namespace has its own
root. Nodes in use by running requests are locked and never evicted.

Tiers: a node's KV is on the device (a page), in host memory (a host slot; fetched back
instead of recomputed) or gone. Eviction policies: "lru" and "value" — the expected
saving per MiB of 8.3.4, V_h = p_h (T_r - T_f) - T_m, with p_h estimated from observed
hits. Optional snapshots (8.3.3) model recurrent / hybrid state: a match restores from
the last snapshot at or before it and the rest is recomputed.

The cache changes only host bookkeeping; the device copies it needs (offload page ->
host slot, fetch host slot -> page) are returned for the executor to perform.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from jaxinfer.runtime.pages import PageManager

CacheKey = Tuple[str, str, str]  # (model, adapter, kv_format)


@dataclasses.dataclass(eq=False, slots=True)
class Node:
  tokens: Tuple[int, ...]
  parent: Optional["Node"]
  depth: int  # tokens from the root to the end of this node's page
  page: Optional[int] = None  # device page (owned reference) or None
  host_slot: Optional[int] = None
  children: Dict[Tuple[int, ...], "Node"] = dataclasses.field(default_factory=dict)
  locks: int = 0
  last_access: int = 0
  hits: int = 0
  created: int = 0

  @property
  def on_device(self) -> bool:
    return self.page is not None


@dataclasses.dataclass
class Match:
  nodes: List[Node]
  device_tokens: int  # matched tokens whose pages are on the device
  host_tokens: int  # matched tokens to fetch from host memory
  restore_tokens: int  # with snapshots: tokens restored (<= matched)
  recompute_tokens: int  # matched tokens that must still be recomputed (snapshots)

  @property
  def num_tokens(self) -> int:
    return self.nodes[-1].depth if self.nodes else 0

  @property
  def device_pages(self) -> List[int]:
    return [n.page for n in self.nodes if n.on_device]


@dataclasses.dataclass
class CacheStats:
  lookups: int = 0
  lookup_tokens: int = 0
  device_hit_tokens: int = 0
  host_hit_tokens: int = 0
  recomputed_tokens: int = 0
  inserted_pages: int = 0
  evicted_pages: int = 0
  offloaded_pages: int = 0
  fetched_pages: int = 0


class PrefixCache:

  def __init__(self, pages: PageManager, *, eviction: str = "lru", host_pages: int = 0,
               snapshot_interval: int = 0, admission: Optional[Callable[[int], bool]] = None,
               recompute_time: Optional[Callable[[int], float]] = None,
               fetch_time_per_page: float = 0.0, maintenance_time: Optional[float] = None,
               page_mib: float = 1.0):
    if eviction not in ("lru", "value"):
      raise ValueError(f"unknown eviction policy {eviction!r}; choose 'lru' or 'value'")
    self.pm = pages
    self.page_size = pages.page_size
    self.eviction = eviction
    self.host_capacity = host_pages
    self._host_free = list(range(host_pages))
    self.snapshot_interval = snapshot_interval
    self.admission = admission or (lambda num_pages: True)
    # 8.3.4 inputs: recompute time of a prefix of n tokens, fetch time per page, upkeep.
    self.recompute_time = recompute_time or (lambda n: float(n))
    self.fetch_time_per_page = fetch_time_per_page
    # T_m, the upkeep of a kept page: one transfer over the host link unless given (8.3.4).
    self.maintenance_time = fetch_time_per_page if maintenance_time is None else maintenance_time
    self.page_mib = page_mib
    self._roots: Dict[CacheKey, Node] = {}
    self._now = 0  # logical clock: one tick per lookup / insert
    self.stats = CacheStats()
    self.pending_offloads: List[Tuple[int, int]] = []  # (device page, host slot)
    # LRU eviction's candidates, kept across evictions: (rank, id, node) entries pushed
    # when a node may have become evictable (a page placed, the last lock released, the
    # last device child evicted). Ranks only grow, so an entry's rank is at most its node's;
    # a popped entry whose node was touched since goes back at its rank, one whose node is
    # no longer evictable is dropped. Rebuilt by a scan when stale entries pile up.
    self._lru: List[Tuple[Tuple[int, int], int, Node]] = []

  # --- lookup ---------------------------------------------------------------------------
  def _root(self, key: CacheKey) -> Node:
    if key not in self._roots:
      self._roots[key] = Node(tokens=(), parent=None, depth=0)
    return self._roots[key]

  def match(self, key: CacheKey, token_ids: Sequence[int], max_tokens: Optional[int] = None,
            record: bool = True) -> Match:
    """Longest cached page-aligned prefix of token_ids (at most max_tokens tokens)."""
    limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
    node, nodes, ps = self._root(key), [], self.page_size
    self._now += 1
    now = self._now
    for i in range(limit // ps):
      child = node.children.get(tuple(token_ids[i * ps:(i + 1) * ps]))
      if child is None or (child.page is None and child.host_slot is None):
        break
      nodes.append(child)
      node = child
    for n in nodes:
      n.last_access = now
    dev = 0
    for n in nodes:  # device hits are a prefix; after the first host node, fetch the rest
      if not n.on_device:
        break
      dev += ps
    matched = len(nodes) * ps
    restore = matched
    if self.snapshot_interval:
      restore = matched // self.snapshot_interval * self.snapshot_interval
    m = Match(nodes=nodes, device_tokens=min(dev, restore), host_tokens=max(restore - dev, 0),
              restore_tokens=restore, recompute_tokens=matched - restore)
    if record:
      self.record(m, len(token_ids))
    return m

  def record(self, m: "Match", lookup_tokens: int) -> None:
    """Count one lookup: the statistics and the nodes' hit counts (8.3.4's value-per-MiB
    eviction reads them as hit probabilities, so a lookup counts once, when used)."""
    for n in m.nodes:
      n.hits += 1
    self.stats.lookups += 1
    self.stats.lookup_tokens += lookup_tokens
    self.stats.device_hit_tokens += m.device_tokens
    self.stats.host_hit_tokens += m.host_tokens
    self.stats.recomputed_tokens += lookup_tokens - m.restore_tokens

  def lock(self, nodes: Sequence[Node]) -> None:
    for n in nodes:
      n.locks += 1

  def unlock(self, nodes: Sequence[Node]) -> None:
    for n in nodes:
      assert n.locks > 0
      n.locks -= 1
      if not n.locks:
        self._offer(n)

  def fetch(self, nodes: Sequence[Node]) -> Optional[List[Tuple[int, int]]]:
    """Bring host-tier nodes of a match back to device pages. Returns the (host slot,
    page) copies to perform, or None if the pool is short (nothing changes)."""
    todo = [n for n in nodes if not n.on_device]
    pages = self.pm.allocate_pages(len(todo))
    if pages is None:
      return None
    copies = []
    for n, p in zip(todo, pages):
      copies.append((n.host_slot, p))
      self._host_free.append(n.host_slot)
      n.host_slot, n.page = None, p
    for n in todo:
      self._offer(n)
    self.stats.fetched_pages += len(todo)
    return copies

  # --- insert ---------------------------------------------------------------------------
  def insert(self, key: CacheKey, token_ids: Sequence[int], pages: Sequence[int]) -> int:
    """Offer a finished request's full pages. Returns how many new pages the cache now
    owns (it takes a reference on each; the request still frees its own)."""
    ps = self.page_size
    n_full = min(len(token_ids) // ps, len(pages))
    if n_full == 0 or not self.admission(n_full):
      return 0
    self._now += 1
    node, now = self._root(key), self._now
    taken = []  # pages the cache takes a reference on
    i = 0
    while i < n_full:  # along the nodes already there
      child = node.children.get(tuple(token_ids[i * ps:(i + 1) * ps]))
      if child is None:
        break
      if child.page is None:
        if child.host_slot is not None:  # the request recomputed it: keep the device copy
          self._host_free.append(child.host_slot)
          child.host_slot = None
        child.page = pages[i]
        taken.append(pages[i])
      child.last_access = now
      node = child
      i += 1
    depth = node.depth
    rest = iter(token_ids[i * ps:n_full * ps])
    for t, page in zip(zip(*[rest] * ps), pages[i:n_full]):  # past them: new nodes, one
      depth += ps  # per page (the zip cuts the tokens into pages' tuples)
      child = Node(t, node, depth, page, None, {}, 0, now, 0, now)
      node.children[t] = child
      taken.append(page)
      node = child
    self.pm.incref(taken)
    added = len(taken)
    self._offer(node)  # the path's last node (the ones above it have device children)
    self.stats.inserted_pages += added
    return added

  # --- eviction -------------------------------------------------------------------------
  def owned_refs(self) -> Dict[int, int]:
    """page -> references the cache holds (for PageManager.check_invariants)."""
    return {n.page: 1 for n in self._nodes() if n.page is not None}

  def _nodes(self):
    stack = list(self._roots.values())
    while stack:
      n = stack.pop()
      if n.parent is not None:
        yield n
      stack.extend(n.children.values())

  @property
  def num_device_pages(self) -> int:
    return sum(1 for n in self._nodes() if n.on_device)

  @property
  def num_host_pages(self) -> int:
    return self.host_capacity - len(self._host_free)

  @staticmethod
  def _device_evictable(n: Node) -> bool:
    if n.page is None or n.locks:
      return False
    for c in n.children.values():
      if c.page is not None:
        return False
    return True

  def value_per_mib(self, n: Node) -> float:
    """8.3.4: V_h = p_h (T_r - T_f) - T_m, per MiB kept. T_r: recomputing this page at its
    depth (prefill grows super-linearly, so deep pages are worth more)."""
    age = max(self._now - n.created, 1)
    p_h = min(n.hits / age, 1.0)  # observed hit rate since insertion
    t_r = self.recompute_time(n.depth) - self.recompute_time(n.depth - self.page_size)
    t_f = self.fetch_time_per_page if self.host_capacity else 0.0
    return (p_h * (t_r - t_f) - self.maintenance_time) / self.page_mib

  def _offer(self, n: Node) -> None:
    if self.eviction == "lru" and self._device_evictable(n):
      heapq.heappush(self._lru, (self._rank(n), id(n), n))

  def _rank(self, n: Node):
    if self.eviction == "lru":
      return (n.last_access, -n.depth)
    return (self.value_per_mib(n), n.last_access)

  def evict(self, num_pages: int) -> int:
    """Release up to num_pages device pages from unlocked leaves (offloading them to the
    host tier when it has room). Returns pages released to the page manager. Candidates
    come from a heap of evictable leaves (LRU: kept across calls; value: built by one
    scan, since every node's value changes with the clock); a parent joins it once its
    last device child is gone."""
    if num_pages <= 0:
      return 0
    lru = self.eviction == "lru"
    if lru and len(self._lru) <= 2 * self.pm.num_pages + 1024:
      heap = self._lru
    else:
      heap = [(self._rank(n), id(n), n) for n in self._nodes() if self._device_evictable(n)]
      heapq.heapify(heap)
      if lru:
        self._lru = heap
    evictable, rank_of = self._device_evictable, self._rank
    host = self.host_capacity
    released = []  # the pages whose reference the cache drops (at the end, in one call)
    nxt = None  # a parent that became evictable and ranks before the heap's top
    while len(released) < num_pages and (heap or nxt is not None):
      if nxt is not None:  # what pushing it and popping the heap would give
        rank, _, victim = nxt
        nxt = None
      else:
        rank, _, victim = heapq.heappop(heap)
        if not evictable(victim):
          continue
        if lru and rank != rank_of(victim):  # touched since: back at its rank
          heapq.heappush(heap, (rank_of(victim), id(victim), victim))
          continue
      parent = victim.parent
      page = victim.page
      if host and not self._host_free:
        self._drop_host_leaf()
      if host and self._host_free:
        slot = self._host_free.pop()
        self.pending_offloads.append((page, slot))
        victim.host_slot = slot
        self.stats.offloaded_pages += 1
      victim.page = None
      released.append(page)
      if victim.host_slot is None:
        self._remove(victim)
      if parent.parent is not None and evictable(parent):
        item = (rank_of(parent), id(parent), parent)
        if heap and item[:2] > heap[0][:2]:
          heapq.heappush(heap, item)
        else:  # a chain of a request's own pages goes leaf to root without the heap
          nxt = item
    if nxt is not None:
      heapq.heappush(heap, nxt)
    self.pm.decref(released)
    self.stats.evicted_pages += len(released)
    return len(released)

  def _drop_host_leaf(self) -> None:
    leaves = [n for n in self._nodes() if n.host_slot is not None and n.locks == 0 and
              not n.children]
    if leaves:
      victim = min(leaves, key=lambda n: n.last_access)
      self._host_free.append(victim.host_slot)
      victim.host_slot = None
      self._remove(victim)

  def _remove(self, n: Node) -> None:
    """Detach a node that holds nothing; descendants without device pages go with it."""
    if n.children:
      return  # still a path to other cached pages
    while n.parent is not None and not n.children and n.page is None and n.host_slot is None \
        and n.locks == 0:
      parent = n.parent
      del parent.children[n.tokens]
      n = parent
