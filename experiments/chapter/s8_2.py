"""8.2: weight reuse, fixed / continuous / chunked batching, chunk size, token budget
(configs/chapter/s8_2.py). 8.2.2's scenario runs on the simulator with the chapter's
fitted iteration time; 8.2.4's replay likewise (an analogue of the GPU measurement)."""
from __future__ import annotations

from typing import List

import ml_collections

from experiments.batch_sweep import sim_sweep
from experiments.chapter import Figure, fig
from experiments.common import Progress
from experiments.scheduling import run_budget_sweep, run_trace, sim_engine
from jaxinfer.buckets import BucketTable
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import ModelCosts, RooflineStepModel, formulas, load_hardware
from jaxinfer.costmodel.accounting import capacity
from jaxinfer.costmodel.lora import adapter_bytes, parse_targets
from jaxinfer.executors.sim_executor import AffineStepModel

MIB, GIB = 2**20, 2**30


def _scenario(i, model: AffineStepModel):
  trace = [{"arrival_ms": a, "input_tokens": n, "output_tokens": g} for a, n, g in i.trace]
  vocab = get_model_config(i.model).vocab_size
  out = {}
  for policy in ("fixed", "continuous", "chunked"):
    eng = sim_engine(policy, i.model, i.kv_budget_gib, i.chunk, i.token_budget, i.max_running,
                     model)
    out[policy] = run_trace(eng, trace, vocab)
  return out


def _replay(i, model: AffineStepModel):
  """8.2.4's six requests every 80 ms, chunk = budget, through the scheduling study's own
  budget sweep (its simulated part; its request lengths, which the chapter does not
  give) on the fitted iteration time: {budget: (late queueing ms, max ITL ms)}."""
  from configs.studies.scheduling import get_config
  c = ml_collections.ConfigDict(dict(get_config("sim").to_dict(), sim_model=i.model,
                                     kv_budget_gib=i.kv_budget_gib, sweep_step_model=model,
                                     sweep_budgets=tuple(i.replay_budgets)))
  rows = run_budget_sweep("sim", c, None, Progress(len(c.sweep_budgets), "chapter 8.2.4"))
  return {r["budget"]: (r["late_queueing_ms"], r["max_itl_ms"]) for r in rows}


def compute(i) -> List[Figure]:
  cfg = get_model_config(i.model)
  costs = ModelCosts(cfg, i.weight_bytes_per_param, i.kv_format, i.page_size)
  hw = load_hardware(i.hardware)
  d_w, k = costs.d_w, costs.kv_bytes_per_token
  short, long_ = i.contexts
  per_tok = formulas.bytes_per_output_token
  b_lo, b_hi = min(i.batches), max(i.batches)
  figs = [
      fig("8.2.1", "intensity_gain_b16", "FLOPs per weight byte, 16 rows against one",
          formulas.weight_arithmetic_intensity(16, i.weight_bytes_per_param)
          / formulas.weight_arithmetic_intensity(1, i.weight_bytes_per_param), "x",
          "formulas.weight_arithmetic_intensity"),
      fig("8.2.1", "lora_adapter_mib", "one rank-16 Q,V adapter",
          adapter_bytes(cfg, i.lora_rank, parse_targets(i.lora_targets)) / MIB, "MiB", "costmodel.lora.adapter_bytes"),
      fig("8.2.1", "lora_100_gib", "100 adapters", i.num_adapters * adapter_bytes(
          cfg, i.lora_rank, parse_targets(i.lora_targets)) / GIB, "GiB", "costmodel.lora.adapter_bytes"),
      fig("8.2.1", "matrix_weights_gib", "D_w, matrix weights one step reads", d_w / GIB, "GiB",
          "ModelCosts.d_w"),
      fig("8.2.1", "kv_100_8k_gib", "KV of 100 independent 8K contexts",
          i.num_adapters * long_ * k / GIB, "GiB", "kv.bytes_per_token"),
      fig("8.2.1", "kv_2k_gib", "KV of a 2K context", short * k / GIB, "GiB", "kv.bytes_per_token"),
      fig("8.2.1", "weights_per_token_b16_gib", "weights read per output token, batch 16",
          d_w / 16 / GIB, "GiB", "formulas.bytes_per_output_token"),
      fig("8.2.1", "weights_per_token_b64_gib", "weights read per output token, batch 64",
          d_w / 64 / GIB, "GiB", "formulas.bytes_per_output_token"),
      fig("8.2.1", "read_per_token_2k_b1_gib", "d(1, 2K)", per_tok(d_w, b_lo, short, k) / GIB,
          "GiB", "formulas.bytes_per_output_token"),
      fig("8.2.1", "read_per_token_2k_b64_gib", "d(64, 2K)", per_tok(d_w, b_hi, short, k) / GIB,
          "GiB", "formulas.bytes_per_output_token"),
      fig("8.2.1", "read_per_token_reduction", "d(1, 2K) / d(64, 2K)",
          per_tok(d_w, b_lo, short, k) / per_tok(d_w, b_hi, short, k), "x",
          "formulas.bytes_per_output_token"),
      fig("8.2.1", "b_kv_2k", "b_KV at 2K", formulas.b_kv(d_w, short, k), "", "formulas.b_kv"),
      fig("8.2.1", "b_kv_8k", "b_KV at 8K", formulas.b_kv(d_w, long_, k), "", "formulas.b_kv"),
      fig("8.2.1", "memory_b64_2k_gb", "weights + KV of 64 2K requests after one decode step",
          (costs.weight_bytes + b_hi * (short + 1) * k) / 1e9, "GB", "ModelCosts"),
  ]
  # the batch sweep of experiment 8-1, simulated on the roofline calibrated on its table
  src = "simulator, roofline on 8-1 (experiments.batch_sweep.sim_sweep)"
  for row in sim_sweep([b_lo, b_hi], short, i.output_tokens):
    b = row["batch"]
    ttft = ("ms", 1e3 * row["ttft_s"]) if b == b_lo else ("s", row["ttft_s"])
    figs += [fig("8.2.1", f"sweep_throughput_b{b}", f"batch {b}: output tokens per second",
                 row["throughput_tok_s"], "tok/s", src),
             fig("8.2.1", f"sweep_ttft_b{b}_{ttft[0]}", f"batch {b}: mean TTFT", ttft[1], ttft[0],
                 src),
             fig("8.2.1", f"sweep_itl_b{b}_ms", f"batch {b}: mean ITL", row["mean_itl_ms"], "ms", src)]
  for ctx in i.contexts:  # exercise 8-1
    for b in i.batches:
      figs.append(fig("ex8-1", f"ex1_read_per_token_{ctx}_b{b}_gib", f"d({b}, {ctx})",
                      per_tok(d_w, b, ctx, k) / GIB, "GiB", "formulas.bytes_per_output_token"))
    fit = capacity(k, i.kv_budget_gib * GIB, ctx, i.output_tokens, i.page_size).requests_fit
    figs += [fig("ex8-1", f"ex1_fit_{ctx}", f"independent {ctx}-token requests in 12 GiB", fit, "",
                 "accounting.capacity"),
             fig("ex8-1", f"ex1_capacity_before_b_kv_{ctx}", "capacity stops the batch before b_KV "
                 "(1 yes, 0 no)", fit < formulas.b_kv(d_w, ctx, k), "", "formulas.b_kv")]

  # 8.2.2
  affine = AffineStepModel(i.fixed_ms / 1e3, i.per_token_us / 1e6, i.per_pair_ns / 1e9)
  sc = _scenario(i, affine)
  figs += [
      fig("8.2.2", "affine_decode_round_ms", "the fit's decode round at 2K",
          1e3 * affine.step_time([(1, short)]), "ms", "sim_executor.AffineStepModel"),
      fig("8.2.2", "affine_prefill_2k_ms", "the fit's lone 2K prefill",
          1e3 * affine.step_time([(short, 0)]), "ms", "sim_executor.AffineStepModel"),
      fig("8.2.2", "weight_read_ms", "reading all weights at 1792 GB/s",
          1e3 * formulas.read_seconds(d_w, hw.bandwidth), "ms", "formulas.read_seconds"),
  ]
  src = "simulator (experiments.scheduling.sim_engine)"
  for p in ("fixed", "continuous", "chunked"):
    figs += [fig("8.2.2", f"{p}_makespan_ms", f"{p}: all four requests done",
                 sc[p]["makespan_ms"], "ms", src),
             fig("8.2.2", f"{p}_max_itl_ms", f"{p}: the largest inter-token gap",
                 sc[p]["max_itl_ms"], "ms", src)]
  figs += [
      fig("8.2.2", "makespan_cut_pct", "continuous against fixed: completion time cut",
          100 * (1 - sc["continuous"]["makespan_ms"] / sc["fixed"]["makespan_ms"]), "%", src),
      fig("8.2.2", "gap_growth_x", "continuous against fixed: largest gap",
          sc["continuous"]["max_itl_ms"] / sc["fixed"]["max_itl_ms"], "x", src),
      fig("ex8-2", "ex2_prefill_r0_r1_ms", "r0 and r1's first prefill (one iteration)",
          1e3 * affine.step_time([(short, 0), (short, 0)]), "ms", "sim_executor.AffineStepModel"),
      fig("ex8-2", "ex2_decode_r0_r1_ms", "their next decode step",
          1e3 * affine.step_time([(1, short), (1, short)]), "ms", "sim_executor.AffineStepModel"),
      fig("ex8-2", "ex2_admit_r2_ms", "the round that admits r2 beside r0's decode",
          1e3 * affine.step_time([(1, short + 1), (long_, 0)]), "ms",
          "sim_executor.AffineStepModel"),
  ]

  # 8.2.3
  pairs = formulas.chunk_pairs
  c, h = i.pair_chunk, i.pair_last_cached
  roof = RooflineStepModel.for_names(i.model, i.hardware, i.kv_format, i.page_size,
                                     i.weight_bytes_per_param)
  first = costs.step_flops([(c, 0)], sampled=0)
  last = costs.step_flops([(c, h)], sampled=0)
  figs += [
      fig("8.2.3", "pairs_first_chunk", "N_pair of the first 512-token chunk", pairs(c, 0), "",
          "formulas.chunk_pairs"),
      fig("8.2.3", "pairs_last_chunk", "N_pair of the last chunk of an 8K prompt", pairs(c, h), "",
          "formulas.chunk_pairs"),
      fig("8.2.3", "pairs_ratio", "last / first", pairs(c, h) / pairs(c, 0), "x",
          "formulas.chunk_pairs"),
      fig("8.2.3", "pairs_small_first", "four tokens, no context", pairs(i.small_chunk, 0), "",
          "formulas.chunk_pairs"),
      fig("8.2.3", "pairs_small_rectangle", "their pairs with the eight old tokens",
          pairs(i.small_chunk, i.small_cached) - pairs(i.small_chunk, 0), "",
          "formulas.chunk_pairs"),
      fig("8.2.3", "pairs_small_after", "four tokens after eight",
          pairs(i.small_chunk, i.small_cached), "", "formulas.chunk_pairs"),
      fig("8.2.3", "matmul_growth_pct", "the last chunk's FLOPs over the first's",
          100 * (last / first - 1), "%", "ModelCosts.step_flops"),
      fig("8.2.3", "chunk_first_ms", "the first 512-token chunk, on the calibrated roofline",
          1e3 * roof.step_time([(c, 0)], logits_rows=0), "ms", "RooflineStepModel.step_time"),
      fig("8.2.3", "chunk_last_ms", "the last one", 1e3 * roof.step_time([(c, h)], logits_rows=0),
          "ms", "RooflineStepModel.step_time"),
      fig("8.2.3", "chunk_growth_pct", "last over first", 100 * (
          roof.step_time([(c, h)], logits_rows=0) / roof.step_time([(c, 0)], logits_rows=0) - 1),
          "%", "RooflineStepModel.step_time"),
      fig("8.2.3", "ffn_read_one_chunk_mib", "one layer's FFN read by one chunk",
          costs.ffn_bytes_per_layer / MIB, "MiB", "ModelCosts.ffn_bytes_per_layer"),
      fig("8.2.3", "ffn_read_two_chunks_mib", "read by two half chunks",
          2 * costs.ffn_bytes_per_layer / MIB, "MiB", "ModelCosts.ffn_bytes_per_layer"),
  ]
  # 8.2.4: captured shapes
  table = BucketTable(token_sizes=tuple(i.graph_rows), request_sizes=(1,), page_table_sizes=(1,))
  figs += [fig("8.2.4", f"graph_rows_for_{n}", f"rows a step of {n} runs at", table.pad_tokens(n),
               "rows", "BucketTable.pad_tokens") for n in (16, 17, 18)]
  figs.append(fig("8.2.4", "graph_padding_for_17", "rows of padding at 17",
                  table.pad_tokens(17) - 17, "rows", "BucketTable.pad_tokens"))
  rp = _replay(i, affine)
  lo, hi = min(i.replay_budgets), max(i.replay_budgets)
  src = "simulator on 8.2.2's fit (experiments.scheduling)"
  figs += [fig("8.2.4", "replay_late_queueing_small_ms", f"late requests' queueing, budget {lo}",
               rp[lo][0], "ms", src),
           fig("8.2.4", "replay_late_queueing_large_ms", f"late requests' queueing, budget {hi}",
               rp[hi][0], "ms", src),
           fig("8.2.4", "replay_max_itl_small_ms", f"largest gap, budget {lo}", rp[lo][1], "ms", src),
           fig("8.2.4", "replay_max_itl_large_ms", f"largest gap, budget {hi}", rp[hi][1], "ms", src)]
  return figs
