"""Steady-state decode and prefill steps on this machine: jaxinfer vs HF transformers
in the same run, each figure beside this machine's bandwidth and compute floors.

  python tools/bench_decode.py --batch_sizes=1,16,64 --contexts=256,1024,4096

Decode: one step in which every request decodes one token after `context` cached
tokens and nothing prefills (jaxinfer: a step packed at exactly that shape, median of
--repeats; HF: the model's forward of one token per request on a DynamicCache holding
`context` tokens, median of --repeats consecutive steps). Prefill: one request of each
--prefill_lens tokens, no cache.

Floors of a step, from measurements made in the same run:
  bandwidth floor = (weight bytes read + the step's KV bytes) / measured read bandwidth
  compute floor   = the step's weight-matmul FLOPs / measured f32 matmul FLOP/s at the
                    step's own shapes + its attention FLOPs / the 2048^3 matmul rate
Each cell runs in rounds: the read bandwidth and the matmul rates at the step's shapes are
measured again in every round, then one step of each executor and one HF step per dtype are
taken (ours first: right after an HF forward torch's threads still spin), and every ratio
(x floor, x HF) is the median of the rounds' own ratios; the floors and times printed are
medians over the rounds. 'HF/floor' is HF's step over max(floors) in the same rounds: the
'x HF' of a step exactly at its floor, the most any engine that reads the weights and the KV
once at the measured bandwidth (or computes at the measured matmul rate) could show here.
  serial floor    = KV bytes / read bandwidth + max(weight bytes / read bandwidth, weight-
                    matmul FLOPs / the matmul rate at the step's shapes)
a step whose attention and weight matmuls each run at their floor, one after the other;
'serial/floor' is it over max(floors): where it exceeds 1.5, 1.5x of max(floors) needs the KV
read to overlap the matmuls.
(attention used to be charged at the weight matmuls' rate; at batch 1 that rate is
bandwidth-bound, so the "floor" sat above what the native decode call achieves)
Combinations whose KV pool exceeds --max_pool_gib are skipped and listed.
"""
from __future__ import annotations

import itertools
import os
import sys
import time

from absl import app, flags
import numpy as np
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "model name or GGUF path")
flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "decode batch sizes")
flags.DEFINE_list("contexts", ["256", "1024", "4096"], "cached tokens per request")
flags.DEFINE_list("prefill_lens", ["128", "512"], "prompt lengths of the prefill rows")
flags.DEFINE_list("kv_formats", ["f32"], "KV formats to run the decode grid in")
flags.DEFINE_list("attention", ["xla"], "attention backends (xla, reference, pallas); with "
                  "several, each cell runs them back to back, so they share the machine's state")
flags.DEFINE_integer("page_width", 0, "pages per request of the steps' page tables (0: just "
                     "the context's; larger: a bucket wider than the context)")
flags.DEFINE_integer("prefill_context", 0, "cached tokens before each prefill row (a later "
                     "chunk of a long prompt, or a prefix-cache hit)")
flags.DEFINE_list("engine_batches", ["64"], "host time per step: LLM.generate of this many "
                  "prompts (--engine_prompt tokens each, --engine_new_tokens out); empty: skip")
flags.DEFINE_integer("engine_prompt", 128, "host time: prompt tokens")
flags.DEFINE_integer("engine_new_tokens", 32, "host time: new tokens per prompt")
flags.DEFINE_list("weight_formats", ["dense"], "dense (f32 weights) and/or gguf (the file's "
                  "own Q4_1/Q8_0 blocks read in place; CPU): gguf rows only at batches up to "
                  "pallas_kernels.cpu.weights.GGUF_MAX_ROWS (larger steps use the dense weights)")
flags.DEFINE_list("dtypes", ["float32"], "weight dtypes of the dense rows: float32 and/or "
                  "bfloat16 (bf16 weights, float32 activations, bf16 x bf16 -> f32 matmuls; HF "
                  "beside them in bf16)")
flags.DEFINE_integer("repeats", 5, "timed steps per figure (median)")
flags.DEFINE_float("max_pool_gib", 6.0, "skip combinations whose KV pool is larger")
flags.DEFINE_bool("alternate", True, "time each (batch, context) cell's rows (KV formats, "
                  "weights, dtypes, backends) with their steps in turn, all executors alive "
                  "at once: their ratios then survive this machine's drifting speed")
flags.DEFINE_bool("hf", True, "run HF transformers in the same run (if installed)")
flags.DEFINE_bool("llama_cpp", True, "run llama.cpp at batch 1 and in prefill in the same run "
                  "(if llama-cpp-python is installed: tools/install_peers.sh)")
flags.DEFINE_string("output_dir", "", "write bench_decode.json and bench_decode.png here")


def _fmt(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def main(argv):
  del argv
  import jax
  from jaxinfer import benchmarking as bm
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.kv import bytes_per_token
  from jaxinfer.loading import load_model
  from pallas_kernels.cpu.weights import GGUF_MAX_ROWS

  for backend in FLAGS.attention:
    if backend not in ("xla", "reference", "pallas"):
      raise app.UsageError(f"--attention: unknown backend {backend!r}")
  batches = [int(b) for b in FLAGS.batch_sizes]
  contexts = [int(c) for c in FLAGS.contexts]
  if FLAGS.repeats < 1:
    raise app.UsageError(f"--repeats must be >= 1 (rounds per cell), got {FLAGS.repeats}")
  for b in batches:
    if b < 1:
      raise app.UsageError(f"--batch_sizes: each must be >= 1, got {b}")
  for c in contexts:
    if c < 0:
      raise app.UsageError(f"--contexts: each must be >= 0, got {c}")
  ps = 16
  for wf in FLAGS.weight_formats:
    if wf not in ("dense", "gguf"):
      raise app.UsageError(f"--weight_formats: unknown format {wf!r}")
  for dt in FLAGS.dtypes:
    if dt not in ("float32", "bfloat16"):
      raise app.UsageError(f"--dtypes: unknown dtype {dt!r} (float32, bfloat16)")
  m = load_model(FLAGS.model, weight_format="gguf" if "gguf" in FLAGS.weight_formats
                 else "dense")
  cfg = m.cfg
  dense_params = {k: v for k, v in m.params.items() if k != "blocks"}
  # rows: dense weights in each dtype; gguf blocks (float32 scales) whatever --dtypes says
  variants = [("dense", dt) for dt in FLAGS.dtypes if "dense" in FLAGS.weight_formats]
  variants += [("gguf", "float32")] if "gguf" in FLAGS.weight_formats else []
  params_of = {("dense", "float32"): dense_params, ("gguf", "float32"): m.params}
  if ("dense", "bfloat16") in variants:
    from jaxinfer.model.params import cast_params
    params_of["dense", "bfloat16"] = cast_params(dense_params, jax.numpy.bfloat16)
  # bytes a gguf step reads for its weights: the blocks as held (codes + float32 scales)
  # and the norms; compared with the dense d_w below
  block_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(m.params.get("blocks", {})))
  block_bytes += (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
  # dense rows: a CPU executor runs them on its native matmuls where it can
  # (pallas_kernels.cpu.weights): bf16 in AMX's tile layout (AMX or AVX512-BF16), f32 in AVX-512
  # panels
  tiles = bm.native_kernel(cfg, jax.numpy.bfloat16) if ("dense", "bfloat16") in variants \
      else None
  pan = bm.native_kernel(cfg, jax.numpy.float32) is not None
  probe = bm.ReadProbe(512)  # the read bandwidth, taken again in every round of every cell
  bw = probe.median(FLAGS.repeats)
  peak = bm.measure_matmul_flops(2048, FLAGS.repeats)
  print(f"machine: read bandwidth {bw / 1e9:.1f} GB/s, f32 matmul 2048^3 {peak / 1e9:.0f} "
        f"GFLOP/s, {os.cpu_count()} cores; model {FLAGS.model} f32, attention "
        f"{','.join(FLAGS.attention)}" + ("; f32 weights in AVX-512 panels" if pan else "")
        + (f"; bf16 weights in the tile layout ({'+'.join(tiles.engines())})" if tiles
           else ""),
        flush=True)
  hf = bm.hf_model(m.source) if FLAGS.hf else None
  hf_of = {"float32": hf}
  if hf is not None and "bfloat16" in FLAGS.dtypes:
    import copy
    import torch
    hf_of["bfloat16"] = copy.deepcopy(hf).to(torch.bfloat16)
  lc = bm.llama_cpp_model(m.source, max(contexts + [int(x) for x in FLAGS.prefill_lens if x])
                          + 64) if FLAGS.llama_cpp else None
  rate_probes = {}

  def rate_probe(key):  # (rows, lm rows, dtype, native) -> its MatmulRateProbe, built once
    if key not in rate_probes:
      rows_, lm_rows, dtype, native = key
      rate_probes[key] = bm.MatmulRateProbe(cfg, rows_, lm_rows, jax.numpy.dtype(dtype),
                                            native)
    return rate_probes[key]

  rows, skipped = [], []
  for ctx in contexts:
    for B in batches:
      step, num_pages = bm.uniform_step(B, ctx, 1, ps, page_width=FLAGS.page_width)
      seqs = [(1, ctx)] * B
      cell = []  # (row without its times, (params, kv_format, backend), floor terms) of every
      # KV format and variant; floor terms: (bytes, weight-matmul FLOPs, attention FLOPs, the
      # rate probe's key or None: the 2048^3 rate, the KV bytes among the bytes)
      tl = None
      for kv_format in FLAGS.kv_formats:
        costs = ModelCosts(cfg, 4.0, kv_format, ps)
        pool_gib = B * (ctx + 1 + ps) * bytes_per_token(cfg, kv_format, ps) / 2**30
        if pool_gib > FLAGS.max_pool_gib:
          skipped.append(f"{kv_format} batch {B} context {ctx}: pool {pool_gib:.1f} GiB")
          continue
        attn = costs.attention_flops(seqs)
        mm = costs.step_flops(seqs) - attn
        kv = costs.step_bytes(seqs) - costs.d_w
        terms = {("dense", "float32"): (costs.step_bytes(seqs), mm, attn,
                                        (B, B, "float32", pan), kv),
                 # gguf: XLA's f32 rate at these shapes is no floor for the block call
                 ("gguf", "float32"): (kv + block_bytes, mm + attn, 0.0, None, kv)}
        if "bfloat16" in FLAGS.dtypes:  # the tile call's rate where it runs the step,
          # else XLA's at >= 16 rows (fewer are padded to 16)
          r16 = B if tiles else max(B, 16)
          terms["dense", "bfloat16"] = (ModelCosts(cfg, 2.0, kv_format, ps).step_bytes(seqs),
                                        mm, attn, (r16, r16, "bfloat16", tiles is not None), kv)
        if kv_format == "f32" and lc is not None and B == 1:
          tl = bm.llama_cpp_decode_step(lc, ctx, FLAGS.repeats)
        for (wf, dt), backend in itertools.product(variants, FLAGS.attention):
          if wf == "gguf" and B > GGUF_MAX_ROWS:
            continue  # such a step multiplies by the dense weights: the dense row
          r = {"attention": backend, "weights": wf, "dtype": dt, "kv_format": kv_format,
               "batch": B, "context": ctx,
               "llama_cpp_step_ms": None if tl is None or kv_format != "f32" else 1e3 * tl}
          cell.append((r, (params_of[wf, dt], kv_format, backend), terms[wf, dt]))

      def make(spec):
        params, kv_format, backend = spec
        return JaxExecutor(cfg, params, num_pages=num_pages, page_size=ps,
                           kv_format=kv_format, backend=backend)

      # Rounds: each takes the read bandwidth, the matmul rates at the step's shapes, one step
      # of each executor and one HF step per dtype, in turn; a row's ratios are the median
      # of its rounds' ratios, so each compares figures taken within about a second of each
      # other (on this VM the probes alone moved by up to 1.7x between runs).
      # --alternate: one group holding every row's executor; else a group per row.
      groups = [list(range(len(cell)))] if FLAGS.alternate else [[i] for i in range(len(cell))]
      for group in groups:
        exs = {i: make(cell[i][1]) for i in group}
        for ex in exs.values():
          ex.execute(step)  # compiles
        # HF rows: f32 KV only; each in its own dtype, and f32 for over_hf_f32
        hf_dts = {d for i in group if cell[i][0]["kv_format"] == "f32"
                  for d in (cell[i][0]["dtype"], "float32") if hf_of.get(d) is not None}
        hfs = {d: bm.HfDecode(hf_of[d], cfg, B, ctx) for d in sorted(hf_dts)}
        keys = {cell[i][2][3] for i in group} - {None}
        got = {i: [] for i in group}  # (step s, bandwidth floor s, compute floor s, HF s of
        # the row's dtype, HF f32 s, serial floor s)
        for _ in range(FLAGS.repeats):
          bw_r = probe()
          rate_r = {k: rate_probe(k)(3) for k in keys}
          ts = {}
          for i in group:
            t = time.perf_counter()
            exs[i].execute(step)
            ts[i] = time.perf_counter() - t
          hf_r = {d: h() for d, h in hfs.items()}
          if hfs:  # torch's threads keep spinning after a forward: measured, a step of ours
            # right after one took 20% longer (batch 1 / 4096 32.5 vs 27.7 ms 50 ms later)
            time.sleep(0.1)
          for i in group:
            r, _, (nbytes, mm, attn, key, kv) = cell[i]
            f32_kv = r["kv_format"] == "f32"
            mm_s = mm / (peak if key is None else rate_r[key])
            got[i].append((ts[i], nbytes / bw_r, mm_s + attn / peak,
                           hf_r.get(r["dtype"]) if f32_kv else None,
                           hf_r.get("float32") if f32_kv else None,
                           kv / bw_r + max((nbytes - kv) / bw_r, mm_s)))
        del exs, hfs
        for i in group:
          r, g = cell[i][0], got[i]
          med = lambda xs: None if xs[0] is None else float(np.median(xs))  # noqa: E731
          t, bwf, cf, h, h32, sf = (med([x[j] for x in g]) for j in range(6))
          top = [max(x[1], x[2]) for x in g]  # each round's max(floors)
          r.update({"step_ms": 1e3 * t, "tok_s": B / t, "bandwidth_floor_ms": 1e3 * bwf,
                    "compute_floor_ms": 1e3 * cf, "hf_step_ms": None if h is None else 1e3 * h,
                    "serial_floor_ms": 1e3 * sf,
                    "serial_over_floor": med([x[5] / f for x, f in zip(g, top)]),
                    "over_floor": med([x[0] / f for x, f in zip(g, top)]),
                    "over_hf": None if h is None else med([x[3] / x[0] for x in g]),
                    "over_hf_f32": None if h32 is None else med([x[4] / x[0] for x in g]),
                    "hf_over_floor": None if h is None else med([x[3] / f for x, f in zip(g, top)]),
                    "probe_read_gbs": cell[i][2][0] / bwf / 1e9})
          rows.append(r)
          print(f"decode {r['attention']} {r['weights']} {r['dtype']} {r['kv_format']} "
                f"batch {B} context {ctx}: {r['step_ms']:.1f} ms "
                f"(floor x{r['over_floor']:.2f}, HF {_fmt(r['hf_step_ms'])} ms)",
                file=sys.stderr, flush=True)
  # the table by KV format, then context and batch, as the runs were once made
  rows.sort(key=lambda r: FLAGS.kv_formats.index(r["kv_format"]))

  pre = []
  costs = ModelCosts(cfg, 4.0, "f32", ps)
  for n in (int(x) for x in FLAGS.prefill_lens if x):
    c0 = FLAGS.prefill_context
    step, num_pages = bm.uniform_step(1, c0, n, ps, page_width=FLAGS.page_width)
    flops = costs.step_flops([(n, c0)])
    th = bm.hf_prefill(hf, n, max(2, FLAGS.repeats // 2)) if hf is not None and not c0 else None
    tl = bm.llama_cpp_prefill(lc, n, max(2, FLAGS.repeats // 2)) if lc is not None and not c0 \
        else None
    for backend in FLAGS.attention:
      ex = JaxExecutor(cfg, dense_params, num_pages=num_pages, page_size=ps, backend=backend)
      # the step and the matmul rate at its shapes measured in turn, round by round, and
      # their ratio taken per round: one rate beside a median of steps gave 0.48-0.79 in
      # runs an hour apart on this VM, whose speed drifts within minutes
      ex.execute(step)  # compiles
      rate_n = bm.MatmulRateProbe(cfg, n, 1, native=pan)
      ts, rates_n = [], []
      for _ in range(max(2, FLAGS.repeats // 2)):
        t0 = time.perf_counter()
        ex.execute(step)
        ts.append(time.perf_counter() - t0)
        rates_n.append(rate_n(1))
      t = float(np.median(ts))
      del ex, rate_n
      pre.append({"attention": backend, "tokens": n, "cached": c0, "ms": 1e3 * t,
                  "gflop_s": flops / t / 1e9,
                  "of_step_matmul_rate": float(np.median(
                      [flops / ti / r for ti, r in zip(ts, rates_n)])),
                  "of_peak": flops / t / peak,
                  "compute_floor_ms": 1e3 * float(np.median([flops / r for r in rates_n])),
                  "hf_ms": None if th is None else 1e3 * th,
                  "over_hf": None if th is None else th / t,
                  "llama_cpp_ms": None if tl is None else 1e3 * tl})

  print("\nsteady decode step (ms); floors from this run; 'x floor' = step / max(floors); "
        "'x HF' = HF step (in the row's dtype) / ours; 'HF/floor' = HF step / max(floors), "
        "the 'x HF' of a step at its floor; 'serial/floor' = (KV read floor + the larger of "
        "the weights' read and matmul floors) / max(floors)")
  print(f"{'attention':>9} {'weights':>7} {'dtype':>8} {'kv':>5} {'batch':>5} {'ctx':>5} "
        f"{'jaxinfer':>9} "
        f"{'tok/s':>8} {'bw floor':>9} {'cmp floor':>9} {'x floor':>7} {'HF':>8} {'x HF':>6} "
        f"{'HF/floor':>8} {'serial/floor':>12} {'llama.cpp':>9}")
  for r in rows:
    print(f"{r['attention']:>9} {r['weights']:>7} {r['dtype']:>8} {r['kv_format']:>5} "
          f"{r['batch']:>5} "
          f"{r['context']:>5} "
          f"{r['step_ms']:>9.1f} "
          f"{r['tok_s']:>8.1f} {r['bandwidth_floor_ms']:>9.1f} {r['compute_floor_ms']:>9.1f} "
          f"{r['over_floor']:>7.2f} {_fmt(r['hf_step_ms']):>8} {_fmt(r['over_hf'], '.2f'):>6} "
          f"{_fmt(r['hf_over_floor'], '.2f'):>8} {r['serial_over_floor']:>12.2f} "
          f"{_fmt(r['llama_cpp_step_ms']):>9}")
  for s in skipped:
    print(f"skipped (--max_pool_gib={FLAGS.max_pool_gib:g}): {s}")
  print("\nprefill, one request (ms)")
  print(f"{'attention':>9} {'tokens':>6} {'jaxinfer':>9} {'GFLOP/s':>8} {'of matmul rate':>14} "
        f"{'cmp floor':>9} {'HF':>8} {'x HF':>6} {'llama.cpp':>9}")
  for r in pre:
    print(f"{r['attention']:>9} {r['tokens']:>6} {r['ms']:>9.1f} {r['gflop_s']:>8.1f} "
          f"{r['of_step_matmul_rate']:>14.2f} {r['compute_floor_ms']:>9.1f} "
          f"{_fmt(r['hf_ms']):>8} {_fmt(r['over_hf'], '.2f'):>6} {_fmt(r['llama_cpp_ms']):>9}")
  if lc is not None:
    print("llama.cpp runs the GGUF's own quantized weights (fewer bytes a step than the f32 "
          "weights jaxinfer and HF read), batch 1 only")

  host = [_host_time(m, int(b)) for b in FLAGS.engine_batches if b]
  if host:
    print("\nhost time per engine step (LLM.generate; decode-only steps, median): scheduling "
          "+ packing before dispatch, sampling bookkeeping + stop checks + events after")
    print(f"{'batch':>5} {'steps':>5} {'step ms':>8} {'host ms':>8} {'host share':>10}")
    for h in host:
      print(f"{h['batch']:>5} {h['decode_steps']:>5} {h['step_ms']:>8.1f} {h['host_ms']:>8.2f} "
            f"{h['host_share']:>10.3f}")

  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    out = {"bandwidth_gbs": bw / 1e9, "matmul_gflops_2048": peak / 1e9,
           "bf16_tile_engines": list(tiles.engines()) if tiles else [], "f32_in_panels": pan,
           "attention": FLAGS.attention, "decode": rows, "prefill": pre, "skipped": skipped,
           "host_time": host}
    with open(os.path.join(FLAGS.output_dir, "bench_decode.json"), "w") as f:
      strict_json.dump(out, f, indent=1)
    _figure(rows, os.path.join(FLAGS.output_dir, "bench_decode.png"))


def _host_time(m, batch: int) -> dict:
  """Host time per step of the real engine: `batch` prompts through LLM.generate (a first
  run compiles, the second is measured); medians over the steps in which every request
  decodes."""
  import numpy as np
  from jaxinfer import LLM
  from jaxinfer.config import SamplingParams
  n, new = FLAGS.engine_prompt, FLAGS.engine_new_tokens
  llm = LLM(m, warmup=False, max_num_seqs=batch, max_num_batched_tokens=max(1024, n),
            num_pages=batch * (-(-(n + new) // 16)) + 16, attention=FLAGS.attention[0])
  prompts = [[100 + (7 * i + j) % 20000 for j in range(n)] for i in range(batch)]
  sp = SamplingParams(max_tokens=new, ignore_eos=True)
  llm.generate(prompts, sp)
  before = len(llm.engine.steps)
  llm.generate(prompts, sp)
  steps = [s for s in llm.engine.steps[before:]
           if s.num_prefill_tokens == 0 and s.num_seqs == batch]
  if not steps:
    raise app.UsageError(f"--engine_batches={batch}: no step had every request decoding (the "
                         "prompts' prefill outlasted the answers): raise --engine_new_tokens")
  step_ms = 1e3 * float(np.median([s.duration for s in steps]))
  host_ms = 1e3 * float(np.median([s.host_s for s in steps]))
  print(f"host time batch {batch}: step {step_ms:.1f} ms, host {host_ms:.2f} ms",
        file=sys.stderr, flush=True)
  return {"batch": batch, "decode_steps": len(steps), "step_ms": step_ms, "host_ms": host_ms,
          "host_share": host_ms / step_ms}


def _figure(rows, path):
  from jaxinfer.plotting import pyplot, save
  plt = pyplot()
  ctxs = sorted({r["context"] for r in rows if r["kv_format"] == "f32"})
  fig, axes = plt.subplots(1, max(len(ctxs), 1), figsize=(4.5 * max(len(ctxs), 1), 3.6),
                           squeeze=False)
  for ax, ctx in zip(axes[0], ctxs):
    rs = [r for r in rows if r["context"] == ctx and r["kv_format"] == "f32"]
    for key in dict.fromkeys((r["attention"], r["weights"], r["dtype"]) for r in rs):
      mine = [r for r in rs if (r["attention"], r["weights"], r["dtype"]) == key]
      ax.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], "o-",
              label="jaxinfer (" + ", ".join(key) + ")")
    for dt in dict.fromkeys(r["dtype"] for r in rs):
      mine = [r for r in rs if r["dtype"] == dt and r["weights"] == "dense"
              and r["attention"] == rs[0]["attention"]]
      if any(r["hf_step_ms"] for r in mine):
        ax.plot([r["batch"] for r in mine], [r["hf_step_ms"] for r in mine], "s-",
                label=f"HF transformers ({dt})")
    rs = [r for r in rs if (r["attention"], r["weights"], r["dtype"]) == (
        rs[0]["attention"], rs[0]["weights"], rs[0]["dtype"])]
    ax.plot([r["batch"] for r in rs],
            [max(r["bandwidth_floor_ms"], r["compute_floor_ms"]) for r in rs], "k--",
            label="max(floors), " + rs[0]["weights"] + " " + rs[0]["dtype"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"decode step, context {ctx}")
    ax.set_xlabel("batch")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
  save(fig, path)


if __name__ == "__main__":
  app.run(main)
