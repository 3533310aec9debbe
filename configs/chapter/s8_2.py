"""Chapter 8.2 (batching and scheduling): inputs, and the figures the chapter states.

(section, figure, value as printed, kind[, reason]); kind: worked | gpu | quoted.
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  i = c.inputs = ml_collections.ConfigDict()
  i.model = "qwen3-8b"
  i.hardware = "rtx-pro-6000"  # 1792 GB/s, 503.8 TFLOP/s BF16
  i.weight_bytes_per_param = 2.0
  i.kv_format = "bf16"
  i.contexts = (2048, 8192)
  i.batches = (1, 4, 16, 64)  # exercise 8-1
  i.page_size = 16
  i.kv_budget_gib = 12.0
  i.output_tokens = 256
  # multi-LoRA (8.2.1): rank 16 on Q and V, 100 adapters beside 100 contexts of 8K
  i.lora_rank = 16
  i.lora_targets = ("q", "v")
  i.num_adapters = 100
  # 8.2.2's iteration time, fitted to experiment 8-1 at batch 1
  i.fixed_ms = 26.22
  i.per_token_us = 30.4
  i.per_pair_ns = 3.0
  # 8.2.2's four requests (arrival ms, input, output); at most two run at once; chunked:
  # 2048-token chunks under a 4096-token budget, decode first
  i.trace = ((0.0, 2048, 8), (0.0, 2048, 2), (20.0, 8192, 2), (30.0, 2048, 4))
  i.max_running = 2
  i.chunk = 2048
  i.token_budget = 4096
  # 8.2.3: chunks of 512, the last one of an 8K prompt after 7680 tokens; the figures'
  # four tokens after 0 and after 8
  i.pair_chunk = 512
  i.pair_last_cached = 7680
  i.small_chunk = 4
  i.small_cached = 8
  i.split_chunk = 256  # one chunk of 256 or two of 128, each reading one layer's FFN
  # 8.2.4: graphs captured for 16 and 32 rows
  i.graph_rows = (16, 32)
  i.replay_budgets = (512, 8192)  # six requests every 80 ms
  c.stated = (
      ("8.2.1", "intensity_gain_b16", "16", "worked"),
      ("8.2.1", "lora_adapter_mib", "14.6", "worked"),
      ("8.2.1", "lora_100_gib", "1.43", "worked"),
      ("8.2.1", "matrix_weights_gib", "14.1", "worked"),
      ("8.2.1", "kv_100_8k_gib", "112.5", "worked"),
      ("8.2.1", "kv_2k_gib", "0.28125", "worked"),
      ("8.2.1", "weights_per_token_b16_gib", "0.88", "worked"),
      ("8.2.1", "weights_per_token_b64_gib", "0.22", "worked"),
      ("8.2.1", "read_per_token_2k_b1_gib", "14.38", "worked"),
      ("8.2.1", "read_per_token_2k_b64_gib", "0.50", "worked"),
      ("8.2.1", "read_per_token_reduction", "29", "worked"),
      ("8.2.1", "b_kv_2k", "51", "worked"),
      ("8.2.1", "b_kv_8k", "13", "worked"),
      ("8.2.1", "memory_b64_2k_gb", "35.7", "worked"),
      ("8.2.1", "sweep_throughput_b1", "37", "gpu"),
      ("8.2.1", "sweep_throughput_b64", "1165", "gpu"),
      ("8.2.1", "sweep_ttft_b1_ms", "96", "gpu"),
      ("8.2.1", "sweep_ttft_b64_s", "3.29", "gpu"),
      ("8.2.1", "sweep_itl_b1_ms", "27", "gpu"),
      ("8.2.1", "sweep_itl_b64_ms", "40", "gpu"),
      ("8.2.2", "affine_decode_round_ms", "26.26", "worked"),
      ("8.2.2", "affine_prefill_2k_ms", "94.8", "worked"),
      ("8.2.2", "weight_read_ms", "8.4", "worked"),
      ("8.2.2", "fixed_makespan_ms", "870", "worked"),
      ("8.2.2", "fixed_max_itl_ms", "26", "worked"),
      ("8.2.2", "continuous_makespan_ms", "766", "worked"),
      ("8.2.2", "continuous_max_itl_ms", "376", "worked"),
      ("8.2.2", "makespan_cut_pct", "12", "worked"),
      ("8.2.2", "gap_growth_x", "14", "worked"),
      ("8.2.2", "chunked_max_itl_ms", "133", "worked"),
      ("8.2.2", "chunked_makespan_ms", "844", "worked"),
      ("8.2.3", "pairs_first_chunk", "131328", "worked"),
      ("8.2.3", "pairs_last_chunk", "4063488", "worked"),
      ("8.2.3", "pairs_ratio", "31", "worked"),
      ("8.2.3", "pairs_small_first", "10", "worked"),
      ("8.2.3", "pairs_small_rectangle", "32", "worked"),
      ("8.2.3", "pairs_small_after", "42", "worked"),
      ("8.2.3", "matmul_growth_pct", "32", "worked"),
      ("8.2.3", "chunk_first_ms", "25.3", "gpu"),
      ("8.2.3", "chunk_last_ms", "35.1", "gpu"),
      ("8.2.3", "chunk_growth_pct", "39", "gpu"),
      ("8.2.3", "ffn_read_one_chunk_mib", "288", "worked"),
      ("8.2.3", "ffn_read_two_chunks_mib", "576", "worked"),
      ("8.2.4", "graph_rows_for_17", "32", "worked"),
      ("8.2.4", "graph_rows_for_18", "32", "worked"),
      ("8.2.4", "graph_rows_for_16", "16", "worked"),
      ("8.2.4", "graph_padding_for_17", "15", "worked"),
      ("8.2.4", "replay_late_queueing_small_ms", "149", "gpu"),
      ("8.2.4", "replay_late_queueing_large_ms", "<0.1", "gpu"),
      ("8.2.4", "replay_max_itl_small_ms", "32", "gpu"),
      ("8.2.4", "replay_max_itl_large_ms", "183", "gpu"),
  )
  return c
