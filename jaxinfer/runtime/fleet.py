"""A fleet of simulated replicas behind a router: many `Engine`s (each the real scheduler,
page manager and prefix cache over a `SimExecutor` on the cost model's clock), one
`routing.RoutingPolicy` choosing where each request goes, one discrete-event loop.

Each replica keeps its own virtual clock. The loop always advances the replica that is
furthest behind (the smallest clock among those with work), and hands a request to the
router once every busy replica has reached its arrival time, so the router sees each
replica as it stands at that moment (to within one step). An idle replica's clock jumps to
its next request's arrival, as one engine's does.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Iterable, List, Optional, Sequence

from jaxinfer.config import SamplingParams
from jaxinfer.runtime.routing import RoutingPolicy


@dataclasses.dataclass(frozen=True)
class Arrival:
  """One request of a stream: when it arrives, its prompt and its sampling."""
  time: float
  prompt_token_ids: Sequence[int]
  sampling: SamplingParams
  session: Optional[int] = None
  deadline_s: Optional[float] = None


class Fleet:
  """Replicas (Engines on virtual clocks) behind `policy`; `run(arrivals)` plays a stream."""

  def __init__(self, replicas: Sequence, policy: RoutingPolicy):
    if not replicas:
      raise ValueError("a fleet needs at least one replica")
    if not all(e.executor.virtual_clock for e in replicas):
      raise ValueError("a fleet runs simulated replicas (executors on a virtual clock)")
    self.replicas = list(replicas)
    self.policy = policy
    self.routed = [0] * len(self.replicas)
    self.placement: List[int] = []  # the replica of each request, in arrival order
    self.steps = 0

  def _add(self, a: Arrival, request_id):
    """Route one arrival; returns (its replica, its Request)."""
    ids = list(a.prompt_token_ids)
    i = self.policy.choose(ids, self.replicas)
    r = self.replicas[i].add_request(ids, a.sampling, request_id=request_id,
                                     arrival_time=a.time, deadline_s=a.deadline_s)
    self.policy.placed(i, ids)
    self.routed[i] += 1
    return i, r

  def run(self, arrivals: Iterable[Arrival]) -> List:
    """Play `arrivals` (in time order) to the end; returns every request, in arrival
    order (the replicas' Request objects, with their per-token times; kept here, since a
    replica retains only its latest finished requests)."""
    stream = iter(arrivals)
    nxt = next(stream, None)
    order = []
    busy = []  # heap of (clock, replica index) of the replicas with work
    queued = set()
    last = float("-inf")
    while nxt is not None or busy:
      if nxt is not None and (not busy or nxt.time <= busy[0][0]):
        if nxt.time < last:
          raise ValueError(f"arrivals must come in time order: {nxt.time} after {last}")
        last = nxt.time
        i, r = self._add(nxt, len(order))
        order.append(r)
        self.placement.append(i)
        if i not in queued:
          heapq.heappush(busy, (max(self.replicas[i].now(), nxt.time), i))
          queued.add(i)
        nxt = next(stream, None)
        continue
      _, i = heapq.heappop(busy)
      queued.discard(i)
      e = self.replicas[i]
      e.step()
      self.steps += 1
      if e.has_unfinished():
        heapq.heappush(busy, (e.now(), i))
        queued.add(i)
    return order
