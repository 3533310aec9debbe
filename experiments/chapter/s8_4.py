"""8.4: quantized weights, KV formats, weight offload (configs/chapter/s8_4.py)."""
from __future__ import annotations

from typing import List

import gguf

from experiments.chapter import Figure, fig
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import formulas, load_hardware
from jaxinfer.costmodel.accounting import capacity
from jaxinfer.costmodel.offload import OffloadConfig, account, ffn_set_bytes
from jaxinfer.kv import bytes_per_token

MIB, GIB = 2**20, 2**30


def compute(i) -> List[Figure]:
  values, block = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[i.weight_format]]
  code = values * i.code_bits // 8
  machine = load_hardware(i.machine)
  usable = machine.memory_gb * 1e9 / GIB - i.system_reserve_gib
  file_gib = (i.file_payload_bytes + i.file_metadata_bytes + i.file_header_bytes) / GIB
  big = get_model_config(i.big_model)
  kv_big = [bytes_per_token(big, "bf16") * n / GIB for n in i.contexts]
  left = usable - file_gib
  q = "gguf GGML_QUANT_SIZES"
  figs = [
      fig("8.4.1", "q2k_code_bytes", "2-bit codes of one block", code, "B", q),
      fig("8.4.1", "q2k_metadata_bytes", "scales and minimums of one block", block - code, "B", q),
      fig("8.4.1", "q2k_block_bytes", "one block of 256 values", block, "B", q),
      fig("8.4.1", "q2k_bits_per_value", "bits per value", 8 * block / values, "bits", q),
      fig("8.4.1", "q2k_metadata_pct", "metadata's share", 100 * (block - code) / block, "%", q),
      fig("8.4.1", "file_payload_gib", "the file's codes and floats",
          i.file_payload_bytes / GIB, "GiB", "file header bytes"),
      fig("8.4.1", "file_metadata_gib", "its quantization metadata", i.file_metadata_bytes / GIB,
          "GiB", "file header bytes"),
      fig("8.4.1", "file_total_gib", "the whole file", file_gib, "GiB", "file header bytes"),
      fig("8.4.1", "machine_usable_gib", "96 GB less 8 GiB for the system", usable, "GiB",
          "hardware profile m2-max"),
      fig("8.4.1", "left_after_file_gib", "left after the file", left, "GiB",
          "hardware profile m2-max"),
      fig("8.4.1", "other_file_over_gib", "the other file over the memory",
          i.other_file_gib - usable, "GiB", "hardware profile m2-max"),
      fig("8.4.1", "kv_8k_gib", "BF16 KV of one 8K context of the 235B model", kv_big[0], "GiB",
          "kv.bytes_per_token"),
      fig("8.4.1", "left_after_one_request_gib", "left after one 8K request", left - kv_big[0],
          "GiB", "kv.bytes_per_token"),
      fig("8.4.1", "kv_32k_gib", "KV of a 32K context", kv_big[1], "GiB", "kv.bytes_per_token"),
      fig("8.4.1", "file_difference_gib", "the two files' difference", i.other_file_gib - file_gib,
          "GiB", "file header bytes"),
      fig("8.4.1", "uniform_q2k_gib", "the 235B model's weights all in Q2_K (the planner's "
          "estimate; the file mixes types)", big.param_count() * block / values / GIB, "GiB",
          "ModelConfig.param_count"),
  ]
  cfg = get_model_config(i.model)
  kv = {f: bytes_per_token(cfg, f, i.page_size) * i.context / MIB for f in ("bf16", "q8_0", "q4_0")}
  mla = bytes_per_token(get_model_config(i.mla_model), "bf16") * i.context / MIB
  k8 = bytes_per_token(cfg, "q8_0", i.page_size)
  end_q8 = capacity(k8, 0, i.context, i.output_tokens, i.page_size).kv_end_bytes
  hw = load_hardware(i.hardware)
  beta = hw.bandwidth * i.read_mbu
  saved = (kv["bf16"] - kv["q8_0"]) * MIB
  lo, hi = i.line_contexts
  line = lambda ab, n: ab[0] + ab[1] * n
  kvp = "kv.bytes_per_token"
  figs += [
      fig("8.4.2", "kv_8k_bf16_mib", "BF16 KV of an 8K context", kv["bf16"], "MiB", kvp),
      fig("8.4.2", "kv_8k_mla_mib", "DeepSeek-V3's MLA latent KV of 8K", mla, "MiB", kvp),
      fig("8.4.2", "kv_8k_q8_mib", "q8_0", kv["q8_0"], "MiB", kvp),
      fig("8.4.2", "kv_8k_q4_mib", "q4_0", kv["q4_0"], "MiB", kvp),
      fig("8.4.2", "q8_saving_mib", "q8_0 saves", kv["bf16"] - kv["q8_0"], "MiB", kvp),
      fig("8.4.2", "q4_saving_mib", "q4_0 saves", kv["bf16"] - kv["q4_0"], "MiB", kvp),
      fig("8.4.2", "q8_bits", "q8_0 bits per value", 16 * kv["q8_0"] / kv["bf16"], "bits", kvp),
      fig("8.4.2", "q4_bits", "q4_0 bits per value", 16 * kv["q4_0"] / kv["bf16"], "bits", kvp),
      fig("8.4.2", "long_end_q8_mib", "a long request at its end in q8_0", end_q8 / MIB, "MiB",
          "accounting.capacity"),
      fig("8.4.2", "sixteen_q8_gib", "16 of them", i.long_requests * end_q8 / GIB, "GiB",
          "accounting.capacity"),
      fig("8.4.2", "effective_bandwidth_tbs", "65% of 1792 GB/s", beta / 1e12, "TB/s",
          "hardware profile"),
      fig("8.4.2", "read_saving_ms", "reading 540 MiB less", 1e3 * formulas.read_seconds(saved, beta),
          "ms", "formulas.read_seconds"),
      fig("8.4.2", "net_gain_fast_convert_ms", "dT with a 0.2 ms conversion",
          1e3 * formulas.kv_compression_gain(saved, beta, i.convert_ms[0] / 1e3), "ms",
          "formulas.kv_compression_gain"),
      fig("8.4.2", "net_gain_slow_convert_ms", "dT with a 0.8 ms conversion",
          1e3 * formulas.kv_compression_gain(saved, beta, i.convert_ms[1] / 1e3), "ms",
          "formulas.kv_compression_gain"),
      fig("8.4.2", "fp8_crossover_tokens", "where FP8's ITL line crosses BF16's",
          formulas.linear_crossover(*i.bf16_line, *i.fp8_line), "tokens",
          "formulas.linear_crossover"),
      fig("8.4.2", "bf16_itl_2k_ms", "BF16 at 2K", line(i.bf16_line, lo), "ms", "fitted line"),
      fig("8.4.2", "fp8_itl_2k_ms", "FP8 at 2K", line(i.fp8_line, lo), "ms", "fitted line"),
      fig("8.4.2", "bf16_itl_16k_ms", "BF16 at 16K", line(i.bf16_line, hi), "ms", "fitted line"),
      fig("8.4.2", "fp8_itl_16k_ms", "FP8 at 16K", line(i.fp8_line, hi), "ms", "fitted line"),
  ]
  # exercise 8-6: the same for the input and the whole long request
  for f in ("q8_0", "q4_0"):
    kf = bytes_per_token(cfg, f, i.page_size)
    c = capacity(kf, 0, i.context, i.output_tokens, i.page_size)
    figs += [fig("ex8-6", f"ex6_input_{f}_mib", f"8K input in {f}", c.kv_after_prefill_bytes / MIB,
                 "MiB", "accounting.capacity"),
             fig("ex8-6", f"ex6_request_{f}_mib", f"whole long request in {f}",
                 c.kv_end_bytes / MIB, "MiB", "accounting.capacity")]

  # 8.4.3
  bf = bytes_per_token(cfg, "bf16", i.page_size)
  long_c = capacity(bf, 0, i.context, i.output_tokens, i.page_size)
  fast = load_hardware(i.fast_link_hardware)
  one = account(cfg, OffloadConfig.every_kth(cfg.num_layers, i.offload_every, 1), hw.link_bandwidth,
                long_c.kv_after_prefill_bytes, long_c.kv_end_bytes)
  two = account(cfg, OffloadConfig.every_kth(cfg.num_layers, i.offload_every, 2), hw.link_bandwidth,
                long_c.kv_after_prefill_bytes, long_c.kv_end_bytes)
  copied = one.freed_mib * MIB
  pcie = one.copy_ms_per_step / 1e3  # formulas.offload_copy_time over the card's link
  c2c = formulas.offload_copy_time(ffn_set_bytes(cfg), one.offloaded_sets, fast.link_bandwidth)
  step = max(pcie, i.decode_round_ms / 1e3)
  src = "costmodel.offload.account"
  figs += [
      fig("8.4.3", "ffn_set_mib", "one layer's three FFN matrices", ffn_set_bytes(cfg) / MIB,
          "MiB", "costmodel.offload.ffn_set_bytes"),
      fig("8.4.3", "offloaded_sets", "one layer in four", one.offloaded_sets, "", src),
      fig("8.4.3", "freed_mib", "freed", one.freed_mib, "MiB", src),
      fig("8.4.3", "net_one_buffer_mib", "net of one prefetch buffer", one.net_mib, "MiB", src),
      fig("8.4.3", "net_two_buffers_mib", "net of two", two.net_mib, "MiB", src),
      fig("8.4.3", "extra_inputs_one_buffer", "more 8K inputs, one buffer",
          one.extra_requests_after_prefill, "", src),
      fig("8.4.3", "extra_inputs_two_buffers", "more 8K inputs, two buffers",
          two.extra_requests_after_prefill, "", src),
      fig("8.4.3", "extra_requests_one_buffer", "more whole requests, one buffer",
          one.extra_requests_at_end, "", src),
      fig("8.4.3", "extra_requests_two_buffers", "more whole requests, two buffers",
          two.extra_requests_at_end, "", src),
      fig("8.4.3", "copied_gb", "copied every step", copied / 1e9, "GB", src),
      fig("8.4.3", "copy_pcie_ms", "T_copy over PCIe Gen5", 1e3 * pcie, "ms",
          "formulas.offload_copy_time"),
      fig("8.4.3", "offload_throughput", "4 requests' tokens per second at best",
          formulas.decode_throughput(i.offload_batch, step), "tok/s", "formulas.decode_throughput"),
      fig("8.4.3", "copy_pcie_255_s", "255 steps' copies", i.decode_steps * pcie, "s",
          "formulas.offload_copy_time"),
      fig("8.4.3", "copy_c2c_ms", "T_copy over NVLink-C2C", 1e3 * c2c, "ms",
          "formulas.offload_copy_time"),
      fig("8.4.3", "copy_c2c_255_s", "255 steps over NVLink-C2C", i.decode_steps * c2c, "s",
          "formulas.offload_copy_time"),
      fig("ex8-5", "ex5_min_link_gbs", "the link that copies 255 steps in one second",
          i.decode_steps * copied / i.copy_budget_s / 1e9, "GB/s", "formulas.offload_copy_time"),
  ]
  s = i.transfer_mib * MIB
  direct = formulas.read_seconds(s, hw.link_bandwidth)
  packed = formulas.read_seconds(i.compressed_ratio * s, hw.link_bandwidth)
  r_min = hw.link_bandwidth / (1 - i.compressed_ratio)
  figs += [
      fig("8.4.3", "direct_transfer_ms", "96 MiB over PCIe Gen5", 1e3 * direct, "ms",
          "formulas.read_seconds"),
      fig("8.4.3", "compressed_transfer_ms", "compressed to a quarter", 1e3 * packed, "ms",
          "formulas.read_seconds"),
      fig("8.4.3", "compressed_saving_ms", "saved", 1e3 * (direct - packed), "ms",
          "formulas.read_seconds"),
      fig("8.4.3", "min_decompress_gbs", "R_dec > B_link / (1 - r)", r_min / 1e9, "GB/s",
          "formulas.compressed_transfer_pays"),
  ]
  shared = capacity(bf, 0, i.context, i.output_tokens, i.page_size, i.shared_prefix)
  figs += [
      fig("8.4.4", "sixteen_q8_gib_844", "16 long requests in q8_0", i.long_requests * end_q8 / GIB,
          "GiB", "accounting.capacity"),
      fig("8.4.4", "sixteen_shared_gib_844", "16 sharing the BF16 prefix",
          (shared.shared_prefix_bytes + i.long_requests * shared.private_end_bytes) / GIB, "GiB",
          "accounting.capacity"),
  ]
  return figs
