"""Chapter 8.6 (serving a request stream; configuration and cost): inputs, and the figures
the chapter states: (section, figure, value as printed, kind[, reason])."""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  # 8.6.1: Little's law
  i.arrival_rate = 4.0
  i.times_in_system = (0.5, 2.0)
  i.ttft_s = 0.196  # the short request of 8.1
  i.itl_s = 0.0265
  i.output_tokens = 256
  # 8.6.3: experiment 8-1 on the RTX PRO 6000, 2K context, no shared prefix
  i.model = "qwen3-8b"
  i.hardware = "rtx-pro-6000"
  i.context = 2048
  i.batches = (1, 4, 16, 64)
  i.rounds_ms = (26.26, 26.62, 27.44, 29.63)
  # the long requests: 8K in, first 6K cached, batch 16 (measured: prefill and rounds)
  i.input_tokens = 8192
  i.shared_prefix = 6144
  i.num_requests = 16
  i.kv_budget_gib = 12.0
  i.small_budget_gib = 6.0
  i.short_output = 16
  i.deadline_s = 7.0
  i.measured_prefill_s = 2.04
  i.measured_round_ms = 27.35
  i.prefill_mfu_b16 = 0.58
  # experiment 8-5 (DFlash draft): process peaks and TTFTs without and with the draft
  i.peak_mib = (17706, 20894)
  i.ttft_ms = (129.4, 141.6)
  i.draft_tokens_per_round = 3
  i.draft_verify_positions = 8
  # exercise 8-9: context-lookup drafts
  i.lookup_tokens_per_round = 2
  i.lookup_round_ms = 0.1
  # 8.6.2's stream on the simulator: arrivals, rates; the task the chapter's runs always
  # got wrong (its 42 errors were one task's; which one it does not say)
  i.goodput_process = "poisson"
  i.goodput_deadline_s = 3.0
  i.goodput_rates = (1.0, 4.0, 16.0)
  i.goodput_wrong_task = 4
  # Amdahl: a 100 s agent task, decode sped up 4x
  i.task_s = 100.0
  i.decode_shares = (0.5, 0.2)
  i.speedup = 4.0
  # exercise 8-8: prefill, decode, tools (s); draft preparation
  i.task_parts_s = (20.0, 50.0, 30.0)
  i.prep_s = 8.0
  c.stated = (
      ("8.6.1", "little_n_fast", "2", "worked"),
      ("8.6.1", "little_n_slow", "8", "worked"),
      ("8.6.1", "admission_request_s", "6.95", "worked"),
      ("8.6.2", "answers", "336", "gpu"),
      ("8.6.2", "correct", "294", "gpu"),
      ("8.6.2", "correct_on_time", "155", "gpu"),
      ("8.6.2", "correct_late", "139", "gpu"),
      ("8.6.2", "goodput_rate1", "0.90", "gpu"),
      ("8.6.2", "sequential_completion_rate4", "1.22", "gpu"),
      ("8.6.2", "sequential_goodput_rate4", "0.31", "gpu"),
      ("8.6.2", "continuous_completion_rate4", "2.33", "gpu"),
      ("8.6.2", "continuous_goodput_rate4", "1.02", "gpu"),
      ("8.6.2", "continuous_completion_rate16", "2.38", "gpu"),
      ("8.6.2", "continuous_goodput_rate16", "0.60", "gpu"),
      ("8.6.2", "goodput_drop_16_pct", "41", "gpu"),
      ("8.6.3", "read_b1_gb", "15.44", "worked"),
      ("8.6.3", "read_b4_gb", "16.34", "worked"),
      ("8.6.3", "read_b16_gb", "19.97", "worked"),
      ("8.6.3", "read_b64_gb", "34.46", "worked"),
      ("8.6.3", "read_b1_ms", "8.62", "worked"),
      ("8.6.3", "read_b4_ms", "9.12", "worked"),
      ("8.6.3", "read_b16_ms", "11.14", "worked"),
      ("8.6.3", "read_b64_ms", "19.23", "worked"),
      ("8.6.3", "mbu_b1_pct", "33", "worked"),
      ("8.6.3", "mbu_b4_pct", "34", "worked"),
      ("8.6.3", "mbu_b16_pct", "41", "worked"),
      ("8.6.3", "mbu_b64_pct", "65", "worked"),
      ("8.6.3", "host_overhead_b1_ms", "17.6", "worked"),
      ("8.6.3", "r_prefill", "16059", "worked"),
      ("8.6.3", "r_decode", "585", "worked"),
      ("8.6.3", "gpu_s_per_request", "0.563", "worked"),
      ("8.6.3", "gpu_s_16", "9.01", "worked"),
      ("8.6.3", "a_prefill_s", "7.34", "worked"),
      ("8.6.3", "a_prefill_tflop", "2137.5", "worked"),
      ("8.6.3", "a_round_gb", "34.46", "worked"),
      ("8.6.3", "a_round_ms", "29.63", "worked"),
      ("8.6.3", "b_prefill_s", "2.04", "worked"),
      ("8.6.3", "b_round_ms", "27.35", "worked"),
      ("8.6.3", "c_round_gb", "25.40", "worked"),
      ("8.6.3", "c_round_ms", "28.26", "worked"),
      ("8.6.3", "d_prefill_s", "2.23", "worked"),
      ("8.6.3", "d_rounds", "85", "worked"),
      ("8.6.3", "d_verify_tflop", "2.56", "worked"),
      ("8.6.3", "d_verify_ms", "8.8", "worked"),
      ("8.6.3", "d_extra_memory_gib", "3.1", "worked"),
      ("8.6.3", "d_prefill_overhead_pct", "9.4", "worked"),
      ("8.6.3", "a_memory_mib", "19008", "worked"),
      ("8.6.3", "b_memory_mib", "6048", "worked"),
      ("8.6.3", "b_memory_gib", "5.91", "worked"),
      ("8.6.3", "c_memory_gib", "9.86", "worked"),
      ("8.6.3", "d_memory_mib", "9236", "worked"),
      ("8.6.3", "d_memory_gib", "9.02", "worked"),
      ("8.6.3", "b_total_s", "9.01", "worked"),
      ("8.6.3", "b_measured_request_s", "9.02", "gpu"),
      ("8.6.3", "b_decode_s", "6.97", "worked"),
      ("8.6.3", "c_total_s", "14.55", "worked"),
      ("8.6.3", "d_total_s", "4.56", "worked"),
      ("8.6.3", "d_gpu_s_per_good", "0.285", "worked"),
      ("8.6.3", "d_joules_per_good", "171", "worked"),
      ("8.6.3", "feasible_variants", "1", "worked"),
      ("8.6.3", "feasible_variants_6gib", "0", "worked"),
      ("8.6.3", "b_total_16_out_s", "2.45", "worked"),
      ("8.6.3", "d_total_16_out_s", "2.37", "worked"),
      ("8.6.3", "d_ahead_16_out_s", "0.08", "worked"),
      ("8.6.3", "d_extra_prefill_s", "0.19", "worked"),
      ("8.6.3", "amdahl_half_task_s", "62.5", "worked"),
      ("8.6.3", "amdahl_half_speedup", "1.6", "worked"),
      ("8.6.3", "amdahl_fifth_task_s", "85", "worked"),
      ("8.6.3", "amdahl_fifth_speedup", "1.18", "worked"),
      ("8.6.3", "joules_per_good_rate1", "615.0", "gpu"),
      ("8.6.3", "joules_per_good_rate4", "652.0", "gpu"),
      ("8.6.3", "joules_per_good_rate16", "1083.7", "gpu"),
      ("8.6.3", "joules_per_good_sequential4", "1982.3", "gpu"),
      ("8.6.3", "joules_rate16_over_rate4_pct", "66", "gpu"),
  )
  return c
