"""Request traces for the studies: named scenarios and JSON traces.

A trace is a list of dicts {arrival_ms, input_tokens, output_tokens[, shared_prefix]}.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List


def ch8_2_2() -> List[Dict]:
  """chapter 8.2.2's four requests, from configs/chapter/s8_2.py: r0 and r1 at t = 0
  (2048 in; 8 and 2 out), r2 at 20 ms (8192 in, 2 out), r3 at 30 ms (2048 in, 4 out)."""
  from experiments.chapter import load_config
  return [{"arrival_ms": a, "input_tokens": n, "output_tokens": g}
          for a, n, g in load_config("8.2").inputs.trace]


def ch8_2_4(num_requests: int = 6, interval_ms: float = 80.0, input_tokens: int = 2048,
            output_tokens: int = 64) -> List[Dict]:
  """chapter 8.2.4's replay: six requests arriving every 80 ms. The chapter gives neither
  their prompt nor their output lengths: those are inputs of ours (2048 / 64 by default,
  the chapter's short-chat prompt) and the study prints them."""
  return [{"arrival_ms": interval_ms * i, "input_tokens": input_tokens,
           "output_tokens": output_tokens} for i in range(num_requests)]


WORKLOADS = {"ch8_2_2": ch8_2_2, "ch8_2_4": ch8_2_4}


def load_workload(name_or_path: str) -> List[Dict]:
  if name_or_path in WORKLOADS:
    return WORKLOADS[name_or_path]()
  if os.path.isfile(name_or_path):
    with open(name_or_path) as f:
      trace = json.load(f)
    for i, r in enumerate(trace):
      for k in ("arrival_ms", "input_tokens", "output_tokens"):
        if k not in r:
          raise ValueError(f"trace entry {i} lacks {k!r}: {r}")
    return trace
  raise ValueError(f"unknown workload {name_or_path!r}: not one of {sorted(WORKLOADS)} "
                   "and no such JSON file")


def scale(trace: List[Dict], tokens: float, time: float) -> List[Dict]:
  """Scale a trace down for the real model on a CPU (lengths and arrival times)."""
  return [dict(r, arrival_ms=r["arrival_ms"] * time,
               input_tokens=max(1, int(round(r["input_tokens"] * tokens))))
          for r in trace]
