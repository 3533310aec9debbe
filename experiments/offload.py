"""Weight offload with prefetch (chapter 8.4.3), simulated: sweep the offloaded FFN sets and
the prefetch buffers for Qwen3-8B on RTX PRO 6000 (PCIe Gen5 x16) and GH200
(NVLink-C2C); a 8192-in / 256-out request runs through the real scheduler on the
simulated clock; report round time, request time vs the 7 s deadline, memory freed /
kept / net and the requests that saving admits; draw round time vs offloaded sets.

  python -m experiments.offload --output_dir=out/offload [--json]
"""
from __future__ import annotations

import dataclasses
import os

from absl import app, flags

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams, get_model_config
from jaxinfer.costmodel import RooflineStepModel, load_hardware
from jaxinfer.costmodel.offload import OffloadConfig, OffloadStepModel, account
from jaxinfer.executors.sim_executor import SimExecutor
from jaxinfer.plotting import pyplot, save
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.scheduler import SchedulerConfig
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "qwen3-8b", "model config")
flags.DEFINE_list("hardware", ["rtx-pro-6000", "gh200"], "hardware profiles")
flags.DEFINE_list("sets", ["0", "4", "9", "18", "27", "36"], "offloaded FFN sets")
flags.DEFINE_integer("input_tokens", 8192, "L")
flags.DEFINE_integer("output_tokens", 256, "G")
flags.DEFINE_float("deadline_s", 7.0, "deadline")
flags.DEFINE_bool("json", False, "print JSON")
flags.DEFINE_string("output_dir", "", "write offload.json and offload.png here")
flags.DEFINE_bool("real", True, "also measure SmolLM2 on this machine with offload")
flags.DEFINE_list("real_every", ["0", "6", "3", "1"], "real: offload every k-th layer's FFN")


def simulate(model: str, hardware: str, n_sets: int, buffers: int, L: int, G: int) -> dict:
  cfg = get_model_config(model)
  hw = load_hardware(hardware)
  base = RooflineStepModel.for_names(model, hardware)
  off = OffloadConfig.count(cfg.num_layers, n_sets, buffers)
  sm = OffloadStepModel(base, cfg, off, hw.link_bandwidth)
  ex = SimExecutor(sm, num_pages=4096, page_size=16)
  eng = Engine(ex, SchedulerConfig("continuous", 1, 1 << 20, 1 << 20),
               buckets=BucketTable.default(1 << 14, 8, 1024))
  r = eng.add_request([1] * L, SamplingParams(max_tokens=G, ignore_eos=True), arrival_time=0)
  eng.run()
  k = base.costs.kv_bytes_per_token
  acc = account(cfg, off, hw.link_bandwidth, -(-L // 16) * 16 * k, -(-(L + G - 1) // 16) * 16 * k)
  return {"hardware": hardware, "link": hw.host_link, "sets": n_sets, "buffers": buffers,
          "round_ms": 1e3 * sum(r.itls) / len(r.itls), "plain_round_ms":
          1e3 * base.decode_round(1, L + G // 2), "request_s": r.latency,
          "meets_deadline": r.latency <= FLAGS.deadline_s, **dataclasses.asdict(acc)}


def measure_real(every_k, buffers, new_tokens=24):
  """SmolLM2 decode on this machine with every k-th layer's FFN streamed from host memory."""
  import numpy as np
  from jaxinfer.costmodel.offload import OffloadConfig, ffn_set_bytes
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  m = measure_real.model = getattr(measure_real, "model", None) or load_model(
      "smollm2-135m-instruct")
  off = OffloadConfig.every_kth(m.cfg.num_layers, every_k, buffers) if every_k else None
  llm = LLM(m, warmup=False, num_pages=64, offload=off,
            buckets=BucketTable.default(max_tokens=64, max_requests=1, max_pages=8))
  sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
  llm.generate(["Tell me about the sea."], sp)  # compile
  out = llm.generate(["Tell me about the sea."], sp)[0]
  n_sets = len(off.layers) if off else 0
  set_bytes = ffn_set_bytes(m.cfg, 4)
  return {"every_k": every_k, "sets": n_sets, "buffers": buffers,
          "step_ms": 1e3 * float(np.median(np.diff(out.token_times))),
          "bytes_moved_per_step": n_sets * set_bytes,
          "device_weight_mib": (m.cfg.param_count() * 4 - n_sets * set_bytes
                                + min(buffers, n_sets) * set_bytes) / 2**20}


def main(argv):
  del argv
  real = []
  if FLAGS.real:
    for k in (int(x) for x in FLAGS.real_every):
      for b in ((1,) if k == 0 else (1, 2)):
        real.append(measure_real(k, b))
    print("SmolLM2 f32 on this machine (host copies are memcpys here):")
    print(f"{'every k':>7} {'sets':>4} {'buf':>3} {'step ms':>8} {'MB moved/step':>13} "
          f"{'device weights MiB':>18}")
    for r in real:
      print(f"{r['every_k']:>7} {r['sets']:>4} {r['buffers']:>3} {r['step_ms']:>8.1f} "
            f"{r['bytes_moved_per_step'] / 1e6:>13.1f} {r['device_weight_mib']:>18.0f}")
  rows = []
  for hw in FLAGS.hardware:
    for n in (int(s) for s in FLAGS.sets):
      for b in (1, 2):
        if n == 0 and b == 2:
          continue
        rows.append(simulate(FLAGS.model, hw, n, b, FLAGS.input_tokens, FLAGS.output_tokens))
  if FLAGS.json:
    print(strict_json.dumps({"simulated": rows, "real": real}, indent=1))
  else:
    print(f"{'hardware':>13} {'sets':>4} {'buf':>3} {'round ms':>9} {'copy ms':>8} "
          f"{'request s':>9} {'<=7s':>5} {'net MiB':>8} {'+req@end':>8}")
    for r in rows:
      print(f"{r['hardware']:>13} {r['sets']:>4} {r['buffers']:>3} {r['round_ms']:>9.1f} "
            f"{r['copy_ms_per_step']:>8.1f} {r['request_s']:>9.2f} "
            f"{'yes' if r['meets_deadline'] else 'no':>5} {r['net_mib']:>8.0f} "
            f"{r['extra_requests_at_end']:>8}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "offload.json"), "w") as f:
      strict_json.dump({"simulated": rows, "real": real}, f, indent=1)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for hw in FLAGS.hardware:
      for b, style in ((1, "o--"), (2, "s-")):
        pts = [r for r in rows if r["hardware"] == hw and (r["buffers"] == b or r["sets"] == 0)]
        ax.plot([r["sets"] for r in pts], [r["round_ms"] for r in pts], style,
                label=f"{hw}, {b} buffer{'s' if b > 1 else ''}")
    ax.set_xlabel("offloaded FFN sets (of 36, 288 MiB each)")
    ax.set_ylabel("decode round (ms), batch 1, 8K context")
    ax.set_title("8.4.3 weight offload with prefetch (simulated)")
    ax.legend(fontsize=8)
    save(fig, os.path.join(FLAGS.output_dir, "offload.png"), dpi=110)


if __name__ == "__main__":
  app.run(main)
