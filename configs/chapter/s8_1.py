"""Chapter 8.1 (requests, lifecycle and memory): inputs, and the figures the chapter states.

Inputs come from the chapter's opening (the instance and its workload) and experiment
8-1's measurements on the RTX PRO 6000; `stated` holds what the chapter prints, kept as
printed: (section, figure, value, kind[, reason]).
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  i.model = "qwen3-8b"  # 36 layers, 8 KV heads of 128, BF16 (configs of jaxinfer.config)
  i.weight_bytes_per_param = 2.0
  i.kv_format = "bf16"
  i.page_size = 16
  i.instance_gib = 32.0  # the instance's share of the card
  i.kv_budget_gib = 12.0  # KV and auxiliary buffers
  i.short_input = 2048
  i.long_input = 8192
  i.output_tokens = 256
  i.shared_prefix = 6144
  i.long_requests = 16
  i.deadline_s = 7.0
  # experiment 8-1, one short request alone (8.1.1)
  i.queue_s = 0.1
  i.prefill_s = 0.096  # prefill + first token
  i.client_itl_s = 0.0265  # one token every 26.5 ms as the client sees it
  # experiment 8-1's decode rounds (8.1.3)
  i.round_b1_s = 0.02626
  i.round_b16_s = 0.02744
  c.stated = (
      ("8.1", "weights_gib", "15.3", "worked"),
      ("8.1", "workspace_gib", "4.7", "worked"),
      ("8.1", "request_time_s", "6.95", "worked"),
      ("8.1", "deadline_margin_s", "0.05", "worked"),
      ("8.1.1", "request_time_s_811", "6.95", "worked"),
      ("8.1.1", "interleaved_gap_ms", "123", "worked"),
      ("8.1.1", "interleaved_total_s", "7.05", "worked"),
      ("8.1.2", "kv_per_token_bytes", "147456", "worked"),
      ("8.1.2", "kv_per_token_kib", "144", "worked"),
      ("8.1.2", "kv_short_input_mib", "288", "worked"),
      ("8.1.2", "kv_long_input_mib", "1152", "worked"),
      ("8.1.2", "kv_long_input_gib", "1.125", "worked"),
      ("8.1.2", "kv_16_long_inputs_gib", "18", "worked"),
      ("8.1.2", "short_tokens_computed", "2303", "worked"),
      ("8.1.2", "long_tokens_computed", "8447", "worked"),
      ("8.1.2", "short_slots", "2304", "worked"),
      ("8.1.2", "long_slots", "8448", "worked"),
      ("8.1.2", "short_end_mib", "324", "worked"),
      ("8.1.2", "long_end_mib", "1188", "worked"),
      ("8.1.2", "short_fit", "37", "worked"),
      ("8.1.2", "long_fit", "10", "worked"),
      ("8.1.2", "short_fit_at_prefill", "42", "worked"),
      ("8.1.2", "short_fit_at_prefill_end_mib", "13608", "worked"),
      ("8.1.2", "shared_prefix_mib", "864", "worked"),
      ("8.1.2", "long_rest_mib", "288", "worked"),
      ("8.1.3", "ttft_s", "0.196", "worked"),
      ("8.1.3", "itl_sum_s", "6.76", "worked"),
      ("8.1.3", "throughput_b16", "583", "worked"),
      ("8.1.3", "throughput_b1", "38", "worked"),
  )
  return c
