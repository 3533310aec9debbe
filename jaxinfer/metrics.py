"""Serving metrics (8.1, 8.6): TTFT, ITL, end-to-end, queueing, throughput, goodput,
Little's law, and per-step records; exported as JSON-ready dicts. Requests are read by
their attributes (runtime/request.py's Request); this module imports nothing of the
runtime."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np



@dataclasses.dataclass
class StepRecord:
  index: int
  start: float
  duration: float
  num_seqs: int
  num_prefill_tokens: int
  num_decode_tokens: int
  padded_tokens: int  # bucket tokens - real tokens (8.2.4 padding waste)
  bucket: tuple
  num_preempted: int = 0
  members: list = dataclasses.field(default_factory=list)  # (request id, tokens, is_prefill)
  # speculative decoding (8.5.3): drafting time before this (verify) step, and its counts
  draft_s: float = 0.0
  drafted: int = 0
  accepted: int = 0
  emitted: int = 0
  # host time of the step outside the device: scheduling and packing before dispatch,
  # sampling bookkeeping, stop checks and events after the result arrived
  host_s: float = 0.0

  @property
  def end(self) -> float:
    return self.start + self.duration


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def summarize(requests: Sequence, steps: Sequence[StepRecord] = (),
              correct: Optional[Callable[[object], bool]] = None) -> Dict:
  """Aggregate metrics. Time runs from the earliest scheduled arrival to the last finish.
  Goodput (8.6.2) counts requests that are correct (by `correct`, default: finished) and
  done by their deadline; completion throughput counts every completion."""
  reqs = list(requests)
  done = [r for r in reqs if r.state.value == "finished"]
  t0 = min((r.arrival_time for r in reqs), default=0.0)
  t1 = max((r.finished_at for r in reqs if r.finished_at is not None), default=t0)
  span = max(t1 - t0, 1e-12)
  itls = [x for r in done for x in r.itls]
  ttfts = [r.ttft for r in done if r.ttft is not None]
  lat = [r.latency for r in done]
  good = [r for r in done if r.on_time and (correct is None or correct(r))]
  out_tokens = sum(len(r.output_token_ids) for r in reqs)
  # Little's law: time-average number in the system vs arrival rate x mean time in system.
  in_sys = sum((r.finished_at - r.arrival_time) for r in reqs if r.finished_at is not None)
  mean_n = in_sys / span
  lam = len(reqs) / span
  mean_t = in_sys / max(len([r for r in reqs if r.finished_at is not None]), 1)
  return {
      "num_requests": len(reqs),
      "num_finished": len(done),
      "num_cancelled": sum(r.state.value == "cancelled" for r in reqs),
      "num_rejected": sum(r.state.value == "rejected" for r in reqs),
      "makespan_s": span,
      "output_tokens": out_tokens,
      "throughput_tok_s": out_tokens / span,
      "completion_rps": len(done) / span,
      "goodput_rps": len(good) / span,
      "num_good": len(good),
      "ttft_s": {"mean": float(np.mean(ttfts)) if ttfts else None, "p50": _pct(ttfts, 50),
                 "p95": _pct(ttfts, 95), "p99": _pct(ttfts, 99),
                 "max": max(ttfts) if ttfts else None},
      "itl_s": {"mean": float(np.mean(itls)) if itls else None, "p50": _pct(itls, 50),
                "p95": _pct(itls, 95), "p99": _pct(itls, 99), "max": max(itls) if itls else None},
      "latency_s": {"mean": float(np.mean(lat)) if lat else None, "p50": _pct(lat, 50),
                    "max": max(lat) if lat else None},
      "queueing_s": {"mean": float(np.mean([r.queueing for r in done])) if done else None,
                     "max": max((r.queueing for r in done), default=None)},
      "littles_law": {"mean_in_system": mean_n, "lambda_times_T": lam * mean_t},
      "preemptions": sum(r.num_preemptions for r in reqs),
      "recomputed_tokens": sum(r.recomputed_tokens for r in reqs),
      "prefix_cached_tokens": sum(r.cached_tokens for r in reqs),
      "steps": len(steps),
      "padding_tokens": sum(s.padded_tokens for s in steps),
      "padding_fraction": (sum(s.padded_tokens for s in steps) /
                           max(sum(s.padded_tokens + s.num_prefill_tokens + s.num_decode_tokens
                                   for s in steps), 1)),
  }


def request_record(r, t0: float = 0.0) -> Dict:
  """One request as a JSON-able dict; times (s) relative to t0."""
  rel = lambda t: None if t is None else t - t0  # noqa: E731
  return {"request_id": r.request_id, "state": r.state.value, "arrival_s": rel(r.arrival_time),
          "admitted_s": rel(r.first_admitted_at),
          "first_token_s": rel(r.token_times[0]) if r.token_times else None,
          "finished_s": rel(r.finished_at), "ttft_s": r.ttft,
          "max_itl_s": max(r.itls, default=None),
          "prompt_tokens": len(r.prompt_token_ids), "output_tokens": len(r.output_token_ids),
          "finish_reason": r.finish_reason, "reject_reason": r.reject_reason,
          "preemptions": r.num_preemptions, "recomputed_tokens": r.recomputed_tokens,
          "cached_tokens": r.cached_tokens, "token_times_s": [t - t0 for t in r.token_times]}


def step_records(steps: Sequence[StepRecord], t0: float = 0.0) -> List[Dict]:
  """Steps as JSON-able dicts; start / end (s) relative to t0."""
  return [dict(dataclasses.asdict(s), start=s.start - t0, end=s.end - t0) for s in steps]
