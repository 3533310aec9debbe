"""Routing policies: which replica a new request goes to. One class per policy, used by the
data-parallel `Router` over real replicas and by the fleet simulator over simulated ones
(both hold `Engine`s, so a policy reads the same state either way).

  round_robin    in turn.
  least_loaded   the fewest outstanding tokens (prompt tokens not yet computed plus output
                 tokens not yet generated, over running and waiting requests).
  power_of_two   two replicas drawn at random (seeded), the one with fewer outstanding
                 tokens (Mitzenmacher's two choices: nearly least-loaded at O(1) reads).
  prefix         the replica that already saw the longest page-aligned prefix of the
                 prompt (each replica's routed prompts remembered as chained page hashes,
                 so a burst of requests sharing a prefix lands together before any is
                 cached), unless the replicas' loads differ by more than
                 `balance_threshold` requests: then, or with no match, the least loaded.
  slo            the smallest predicted time to the request's first token on the
                 replica: the rest of the step it is running, then its scheduler's
                 prefill backlog ahead of the request plus the request's own prompt,
                 each step also carrying the running decodes, on the scheduler's step
                 model (8.6.1); without a step model, outstanding tokens stand in for
                 time.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

POLICIES = ("prefix", "round_robin", "least_loaded", "power_of_two", "slo")


def load(engine) -> int:
  """Unfinished requests of a replica (running and waiting)."""
  s = engine.scheduler
  return len(s.running) + len(s.waiting)


def outstanding_tokens(engine) -> int:
  """Work a replica holds: prompt tokens not yet computed and output tokens not yet
  generated, over its running and waiting requests."""
  s = engine.scheduler
  return sum(r.num_pending + max(r.sampling.max_tokens - len(r.output_token_ids), 0)
             for reqs in (s.running, s.waiting) for r in reqs)


def replica_load(replicas: Sequence, i: int) -> int:
  """load() of replicas[i]; a sequence that tells it without reading the replica's state
  (the fleet's replicas as of a time: fleet._AsOf) answers itself."""
  own = getattr(replicas, "load", None)
  return own(i) if own is not None else load(replicas[i])


def replica_tokens(replicas: Sequence, i: int) -> int:
  """outstanding_tokens() of replicas[i], as replica_load reads it."""
  own = getattr(replicas, "outstanding_tokens", None)
  return own(i) if own is not None else outstanding_tokens(replicas[i])


def replica_busy_s(replicas: Sequence, i: int) -> float:
  """Seconds replicas[i] is still busy with the step it runs when the request arrives,
  where the sequence can tell (a simulated replica's clock runs past the arrival by up to
  one step: fleet._AsOf); 0 otherwise (a real replica's step in flight is not timed)."""
  own = getattr(replicas, "busy_s", None)
  return own(i) if own is not None else 0.0


class PrefixIndex:
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


class RoutingPolicy:
  """choose(ids, replicas) -> an index into `replicas` (the ones open to new requests now:
  a fleet's set may change between calls); placed(engine, ids) after the request lands."""
  name = ""

  def choose(self, ids: Sequence[int], replicas: Sequence) -> int:
    raise NotImplementedError

  def placed(self, engine, ids: Sequence[int]) -> None:
    pass


class RoundRobin(RoutingPolicy):
  name = "round_robin"

  def __init__(self):
    self._turn = 0

  def choose(self, ids, replicas):
    i = self._turn % len(replicas)
    self._turn += 1
    return i


class LeastLoaded(RoutingPolicy):
  name = "least_loaded"

  def choose(self, ids, replicas):
    work = [replica_tokens(replicas, i) for i in range(len(replicas))]
    return min(range(len(replicas)), key=lambda i: (work[i], i))


class PowerOfTwo(RoutingPolicy):
  name = "power_of_two"

  def __init__(self, seed: int = 0):
    self._rng = np.random.default_rng(seed)

  def choose(self, ids, replicas):
    n = len(replicas)
    if n == 1:
      return 0
    a = int(self._rng.integers(n))  # two distinct, uniformly (no permutation of all n)
    b = int(self._rng.integers(n - 1))
    b += b >= a
    return min((a, b), key=lambda i: (replica_tokens(replicas, i), i))


class PrefixAffinity(RoutingPolicy):
  name = "prefix"

  def __init__(self, balance_threshold: int = 8):
    self.index = {}  # id(engine) -> PrefixIndex of the prompts routed to it
    self.balance_threshold = balance_threshold

  def _index(self, engine) -> PrefixIndex:
    key = id(engine)
    if key not in self.index:
      self.index[key] = PrefixIndex(engine.pm.page_size)
    return self.index[key]

  def choose(self, ids, replicas):
    n = len(replicas)
    loads = [replica_load(replicas, i) for i in range(n)]
    least = min(range(n), key=lambda i: (loads[i], i))
    if max(loads) - min(loads) > self.balance_threshold:
      return least
    hits = [self._index(e).match(ids) for e in replicas]
    best = max(range(n), key=lambda i: (hits[i], -loads[i], -i))
    return best if hits[best] > 0 else least

  def placed(self, engine, ids):
    self._index(engine).insert(ids)


class SloAware(RoutingPolicy):
  name = "slo"

  def choose(self, ids, replicas):
    # the replica's state as of the request's arrival first (its step in flight), then
    # how long that step still runs
    est = [predicted_first_token_s(replicas[i], len(ids)) + replica_busy_s(replicas, i)
           for i in range(len(replicas))]
    return min(range(len(replicas)), key=lambda i: (est[i], i))


def predicted_first_token_s(engine, prompt_tokens: int) -> float:
  """Seconds until a request of `prompt_tokens` new prompt tokens would get its first
  token on this replica, routed now, once the step it is running ends
  (replica_busy_s), on the scheduler's step model: (1) a slot and its
  memory: when the replica runs its most requests and others wait, or (admission
  reserving each request's K/V to its end) its free pages do not hold the waiting
  requests' and this prompt's, it waits for as many running requests to finish as free
  enough of both (the ones with the fewest outputs left, one decode round per output);
  (2) the prompt backlog ahead of it (running and waiting requests' uncomputed prompt
  tokens) and its own prompt, through steps of at most the token budget, each also
  carrying the running decodes. Without a step model: the outstanding tokens (a unit of
  work per token)."""
  s = engine.scheduler
  model = s.step_model
  if model is None:
    return float(outstanding_tokens(engine) + prompt_tokens)
  cfg = s.config
  budget = cfg.token_budget if cfg.policy == "chunked" else 1 << 30
  decodes = [(1, r.num_tokens) for r in s.running if r.num_pending <= 1]
  t = 0.0
  behind = len(s.waiting) + 1 - (cfg.max_running - len(s.running))
  short = _pages_short(engine, prompt_tokens)
  if (behind > 0 or short > 0) and s.running:  # wait for running requests to finish
    # and free a slot each, and (reserve="end") the pages they hold to their end
    ends = sorted((max(r.sampling.max_tokens - len(r.output_token_ids), 1),
                   engine.pm.pages_for(r.kv_tokens_at_end) - len(r.prefix_nodes))
                  for r in s.running)
    k, freed = max(behind, 0), 0
    for j, (_, pages) in enumerate(ends):
      freed += pages
      if freed >= short:
        k = max(k, j + 1)
        break
    else:
      k = len(ends)
    t += ends[min(max(k, 1), len(ends)) - 1][0] * model.step_time(decodes or [(1, 1)])
  ahead = sum(r.num_pending for r in list(s.running) + list(s.waiting)
              if r.num_pending > 1) + prompt_tokens
  done = 0
  while done < ahead:
    n = min(ahead - done, budget)
    t += model.step_time([(n, 0)] + decodes)
    done += n
  return t


def _pages_short(engine, prompt_tokens: int) -> int:
  """Pages the waiting requests' and a new prompt's admission would lack now, when the
  scheduler reserves each request's K/V to its end (8.1): free pages not promised, and
  the prefix cache's pages no running request holds, against what they reserve (the new
  one: its prompt; its output length is not known here)."""
  s = engine.scheduler
  if s.config.reserve != "end":
    return 0
  pm = engine.pm
  have = pm.num_available
  if s.cache is not None:
    have += s.cache.num_device_pages - sum(len(r.prefix_nodes) for r in s.running)
  need = sum(pm.pages_for(r.kv_tokens_at_end) for r in s.waiting) + pm.pages_for(prompt_tokens)
  return need - have


def make_policy(name: str, balance_threshold: int = 8, seed=0) -> RoutingPolicy:
  """The policy `name` (one of POLICIES); seed (an int or a sequence of ints, as numpy's
  generators take) draws power_of_two's pairs."""
  if name not in POLICIES:
    raise ValueError(f"routing must be one of {POLICIES}, got {name!r}")
  return {"prefix": lambda: PrefixAffinity(balance_threshold), "round_robin": RoundRobin,
          "least_loaded": LeastLoaded, "power_of_two": lambda: PowerOfTwo(seed),
          "slo": SloAware}[name]()
