"""Data parallelism: several engine replicas (each its own devices, pool and scheduler)
behind one front with the Engine's request API (`LLM(mesh="dp:M")`, the server).

Routing (where a new request goes):
  "prefix"       the replica that has already seen the longest page-aligned prefix of
                 the prompt (SGLang router's cache-aware policy: each replica's routed
                 prompts are remembered as page-prefix hashes, so requests routed in the
                 same burst land together before any of them is cached), unless the
                 replicas' loads differ by more than `balance_threshold` requests; then
                 the least loaded. No match: the least loaded.
  "round_robin"  in turn.
One thread owns the router and through it every replica; a step launches every replica
that has work (JAX dispatches asynchronously, so replicas on different devices run at
the same time) and then finishes them in order.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
from typing import Dict, List, Optional, Sequence

import numpy as np

from jaxinfer.config import SamplingParams
from jaxinfer.metrics import summarize

ROUTING = ("prefix", "round_robin")


class _PrefixIndex:
  """Hashes of the page-aligned prefixes of prompts routed to one replica (bounded, LRU)."""

  def __init__(self, page_size: int, capacity: int = 1 << 20):
    self.page_size = page_size
    self.capacity = capacity
    self.seen: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()

  def _hashes(self, ids: Sequence[int]):
    """A chained hash per whole page of `ids` (validated token ids)."""
    h = hashlib.blake2b(digest_size=16)
    raw = np.asarray(ids, np.int32).tobytes()
    step = 4 * self.page_size
    for i in range(len(ids) // self.page_size):
      h.update(raw[i * step:(i + 1) * step])
      yield h.copy().digest()

  def match(self, ids: Sequence[int]) -> int:
    """Tokens of the longest routed page-aligned prefix of `ids`."""
    n = 0
    for d in self._hashes(ids):
      if d not in self.seen:
        break
      self.seen.move_to_end(d)
      n += self.page_size
    return n

  def insert(self, ids: Sequence[int]) -> None:
    for d in self._hashes(ids):
      self.seen[d] = None
      self.seen.move_to_end(d)
    while len(self.seen) > self.capacity:
      self.seen.popitem(last=False)


class Router:
  """The Engine's request API over `replicas` (Engines); request ids are global."""

  def __init__(self, replicas: Sequence, routing: str = "prefix", balance_threshold: int = 8):
    if not replicas:
      raise ValueError("a router needs at least one replica")
    if routing not in ROUTING:
      raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
    if isinstance(balance_threshold, bool) or not isinstance(balance_threshold, int) or \
        balance_threshold < 0:
      raise ValueError(f"balance_threshold must be an integer >= 0, got {balance_threshold!r}")
    self.replicas = list(replicas)
    self.routing = routing
    self.balance_threshold = balance_threshold
    self.tokenizer = self.replicas[0].tokenizer
    self._index = [_PrefixIndex(e.pm.page_size) for e in self.replicas]
    self._rr = itertools.cycle(range(len(self.replicas)))
    self._next_id = 0
    self.steps: List = []  # every replica's step records, in the order they finished
    self.max_step_records = self.replicas[0].steps.max_records
    self.routed = [0] * len(self.replicas)

  # --- requests ------------------------------------------------------------------------------
  @property
  def requests(self) -> Dict[object, object]:
    out = {}
    for e in self.replicas:
      out.update(e.requests)
    return out

  def now(self) -> float:
    """The latest replica clock (simulated replicas each keep their own)."""
    return max(e.now() for e in self.replicas)

  def validate_request(self, prompt_token_ids, sampling):
    return self.replicas[0].validate_request(prompt_token_ids, sampling)

  def load(self, i: int) -> int:
    """Unfinished requests of replica i (running and waiting)."""
    s = self.replicas[i].scheduler
    return len(s.running) + len(s.waiting)

  def route(self, ids: Sequence[int]) -> int:
    """The replica a request with prompt `ids` goes to (changes nothing)."""
    n = len(self.replicas)
    if self.routing == "round_robin":
      return next(self._rr)
    loads = [self.load(i) for i in range(n)]
    least = min(range(n), key=lambda i: (loads[i], i))
    if max(loads) - min(loads) > self.balance_threshold:
      return least
    hits = [self._index[i].match(ids) for i in range(n)]
    best = max(range(n), key=lambda i: (hits[i], -loads[i], -i))
    return best if hits[best] > 0 else least

  def add_request(self, prompt_token_ids, sampling=None, *, request_id=None, **kw):
    """Validated before anything changes (the routing index hashes checked ids); an id is
    in use while a replica retains its request, as on one engine."""
    ids = self.validate_request(prompt_token_ids, sampling or SamplingParams())
    if request_id is None:
      while self.replica_of(self._next_id) is not None:
        self._next_id += 1
      request_id = self._next_id
      self._next_id += 1
    if self.replica_of(request_id) is not None:
      raise ValueError(f"request id {request_id!r} is already in use")
    i = self.route(ids)
    r = self.replicas[i].add_request(ids, sampling, request_id=request_id, **kw)
    self._index[i].insert(ids)
    self.routed[i] += 1
    return r

  def replica_of(self, request_id) -> Optional[int]:
    """The replica holding `request_id` (None: unknown, or no longer retained)."""
    return next((i for i, e in enumerate(self.replicas) if request_id in e.requests), None)

  def abort(self, request_id) -> bool:
    i = self.replica_of(request_id)
    return False if i is None else self.replicas[i].abort(request_id)

  def abort_requests(self, request_ids) -> None:
    by = collections.defaultdict(list)
    for rid in request_ids:
      i = self.replica_of(rid)
      if i is not None:
        by[i].append(rid)
    for i, e in enumerate(self.replicas):  # each finishes its step in flight, if any
      e.abort_requests(by.get(i, []))

  # --- steps ---------------------------------------------------------------------------------
  def has_unfinished(self) -> bool:
    return any(e.has_unfinished() for e in self.replicas)

  @property
  def num_steps(self) -> int:
    return sum(e.num_steps for e in self.replicas)

  def step(self) -> List:
    """Launch every replica with work, then finish each; replicas that could launch
    nothing take a plain step (which waits for their next arrival)."""
    flights = [(e, e.launch()) for e in self.replicas if e.has_unfinished()]
    events = []
    for e, f in flights:
      n = len(e.steps)
      events += e.finish(f) if f is not None else e.step()
      self.steps += e.steps[n:]
    if len(self.steps) > self.max_step_records * 1.1:
      del self.steps[:len(self.steps) - self.max_step_records]
    return events

  def run(self) -> List:
    while self.has_unfinished():
      self.step()
    return list(self.requests.values())

  def warmup(self, progress: bool = False, structured: bool = False) -> float:
    return sum(e.warmup(progress=progress, structured=structured) for e in self.replicas)

  def set_step_model(self, model) -> None:
    for e in self.replicas:
      e.set_step_model(model)

  def metrics(self, correct=None) -> Dict:
    m = summarize(list(self.requests.values()), self.steps, correct)
    m["replicas"] = [{"routed": self.routed[i], "memory": e.executor.memory_report()}
                     for i, e in enumerate(self.replicas)]
    return m
