"""Which adapter sits in which device slot (S-LoRA, 8.2.1). Host side, imports no JAX.

The device keeps `num_slots` adapter slots of fixed shape (slot 0 is "no adapter", all
zeros, and is not counted). Every registered adapter lives in host memory; a running
request pins its adapter's slot, so the adapters of one step never exceed the slots and
an adapter in use is never replaced. An adapter no running request uses stays resident
until its slot is needed (least recently used first), so a returning adapter is usually
still there. The scheduler asks `can_acquire` before admitting a request; the loads it
causes are taken by the engine (`take_loads`) and done by the executor before the step.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Tuple


class AdapterSlots:

  def __init__(self, num_slots: int):
    if num_slots < 1:
      raise ValueError(f"max_loras must be >= 1, got {num_slots}")
    self.num_slots = num_slots
    self.slot_of: Dict[str, int] = {}  # resident adapter -> its slot (1..num_slots)
    self.users: Dict[str, int] = collections.Counter()  # running requests per adapter
    self._idle = collections.OrderedDict()  # resident, unused adapters; oldest first
    self._free = list(range(num_slots, 0, -1))  # never-used slots (pop from the end)
    self._loads: List[Tuple[int, str]] = []
    self.generation: Dict[str, int] = collections.Counter()  # bumped when weights change
    self.num_loads = 0  # host -> device adapter copies so far
    self.num_evictions = 0

  def can_acquire(self, name: str) -> bool:
    return name in self.slot_of or bool(self._free) or bool(self._idle)

  def acquire(self, name: str) -> int:
    """Pin `name` for one more running request; returns its slot. A non-resident adapter
    takes a free slot or replaces the least recently used idle one (a load is queued)."""
    if name in self.slot_of:
      self._idle.pop(name, None)
    else:
      if self._free:
        slot = self._free.pop()
      elif self._idle:
        old, _ = self._idle.popitem(last=False)
        slot = self.slot_of.pop(old)
        self._loads = [(s, n) for s, n in self._loads if n != old]  # e.g. a re-queued one
        self.num_evictions += 1
      else:
        raise RuntimeError(f"no adapter slot free for {name!r}: all {self.num_slots} slots "
                           "hold adapters of running requests (check can_acquire first)")
      self.slot_of[name] = slot
      self._loads.append((slot, name))
      self.num_loads += 1
    self.users[name] += 1
    return self.slot_of[name]

  def release(self, name: str) -> None:
    """One running request of `name` ended (finished, preempted, aborted, failed)."""
    if self.users.get(name, 0) <= 0:
      raise RuntimeError(f"adapter {name!r} released more often than acquired")
    self.users[name] -= 1
    if self.users[name] == 0:
      del self.users[name]
      self._idle[name] = True  # most recently used at the end

  def forget(self, name: str) -> None:
    """Drop a resident idle adapter (its weights were replaced or unregistered); K/V cached
    under its old weights is no longer matched (a new generation)."""
    if self.users.get(name, 0):
      raise RuntimeError(f"adapter {name!r} is in use by running requests")
    self.generation[name] += 1
    if name in self.slot_of:
      self._idle.pop(name, None)
      self._free.append(self.slot_of.pop(name))
      self._loads = [(s, n) for s, n in self._loads if n != name]

  def load_pending(self, load) -> None:
    """load(take_loads()); when it raises, the loads are queued again for the next step
    (the failing step's requests fail; the adapters stay registered)."""
    loads = self.take_loads()
    if not loads:
      return
    try:
      load(loads)
    except BaseException:
      self._loads.extend((s, n) for s, n in loads if self.slot_of.get(n) == s)
      raise

  def take_loads(self) -> List[Tuple[int, str]]:
    """(slot, adapter) copies to do before the next step; the list is cleared."""
    loads, self._loads = self._loads, []
    return loads
