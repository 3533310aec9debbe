"""Decode throughput on this CPU: jaxinfer vs HF transformers `generate`, same weights
and dtype, in the same run, against the memory-bandwidth floor.

  python tools/bench_decode.py --batch_sizes=1,16 --prompt_len=128 --new_tokens=64

The floor of one decode step is (weight bytes + the batch's KV bytes) / the read
bandwidth measured here (tools/measure_hardware.py's method). HF is skipped with a
message when torch/transformers are not installed (`pip install -e '.[test]'`).
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "model name or GGUF path")
flags.DEFINE_list("batch_sizes", ["1", "16"], "batch sizes")
flags.DEFINE_integer("prompt_len", 128, "prompt tokens per request")
flags.DEFINE_integer("new_tokens", 64, "tokens generated per request")
flags.DEFINE_bool("hf", True, "also run HF transformers generate (if installed)")
flags.DEFINE_string("output_dir", "", "write bench_decode.json here")


def _prompts(vocab, B, L, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(100, vocab - 100, L).tolist() for _ in range(B)]


def bench_jax(llm, B, L, N):
  from jaxinfer.config import SamplingParams
  sp = SamplingParams(max_tokens=N, ignore_eos=True)
  llm.generate(_prompts(llm.cfg.vocab_size, B, L, 1), sp)  # compile every bucket used
  outs = llm.generate(_prompts(llm.cfg.vocab_size, B, L), sp)
  t_first = max(o.token_times[0] for o in outs)
  t_last = max(o.token_times[-1] for o in outs)
  steps = np.diff(outs[0].token_times)
  return {"decode_tok_s": B * (N - 1) / (t_last - t_first), "step_ms": 1e3 * float(np.median(steps)),
          "ttft_s": t_first}


def bench_hf(path, B, L, N, vocab):
  from experiments.peers import hf_generate
  return hf_generate(path, _prompts(vocab, B, L), N)


def main(argv):
  del argv
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, here)
  sys.path.insert(0, os.path.dirname(here))
  from measure_hardware import measure_read_bandwidth
  from jaxinfer.buckets import BucketTable
  from jaxinfer.kv import bytes_per_token
  from jaxinfer.llm import LLM
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  L, N = FLAGS.prompt_len, FLAGS.new_tokens
  bw = measure_read_bandwidth(512, 5)
  page_size = 16
  pages_per_req = -(-(L + N) // page_size)
  llm = LLM(FLAGS.model, num_pages=max(batch_sizes) * pages_per_req + 8,
            buckets=BucketTable.default(max_tokens=256, max_requests=max(batch_sizes),
                                        max_pages=pages_per_req))
  cfg = llm.cfg
  w_bytes = cfg.weight_bytes_read_per_step(4)  # f32
  kv_tok = bytes_per_token(cfg, "f32", page_size)
  has_hf = FLAGS.hf
  if has_hf:
    import importlib.util
    has_hf = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    if not has_hf:
      print("HF transformers/torch not installed: skipping the HF peer", file=sys.stderr)
  rows = []
  for B in batch_sizes:
    ctx = L + N // 2  # mean context over the decode
    floor_ms = 1e3 * (w_bytes + B * ctx * kv_tok) / bw
    r = {"batch": B, "floor_step_ms": floor_ms, "floor_tok_s": B / floor_ms * 1e3}
    r["jax"] = bench_jax(llm, B, L, N)
    r["jax_step_over_floor"] = r["jax"]["step_ms"] / floor_ms
    hf = bench_hf(llm.model.source, B, L, N, cfg.vocab_size) if has_hf else None
    if hf:
      r["hf"] = hf
      r["jax_over_hf_tok_s"] = r["jax"]["decode_tok_s"] / hf["decode_tok_s"]
    rows.append(r)
    print(f"batch {B}: done", file=sys.stderr)
  print(f"read bandwidth {bw / 1e9:.1f} GB/s; weights read per step {w_bytes / 1e6:.0f} MB (f32); "
        f"prompt {L}, new tokens {N}")
  print(f"{'batch':>5} {'floor ms':>9} {'jax ms':>8} {'x floor':>8} {'jax tok/s':>10} "
        f"{'hf ms':>8} {'hf tok/s':>9} {'jax/hf':>7}")
  for r in rows:
    hf = r.get("hf", {})
    print(f"{r['batch']:>5} {r['floor_step_ms']:>9.1f} {r['jax']['step_ms']:>8.1f} "
          f"{r['jax_step_over_floor']:>8.2f} {r['jax']['decode_tok_s']:>10.1f} "
          f"{hf.get('step_ms', float('nan')):>8.1f} {hf.get('decode_tok_s', float('nan')):>9.1f} "
          f"{r.get('jax_over_hf_tok_s', float('nan')):>7.2f}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "bench_decode.json"), "w") as f:
      json.dump({"bandwidth_gbs": bw / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
