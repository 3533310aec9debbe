"""Chapter 8.4 (compression and offload): inputs, and the figures the chapter states:
(section, figure, value as printed, kind[, reason])."""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  # 8.4.1: GGML's Q2_K block (its size from the gguf package), 2-bit codes
  i.weight_format = "Q2_K"
  i.code_bits = 2
  # a Q2_K file of Qwen3-235B-A22B, mixed types, as its headers give it (bytes)
  i.file_payload_bytes = 69_178_275_840
  i.file_metadata_bytes = 16_506_720_256
  i.file_header_bytes = 6_006_016
  i.other_file_gib = 81.97  # UD-Q2_K_XL
  i.machine = "m2-max"  # 96 GB unified memory (decimal)
  i.system_reserve_gib = 8.0
  i.big_model = "qwen3-235b-a22b"
  i.contexts = (8192, 32768)
  # 8.4.2: the chapter's model, an 8K context, the long request at its end
  i.model = "qwen3-8b"
  i.mla_model = "deepseek-v3"
  i.context = 8192
  i.output_tokens = 256
  i.shared_prefix = 6144
  i.page_size = 16
  i.long_requests = 16
  i.hardware = "rtx-pro-6000"
  i.read_mbu = 0.65  # 8-1's MBU of a read-bound step (batch 64)
  i.convert_ms = (0.2, 0.8)
  # fitted H100 ITLs for Llama-3.1-8B, ms = a + b L
  i.bf16_line = (6.44, 4.37e-5)
  i.fp8_line = (6.58, 2.37e-5)
  i.line_contexts = (2048, 16384)
  # 8.4.3: every fourth layer's FFN to host memory; 1 or 2 prefetch buffers
  i.offload_every = 4
  i.decode_round_ms = 26.26  # 8-1, batch 1
  i.offload_batch = 4
  i.decode_steps = 255
  i.fast_link_hardware = "gh200"  # NVLink-C2C, 450 GB/s per direction
  i.copy_budget_s = 1.0  # exercise 8-5
  # compressed transfer: 96 MiB compressed to a quarter
  i.transfer_mib = 96.0
  i.compressed_ratio = 0.25
  c.stated = (
      ("8.4.1", "q2k_code_bytes", "64", "worked"),
      ("8.4.1", "q2k_metadata_bytes", "20", "worked"),
      ("8.4.1", "q2k_block_bytes", "84", "worked"),
      ("8.4.1", "q2k_bits_per_value", "2.625", "worked"),
      ("8.4.1", "q2k_metadata_pct", "24", "worked"),
      ("8.4.1", "file_payload_gib", "64.43", "worked"),
      ("8.4.1", "file_metadata_gib", "15.37", "worked"),
      ("8.4.1", "file_total_gib", "79.81", "worked"),
      ("8.4.1", "other_file_gib", "81.97", "quoted"),
      ("8.4.1", "machine_usable_gib", "81.41", "worked"),
      ("8.4.1", "left_after_file_gib", "1.60", "worked"),
      ("8.4.1", "other_file_over_gib", "0.56", "worked"),
      ("8.4.1", "kv_8k_gib", "1.47", "worked"),
      ("8.4.1", "left_after_one_request_gib", "0.13", "worked"),
      ("8.4.1", "kv_32k_gib", "5.88", "worked"),
      ("8.4.1", "file_difference_gib", "2.16", "worked"),
      ("8.4.2", "kv_8k_bf16_mib", "1152", "worked"),
      ("8.4.2", "kv_8k_mla_mib", "549", "worked"),
      ("8.4.2", "kv_8k_q8_mib", "612", "worked"),
      ("8.4.2", "kv_8k_q4_mib", "324", "worked"),
      ("8.4.2", "q8_saving_mib", "540", "worked"),
      ("8.4.2", "q4_saving_mib", "828", "worked"),
      ("8.4.2", "q8_bits", "8.5", "worked"),
      ("8.4.2", "q4_bits", "4.5", "worked"),
      ("8.4.2", "long_end_q8_mib", "631.125", "worked"),
      ("8.4.2", "sixteen_q8_gib", "9.86", "worked"),
      ("8.4.2", "effective_bandwidth_tbs", "1.16", "worked"),
      ("8.4.2", "read_saving_ms", "0.487", "worked"),
      ("8.4.2", "net_gain_fast_convert_ms", "0.287", "worked"),
      ("8.4.2", "net_gain_slow_convert_ms", "-0.313", "worked"),
      ("8.4.2", "fp8_crossover_tokens", "7000", "worked"),
      ("8.4.2", "bf16_itl_2k_ms", "6.53", "worked"),
      ("8.4.2", "fp8_itl_2k_ms", "6.63", "worked"),
      ("8.4.2", "bf16_itl_16k_ms", "7.16", "worked"),
      ("8.4.2", "fp8_itl_16k_ms", "6.97", "worked"),
      ("8.4.2", "v41_state_mib", "9.531", "quoted"),
      ("8.4.2", "v4_state_mib", "30.521", "quoted"),
      ("8.4.2", "v4_over_v41", "3.20", "quoted"),
      ("8.4.2", "v4_over_v41_global", "3.95", "quoted"),
      ("8.4.3", "ffn_set_mib", "288", "worked"),
      ("8.4.3", "offloaded_sets", "9", "worked"),
      ("8.4.3", "freed_mib", "2592", "worked"),
      ("8.4.3", "net_one_buffer_mib", "2304", "worked"),
      ("8.4.3", "net_two_buffers_mib", "2016", "worked"),
      ("8.4.3", "extra_inputs_one_buffer", "2", "worked"),
      ("8.4.3", "extra_inputs_two_buffers", "1", "worked"),
      ("8.4.3", "extra_requests_one_buffer", "1", "worked"),
      ("8.4.3", "extra_requests_two_buffers", "1", "worked"),
      ("8.4.3", "copied_gb", "2.72", "worked"),
      ("8.4.3", "copy_pcie_ms", "42.5", "worked"),
      ("8.4.3", "offload_throughput", "94", "worked"),
      ("8.4.3", "copy_pcie_255_s", "10.8", "worked"),
      ("8.4.3", "copy_c2c_ms", "6.0", "worked"),
      ("8.4.3", "copy_c2c_255_s", "1.54", "worked"),
      ("8.4.3", "direct_transfer_ms", "1.57", "worked"),
      ("8.4.3", "compressed_transfer_ms", "0.39", "worked"),
      ("8.4.3", "compressed_saving_ms", "1.18", "worked"),
      ("8.4.3", "min_decompress_gbs", "85.3", "worked"),
      ("8.4.4", "bf16_correct", "28", "gpu"),
      ("8.4.4", "fp8_correct", "26", "gpu"),
      ("8.4.4", "fp8_kv_bf16_q_correct", "28", "gpu"),
      ("8.4.4", "retry_seconds", "2.0", "gpu"),
      ("8.4.4", "retry_tokens", "92", "gpu"),
      ("8.4.4", "sixteen_q8_gib_844", "9.86", "worked"),
      ("8.4.4", "sixteen_shared_gib_844", "5.91", "worked"),
  )
  return c
