"""8.3: paging, sharing and copy-on-write, prefix reuse and snapshots, what a prefix is
worth keeping (configs/chapter/s8_3.py)."""
from __future__ import annotations

from typing import List

import ml_collections
import numpy as np

from experiments.chapter import Figure, fig
from experiments.preemption import measure_cancel, run_pool
from experiments.prefix_reuse import SessionShape, run_session, sim_engine, summarize_run
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import ModelCosts, formulas, load_hardware
from jaxinfer.costmodel.accounting import account, account_branches, capacity, pages_for

MIB, GIB = 2**20, 2**30


def _prefix(i, costs, hw, tokens: int, link: float):
  """(bytes, FLOPs, recompute s, fetch s): 8.3.4's recompute at the prefill MFU and fetch
  over a host link; the upkeep is one transfer."""
  nbytes = tokens * costs.kv_bytes_per_token
  flops = costs.step_flops([(tokens, 0)], sampled=0)
  return (nbytes, flops, formulas.compute_seconds(flops, hw.peak_flops, i.prefill_mfu),
          formulas.read_seconds(nbytes, link))


def _preemption(i) -> List[Figure]:
  """8.3.2's pools of 1 and 2 GiB on the simulator (experiments.preemption): the chapter
  does not give its workload, so the study's stands in (the config's preempt_* fields)."""
  c = ml_collections.ConfigDict({"sim_model": i.model, "num_requests": i.preempt_requests,
                                 "input_tokens": i.preempt_input, "output_tokens": i.preempt_output})
  small, large = (run_pool(c, g) for g in i.preempt_pools_gib)
  src = "simulator (experiments.preemption.run_pool)"
  return [fig("8.3.2", "preemption_extra_tokens", "extra tokens scheduled, smaller pool",
              small["extra_scheduled_tokens"], "tokens", src),
          fig("8.3.2", "preemption_extra_tokens_large_pool", "extra tokens scheduled, larger pool",
              large["extra_scheduled_tokens"], "tokens", src)]


def _cancel(i) -> List[Figure]:
  """8.3.2's cancellation measured on this CPU (SmolLM2, experiments.preemption): a
  request is cancelled while a step reading its pages is in flight."""
  from jaxinfer.llm import LLM
  c = ml_collections.ConfigDict({"cancel_prompt_tokens": i.cancel_prompt_tokens,
                                 "cancel_batch": i.cancel_batch,
                                 "cancel_repeats": i.cancel_repeats})
  pages = -(-(i.cancel_prompt_tokens + 64) // 16)
  llm = LLM(i.cancel_model, warmup=False, max_num_seqs=i.cancel_batch,
            max_num_batched_tokens=512, num_pages=i.cancel_batch * pages + 16,
            max_model_len=i.cancel_prompt_tokens + 64)
  rows = measure_cancel(c, llm)
  med = lambda k: float(np.median([r[k] for r in rows]))
  src = "measured on this CPU (experiments.preemption.measure_cancel)"
  return [fig("8.3.2", "cancel_return_ms", "abort() returns", med("abort_return_ms"), "ms", src),
          fig("8.3.2", "cancel_freed_ms", "its pages free (the step in flight ends)",
              med("pages_free_after_ms"), "ms", src),
          fig("8.3.2", "cancel_blocks", "pages freed", med("freed_after_step"), "pages", src)]


def _replay(i) -> List[Figure]:
  """8.3.4's replay of 12 agent rounds with interfering requests, on the simulator with
  the prefix cache (experiments.prefix_reuse's session: the chapter's own inputs are
  attached data it does not print), in a large and a small pool."""
  out = {}
  for gib in i.replay_pools_gib:
    eng = sim_engine(gib, 0)
    out[gib] = summarize_run(eng, run_session(eng, SessionShape(**i.replay_session), "append",
                                               i.replay_rounds))
  big, small = (out[g] for g in i.replay_pools_gib)
  src = "simulator with the prefix cache (experiments.prefix_reuse)"
  return [fig("8.3.4", "replay_input_tokens", "the session's input tokens",
              big["session_prompt_tokens"], "tokens", src),
          fig("8.3.4", "replay_hit_tokens_6gib", "of them hit, large pool",
              big["session_cached_tokens"], "tokens", src),
          fig("8.3.4", "replay_recomputed_6gib", "recomputed, large pool",
              big["session_prompt_tokens"] - big["session_cached_tokens"], "tokens", src),
          fig("8.3.4", "replay_hit_tokens_1gib", "hit, small pool", small["session_cached_tokens"],
              "tokens", src)]


def compute(i) -> List[Figure]:
  whole, paged, shared = account(i.lengths, i.max_len, i.page_size,
                                 shares=[(0, 1, i.shared_tokens)])
  acc = "accounting.account"
  figs = [
      fig("8.3.1", "whole_segment_slots", "whole-segment reservation", whole.reserved_slots,
          "tokens", acc),
      fig("8.3.1", "paged_slots", "paged allocation", paged.allocated_slots, "tokens", acc),
      *[fig("8.3.1", f"paged_slots_{n}", f"paged, sequence {n.upper()}",
            i.page_size * pages_for(L, i.page_size), "tokens", "accounting.pages_for")
        for n, L in zip("abcd", i.lengths)],
      fig("8.3.1", "stored_tokens", "tokens stored", paged.stored_tokens, "tokens", acc),
      fig("8.3.1", "unused_whole_segment", "unused, whole segments", whole.unused_slots, "tokens",
          acc),
      fig("8.3.1", "unused_paged", "unused, paged", paged.unused_slots, "tokens", acc),
      fig("8.3.1", "shared_slots", "paged with A and B sharing", shared.allocated_slots, "tokens",
          acc),
  ]
  for p in i.exercise_page_sizes:  # exercise 8-3
    _, pg, _ = account(i.lengths, i.max_len, p)
    figs += [fig("ex8-3", f"ex3_unused_p{p}", f"unused slots, pages of {p}", pg.unused_slots,
                 "tokens", acc),
             fig("ex8-3", f"ex3_entries_p{p}", f"page-table entries, pages of {p}",
                 pg.page_table_entries, "", acc)]
  ind, br = account_branches(i.branches, i.prefix_pages, i.private_pages, 1)
  figs += [
      fig("8.3.2", "branch_references", "page-table references of the branches",
          br.page_table_entries, "", "accounting.account_branches"),
      fig("8.3.2", "branch_physical_pages", "physical pages", br.physical_pages, "",
          "accounting.account_branches"),
      fig("8.3.2", "branch_saving_pct", "pages saved against independent copies",
          100 * (1 - br.physical_pages / ind.physical_pages), "%", "accounting.account_branches"),
      fig("8.3.2", "branch_private_pages", "private tail pages", i.branches * i.private_pages, "",
          "accounting.account_branches"),
  ]
  cfg = get_model_config(i.model)
  costs = ModelCosts(cfg, 2.0, i.kv_format, i.kv_page_size)
  k = costs.kv_bytes_per_token
  budget = i.kv_budget_gib * GIB
  cap = capacity(k, budget, i.long_input, i.output_tokens, i.kv_page_size, i.shared_prefix)
  alone = capacity(k, budget, i.long_input, i.output_tokens, i.kv_page_size)
  private_tokens = i.long_input - i.shared_prefix + i.output_tokens - 1
  n = i.long_requests
  total = cap.shared_prefix_bytes + n * cap.private_end_bytes
  figs += [
      fig("8.3.2", "private_tokens", "a request's private tokens", private_tokens, "tokens",
          "accounting.capacity"),
      fig("8.3.2", "private_slots", "in pages of 16", i.kv_page_size * pages_for(
          private_tokens, i.kv_page_size), "tokens", "accounting.pages_for"),
      fig("8.3.2", "private_mib", "a request's private KV", cap.private_end_bytes / MIB, "MiB",
          "accounting.capacity"),
      fig("8.3.2", "prefix_mib", "the shared prefix's KV", cap.shared_prefix_bytes / MIB, "MiB",
          "accounting.capacity"),
      fig("8.3.2", "shared_total_mib", "16 requests sharing the prefix, at the end", total / MIB,
          "MiB", "accounting.capacity"),
      fig("8.3.2", "independent_total_mib", "16 independent requests", n * alone.kv_end_bytes / MIB,
          "MiB", "accounting.capacity"),
      fig("8.3.2", "shared_total_gib", "16 sharing", total / GIB, "GiB", "accounting.capacity"),
      fig("8.3.2", "fit_independent", "requests that fit, independent", alone.requests_fit, "",
          "accounting.capacity"),
      fig("8.3.2", "fit_shared", "requests that fit, sharing", cap.requests_fit, "",
          "accounting.capacity"),
  ]
  figs += _preemption(i) + (_cancel(i) if i.cpu_cancel else [])
  for b in i.exercise_requests:  # exercise 8-3: capacity for b long requests
    figs += [fig("ex8-3", f"ex3_independent_{b}_mib", f"{b} independent requests",
                 b * alone.kv_end_bytes / MIB, "MiB", "accounting.capacity"),
             fig("ex8-3", f"ex3_shared_{b}_mib", f"{b} requests sharing the prefix",
                 (cap.shared_prefix_bytes + b * cap.private_end_bytes) / MIB, "MiB",
                 "accounting.capacity")]
  # one private full page moved into the prefix saves b - 1 pages
  more = capacity(k, budget, i.long_input, i.output_tokens, i.kv_page_size,
                  i.shared_prefix + i.kv_page_size)
  slot = k * i.kv_page_size
  figs.append(fig("ex8-3", "ex3_pages_saved_16", "pages saved for 16 requests when one more page "
                  "is shared", (total - more.shared_prefix_bytes - n * more.private_end_bytes)
                  / slot, "pages", "accounting.capacity"))

  # 8.3.3
  restore = formulas.snapshot_restore(i.match_tokens, i.snapshot_interval)
  figs += [
      fig("8.3.3", "hit_tokens_left", "input left to prefill after a prefix hit",
          i.long_input - i.shared_prefix, "tokens", "accounting.capacity"),
      fig("8.3.3", "restore_from", "the latest snapshot at or before the match", restore,
          "tokens", "formulas.snapshot_restore"),
      fig("8.3.3", "recompute_tokens", "tokens recomputed from it", i.match_tokens - restore,
          "tokens", "formulas.snapshot_restore"),
      *[fig("8.3.3", f"snapshots_{m}_mib", f"{m} snapshots per card", m * i.snapshot_mib, "MiB",
            "snapshots x the size of one") for m in i.snapshot_counts],
  ]

  # 8.3.4
  hw = load_hardware(i.hardware)
  slow = load_hardware(i.slow_link_hardware)
  a_bytes, a_flops, a_tr, a_tf = _prefix(i, costs, hw, i.prefix_a, hw.link_bandwidth)
  b_bytes, _, b_tr, b_tf = _prefix(i, costs, hw, i.prefix_b, hw.link_bandwidth)
  _, _, _, a_tf4 = _prefix(i, costs, hw, i.prefix_a, slow.link_bandwidth)
  _, _, _, b_tf4 = _prefix(i, costs, hw, i.prefix_b, slow.link_bandwidth)
  v = formulas.prefix_value
  va, vb = v(i.p_hit, a_tr, a_tf, a_tf), v(i.p_hit, b_tr, b_tf, b_tf)
  src = "formulas.prefix_value"
  figs += [
      fig("8.3.4", "prefix_a_mib", "prefix A's KV", a_bytes / MIB, "MiB", "kv.bytes_per_token"),
      fig("8.3.4", "prefix_a_gb", "prefix A's KV", a_bytes / 1e9, "GB", "kv.bytes_per_token"),
      fig("8.3.4", "prefix_a_tflop", "matmul work to recompute A", a_flops / 1e12, "TFLOP",
          "ModelCosts.step_flops"),
      fig("8.3.4", "prefix_a_recompute_ms", "T_r of A at 62% of peak", 1e3 * a_tr, "ms",
          "formulas.compute_seconds"),
      fig("8.3.4", "prefix_a_fetch_ms", "T_f = T_m of A over PCIe Gen5", 1e3 * a_tf, "ms",
          "formulas.read_seconds"),
      fig("8.3.4", "prefix_a_value_ms", "V_h of A at p_h = 50%", 1e3 * va, "ms", src),
      fig("8.3.4", "prefix_a_saving_per_hit_ms", "T_r - T_f of A", 1e3 * (a_tr - a_tf), "ms", src),
      fig("8.3.4", "prefix_a_threshold_pct", "the least p_h that pays",
          100 * formulas.hit_probability_threshold(a_tr, a_tf, a_tf), "%",
          "formulas.hit_probability_threshold"),
      fig("8.3.4", "gen4_fetch_ms", "A's fetch over PCIe Gen4", 1e3 * a_tf4, "ms",
          "formulas.read_seconds"),
      fig("8.3.4", "gen4_saving_per_hit_ms", "T_r - T_f over Gen4", 1e3 * (a_tr - a_tf4), "ms", src),
      fig("8.3.4", "gen4_threshold_pct", "the least p_h over Gen4",
          100 * formulas.hit_probability_threshold(a_tr, a_tf4, a_tf4), "%",
          "formulas.hit_probability_threshold"),
      fig("8.3.4", "prefix_b_mib", "a prefix B's KV", b_bytes / MIB, "MiB", "kv.bytes_per_token"),
      fig("8.3.4", "prefix_b_recompute_ms", "T_r of B", 1e3 * b_tr, "ms", "formulas.compute_seconds"),
      fig("8.3.4", "prefix_b_fetch_ms", "T_f of B", 1e3 * b_tf, "ms", "formulas.read_seconds"),
      fig("8.3.4", "prefix_b_value_ms", "V_h of B", 1e3 * vb, "ms", src),
      fig("8.3.4", "three_b_value_ms", "three B in A's space", 1e3 * i.num_b * vb, "ms", src),
      fig("8.3.4", "recompute_ratio_a_b", "T_r of A / T_r of B", a_tr / b_tr, "x",
          "formulas.compute_seconds"),
      fig("8.3.4", "prefix_a_per_mib", "A's saving per MiB",
          1e3 * formulas.saving_per_mib(i.p_hit, a_tr, a_tf, a_tf, a_bytes), "ms/MiB",
          "formulas.saving_per_mib"),
      fig("8.3.4", "prefix_b_per_mib", "B's saving per MiB",
          1e3 * formulas.saving_per_mib(i.p_hit, b_tr, b_tf, b_tf, b_bytes), "ms/MiB",
          "formulas.saving_per_mib"),
  ]
  figs += _replay(i)
  # exercise 8-4: A's hit probability below which three B save more; the same over Gen4
  p_switch = (i.num_b * vb + a_tf) / (a_tr - a_tf)
  vb4 = v(i.p_hit, b_tr, b_tf4, b_tf4)
  figs += [
      fig("ex8-4", "ex4_switch_p_hit_pct", "A's p_h below which three B win", 100 * p_switch, "%",
          src),
      fig("ex8-4", "ex4_gen4_a_value_ms", "V_h of A over Gen4", 1e3 * v(i.p_hit, a_tr, a_tf4, a_tf4),
          "ms", src),
      fig("ex8-4", "ex4_gen4_three_b_value_ms", "three B over Gen4", 1e3 * i.num_b * vb4, "ms", src),
      fig("ex8-4", "ex4_gen4_switch_p_hit_pct", "A's p_h below which three B win, Gen4",
          100 * (i.num_b * vb4 + a_tf4) / (a_tr - a_tf4), "%", src),
  ]
  return figs
