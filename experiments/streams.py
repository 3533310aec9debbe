"""Request streams for the fleet simulator: arrival processes, length distributions,
multi-turn sessions and trace files, each a list of `jaxinfer.runtime.fleet.Arrival`.

Arrival processes (`arrival_times`): poisson; gamma (inter-arrival gaps with a coefficient
of variation `cv`: cv > 1 is bursty, cv = 1 Poisson); diurnal (Poisson whose rate swings
sinusoidally by `amplitude` over `period_s`, from its trough at time 0, drawn by
thinning). Lengths (`lengths`):
lognormal around a median, clipped, for heavy tails. Sessions (`sessions`): agent-like
conversations whose turns share one system prompt and repeat their own history, so
routing by prefix matters. Traces (`read_trace`): JSONL ({"time" or "arrival_time",
"input_tokens", "output_tokens"[, "session_id"]}) or CSV in the column layouts of the
public Azure LLM-inference trace (TIMESTAMP, ContextTokens, GeneratedTokens) and BurstGPT
(Timestamp, Request tokens, Response tokens).
"""
from __future__ import annotations

import csv
import datetime
import json
from typing import Iterator, List, Optional

import numpy as np

from jaxinfer.config import SamplingParams
from jaxinfer.runtime.fleet import Arrival

PROCESSES = ("poisson", "gamma", "diurnal")


def arrival_times(process: str, rate: float, n: int, seed: int = 0, cv: float = 1.0,
                  amplitude: float = 0.5, period_s: float = 60.0) -> np.ndarray:
  """n arrival times (s) of a stream averaging `rate` requests per second; the first
  at 0."""
  if rate <= 0 or n < 1:
    raise ValueError(f"rate must be > 0 and n >= 1, got rate={rate}, n={n}")
  rng = np.random.default_rng(seed)
  if process == "poisson":
    gaps = rng.exponential(1.0 / rate, n - 1)
  elif process == "gamma":
    if cv <= 0:
      raise ValueError(f"cv must be > 0, got {cv}")
    shape = 1.0 / cv**2  # gaps of mean 1/rate and coefficient of variation cv
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n - 1)
  elif process == "diurnal":
    if not 0 <= amplitude < 1:
      raise ValueError(f"amplitude must be in [0, 1), got {amplitude}")
    peak, t, out = rate * (1 + amplitude), 0.0, [0.0]
    while len(out) < n:  # thinning: candidates at the peak rate, kept at rate(t) / peak
      t += rng.exponential(1.0 / peak)
      if rng.random() < (1 - amplitude * np.cos(2 * np.pi * t / period_s)) / (1 + amplitude):
        out.append(t)
    return np.asarray(out)
  else:
    raise ValueError(f"unknown arrival process {process!r}; choose one of {PROCESSES}")
  return np.concatenate([[0.0], np.cumsum(gaps)])


def lengths(n: int, median: float, sigma: float, lo: int, hi: int, seed: int = 0) -> np.ndarray:
  """n token counts, lognormal around `median` (sigma: the log's spread; 0: constant),
  clipped to [lo, hi]."""
  rng = np.random.default_rng(seed)
  x = median * np.exp(sigma * rng.standard_normal(n)) if sigma > 0 else np.full(n, median)
  return np.clip(np.round(x), lo, hi).astype(int)


def _tokens(rng, n: int) -> List[int]:
  return rng.integers(100, 30000, n).tolist()


def independent(times, prompt_lens, output_lens, seed: int = 0,
                deadline_s: Optional[float] = None) -> List[Arrival]:
  """Requests with unrelated prompts."""
  return list(iter_independent(times, prompt_lens, output_lens, seed, deadline_s))


def iter_independent(times, prompt_lens, output_lens, seed: int = 0,
                     deadline_s: Optional[float] = None) -> Iterator[Arrival]:
  """independent's requests, made one at a time as they are read (a million-request
  stream is never held whole)."""
  rng = np.random.default_rng(seed)
  for t, p, g in zip(times, prompt_lens, output_lens):
    yield Arrival(float(t), _tokens(rng, int(p)),
                  SamplingParams(max_tokens=int(g), ignore_eos=True), None, deadline_s)


def sessions(num_sessions: int, turns: int, rate: float, system_tokens: int,
             user_tokens: int, output_tokens: int, think_s: float, seed: int = 0,
             deadline_s: Optional[float] = None) -> List[Arrival]:
  """Agent-like sessions: each starts at a Poisson time (`rate` sessions per second) and
  sends `turns` turns `think_s` apart; every turn's prompt is the shared system prompt,
  the session's history (its earlier turns and stand-ins for their outputs) and
  `user_tokens` new tokens. Returned in time order."""
  rng = np.random.default_rng(seed)
  system = _tokens(rng, system_tokens)
  starts = arrival_times("poisson", rate, num_sessions, seed)
  out = []
  for s, t0 in enumerate(starts):
    history: List[int] = []
    for j in range(turns):
      history += _tokens(rng, user_tokens)
      out.append(Arrival(float(t0 + j * think_s), system + history,
                         SamplingParams(max_tokens=output_tokens, ignore_eos=True), s,
                         deadline_s))
      history += _tokens(rng, output_tokens)  # the answer, as the next turn quotes it
  return sorted(out, key=lambda a: a.time)


def read_trace(path: str, seed: int = 0, limit: Optional[int] = None) -> List[Arrival]:
  """A trace file's requests, times relative to its first (prompts are random tokens of
  the given lengths; a session id, where given, is kept)."""
  rows = []
  if path.endswith(".jsonl"):
    with open(path) as f:
      for i, line in enumerate(f):
        if line.strip():
          d = json.loads(line)
          t = d.get("time", d.get("arrival_time"))
          if t is None or "input_tokens" not in d or "output_tokens" not in d:
            raise ValueError(f"{path}:{i + 1}: needs time (or arrival_time), input_tokens "
                             f"and output_tokens, got {sorted(d)}")
          rows.append((float(t), int(d["input_tokens"]), int(d["output_tokens"]),
                       d.get("session_id")))
  else:
    with open(path, newline="") as f:
      reader = csv.DictReader(f)
      cols = set(reader.fieldnames or ())
      if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols:  # Azure
        get = lambda r: (_seconds(r["TIMESTAMP"]), int(r["ContextTokens"]),  # noqa: E731
                         int(r["GeneratedTokens"]), None)
      elif {"Timestamp", "Request tokens", "Response tokens"} <= cols:  # BurstGPT
        get = lambda r: (float(r["Timestamp"]), int(r["Request tokens"]),  # noqa: E731
                         int(r["Response tokens"]), None)
      else:
        raise ValueError(f"{path}: columns {sorted(cols)} are neither the Azure trace's "
                         "(TIMESTAMP, ContextTokens, GeneratedTokens) nor BurstGPT's "
                         "(Timestamp, Request tokens, Response tokens)")
      rows = [get(r) for r in reader]
  rows.sort(key=lambda r: r[0])
  rows = rows[:limit] if limit else rows
  if not rows:
    raise ValueError(f"{path}: no requests")
  t0 = rows[0][0]
  rng = np.random.default_rng(seed)
  return [Arrival(t - t0, _tokens(rng, max(p, 1)),
                  SamplingParams(max_tokens=max(g, 1), ignore_eos=True), s)
          for t, p, g, s in rows]


def _seconds(stamp: str) -> float:
  """Seconds since the epoch of an Azure trace timestamp ("2023-11-16 18:15:46.6805900")."""
  day, _, frac = stamp.strip().partition(".")
  t = datetime.datetime.strptime(day, "%Y-%m-%d %H:%M:%S").replace(
      tzinfo=datetime.timezone.utc).timestamp()
  return t + (float("0." + frac) if frac else 0.0)
