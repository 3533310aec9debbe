"""A fleet of simulated replicas behind a router: many `Engine`s (each the real scheduler,
page manager and prefix cache over a `SimExecutor` on the cost model's clock), one
`routing.RoutingPolicy` choosing where each request goes, one discrete-event loop, and
optionally an `Autoscaler` that starts and releases replicas.

Each replica keeps its own virtual clock. The loop always advances the replica that is
furthest behind (the smallest clock among those with work), and hands a request to the
router once every busy replica has reached its arrival time, so the router sees each
replica as it stands at that moment (to within one step). An idle replica's clock jumps to
its next request's arrival, as one engine's does.

Disaggregated (DistServe, Splitwise, Mooncake): a prefill pool and a decode pool. A request
arrives at a prefill replica, which computes its prompt's K/V and first token; its K/V then
crosses a link (`KVTransfer`: latency + its bytes over the link's bandwidth) to a decode
replica chosen by the decode pool's policy, which admits it with those K/V imported (no
prefill there: Engine.add_request(imported_tokens=...)) and generates the rest.
"""
from __future__ import annotations

import dataclasses
import gc
import heapq
import math
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from jaxinfer.config import SamplingParams
from jaxinfer.runtime.fast_forward import planned_ahead
from jaxinfer.runtime.request import State, Timeline
from jaxinfer.runtime.routing import RoutingPolicy, load, outstanding_tokens


@dataclasses.dataclass(frozen=True)
class Arrival:
  """One request of a stream: when it arrives, its prompt and its sampling."""
  time: float
  prompt_token_ids: Sequence[int]
  sampling: SamplingParams
  session: Optional[int] = None
  deadline_s: Optional[float] = None


@dataclasses.dataclass(frozen=True, eq=False)
class Served(Timeline):
  """What a fleet run with compact=True keeps of a finished request: its times and sizes,
  not its tokens (a million requests' token lists do not fit in memory)."""
  request_id: int
  state: State
  arrival_time: float
  num_prompt_tokens: int
  cached_tokens: int
  token_times: np.ndarray
  finished_at: Optional[float]

  @classmethod
  def of(cls, r) -> "Served":
    return cls(r.request_id, r.state, r.arrival_time, r.num_prompt_tokens, r.cached_tokens,
               np.asarray(r.token_times, np.float64), r.finished_at)


@dataclasses.dataclass(frozen=True)
class Autoscaler:
  """Checked at each arrival: the fleet aims at `target_load` unfinished requests
  (running and waiting) per replica; when the open replicas (those still starting
  included) hold more, as many replicas start as that load needs, up to max_replicas.
  A new replica takes requests `cold_start_s` later (its weights over the host link plus
  warm-up: `cold_start_s`). When one replica fewer would hold the load at
  `down_fraction` of the target, the least loaded open replica drains: it takes no new
  request and is released when its last one finishes (down to min_replicas). Replica
  time is counted from a start to its release."""
  min_replicas: int = 1
  max_replicas: int = 8
  target_load: float = 32.0
  down_fraction: float = 0.5
  cold_start_s: float = 30.0

  def __post_init__(self):
    if not 1 <= self.min_replicas <= self.max_replicas:
      raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas} "
                       f"and {self.max_replicas}")
    if self.target_load <= 0 or not 0 < self.down_fraction < 1 or self.cold_start_s < 0:
      raise ValueError("target_load must be > 0, down_fraction in (0, 1), cold_start_s >= 0")


@dataclasses.dataclass(frozen=True)
class KVTransfer:
  """A request's K/V moving from its prefill replica to its decode replica: latency + the
  prompt's K/V bytes over the link (per direction; each transfer has the link to itself,
  as with a NIC per device)."""
  bytes_per_token: float  # of the KV format (kv.bytes_per_token)
  link_bandwidth: float  # bytes / s
  latency_s: float = 0.0

  def __post_init__(self):
    if self.bytes_per_token <= 0 or self.link_bandwidth <= 0 or self.latency_s < 0:
      raise ValueError(f"KVTransfer needs bytes_per_token > 0, link_bandwidth > 0 and "
                       f"latency_s >= 0, got {self.bytes_per_token}, {self.link_bandwidth}, "
                       f"{self.latency_s}")

  def seconds(self, tokens: int) -> float:
    return self.latency_s + tokens * self.bytes_per_token / self.link_bandwidth


class _AsOf(list):
  """Replicas as a routing policy sees them at time t: each one it reads is first brought
  up to t (the decode rounds it planned that start before t are run), so the policy sees
  what stepping every replica round by round up to t would show. Its load and outstanding
  tokens are told from those rounds without running them (routing.replica_load; the
  rounds run when the replica is chosen or next wakes)."""

  def __init__(self, replicas, t: float):
    super().__init__(replicas)
    self.t = t

  def __getitem__(self, i):
    e = super().__getitem__(i)
    e.fast_forward(self.t, plan=False)
    return e

  def load(self, i: int) -> int:
    e = super().__getitem__(i)
    return load(e) - planned_ahead(e, self.t)[0]

  def outstanding_tokens(self, i: int) -> int:
    e = super().__getitem__(i)
    return outstanding_tokens(e) - planned_ahead(e, self.t)[1]

  def busy_s(self, i: int) -> float:
    """How far replica i's clock runs past t once brought up to t: the rest of the step
    (or decode round) it started before t, which a request arriving at t waits out."""
    return max(self[i].now() - self.t, 0.0)

  def __iter__(self):
    for i in range(len(self)):
      yield self[i]


def cold_start_s(weight_bytes: float, link_bandwidth: float, warmup_s: float) -> float:
  """A new replica's start: its weights over the host link, then warm-up (compiles)."""
  return weight_bytes / link_bandwidth + warmup_s


def _joined(a: Arrival, first, rest) -> Served:
  """A disaggregated request's record: its prefill's first token and its decode's rest."""
  last = rest if rest is not None else first
  times = list(first.token_times) + (list(rest.token_times) if rest is not None else [])
  return Served(first.request_id, last.state, a.time, first.num_prompt_tokens,
                first.cached_tokens, np.asarray(times, np.float64), last.finished_at)


class Fleet:
  """Replicas (Engines on virtual clocks) behind `policy`; `run(arrivals)` plays a stream.
  With `autoscaler`, `replicas` are the ones up at time 0 and `make_replica()` builds
  another. fast_forward: a replica that only decodes runs its rounds up to the next
  arrival as one event (Engine.fast_forward; the same timelines as step by step).
  decode_replicas (with decode_policy and transfer): disaggregated serving, `replicas`
  being the prefill pool."""

  def __init__(self, replicas: Sequence, policy: RoutingPolicy,
               autoscaler: Optional[Autoscaler] = None,
               make_replica: Optional[Callable[[], object]] = None,
               fast_forward: bool = True, decode_replicas: Sequence = (),
               decode_policy: Optional[RoutingPolicy] = None,
               transfer: Optional[KVTransfer] = None):
    if not replicas:
      raise ValueError("a fleet needs at least one replica")
    if autoscaler is not None and make_replica is None:
      raise ValueError("an autoscaled fleet needs make_replica to start replicas")
    if decode_replicas and (decode_policy is None or transfer is None or autoscaler):
      raise ValueError("a disaggregated fleet needs decode_policy and transfer (and scales "
                       "neither pool)")
    self.num_prefill = len(replicas)
    self.decode_ids = list(range(len(replicas), len(replicas) + len(decode_replicas)))
    self.decode_policy = decode_policy
    self.transfer = transfer
    replicas = list(replicas) + list(decode_replicas)
    self.replicas = list(replicas)
    for e in self.replicas:
      self._check(e)
    self.policy = policy
    self.autoscaler = autoscaler
    self.make_replica = make_replica
    self.fast_forward = fast_forward
    self.events = 0  # replica advances: steps, and fast-forwarded stretches of rounds
    self.routed = [0] * len(self.replicas)
    self.placement: List[int] = []  # the replica of each request, in arrival order
    n = len(self.replicas)
    self.started = [0.0] * n  # when each replica was started (its cold start counts)
    self.ready_at = [0.0] * n
    self.released: List[Optional[float]] = [None] * n
    self.idle_since: List[Optional[float]] = [0.0] * n
    self.live = list(range(self.num_prefill))  # replicas open to new requests
    self.draining: List[int] = []  # replicas finishing their requests before release
    self.timeline = [(0.0, n)]  # (time, live replicas) at each change
    self.transfer_s: List[float] = []  # disaggregated: each handed-off request's transfer

  @staticmethod
  def _check(e) -> None:
    if not e.executor.virtual_clock:
      raise ValueError("a fleet runs simulated replicas (executors on a virtual clock)")

  # --- scaling ---------------------------------------------------------------------------
  def _scale(self, t: float) -> None:
    a = self.autoscaler
    for i in list(self.draining):  # drained replicas are released when they went idle
      if not self.replicas[i].has_unfinished() and self.idle_since[i] is not None:
        self.draining.remove(i)
        self.released[i] = max(self.idle_since[i], self.started[i])
    held = sum(load(self.replicas[i]) for i in self.live) + 1  # with the arriving one
    ready = [i for i in self.live if self.ready_at[i] <= t]
    if (len(self.live) > a.min_replicas and len(ready) > 1
        and held <= (len(self.live) - 1) * a.target_load * a.down_fraction):
      i = min(ready, key=lambda j: (load(self.replicas[j]), -j))
      self.live.remove(i)
      self.draining.append(i)
      if not self.replicas[i].has_unfinished():
        self.idle_since[i] = max(self.idle_since[i] or t, t)
    want = min(a.max_replicas, math.ceil(held / a.target_load))
    for _ in range(want - len(self.live)):
      e = self.make_replica()
      self._check(e)
      e.hold_until(t + a.cold_start_s)
      self.replicas.append(e)
      self.routed.append(0)
      self.started.append(t)
      self.ready_at.append(t + a.cold_start_s)
      self.released.append(None)
      self.idle_since.append(None)
      self.live.append(len(self.replicas) - 1)
    if self.timeline[-1][1] != len(self.live):
      self.timeline.append((t, len(self.live)))

  @property
  def steps(self) -> int:
    """Steps (decode rounds included) the replicas have run."""
    return sum(e.num_steps for e in self.replicas)

  def replica_seconds(self, end: float) -> float:
    """Replica time from each start to its release (or `end`)."""
    return sum((r if r is not None else end) - s for s, r in zip(self.started, self.released))

  # --- the loop --------------------------------------------------------------------------
  def _add(self, a: Arrival, request_id):
    """Route one arrival; returns (its replica, its Request)."""
    if self.autoscaler is not None:
      self._scale(a.time)
    ready = [i for i in self.live if self.ready_at[i] <= a.time] or self.live
    ids = list(a.prompt_token_ids)
    i = ready[self.policy.choose(ids, _AsOf([self.replicas[j] for j in ready], a.time))]
    e = self.replicas[i]
    e.fast_forward(a.time, plan=False)
    sampling = a.sampling
    if self.decode_ids:  # the prefill pool computes the prompt and the first token
      sampling = dataclasses.replace(sampling, max_tokens=1,
                                     min_tokens=min(sampling.min_tokens, 1))
    r = e.add_request(ids, sampling, request_id=request_id, arrival_time=a.time,
                      deadline_s=a.deadline_s)
    self.policy.placed(e, ids)
    self.routed[i] += 1
    self.idle_since[i] = None
    return i, r

  def _hand_off(self, a: Arrival, first, t: float, request_id):
    """A prefilled request to the decode pool at t (its K/V arrived): (replica, Request)."""
    ids = list(a.prompt_token_ids)
    pool = [self.replicas[j] for j in self.decode_ids]
    j = self.decode_ids[self.decode_policy.choose(ids, _AsOf(pool, t))]
    e = self.replicas[j]
    e.fast_forward(t, plan=False)
    sp = a.sampling
    r = e.add_request(ids + first.output_token_ids,
                      dataclasses.replace(sp, max_tokens=sp.max_tokens - 1,
                                          min_tokens=max(sp.min_tokens - 1, 0)),
                      request_id=request_id, arrival_time=t, imported_tokens=len(ids))
    self.decode_policy.placed(e, ids)
    self.routed[j] += 1
    self.idle_since[j] = None
    return j, r

  def run(self, arrivals: Iterable[Arrival], compact: bool = False,
          progress: Optional[Callable[[int, float], None]] = None) -> List:
    """Play `arrivals` (in time order; any iterable, read as it goes) to the end; returns
    every request, in arrival order: the replicas' Request objects, with their per-token
    times (kept here, since a replica retains only its latest finished requests), or with
    compact=True a `Served` for each request once it has finished (a disaggregated run
    always returns Served records: its prefill's and its decode's times joined).
    progress(requests routed, simulated time) is called every 10,000 arrivals."""
    # A run makes no reference cycles (tested), so the cyclic collector is paused: its
    # passes over the run's live objects would only cost time (docs/design.md).
    collecting = gc.isenabled()
    gc.disable()
    try:
      return self._play(arrivals, compact, progress)
    finally:
      if collecting:
        gc.enable()

  def _play(self, arrivals: Iterable[Arrival], compact: bool, progress) -> List:
    stream = iter(arrivals)
    nxt = next(stream, None)
    order = []
    # Heap of (time, version, replica) for the replicas with work: when each next needs
    # the loop (its clock, or the end of the decode rounds it planned); an entry whose
    # version is not its replica's latest is stale.
    busy = []
    version = {}
    last = float("-inf")
    # disaggregated: (time its K/V arrive, request id) of prefilled requests; each
    # request's Arrival, and its prefill Request while its decode runs
    split = self.num_prefill if self.decode_ids else None
    handoffs, source, prefilled = [], {}, {}

    def wake(i: int, t: float) -> None:
      version[i] = version.get(i, 0) + 1
      heapq.heappush(busy, (t, version[i], i))

    def incoming() -> float:  # the next arrival or hand-off
      return min(nxt.time if nxt is not None else math.inf,
                 handoffs[0][0] if handoffs else math.inf)

    def horizon(i: int) -> float:
      """How far replica i may run decode rounds as one event: to the next arrival or
      hand-off, and a decode replica no further than the earliest hand-off a prefill
      replica could still make (a step ending after its clock, then the link's latency)."""
      t = incoming()
      if split is not None and i >= split:
        t = min([t] + [self.replicas[j].now() + self.transfer.latency_s
                       for j in range(split) if self.replicas[j].has_unfinished()])
      return t

    def finished(i: int, k) -> None:
      r = order[k]
      if split is None:
        if compact:  # request ids are arrival indices
          order[k] = Served.of(r)
        return
      if i >= split:  # its decode ended: one record of both halves
        order[k] = _joined(source.pop(k), prefilled.pop(k), r)
      elif (r.state == State.FINISHED and r.finish_reason == "length"
            and source[k].sampling.max_tokens > 1):
        dt = self.transfer.seconds(r.num_prompt_tokens)
        self.transfer_s.append(dt)
        heapq.heappush(handoffs, (r.finished_at + dt, k))
      else:  # done at its prefill (one token asked, a stop, a rejection)
        order[k] = _joined(source.pop(k), r, None)

    def drain(i: int) -> None:  # requests that a replica's decode rounds ended
      for k in self.replicas[i].take_fast_forward_finished():
        finished(i, k)

    while nxt is not None or busy or handoffs:
      if busy and busy[0][1] != version.get(busy[0][2]):
        heapq.heappop(busy)
        continue
      t_in = incoming()
      if t_in < math.inf and (not busy or t_in <= busy[0][0]):
        if handoffs and (nxt is None or handoffs[0][0] <= nxt.time):
          t, k = heapq.heappop(handoffs)
          prefilled[k] = order[k]
          j, order[k] = self._hand_off(source[k], prefilled[k], t, k)
          drain(j)
          wake(j, max(self.replicas[j].now(), t))
          continue
        if nxt.time < last:
          raise ValueError(f"arrivals must come in time order: {nxt.time} after {last}")
        last = nxt.time
        i, r = self._add(nxt, len(order))
        drain(i)
        if split is not None:
          source[len(order)] = nxt
        order.append(r)
        self.placement.append(i)
        if progress is not None and len(order) % 10_000 == 0:
          progress(len(order), nxt.time)
        wake(i, max(self.replicas[i].now(), nxt.time))  # its planned rounds are dropped
        nxt = next(stream, None)
        continue
      _, _, i = heapq.heappop(busy)
      version[i] += 1
      e = self.replicas[i]
      self.events += 1
      rounds = e.fast_forward(horizon(i)) if self.fast_forward else 0
      drain(i)
      if rounds:  # decode rounds that start before the next arrival, as one event; the
        # rounds it planned past that arrival run when they are due or when the router
        # looks at the replica (_AsOf), unless a request routed to it comes first
        wake(i, e.planned_until())
        continue
      for ev in e.step():
        if ev.finished:
          finished(i, ev.request_id)
      if e.has_unfinished():
        wake(i, e.now())
      else:
        self.idle_since[i] = e.now()
    for i in range(len(self.replicas)):  # ended by a router's read and not taken since
      drain(i)
    for i in self.draining:  # drained after the last arrival: released when they emptied
      self.released[i] = max(self.idle_since[i] or self.started[i], self.started[i])
    self.draining = []
    return order
