"""8.5: acceptance, tokens per round, drafting cost and draft length
(configs/chapter/s8_5.py)."""
from __future__ import annotations

import math
from typing import List

from experiments.chapter import Figure, fig
from jaxinfer.buckets import BucketTable
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import ModelCosts, formulas, load_hardware

GIB = 2**30


def compute(i) -> List[Figure]:
  p = tuple(i.target)
  always_a, always_b = (1.0, 0.0), (0.0, 1.0)
  a_aaaa, a_bbbb = formulas.acceptance_rate(p, always_a), formulas.acceptance_rate(p, always_b)
  en = formulas.expected_tokens
  n_a, n_b = en(a_aaaa, i.draft_len), en(a_bbbb, i.draft_len)
  cfg = get_model_config(i.model)
  costs = ModelCosts(cfg)
  hw = load_hardware(i.hardware)
  m = i.draft_len
  extra = (costs.step_flops([(m + 1, i.context)], sampled=m + 1)
           - costs.step_flops([(1, i.context)], sampled=1))
  t = i.plain_round_ms
  rnd = t + i.draft_request_ms
  per_b = rnd / n_b
  saving = t - per_b
  figs = [
      fig("8.5.1", "accept_a", "a draft always A is accepted", a_aaaa, "", "formulas.acceptance_rate"),
      fig("8.5.1", "accept_b", "a draft always B is accepted", a_bbbb, "", "formulas.acceptance_rate"),
      fig("8.5.2", "pooled_ms_per_token", "sum T_r / sum N_r",
          formulas.time_per_token(i.rounds_ms, i.round_tokens), "ms", "formulas.time_per_token"),
      fig("8.5.2", "mean_of_ratios_ms", "the mean of per-round ratios (the wrong average)",
          sum(r / n for r, n in zip(i.rounds_ms, i.round_tokens)) / len(i.rounds_ms), "ms",
          "formulas.time_per_token"),
      fig("8.5.2", "expected_tokens_aaaa", "E[N], draft AAAA", n_a, "tokens",
          "formulas.expected_tokens"),
      fig("8.5.2", "expected_tokens_bbbb", "E[N], draft BBBB", n_b, "tokens",
          "formulas.expected_tokens"),
      fig("8.5.2", "verify_extra_gflop", "matmul work of four more verified rows", extra / 1e9,
          "GFLOP", "ModelCosts.step_flops"),
      fig("8.5.2", "verify_extra_ms", "its time at 62% of peak",
          1e3 * formulas.compute_seconds(extra, hw.peak_flops, i.prefill_mfu), "ms",
          "formulas.compute_seconds"),
      fig("8.5.2", "round_with_draft_ms", "verify + draft request", rnd, "ms", "formulas.time_per_token"),
      fig("8.5.2", "ms_per_token_aaaa", "time per token, AAAA", rnd / n_a, "ms",
          "formulas.time_per_token"),
      fig("8.5.2", "ms_per_token_bbbb", "time per token, BBBB", per_b, "ms", "formulas.time_per_token"),
      fig("8.5.2", "break_even_draft_aaaa_ms", "the draft cost at which AAAA stops paying",
          n_a * t - t, "ms", "formulas.expected_tokens"),
      fig("8.5.2", "break_even_draft_bbbb_ms", "the same for BBBB", n_b * t - t, "ms",
          "formulas.expected_tokens"),
      fig("8.5.2", "saving_per_token_ms", "BBBB saves per token", saving, "ms",
          "formulas.time_per_token"),
      fig("8.5.2", "index_payback_tokens", "tokens that pay back a 2 s index",
          math.ceil(1e3 * i.index_build_s / saving), "tokens", "formulas.time_per_token"),
      fig("8.5.2", "plain_256_s", "256 tokens, plain", i.output_tokens * t / 1e3, "s",
          "formulas.time_per_token"),
      fig("8.5.2", "with_index_256_s", "2 s index, then BBBB",
          i.index_build_s + i.output_tokens * per_b / 1e3, "s", "formulas.time_per_token"),
  ]
  # 8.5.3: one forward of the draft reads its weights at batch 1's effective bandwidth
  draft_bytes = i.draft_weights_gib * GIB
  bw = formulas.bytes_per_round(costs.d_w, 1, i.context, costs.kv_bytes_per_token) / (t / 1e3)
  fwd = 1e3 * formulas.read_seconds(draft_bytes, bw)
  seq = i.draft_tokens * fwd
  n3, n2 = i.tokens_per_round
  src = "formulas.time_per_token"
  figs += [
      fig("8.5.3", "draft_weights_gb", "the draft's weights", draft_bytes / 1e9, "GB",
          "the draft's GiB in GB"),
      fig("8.5.3", "batch1_bandwidth_gbs", "15.44 GB in 26.26 ms", bw / 1e9, "GB/s",
          "formulas.bytes_per_round"),
      fig("8.5.3", "draft_forward_ms", "one forward of the draft", fwd, "ms", "formulas.read_seconds"),
      fig("8.5.3", "sequential_draft_ms", "four forwards", seq, "ms", "formulas.read_seconds"),
      fig("8.5.3", "sequential_ms_per_token", "sequential drafting, 3 tokens per round",
          (seq + t) / n3, "ms", src),
      fig("8.5.3", "parallel_ms_per_token", "parallel drafting, 3 tokens per round",
          (fwd + t) / n3, "ms", src),
      fig("8.5.3", "parallel_two_tokens_ms", "parallel drafting, 2 tokens per round",
          (fwd + t) / n2, "ms", src),
      fig("8.5.3", "parallel_draft_saving_ms", "drafting time saved by one forward", seq - fwd,
          "ms", src),
  ]
  table = BucketTable(token_sizes=tuple(i.verify_rows), request_sizes=(1,), page_table_sizes=(1,))
  figs += [fig("8.5.4", f"verify_rows_for_{n}", f"rows verifying {n} positions runs at",
               table.pad_tokens(n), "rows", "BucketTable.pad_tokens") for n in (5, 9)]
  # exercise 8-7
  for L in i.ex_lengths:
    n = en(i.ex_acceptance, L)
    t_lin = i.ex_verify_ms + i.ex_draft_ms * L
    t_grp = i.ex_verify_ms + i.ex_draft_ms * i.ex_group * math.ceil(L / i.ex_group)
    figs += [fig("ex8-7", f"ex7_tokens_m{L}", f"E[N] for a draft of {L}", n, "tokens",
                 "formulas.expected_tokens"),
             fig("ex8-7", f"ex7_ms_per_token_m{L}", f"time per token, drafts of {L}", t_lin / n,
                 "ms", src),
             fig("ex8-7", f"ex7_grouped_ms_per_token_m{L}", f"time per token, groups of 4, {L}",
                 t_grp / n, "ms", src)]
  return figs
