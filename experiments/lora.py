"""Multi-LoRA serving (chapter 8.2.1): throughput and ITL of a batch as the number of
distinct adapters in it grows, real SmolLM2 on this machine and simulated Qwen3-8B on
RTX PRO 6000 side by side.

  python -m experiments.lora --output_dir=out/lora [--json] [--small]

A batch of --batch requests (request i uses adapter i mod k; k = 0 is the base model),
all arriving at once, each decoding --new_tokens. Real: SmolLM2 f32 with --max_loras
random adapters of --rank over --targets in as many slots (each configuration runs once
untimed first, so no figure includes a compile). Simulated: the same engine and
scheduler on the roofline cost model, each distinct adapter of a step read once and its
tokens' low-rank FLOPs added (jaxinfer.costmodel.lora). Reported: output tokens per
second of the decode phase and the median inter-token latency, and both relative to the
base model's.
"""
from __future__ import annotations

import os

from absl import app, flags
import numpy as np

from jaxinfer import strict_json
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_list("distinct", ["0", "1", "2", "4", "8", "16"], "distinct adapters (0: none)")
flags.DEFINE_integer("batch", 16, "requests in the batch")
flags.DEFINE_integer("new_tokens", 32, "tokens each request decodes")
flags.DEFINE_integer("rank", 8, "adapter rank")
flags.DEFINE_list("targets", ["all"], "adapted weights (q,k,v,o,gate,up,down or all)")
flags.DEFINE_string("sim_model", "qwen3-8b", "simulated model")
flags.DEFINE_string("sim_hardware", "rtx-pro-6000", "simulated hardware")
flags.DEFINE_integer("sim_context", 2048, "simulated prompt tokens per request")
flags.DEFINE_bool("real", True, "measure SmolLM2 on this machine")
flags.DEFINE_bool("small", False, "CI size: batch 4, 6 tokens, k in 0, 1, 4")
flags.DEFINE_bool("json", False, "print JSON")
flags.DEFINE_string("output_dir", "", "write lora.json and lora.png here")

PROMPT = "Write a short poem about the number {i}."


def _figures(reqs, t_decode_start):
  """(decode tokens per second, median ITL seconds) of finished requests."""
  end = max(r.finished_at for r in reqs)
  tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
  itl = np.median([x for r in reqs for x in r.itls])
  return tokens / (end - t_decode_start), float(itl)


def run_real(distinct, batch, new_tokens, rank, targets):
  import tempfile
  from jaxinfer import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.lora import save_peft
  from jaxinfer.lora.adapter import random_adapter_factors
  m = load_model("smollm2-135m-instruct")
  slots = max(max(distinct), 1)
  table = BucketTable(token_sizes=(batch, 2 * batch, 64), request_sizes=(batch,),
                      page_table_sizes=(8,), prefill_slot_sizes=(1, 2, 4))
  tmp = tempfile.TemporaryDirectory(prefix="jaxinfer-lora-study-")
  paths = {}
  for i in range(slots):  # random adapters in PEFT's format, loaded as a user's would be
    a, b = random_adapter_factors(m.cfg, rank, targets, seed=i)
    paths[f"a{i}"] = os.path.join(tmp.name, f"a{i}")
    save_peft(paths[f"a{i}"], a, b, m.cfg, rank=rank, alpha=2.0)
  llm = LLM(m, warmup=False, buckets=table, num_pages=512, max_loras=slots,
            max_lora_rank=rank, lora_adapters=paths)
  tmp.cleanup()  # loaded into host memory
  rows = []
  for k in distinct:
    sps = [SamplingParams(max_tokens=new_tokens, ignore_eos=True,
                          lora=f"a{i % k}" if k else None) for i in range(batch)]
    prompts = [llm.encode_prompt(PROMPT.format(i=i), chat=True) for i in range(batch)]
    for _ in range(2):  # the first run compiles; the second is measured
      eng = llm.engine
      reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
      eng.run()
    t0 = max(r.token_times[0] for r in reqs)  # every request decoding from here on
    tps, itl = _figures(reqs, t0)
    rows.append(dict(distinct=k, tokens_per_s=tps, itl_ms=1e3 * itl,
                     adapter_loads=eng.scheduler.adapters.num_loads))
  return rows


def run_sim(distinct, batch, new_tokens, rank, targets, model, hardware, context):
  from jaxinfer.costmodel import RooflineStepModel, lora
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names(model, hardware)
  params = lora.adapter_params(rm.costs.cfg, rank, targets)
  slots = max(max(distinct), 1)
  rows = []
  for k in distinct:
    ex = SimExecutor(rm, num_pages=batch * (context + new_tokens) // 16 + 64, page_size=16,
                     lora_adapters={f"a{i}": params for i in range(slots)}, max_loras=slots,
                     lora_cost=lora.LoraCost.for_hardware(rm.hw, rm.costs.bytes_per_param))
    eng = Engine(ex, SchedulerConfig("chunked", batch, 8192, 8192),
                 buckets=BucketTable.default(8192, batch, (context + new_tokens) // 16 + 1))
    reqs = [eng.add_request([1] * context, SamplingParams(
        max_tokens=new_tokens, ignore_eos=True, lora=f"a{i % k}" if k else None),
        arrival_time=0.0) for i in range(batch)]
    eng.run()
    tps, itl = _figures(reqs, max(r.token_times[0] for r in reqs))
    rows.append(dict(distinct=k, tokens_per_s=tps, itl_ms=1e3 * itl))
  return rows, params * rm.costs.bytes_per_param


def main(argv):
  del argv
  from jaxinfer.costmodel import lora
  targets = lora.parse_targets(FLAGS.targets)
  distinct = [int(x) for x in FLAGS.distinct]
  batch, new = FLAGS.batch, FLAGS.new_tokens
  if FLAGS.small:
    distinct, batch, new = [0, 1, 4], 4, 6
  if any(k > batch or k < 0 for k in distinct):
    raise app.UsageError(f"--distinct values must be in [0, --batch={batch}]")
  out = {"batch": batch, "new_tokens": new, "rank": FLAGS.rank, "targets": list(targets)}
  sim, sim_bytes = run_sim(distinct, batch, new, FLAGS.rank, targets, FLAGS.sim_model,
                           FLAGS.sim_hardware, FLAGS.sim_context)
  out["simulated"] = dict(model=FLAGS.sim_model, hardware=FLAGS.sim_hardware,
                          context=FLAGS.sim_context, adapter_bytes=sim_bytes, rows=sim)
  if FLAGS.real:
    out["real"] = dict(model="smollm2-135m-instruct", rows=run_real(
        distinct, batch, new, FLAGS.rank, targets))
  for part in ("real", "simulated"):
    if part not in out:
      continue
    rows = out[part]["rows"]
    base = rows[0]
    for r in rows:
      r["throughput_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
      r["itl_vs_first"] = r["itl_ms"] / base["itl_ms"]
  if FLAGS.json:
    print(strict_json.dumps(out, indent=1))
  else:
    print(f"batch {batch}, {new} new tokens each, adapters of rank {FLAGS.rank} over "
          f"{','.join(targets)}; k = distinct adapters in the batch (0: base model)")
    print(f"{'':>10} {'k':>3} {'tok/s':>9} {'x k=' + str(distinct[0]):>7} {'ITL ms':>8} "
          f"{'x k=' + str(distinct[0]):>7}")
    for part in ("real", "simulated"):
      for r in out.get(part, {}).get("rows", []):
        print(f"{part:>10} {r['distinct']:>3} {r['tokens_per_s']:>9.1f} "
              f"{r['throughput_vs_first']:>7.3f} {r['itl_ms']:>8.2f} {r['itl_vs_first']:>7.3f}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "lora.json"), "w") as f:
      strict_json.dump(out, f, indent=1)
    from jaxinfer.plotting import pyplot, save
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for part, style in (("real", "o-"), ("simulated", "s--")):
      rows = out.get(part, {}).get("rows", [])
      if not rows:
        continue
      label = "SmolLM2, this CPU" if part == "real" else \
          f"{FLAGS.sim_model}, {FLAGS.sim_hardware} (simulated)"
      axes[0].plot([r["distinct"] for r in rows], [r["throughput_vs_first"] for r in rows],
                   style, label=label)
      axes[1].plot([r["distinct"] for r in rows], [r["itl_vs_first"] for r in rows], style,
                   label=label)
    axes[0].set_ylabel("decode throughput / base model's")
    axes[1].set_ylabel("median ITL / base model's")
    for ax in axes:
      ax.set_xlabel(f"distinct adapters in a batch of {batch}")
      ax.legend(fontsize=8)
    fig.suptitle(f"8.2.1 multi-LoRA: rank {FLAGS.rank} over {','.join(targets)}")
    save(fig, os.path.join(FLAGS.output_dir, "lora.png"), dpi=110)


if __name__ == "__main__":
  app.run(main)
