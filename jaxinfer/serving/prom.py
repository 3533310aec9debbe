"""Prometheus metrics of the server, named `jaxinfer:*` after vLLM's `vllm:*` where one
exists. Updated on the engine thread (arrivals, steps, finishes); exported by /metrics.
Request latencies are on the engine's clock (8.1: TTFT, ITL, E2E, queueing)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:

  def __init__(self, model_name: str):
    self.registry = CollectorRegistry()
    r, lab = self.registry, {"model_name": model_name}

    def counter(name, doc, labels=()):
      return Counter(name, doc, ["model_name", *labels], registry=r)

    def gauge(name, doc):
      return Gauge(name, doc, ["model_name"], registry=r).labels(**lab)

    def hist(name, doc):
      return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                       registry=r).labels(**lab)

    self._lab = lab
    self.running = gauge("jaxinfer:num_requests_running", "Requests in a running batch.")
    self.waiting = gauge("jaxinfer:num_requests_waiting", "Requests waiting for admission.")
    self.pages_used = gauge("jaxinfer:kv_pages_used", "KV pages holding live tokens.")
    self.pages_free = gauge("jaxinfer:kv_pages_free", "KV pages on the free list.")
    self.kv_usage = gauge("jaxinfer:kv_cache_usage_perc", "Fraction of KV pages in use (0-1).")
    self.ttft = hist("jaxinfer:time_to_first_token_seconds", "Arrival to first token.")
    self.itl = hist("jaxinfer:inter_token_latency_seconds", "Time between output tokens.")
    self.e2e = hist("jaxinfer:e2e_request_latency_seconds", "Arrival to the last token.")
    self.queue = hist("jaxinfer:request_queue_time_seconds", "Arrival to first admission.")
    self.step = hist("jaxinfer:step_duration_seconds", "One engine step (launch to finish).")
    self.prompt_tokens = counter("jaxinfer:prompt_tokens", "Prompt tokens of finished "
                                 "requests.").labels(**lab)
    self.generation_tokens = counter("jaxinfer:generation_tokens", "Generated tokens.").labels(
        **lab)
    self.finished = counter("jaxinfer:request_success", "Requests that ended, by reason "
                            "(stop, length, abort, rejected, error).", ("finished_reason",))
    self.preemptions = counter("jaxinfer:num_preemptions", "Preemptions (8.3.2).").labels(**lab)
    self.padding = counter("jaxinfer:padding_tokens", "Bucket padding tokens computed "
                           "(8.2.4).").labels(**lab)
    self.prefix_queries = counter("jaxinfer:prefix_cache_queries", "Prompt tokens looked up "
                                  "in the prefix cache.").labels(**lab)
    self.prefix_hits = counter("jaxinfer:prefix_cache_hits", "Prompt tokens served by the "
                               "prefix cache.").labels(**lab)
    self.good = counter("jaxinfer:goodput_requests", "Finished requests that met their "
                        "deadline (8.6.2; no deadline counts as met).").labels(**lab)
    self.http_rejected = counter("jaxinfer:http_rejected", "Requests refused before the "
                                 "engine, by HTTP status.", ("status",))

  # --- engine thread -------------------------------------------------------------------------
  def on_step(self, record, engine) -> None:
    self.step.observe(record.duration)
    self.padding.inc(record.padded_tokens)
    if record.num_preempted:
      self.preemptions.inc(record.num_preempted)
    self.refresh(engine)

  def refresh(self, engine) -> None:
    reps = engine.replicas  # summed over data-parallel replicas
    self.running.set(sum(len(e.scheduler.running) for e in reps))
    self.waiting.set(sum(len(e.scheduler.waiting) for e in reps))
    free = sum(e.pm.num_free for e in reps)
    total = sum(e.pm.num_pages for e in reps)
    self.pages_free.set(free)
    self.pages_used.set(total - free)
    self.kv_usage.set((total - free) / total)

  def on_finish(self, r) -> None:
    self.finished.labels(finished_reason=r.finish_reason or "unknown", **self._lab).inc()
    self.generation_tokens.inc(len(r.output_token_ids))
    self.prompt_tokens.inc(len(r.prompt_token_ids))
    if r.first_admitted_at is not None:
      self.prefix_queries.inc(len(r.prompt_token_ids))
      self.prefix_hits.inc(r.cached_tokens)
      self.queue.observe(max(r.first_admitted_at - r.arrival_time, 0.0))
    if r.ttft is not None:
      self.ttft.observe(r.ttft)
    for x in r.itls:
      self.itl.observe(x)
    if r.finish_reason in ("stop", "length"):
      if r.latency is not None:
        self.e2e.observe(r.latency)
      if r.on_time:
        self.good.inc()

  # --- event loop ----------------------------------------------------------------------------
  def rejected(self, status: int) -> None:
    self.http_rejected.labels(status=str(status), **self._lab).inc()

  def export(self) -> bytes:
    return generate_latest(self.registry)
