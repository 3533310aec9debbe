"""Data parallelism: several engine replicas (each its own devices, pool and scheduler)
behind one front with the Engine's request API (`LLM(mesh="dp:M")`, the server).

Routing (where a new request goes) is one of the policies of `runtime/routing.py` (the
fleet simulator uses the same ones): prefix affinity (default), round robin, least
outstanding tokens, power of two choices, or the smallest predicted time to first token.
One thread owns the router and through it every replica; a step launches every replica
that has work (JAX dispatches asynchronously, so replicas on different devices run at
the same time) and then finishes them in order.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

from jaxinfer.config import SamplingParams
from jaxinfer.metrics import summarize
from jaxinfer.runtime import routing as routing_policies

ROUTING = routing_policies.POLICIES


class Router:
  """The Engine's request API over `replicas` (Engines); request ids are global."""

  def __init__(self, replicas: Sequence, routing: str = "prefix", balance_threshold: int = 8):
    if not replicas:
      raise ValueError("a router needs at least one replica")
    if isinstance(balance_threshold, bool) or not isinstance(balance_threshold, int) or \
        balance_threshold < 0:
      raise ValueError(f"balance_threshold must be an integer >= 0, got {balance_threshold!r}")
    self.replicas = list(replicas)
    self.policy = routing_policies.make_policy(routing, balance_threshold)
    self.routing = routing
    self.balance_threshold = balance_threshold
    self.tokenizer = self.replicas[0].tokenizer
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
    return routing_policies.load(self.replicas[i])

  def route(self, ids: Sequence[int]) -> int:
    """The replica a request with prompt `ids` goes to (round robin advances its turn)."""
    return self.policy.choose(ids, self.replicas)

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
    self.policy.placed(self.replicas[i], ids)
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
