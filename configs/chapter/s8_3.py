"""Chapter 8.3 (the KV cache: paging, sharing, prefix reuse, what to keep): inputs, and
the figures the chapter states: (section, figure, value as printed, kind[, reason])."""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  # 8.3.1: four sequences, at most 16 tokens each, pages of 4; A and B share 8 tokens
  i.lengths = (9, 13, 5, 15)
  i.max_len = 16
  i.page_size = 4
  i.shared_tokens = 8
  i.exercise_page_sizes = (2, 4, 8)  # exercise 8-3
  # 8.3.2: four branches over a 95-page prefix, 9 private pages each
  i.branches = 4
  i.prefix_pages = 95
  i.private_pages = 9
  # the chapter's long requests (8.1) sharing their prefix
  i.model = "qwen3-8b"
  i.kv_format = "bf16"
  i.kv_page_size = 16
  i.kv_budget_gib = 12.0
  i.long_input = 8192
  i.shared_prefix = 6144
  i.output_tokens = 256
  i.long_requests = 16
  i.exercise_requests = (8, 16, 32)
  # 8.3.2's preemption (1 GiB: one preemption; 2 GiB: none) on the simulator; the chapter
  # gives the pools, not the workload: three requests of 2304 + 256 tokens stand in
  i.preempt_pools_gib = (1.0, 2.0)
  i.preempt_requests = 3
  i.preempt_input = 2304
  i.preempt_output = 256
  # 8.3.2's cancellation (104 blocks freed) measured on this CPU: a request of ~100 pages
  # cancelled while a step reading them runs (cpu_cancel=False skips it: it loads and
  # compiles the real model)
  i.cpu_cancel = True
  i.cancel_model = "smollm2-135m-instruct"
  i.cancel_prompt_tokens = 1600
  i.cancel_batch = 2
  i.cancel_repeats = 3
  # 8.3.3: a match up to token 10,752, recurrent snapshots every 4096 tokens, 53.6 MiB each
  i.match_tokens = 10752
  i.snapshot_interval = 4096
  i.snapshot_mib = 53.6
  i.snapshot_counts = (1, 2, 32)
  # 8.3.4: prefixes A (6144 tokens) and B (2048), recomputed at batch 1's prefill MFU,
  # fetched over the card's host link; upkeep = one transfer
  i.hardware = "rtx-pro-6000"  # PCIe Gen5 x16, 64 GB/s per direction
  i.slow_link_hardware = "a100-80gb"  # PCIe Gen4 x16, 32 GB/s per direction
  i.prefix_a = 6144
  i.prefix_b = 2048
  i.num_b = 3
  i.p_hit = 0.5
  i.prefill_mfu = 0.62
  # 8.3.4's replay of an agent: 12 rounds, 19,556 input tokens in all, the first rounds
  # sharing a 206-token root (8.3.3), pools of 6 GiB and 1 GiB. The chapter prints neither
  # the tool results' nor the replies' lengths: 185 and 40 make the session's input
  # 19,542 tokens. Nor does it size the interfering requests; a 1 GiB pool (7,281 tokens)
  # hit nothing, so between rounds they filled it: two of 4000 tokens a round.
  i.replay_rounds = 12
  i.replay_pools_gib = (6.0, 1.0)
  i.replay_session = ml_collections.ConfigDict(dict(
      system_tokens=206, result_tokens=185, reply_tokens=40, interfering=2,
      interfering_tokens=4000))
  c.stated = (
      ("8.3.1", "whole_segment_slots", "64", "worked"),
      ("8.3.1", "paged_slots", "52", "worked"),
      ("8.3.1", "paged_slots_a", "12", "worked"),
      ("8.3.1", "paged_slots_b", "16", "worked"),
      ("8.3.1", "paged_slots_c", "8", "worked"),
      ("8.3.1", "paged_slots_d", "16", "worked"),
      ("8.3.1", "stored_tokens", "42", "worked"),
      ("8.3.1", "unused_whole_segment", "22", "worked"),
      ("8.3.1", "unused_paged", "10", "worked"),
      ("8.3.1", "shared_slots", "44", "worked"),
      ("8.3.2", "branch_references", "416", "worked"),
      ("8.3.2", "branch_physical_pages", "131", "worked"),
      ("8.3.2", "branch_saving_pct", "69", "worked"),
      ("8.3.2", "branch_private_pages", "36", "worked"),
      ("8.3.2", "private_tokens", "2303", "worked"),
      ("8.3.2", "private_slots", "2304", "worked"),
      ("8.3.2", "private_mib", "324", "worked"),
      ("8.3.2", "prefix_mib", "864", "worked"),
      ("8.3.2", "shared_total_mib", "6048", "worked"),
      ("8.3.2", "independent_total_mib", "19008", "worked"),
      ("8.3.2", "shared_total_gib", "5.91", "worked"),
      ("8.3.2", "fit_independent", "10", "worked"),
      ("8.3.2", "fit_shared", "35", "worked"),
      ("8.3.2", "cancel_return_ms", "1.6", "gpu"),
      ("8.3.2", "cancel_freed_ms", "31", "gpu"),
      ("8.3.2", "cancel_blocks", "104", "gpu"),
      ("8.3.2", "preemption_extra_tokens", "1805", "gpu"),
      ("8.3.3", "hit_tokens_left", "2048", "worked"),
      ("8.3.3", "restore_from", "8192", "worked"),
      ("8.3.3", "recompute_tokens", "2560", "worked"),
      ("8.3.3", "snapshots_1_mib", "53.6", "worked"),
      ("8.3.3", "snapshots_2_mib", "107", "worked"),
      ("8.3.3", "snapshots_32_mib", "1714", "worked"),
      ("8.3.3", "v41_long_term_share", "0.125", "quoted"),
      ("8.3.4", "prefix_a_mib", "864", "worked"),
      ("8.3.4", "prefix_a_gb", "0.906", "worked"),
      ("8.3.4", "prefix_a_tflop", "96.5", "worked"),
      ("8.3.4", "prefix_a_recompute_ms", "307.9", "worked"),
      ("8.3.4", "prefix_a_fetch_ms", "14.2", "worked"),
      ("8.3.4", "prefix_a_value_ms", "132.7", "worked"),
      ("8.3.4", "prefix_a_saving_per_hit_ms", "293.7", "worked"),
      ("8.3.4", "prefix_a_threshold_pct", "4.8", "worked"),
      ("8.3.4", "gen4_fetch_ms", "28.3", "worked"),
      ("8.3.4", "gen4_saving_per_hit_ms", "279.6", "worked"),
      ("8.3.4", "gen4_threshold_pct", "10.1", "worked"),
      ("8.3.4", "prefix_b_mib", "288", "worked"),
      ("8.3.4", "prefix_b_recompute_ms", "94.7", "worked"),
      ("8.3.4", "prefix_b_fetch_ms", "4.7", "worked"),
      ("8.3.4", "prefix_b_value_ms", "40.3", "worked"),
      ("8.3.4", "three_b_value_ms", "120.9", "worked"),
      ("8.3.4", "recompute_ratio_a_b", "3.25", "worked"),
      ("8.3.4", "prefix_a_per_mib", "0.154", "worked"),
      ("8.3.4", "prefix_b_per_mib", "0.140", "worked"),
      ("8.3.4", "replay_input_tokens", "19556", "gpu"),
      ("8.3.4", "replay_hit_tokens_6gib", "16304", "gpu"),
      ("8.3.4", "replay_recomputed_6gib", "3252", "gpu"),
      ("8.3.4", "replay_hit_tokens_1gib", "0", "gpu"),
  )
  return c
