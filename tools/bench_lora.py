"""What LoRA adapters cost a step, per way of computing them (8.2.1), on this machine.

  python tools/bench_lora.py [--rank=16] [--targets=all] [--output_dir=DIR]

SmolLM2 f32, steps packed at exactly their shape: decode of 16 and 64 requests at 256
tokens of context, prefill of one 256-token and four 64-token chunks. For each: the plain
step with no adapter, on this executor with LoRA slots and on one without them (a
step with no adapter must pay nothing for the slots), then every mode of the grouped
low-rank product (gather = BGMV, segment = SGMV in blocks of one adapter, ragged = SGMV
via lax.ragged_dot, dense = all slots as two dense matmuls masked per token) with 1, 4
and 8 distinct adapters among the step's requests (8 slots, random adapters of --rank
over --targets). Beside each figure: the step's bandwidth floor (weights + KV + the
distinct adapters' bytes at the measured read bandwidth), its compute floor (FLOPs with
the low-rank products at the measured matmul rate of the step's shapes) and HF
transformers' plain decode step at the same batch and context (same run).
`jaxinfer.lora.ops.DECODE_MODE / PREFILL_MODE` are this table's winners.
"""
from __future__ import annotations

import os

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_integer("rank", 16, "adapter rank")
flags.DEFINE_list("targets", ["all"], "adapted weights: all, or of wq,wk,wv,wo,w_gate,w_up,"
                  "w_down")
flags.DEFINE_list("distinct", ["1", "4", "8"], "distinct adapters in the step")
flags.DEFINE_list("modes", ["gather", "segment", "ragged", "dense"], "modes to time")
flags.DEFINE_list("kinds", ["decode", "prefill"], "steps to time")
flags.DEFINE_integer("repeats", 5, "timed repeats per step (median)")
flags.DEFINE_bool("hf", True, "time HF transformers' decode step in the same run")
flags.DEFINE_string("output_dir", "", "write bench_lora.json here")

KINDS = (("decode", 16, 256, 1), ("decode", 64, 256, 1), ("prefill", 1, 0, 256),
         ("prefill", 4, 0, 64))  # (kind, requests, context, new tokens each)


def main(argv):
  del argv
  from jaxinfer import benchmarking as bm, strict_json
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.loading import load_model
  from jaxinfer.lora import TARGETS, LoraAdapter, adapter_bytes, ops
  from jaxinfer.lora.adapter import random_adapter_factors
  targets = TARGETS if FLAGS.targets == ["all"] else tuple(FLAGS.targets)
  distinct = [int(x) for x in FLAGS.distinct]
  slots = max(distinct)
  bw = bm.measure_read_bandwidth(512, 5)
  print(f"machine: read bandwidth {bw / 1e9:.1f} GB/s, {os.cpu_count()} cores", flush=True)
  m = load_model("smollm2-135m-instruct", "float32")
  cfg = m.cfg
  adapters = []
  for i in range(slots):
    a, b = random_adapter_factors(cfg, FLAGS.rank, targets, seed=i)
    adapters.append(LoraAdapter(f"a{i}", FLAGS.rank, {t: (a[t], b[t]) for t in targets}))
  one = adapter_bytes(cfg, FLAGS.rank, targets, 4)
  costs = ModelCosts(cfg, 4.0, "f32", 16)
  hf = bm.hf_model(m.source) if FLAGS.hf else None
  rows = []
  print(f"\nadapters: rank {FLAGS.rank} over {','.join(targets)}: {one / 2**20:.2f} MiB each "
        f"(f32); the model's weights {cfg.weight_bytes(4) / 2**20:.0f} MiB")
  print(f"{'step':<22} {'variant':<16} {'ms':>8} {'x plain':>8} {'bw floor':>9} "
        f"{'fl floor':>9} {'HF ms':>8}")
  modes = [x for x in ops.MODES if x in FLAGS.modes]
  for kind, B, ctx, new in KINDS:
    if kind not in FLAGS.kinds:
      continue
    step, pages = bm.uniform_step(B, ctx, new)
    ex = JaxExecutor(cfg, m.params, num_pages=pages, page_size=16, lora_adapters=adapters,
                     max_loras=slots, max_lora_rank=FLAGS.rank, lora_targets=targets)
    ex.load_lora([(i + 1, a.name) for i, a in enumerate(adapters)])
    seqs = [(new, ctx)] * B
    rate = bm.step_matmul_rate(cfg, B * new, B, 3)
    hf_ms = None
    if hf is not None and kind == "decode":
      hf_ms = 1e3 * bm.hf_decode_step(hf, cfg, B, ctx, FLAGS.repeats)
    elif hf is not None:
      hf_ms = 1e3 * bm.hf_prefill(hf, new, FLAGS.repeats) * B
    plain = bm.time_step(ex, step, FLAGS.repeats)
    # the same step on an executor without LoRA slots: what a step with no adapter pays
    ex0 = JaxExecutor(cfg, m.params, num_pages=pages, page_size=16)
    no_lora = bm.time_step(ex0, step, FLAGS.repeats)
    del ex0
    name = f"{kind} {B}x{new} ctx{ctx}"
    base_flops = costs.step_flops(seqs)
    base_bytes = costs.step_bytes(seqs)
    row0 = dict(step=name, kind=kind, requests=B, context=ctx, new_tokens=new,
                hf_ms=hf_ms)
    rows.append(dict(row0, variant="no LoRA slots", distinct=0, ms=1e3 * no_lora,
                     ratio=no_lora / plain, bandwidth_floor_ms=1e3 * base_bytes / bw,
                     compute_floor_ms=1e3 * base_flops / rate))
    rows.append(dict(row0, variant="plain", distinct=0, ms=1e3 * plain, ratio=1.0,
                     bandwidth_floor_ms=1e3 * base_bytes / bw,
                     compute_floor_ms=1e3 * base_flops / rate))
    for mode in modes:
      for k in distinct:
        a = dict(step.arrays)
        per_req = [1 + (i % k) for i in range(B)]
        a["lora_slot"] = np.zeros(step.bucket.num_tokens, np.int32)
        for i in range(B):
          a["lora_slot"][i * new:(i + 1) * new] = per_req[i]
        ex.lora_mode = mode
        t = bm.time_step(ex, type(step)(a, step.bucket, step.logits_rows, step.num_tokens),
                         FLAGS.repeats)
        lora_flops = 2 * B * new * one / 4  # 2 FLOPs per adapter parameter per token
        rows.append(dict(row0, variant=mode, distinct=k, ms=1e3 * t, ratio=t / plain,
                         bandwidth_floor_ms=1e3 * (base_bytes + k * one) / bw,
                         compute_floor_ms=1e3 * (base_flops + lora_flops) / rate))
    for r in rows[-(2 + len(modes) * len(distinct)):]:
      v = r["variant"] + (f" x{r['distinct']}" if r["distinct"] else "")
      print(f"{name:<22} {v:<16} {r['ms']:>8.1f} {r['ratio']:>8.3f} "
            f"{r['bandwidth_floor_ms']:>9.1f} {r['compute_floor_ms']:>9.1f} "
            f"{'' if hf_ms is None else f'{hf_ms:.1f}':>8}", flush=True)
    del ex
  best = {}
  for kind in FLAGS.kinds:
    cand = {mode: np.mean([r["ratio"] for r in rows if r["kind"] == kind and
                           r["variant"] == mode]) for mode in modes}
    best[kind] = min(cand, key=cand.get)
    print(f"{kind}: mean ratio to the plain step " +
          ", ".join(f"{k} {v:.3f}" for k, v in cand.items()) + f" -> {best[kind]} "
          f"(library default: {ops.DECODE_MODE if kind == 'decode' else ops.PREFILL_MODE})")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "bench_lora.json"), "w") as f:
      strict_json.dump(dict(machine=dict(read_bandwidth_gbs=bw / 1e9), rank=FLAGS.rank,
                            targets=list(targets), adapter_bytes=one, rows=rows, best=best), f)


if __name__ == "__main__":
  app.run(main)
