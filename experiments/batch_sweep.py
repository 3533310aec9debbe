"""Batch sweep (chapter 8-1, 8.6.3): B requests of a fixed prompt length sent at once.

  python -m experiments.batch_sweep --output_dir=out/batch_sweep
  python -m experiments.batch_sweep --config=configs/studies/batch_sweep.py:small  # CI size

Real: SmolLM2 f32 on this CPU — TTFT, mean ITL, total throughput, bytes read per decode
round, MBU and prefill MFU against the measured local-cpu profile; peers on the same
weights in the same run (HF transformers generate; llama.cpp when llama-cpp-python is
installed). Simulated: Qwen3-8B on RTX PRO 6000 (roofline calibrated on 8-1), 2K in,
256 out, next to the chapter's measured sweep.
"""
from __future__ import annotations

import os

import numpy as np

from experiments.common import Progress, run_binary, write_json
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.plotting import pyplot, save

# chapter 8-1 sweep (2K in, 256 out, all sent at once): batch -> (tok/s, TTFT s, mean ITL ms)
CHAPTER = {1: (37, 0.096, 27), 64: (1165, 3.29, 40)}


def real_sweep(batches, L, G, peers, model="smollm2-135m-instruct"):
  from jaxinfer.costmodel import ModelCosts, load_hardware
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from experiments import peers as P
  m = load_model(model)
  hw = load_hardware("local-cpu")
  costs = ModelCosts(m.cfg, 4.0, "f32", 16)
  rows = []
  prog = Progress(len(batches), "batch_sweep")
  for B in batches:
    pages = -(-(L + G) // 16)
    llm = LLM(m, warmup=False, num_pages=B * pages + 8,
              buckets=BucketTable.default(max_tokens=max(256, L), max_requests=B,
                                          max_pages=pages))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, L).tolist() for _ in range(B)]
    sp = SamplingParams(max_tokens=G, ignore_eos=True)
    llm.generate(prompts, sp)  # compile every shape the run uses
    n0 = len(llm.engine.steps)
    outs = llm.generate(prompts, sp)
    steps = llm.engine.steps[n0:]
    dec = [s for s in steps if s.num_prefill_tokens == 0]
    pre = [s for s in steps if s.num_prefill_tokens > 0]
    ttft = float(np.mean([o.ttft_s for o in outs]))
    itl = float(np.mean([x for o in outs for x in np.diff(o.token_times)]))
    makespan = max(o.token_times[-1] for o in outs)
    round_s = float(np.median([s.duration for s in dec])) if dec else float("nan")
    nbytes = costs.step_bytes([(1, L + G // 2)] * B)
    pre_flops = costs.step_flops([(L, 0)] * B, sampled=B)
    r = {"batch": B, "ttft_s": ttft, "mean_itl_ms": 1e3 * itl,
         "throughput_tok_s": B * G / makespan, "bytes_per_round": nbytes,
         "round_ms": 1e3 * round_s, "mbu": nbytes / (hw.bandwidth * round_s),
         "prefill_s": sum(s.duration for s in pre),
         "mfu": pre_flops / (hw.peak_flops * sum(s.duration for s in pre))}
    if peers:
      hf = P.hf_generate(m.source, prompts, G)
      if hf:
        r["hf"] = hf
        r["jax_over_hf_throughput"] = r["throughput_tok_s"] / hf["throughput_tok_s"]
      lc = P.llama_cpp_generate(m.source, prompts, G)
      if lc:
        r["llama_cpp"] = lc
        r["jax_over_llama_cpp_throughput"] = r["throughput_tok_s"] / lc["throughput_tok_s"]
    rows.append(r)
    prog.step(f"batch {B}: {r['throughput_tok_s']:.0f} tok/s")
  return rows


def sim_sweep(batches, L=2048, G=256, token_budget=8192):
  """Chunked prefill under a token budget, as the chapter's vLLM run (its TTFT grows with
  batch because later prompts wait for earlier chunks; decode shares steps with them)."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  rows = []
  for B in batches:
    # KV for every request at once (the 8-1 runs were not limited by the 12 GiB budget of
    # 8.1, which fits only 37 such requests when reserved to the end of generation).
    ex = SimExecutor(rm, num_pages=B * (-(-(L + G) // 16)) + 16, page_size=16)
    eng = Engine(ex, SchedulerConfig("chunked", B, token_budget, L),
                 buckets=BucketTable.default(1 << 18, max(B, 1), 1024))
    for _ in range(B):
      eng.add_request([1] * L, SamplingParams(max_tokens=G, ignore_eos=True), arrival_time=0)
    reqs = eng.run()
    m = eng.metrics()
    row = {"batch": B, "ttft_s": m["ttft_s"]["mean"], "mean_itl_ms": 1e3 * m["itl_s"]["mean"],
           "throughput_tok_s": m["throughput_tok_s"],
           "bytes_per_round": rm.costs.step_bytes([(1, L)] * B)}
    if B in CHAPTER:
      row["chapter"] = dict(zip(("throughput_tok_s", "ttft_s", "mean_itl_ms"), CHAPTER[B]))
    rows.append(row)
    del reqs
  return rows


def run_study(c, output_dir: str = "") -> dict:
  real = real_sweep(list(c.batches), c.prompt_len, c.output_tokens, c.peers, c.model)
  sim = sim_sweep(list(c.sim_batches), token_budget=c.sim_token_budget)
  res = {"config": c.to_dict(), "real": real, "sim": sim}
  if output_dir:
    write_json(output_dir, "batch_sweep.json", res)
    plot(res, os.path.join(output_dir, "batch_sweep.png"))
  return res


def plot(res: dict, path: str) -> None:
  """Throughput and mean ITL vs batch: the real model (with its peers) and the simulated
  Qwen3-8B next to the chapter's 8-1 points."""
  plt = pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  real, sim = res["real"], res["sim"]
  b = [r["batch"] for r in real]
  ax = axes[0]
  ax.plot(b, [r["throughput_tok_s"] for r in real], "o-", label="jaxinfer")
  for peer, label in (("hf", "HF transformers"), ("llama_cpp", "llama.cpp")):
    pts = [(r["batch"], r[peer]["throughput_tok_s"]) for r in real if peer in r]
    if pts:
      ax.plot(*zip(*pts), "s--", label=label)
  ax.set_title("SmolLM2 f32 on this CPU: throughput", fontsize=9)
  ax.set_ylabel("output tok/s")
  ax = axes[1]
  ax.plot(b, [r["mean_itl_ms"] for r in real], "o-", label="mean ITL (ms)")
  ax2 = ax.twinx()
  ax2.plot(b, [r["mbu"] for r in real], "^:", color="tab:red", label="MBU")
  ax2.set_ylabel("MBU")
  ax.set_title("SmolLM2: ITL and MBU", fontsize=9)
  ax.set_ylabel("ms")
  ax2.legend(fontsize=7, loc="lower right")
  ax = axes[2]
  sb = [r["batch"] for r in sim]
  ax.plot(sb, [r["throughput_tok_s"] for r in sim], "o-", label="simulated")
  ch = [(r["batch"], r["chapter"]["throughput_tok_s"]) for r in sim if "chapter" in r]
  if ch:
    ax.plot(*zip(*ch), "k*", markersize=10, label="chapter 8-1")
  ax.set_title("Qwen3-8B on RTX PRO 6000 (simulated)", fontsize=9)
  ax.set_ylabel("output tok/s")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests sent at once)")
    ax.legend(fontsize=7, loc="upper left")
  save(fig, path)


def print_tables(res: dict) -> None:
  c, real, sim = res["config"], res["real"], res["sim"]
  print(f"SmolLM2 f32 on this CPU, prompt {c['prompt_len']}, {c['output_tokens']} new tokens, "
        "all sent at once")
  print(f"{'batch':>5} {'TTFT s':>7} {'ITL ms':>7} {'tok/s':>7} {'MB/round':>9} {'round ms':>9} "
        f"{'MBU':>5} {'MFU':>5} {'HF tok/s':>9} {'x HF':>5}")
  for r in real:
    hf = r.get("hf", {})
    print(f"{r['batch']:>5} {r['ttft_s']:>7.3f} {r['mean_itl_ms']:>7.1f} "
          f"{r['throughput_tok_s']:>7.1f} {r['bytes_per_round'] / 1e6:>9.0f} "
          f"{r['round_ms']:>9.1f} {r['mbu']:>5.2f} {r['mfu']:>5.2f} "
          f"{hf.get('throughput_tok_s', float('nan')):>9.1f} "
          f"{r.get('jax_over_hf_throughput', float('nan')):>5.2f}")
  print(f"\nsimulated Qwen3-8B on RTX PRO 6000 (2K in, 256 out, chunked prefill, "
        f"{c['sim_token_budget']}-token budget), chapter's 8-1 values in ()")
  print(f"{'batch':>5} {'TTFT s':>12} {'ITL ms':>10} {'tok/s':>14} {'GB/round':>9}")
  for r in sim:
    ch = r.get("chapter")
    f = (lambda k, fmt: f"{r[k]:{fmt}}" + (f" ({ch[k]})" if ch else ""))
    print(f"{r['batch']:>5} {f('ttft_s', '.3f'):>12} {f('mean_itl_ms', '.1f'):>10} "
          f"{f('throughput_tok_s', '.0f'):>14} {r['bytes_per_round'] / 1e9:>9.2f}")


if __name__ == "__main__":
  run_binary("batch_sweep", run_study, print_tables)
