"""8.1: a request's timeline and the memory of weights and KV (configs/chapter/s8_1.py)."""
from __future__ import annotations

from typing import List

from experiments.chapter import Figure, fig
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import formulas
from jaxinfer.costmodel.accounting import capacity, pages_for
from jaxinfer.kv import bytes_per_token

MIB, GIB = 2**20, 2**30


def compute(i) -> List[Figure]:
  cfg = get_model_config(i.model)
  k = bytes_per_token(cfg, i.kv_format, i.page_size)
  budget = i.kv_budget_gib * GIB
  weights = cfg.weight_bytes(i.weight_bytes_per_param)
  t = formulas.request_time(i.queue_s + i.prefill_s, i.client_itl_s, i.output_tokens)
  short = capacity(k, budget, i.short_input, i.output_tokens, i.page_size)
  long_ = capacity(k, budget, i.long_input, i.output_tokens, i.page_size)
  fit_at_prefill = int(budget // short.kv_after_prefill_bytes)
  shared = capacity(k, budget, i.long_input, i.output_tokens, i.page_size, i.shared_prefix)
  req = "formulas.request_time"
  cap = "accounting.capacity"
  return [
      fig("8.1", "weights_gib", "Qwen3-8B's BF16 weights", weights / GIB, "GiB",
          "ModelConfig.weight_bytes"),
      fig("8.1", "workspace_gib", "left of the instance for activations and workspace",
          i.instance_gib - i.kv_budget_gib - weights / GIB, "GiB", "ModelConfig.weight_bytes"),
      fig("8.1", "request_time_s", "a short request alone: queue + prefill + 255 ITLs", t, "s", req),
      fig("8.1", "deadline_margin_s", "left to the deadline", i.deadline_s - t, "s", req),
      fig("8.1.1", "request_time_s_811", "the same request's time (8.1.1)", t, "s", req),
      fig("8.1.1", "interleaved_gap_ms", "one gap when another short prompt's prefill runs inside",
          1e3 * (i.client_itl_s + i.prefill_s), "ms", req),
      fig("8.1.1", "interleaved_total_s", "the request's time with that gap", t + i.prefill_s,
          "s", req),
      fig("8.1.2", "kv_per_token_bytes", "k = 2 x layers x KV heads x head dim x bytes", k, "B",
          "kv.bytes_per_token"),
      fig("8.1.2", "kv_per_token_kib", "k", k / 1024, "KiB", "kv.bytes_per_token"),
      fig("8.1.2", "kv_short_input_mib", "KV of a 2,048-token input", short.kv_after_prefill_bytes
          / MIB, "MiB", cap),
      fig("8.1.2", "kv_long_input_mib", "KV of an 8,192-token input",
          long_.kv_after_prefill_bytes / MIB, "MiB", cap),
      fig("8.1.2", "kv_long_input_gib", "each more long request's KV",
          long_.kv_after_prefill_bytes / GIB, "GiB", cap),
      fig("8.1.2", "kv_16_long_inputs_gib", "16 long requests' input KV",
          i.long_requests * long_.kv_after_prefill_bytes / GIB, "GiB", cap),
      fig("8.1.2", "short_tokens_computed", "L + G - 1, short", i.short_input + i.output_tokens - 1,
          "tokens", cap),
      fig("8.1.2", "long_tokens_computed", "L + G - 1, long", i.long_input + i.output_tokens - 1,
          "tokens", cap),
      fig("8.1.2", "short_slots", "slots in pages of 16, short", i.page_size * pages_for(
          i.short_input + i.output_tokens - 1, i.page_size), "tokens", "accounting.pages_for"),
      fig("8.1.2", "long_slots", "slots in pages of 16, long", i.page_size * pages_for(
          i.long_input + i.output_tokens - 1, i.page_size), "tokens", "accounting.pages_for"),
      fig("8.1.2", "short_end_mib", "a short request's reservation", short.kv_end_bytes / MIB,
          "MiB", cap),
      fig("8.1.2", "long_end_mib", "a long request's reservation", long_.kv_end_bytes / MIB,
          "MiB", cap),
      fig("8.1.2", "short_fit", "short requests that fit 12 GiB", short.requests_fit, "", cap),
      fig("8.1.2", "long_fit", "long requests that fit 12 GiB", long_.requests_fit, "", cap),
      fig("8.1.2", "short_fit_at_prefill", "short requests that fit counting prefill KV only",
          fit_at_prefill, "", cap),
      fig("8.1.2", "short_fit_at_prefill_end_mib", "what those need after 256 tokens",
          fit_at_prefill * short.kv_end_bytes / MIB, "MiB", cap),
      fig("8.1.2", "shared_prefix_mib", "KV of the 6,144-token shared prefix",
          shared.shared_prefix_bytes / MIB, "MiB", cap),
      fig("8.1.2", "long_rest_mib", "KV of the rest of a long input",
          (long_.kv_after_prefill_bytes - shared.shared_prefix_bytes) / MIB, "MiB", cap),
      fig("8.1.3", "ttft_s", "TTFT = t_1 - t_a", i.queue_s + i.prefill_s, "s", req),
      fig("8.1.3", "itl_sum_s", "the 255 ITLs", t - i.queue_s - i.prefill_s, "s", req),
      fig("8.1.3", "throughput_b16", "batch 16: tokens per second",
          formulas.decode_throughput(16, i.round_b16_s), "tok/s", "formulas.decode_throughput"),
      fig("8.1.3", "throughput_b1", "batch 1: tokens per second",
          formulas.decode_throughput(1, i.round_b1_s), "tok/s", "formulas.decode_throughput"),
  ]
