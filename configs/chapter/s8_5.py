"""Chapter 8.5 (speculative decoding): inputs, and the figures the chapter states:
(section, figure, value as printed, kind[, reason])."""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  # 8.5.1-8.5.2: a target over two symbols A, B; drafts of four equal symbols
  i.target = (0.25, 0.75)
  i.draft_len = 4
  i.rounds_ms = (1.5, 1.5)  # two rounds...
  i.round_tokens = (1, 5)  # ...giving 1 and 5 tokens
  i.model = "qwen3-8b"
  i.context = 2048
  i.plain_round_ms = 26.26  # 8-1, batch 1, 2K
  i.prefill_mfu = 0.62
  i.hardware = "rtx-pro-6000"
  i.draft_request_ms = 0.1
  i.index_build_s = 2.0
  i.output_tokens = 256
  # 8.5.3: the DFlash draft network of experiment 8-5
  i.draft_weights_gib = 1.95
  i.draft_tokens = 4
  i.tokens_per_round = (3, 2)
  # 8.5.4: verify shapes captured at 8 and 16 rows
  i.verify_rows = (8, 16)
  # exercise 8-7
  i.ex_acceptance = 0.75
  i.ex_lengths = (1, 2, 4, 5, 8)
  i.ex_verify_ms = 26.3
  i.ex_draft_ms = 3.6
  i.ex_group = 4
  c.stated = (
      ("8.5.1", "accept_a", "0.25", "worked"),
      ("8.5.1", "accept_b", "0.75", "worked"),
      ("8.5.2", "pooled_ms_per_token", "0.5", "worked"),
      ("8.5.2", "mean_of_ratios_ms", "0.9", "worked"),
      ("8.5.2", "expected_tokens_aaaa", "1.33", "worked"),
      ("8.5.2", "expected_tokens_bbbb", "3.05", "worked"),
      ("8.5.2", "verify_extra_gflop", "65", "worked"),
      ("8.5.2", "verify_extra_ms", "0.2", "worked"),
      ("8.5.2", "dflash_round_ms", "15.2", "gpu"),
      ("8.5.2", "dflash_plain_step_ms", "16.9", "gpu"),
      ("8.5.2", "round_with_draft_ms", "26.36", "worked"),
      ("8.5.2", "ms_per_token_aaaa", "19.8", "worked"),
      ("8.5.2", "ms_per_token_bbbb", "8.64", "worked"),
      ("8.5.2", "break_even_draft_aaaa_ms", "8.7", "worked"),
      ("8.5.2", "break_even_draft_bbbb_ms", "53.9", "worked"),
      ("8.5.2", "saving_per_token_ms", "17.6", "worked"),
      ("8.5.2", "index_payback_tokens", "114", "worked"),
      ("8.5.2", "plain_256_s", "6.72", "worked"),
      ("8.5.2", "with_index_256_s", "4.22", "worked"),
      ("8.5.3", "draft_weights_gb", "2.10", "worked"),
      ("8.5.3", "batch1_bandwidth_gbs", "588", "worked"),
      ("8.5.3", "draft_forward_ms", "3.57", "worked"),
      ("8.5.3", "sequential_draft_ms", "14.28", "worked"),
      ("8.5.3", "sequential_ms_per_token", "13.5", "worked"),
      ("8.5.3", "parallel_ms_per_token", "9.9", "worked"),
      ("8.5.3", "parallel_two_tokens_ms", "14.9", "worked"),
      ("8.5.3", "parallel_draft_saving_ms", "10.7", "worked"),
      ("8.5.4", "verify_rows_for_5", "8", "worked"),
      ("8.5.4", "verify_rows_for_9", "16", "worked"),
      ("8.5.4", "k_plain_ms", "90.0", "gpu"),
      ("8.5.4", "k7_ms", "30.6", "gpu"),
      ("8.5.4", "k15_ms", "29.4", "gpu"),
      ("8.5.4", "k7_saving_ms", "59", "gpu"),
      ("8.5.4", "k15_saving_ms", "1.2", "gpu"),
  )
  return c
