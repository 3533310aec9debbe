"""Structured output and logits processing on this machine: which grammar library, and
what each kind of per-request processing costs a decode step.

  python tools/bench_sampling.py [--batch_sizes=1,16] [--output_dir=DIR]

1. Library choice, on configs/structured/schemas.json (20 JSON Schemas) at SmolLM2's
   49,152-token vocabulary: llguidance (what jaxinfer uses) and, when installed,
   outlines-core (`pip install outlines-core`; xgrammar is not measured: it depends on
   torch and triton, which the runtime must not pull). Per schema: compile time (the
   grammar built and ready for its first mask) and the time to fill one token's mask,
   along a valid instance (SmolLM2's own constrained answer, re-serialized compactly so
   both libraries' JSON whitespace rules accept it, and tokenized canonically).
2. The step overhead: steady decode steps of `batch` requests, all free vs all under one
   kind of processing, same prompts, same lengths: a JSON-string constraint (the widest
   masks: almost every token allowed; masks filled before the step's forward is dispatched or
   while it runs), penalties (presence + frequency + repetition: the dense additive row
   and the seen-token bits), top-20 logprobs. Median step time (host packing included)
   and its ratio to the free step, the host's mask-fill time per step, beside this
   machine's bandwidth and compute floors for that step and HF transformers' decode step
   at the same batch and context (same run).
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "16"], "decode batch sizes of the overhead part")
flags.DEFINE_integer("decode_tokens", 40, "tokens each request decodes (overhead part)")
flags.DEFINE_bool("hf", True, "time HF transformers' decode step in the same run")
flags.DEFINE_bool("libraries", True, "run the library comparison")
flags.DEFINE_list("overlap_masks", ["false", "true"], "executor modes to time: false = masks "
                  "filled before the forward is dispatched, true = while it runs")
flags.DEFINE_string("output_dir", "", "write bench_sampling.json here")

STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
         "required": ["story"]}


def _instances(llm, cases):
  """SmolLM2's constrained greedy answer to each schema, compact, and its token ids."""
  from jaxinfer.config import SamplingParams
  outs = llm.generate([c["prompt"] for c in cases],
                      [SamplingParams(max_tokens=160, json_schema=c["schema"]) for c in cases],
                      chat=True)
  inst = []
  for c, o in zip(cases, outs):
    text = json.dumps(json.loads(o.text), separators=(",", ":"), ensure_ascii=False)
    inst.append((c, text, llm.tokenizer.encode(text, add_special_tokens=False)))
  return inst


def _bench_llguidance(llm, inst):
  import llguidance
  from jaxinfer.structured import GrammarCompiler, unconstrained_rows
  t0 = time.perf_counter()
  comp = GrammarCompiler(llm.tokenizer, llm.cfg.vocab_size, llm.cfg.eos_token_ids)
  setup = time.perf_counter() - t0
  rows = []
  for c, text, ids in inst:
    t0 = time.perf_counter()
    g = comp.matcher("json_schema", json.dumps(c["schema"]))
    out = unconstrained_rows(1, comp.vocab_size)
    comp.fill([(g, 0, [])], out)  # the first mask: lazy compilation finishes here
    compile_s = time.perf_counter() - t0
    ts, ok = [], True
    for t in ids:
      if not g.advance(t) in (None, "stop"):
        ok = False
        break
      t0 = time.perf_counter()
      comp.fill([(g, 0, [])], out)
      ts.append(time.perf_counter() - t0)
    rows.append(dict(schema=c["name"], compile_ms=1e3 * compile_s, ok=ok,
                     mask_us=[1e6 * x for x in ts]))
  del llguidance
  return "llguidance", setup, rows


def _bench_outlines(llm, inst):
  try:
    import outlines_core as oc
  except ImportError:
    return None
  import llguidance
  from jaxinfer.structured import mask_words
  t0 = time.perf_counter()
  lt = llguidance.LLTokenizer(llm.tokenizer.backend.to_str(), n_vocab=llm.cfg.vocab_size,
                              eos_token=list(llm.cfg.eos_token_ids))
  vocab = {}
  eos = llm.cfg.eos_token_ids[0]
  for i in range(llm.cfg.vocab_size):
    b = lt.decode_bytes([i])
    if i != eos and b:
      vocab.setdefault(b, []).append(i)
  v = oc.Vocabulary(eos, vocab)
  setup = time.perf_counter() - t0
  words = mask_words(llm.cfg.vocab_size)
  rows = []
  for c, text, ids in inst:
    t0 = time.perf_counter()
    try:
      guide = oc.Guide(oc.Index(oc.json_schema.build_regex_from_schema(
          json.dumps(c["schema"])), v))
    except Exception as e:  # noqa: BLE001 -- a schema the library cannot compile is a result
      rows.append(dict(schema=c["name"], compile_ms=None, ok=False, error=str(e)[:80],
                       mask_us=[]))
      continue
    mask = np.zeros(words, np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    compile_s = time.perf_counter() - t0
    ts, ok = [], True
    for t in ids:
      try:
        guide.advance(t)
      except Exception:  # noqa: BLE001 -- the instance is outside its regex
        ok = False
        break
      t0 = time.perf_counter()
      guide.write_mask_into(mask.ctypes.data, mask.size, 4)
      ts.append(time.perf_counter() - t0)
    rows.append(dict(schema=c["name"], compile_ms=1e3 * compile_s, ok=ok,
                     mask_us=[1e6 * x for x in ts]))
  return "outlines-core", setup, rows


VARIANTS = {"json string": {"json_schema": STORY},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                          "repetition_penalty": 1.2},
            "top-20 logprobs": {"logprobs": 20}}


def _steps(llm, prompts, extra):
  """Median decode-step seconds of `prompts` all decoding under `extra`, and the host's
  mask-fill seconds per step (a warm-up run first compiles this run's shapes)."""
  from jaxinfer.config import SamplingParams
  sp = SamplingParams(max_tokens=FLAGS.decode_tokens, ignore_eos=True, **extra)
  eng = llm.engine
  llm.generate(prompts, sp, chat=True)
  n0, m0 = len(eng.steps), eng.mask_time_s
  llm.generate(prompts, sp, chat=True)
  steps = [s for s in eng.steps[n0:] if s.num_prefill_tokens == 0 and s.num_seqs == len(prompts)]
  return (float(np.median([s.duration for s in steps])),
          (eng.mask_time_s - m0) / max(len(eng.steps) - n0, 1))


def _overhead(llm, B, variants, hf, costs, bw, rate):
  prompts = [f"Tell a long story about a lighthouse keeper number {i}." for i in range(B)]
  free, _ = _steps(llm, prompts, {})
  ctx = int(np.mean([len(llm.encode_prompt(p, chat=True)) for p in prompts])) + \
      FLAGS.decode_tokens // 2
  seqs = [(1, ctx)] * B
  base = dict(batch=B, context=ctx, free_step_ms=1e3 * free,
              bandwidth_floor_ms=1e3 * costs.step_bytes(seqs) / bw,
              compute_floor_ms=1e3 * costs.step_flops(seqs) / rate(B), hf_step_ms=None)
  if hf is not None:
    from jaxinfer.benchmarking import hf_decode_step
    base["hf_step_ms"] = 1e3 * hf_decode_step(hf, llm.cfg, B, ctx, 5)
  rows = []
  for name in variants:
    t, fill = _steps(llm, prompts, VARIANTS[name])
    rows.append(dict(base, variant=name, overlap=llm.executor.overlap_masks,
                     step_ms=1e3 * t, ratio=t / free, mask_fill_ms_per_step=1e3 * fill))
  return rows


def main(argv):
  del argv
  from jaxinfer import LLM, benchmarking as bm, strict_json
  from jaxinfer.buckets import BucketTable
  from jaxinfer.costmodel import ModelCosts
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  batches = [int(b) for b in FLAGS.batch_sizes]
  cases = json.load(open(os.path.join(root, "configs", "structured", "schemas.json")))
  bw = bm.measure_read_bandwidth(512, 5)
  peak = bm.measure_matmul_flops(2048, 5)
  print(f"machine: read bandwidth {bw / 1e9:.1f} GB/s, f32 matmul 2048^3 {peak / 1e9:.0f} "
        f"GFLOP/s, {os.cpu_count()} cores", flush=True)
  # Exact shapes for the overhead part (one decode bucket per batch size); the
  # library part's batch of 20 uses the default table's.
  table = BucketTable(token_sizes=tuple(sorted({*batches, 64, 256})),
                      request_sizes=tuple(sorted({*batches, 32})), page_table_sizes=(16,))
  llm = LLM(warmup=False, buckets=table, max_model_len=256)
  out = {"machine": {"read_bandwidth_gbs": bw / 1e9, "matmul_gflops": peak / 1e9}}
  if FLAGS.libraries:
    inst = _instances(llm, cases)
    libs = [r for r in (_bench_llguidance(llm, inst), _bench_outlines(llm, inst)) if r]
    print("\ngrammar libraries on 20 JSON Schemas (SmolLM2 vocabulary 49,152): compile = "
          "grammar ready for its first mask; mask = one token's mask, along each schema's "
          "instance")
    print(f"{'library':<14} {'setup s':>8} {'compiled':>9} {'compile ms med':>15} "
          f"{'max':>8} {'mask us mean':>13} {'p99':>8} {'max':>8}")
    out["libraries"] = {}
    for name, setup, rows in libs:
      ok = [r for r in rows if r["ok"]]
      comp = [r["compile_ms"] for r in ok]
      us = [x for r in ok for x in r["mask_us"]]
      print(f"{name:<14} {setup:>8.2f} {len(ok):>6}/{len(rows):<2} {np.median(comp):>15.2f} "
            f"{max(comp):>8.2f} {np.mean(us):>13.1f} {np.percentile(us, 99):>8.1f} "
            f"{max(us):>8.1f}" + "".join(f"  failed: {r['schema']}" for r in rows
                                          if not r["ok"]))
      out["libraries"][name] = dict(setup_s=setup, schemas=[
          {k: v for k, v in r.items() if k != "mask_us"} | dict(
              mask_us_mean=float(np.mean(r["mask_us"])) if r["mask_us"] else None)
          for r in rows])
  hf = None
  if FLAGS.hf:
    hf = bm.hf_model(llm.model.source)
  costs = ModelCosts(llm.cfg, 4.0, "f32", 16)
  rates = {}

  def rate(B):
    if B not in rates:
      rates[B] = bm.step_matmul_rate(llm.cfg, B, B, 5)
    return rates[B]

  rows = []
  for k, mode in enumerate(FLAGS.overlap_masks):
    if mode not in ("true", "false"):
      raise app.UsageError(f"--overlap_masks: 'true' or 'false', got {mode!r}")
    llm.executor.overlap_masks = mode == "true"
    variants = list(VARIANTS) if k == 0 else ["json string"]  # only masks overlap
    for B in batches:
      rows += _overhead(llm, B, variants, hf, costs, bw, rate)
  print("\nsteady decode step, free vs every request under one kind of processing (ms; "
        "floors and HF from this run); overlap: masks filled while the forward runs "
        "or before it is dispatched")
  print(f"{'processing':<16} {'overlap':>7} {'batch':>5} {'ctx':>4} {'free':>7} {'step':>7} "
        f"{'ratio':>6} {'mask fill':>9} {'bw floor':>8} {'cmp floor':>9} {'HF':>7}")
  for r in rows:
    hf_ms = "-" if r["hf_step_ms"] is None else f"{r['hf_step_ms']:.1f}"
    print(f"{r['variant']:<16} {str(r['overlap']):>7} {r['batch']:>5} {r['context']:>4} "
          f"{r['free_step_ms']:>7.1f} {r['step_ms']:>7.1f} {r['ratio']:>6.3f} "
          f"{r['mask_fill_ms_per_step']:>9.2f} {r['bandwidth_floor_ms']:>8.1f} "
          f"{r['compute_floor_ms']:>9.1f} {hf_ms:>7}")
  out["overhead"] = rows
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "bench_sampling.json"), "w") as f:
      f.write(strict_json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
