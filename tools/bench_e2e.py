"""End to end: what a user runs (`LLM.generate` with the default bucket table and
scheduler), beside HF transformers and llama.cpp on the same prompts in the same run, and
this machine's floors.

  python tools/bench_e2e.py --output_dir=out/bench_e2e
  python tools/bench_e2e.py --scenarios=single --weight_formats=gguf --rounds=2   # quick

single: one prompt of --prompt_len random token ids, --single_new_tokens out (greedy,
  ignore_eos), the engine built as `generate` builds it for one prompt. Per system: TTFT,
  decode tok/s (tokens after the first over the time after the first), end-to-end tok/s.
  Floor: the prompt's FLOPs at the matmul rate measured at its rows, then each decode
  token's weight and KV bytes at the read bandwidth measured in the same round.
batch: --batch_sizes jobs of N prompts, --batch_new_tokens out each (`LLM.generate` of
  the N prompts at once; HF: one batched `generate`; llama.cpp: the prompts one after
  another, labelled "sequential", over at most --llama_cpp_batch_prompts of them). Wall
  time, output tok/s, seconds in steps that carry prefill and in decode-only steps, the
  prompts' FLOPs at the matmul rate over the seconds of the steps that carry prefill.
  Floor: all prompts' FLOPs at the matmul rate at the token budget's rows, plus every
  decode step's max(bytes / bandwidth, FLOPs / that rate).
--policies runs each batch job under several scheduling policies (each its own engine and
row, alternated inside every round): `--policies=auto,chunked` is the offline default
beside chunked prefill, whose `prefill x matmul` is the prefill rate inside mixed steps.
Each row also shows the bucket the engine ran its decode steps at and their median time
beside the same batch's step packed at exactly its shape (`engine/exact`): a bucket
table that pads decode shows there; the JSON lists every bucket the job ran with its
steps and seconds (the mixed steps' shapes show where prefill time goes).

Rounds alternate the systems (ours first: torch's threads spin on after an HF call) and
re-measure the floors before and after the round's runs, each floor from the faster
reading (a floor bounds the time from below, so a reading taken in one of the VM's slow
spells must not raise it); ratios are medians of each round's own ratio. Writes
bench_e2e.json (and nothing else) under --output_dir; tools/report.py renders it.
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxinfer import strict_json  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "model name or GGUF path")
flags.DEFINE_list("scenarios", ["single", "batch"], "single and/or batch")
flags.DEFINE_list("weight_formats", ["gguf", "dense"], "single: dense (f32 weights), gguf "
                  "(the file's blocks, 8-bit activations as llama.cpp) and/or gguf_f32 (the "
                  "blocks with float32 activations)")
flags.DEFINE_list("batch_sizes", ["16", "64"], "batch: prompts per job")
flags.DEFINE_string("batch_weight_format", "dense", "batch: dense or gguf")
flags.DEFINE_integer("prompt_len", 256, "tokens per prompt")
flags.DEFINE_integer("single_new_tokens", 128, "single: tokens out")
flags.DEFINE_integer("batch_new_tokens", 160, "batch: tokens out per prompt")
flags.DEFINE_integer("rounds", 3, "rounds per row (systems alternate inside a round)")
flags.DEFINE_integer("max_num_batched_tokens", 0, "the engine's token budget (0: LLM's "
                     "default)")
flags.DEFINE_list("policies", ["auto"], "batch: the engine's scheduling policies, each its own "
                  "row, alternated inside every round (auto: LLM's default)")
flags.DEFINE_bool("hf", True, "HF transformers in the same run (if installed)")
flags.DEFINE_bool("llama_cpp", True, "llama.cpp in the same run (if llama-cpp-python is "
                  "installed: tools/install_peers.sh)")
flags.DEFINE_integer("llama_cpp_batch_prompts", 4, "batch rows: llama.cpp runs this many of "
                     "the prompts one after another (its per-request rate, labelled so)")
flags.DEFINE_string("output_dir", "", "write bench_e2e.json here")


WEIGHT_FORMATS = ("dense", "gguf", "gguf_f32")


def prompts(n: int, length: int, vocab: int):
  rng = np.random.default_rng(0)
  return [[int(t) for t in rng.integers(100, min(vocab, 40000), length)] for _ in range(n)]


def machine() -> dict:
  from jaxinfer.benchmarking import machine_stamp
  return machine_stamp("python tools/bench_e2e.py " + " ".join(sys.argv[1:]))


class Ours:
  """LLM.generate as the user runs it; per call the job's figures from its own records."""

  def __init__(self, model, weight_format: str, n: int, policy: str = "auto"):
    import jaxinfer
    kw = {"max_num_batched_tokens": FLAGS.max_num_batched_tokens} \
        if FLAGS.max_num_batched_tokens else {}
    kw["policy"] = policy
    t = time.perf_counter()
    if weight_format == "gguf_f32":
      kw["gguf_activations"] = "f32"
    self.llm = jaxinfer.LLM(model, weight_format=weight_format.split("_")[0], max_num_seqs=n,
                            **kw)
    self.start_s = time.perf_counter() - t
    self.policy = self.llm.engine.config.policy  # as resolved ("auto": separate offline)
    self.name = f"jaxinfer {weight_format} {policy}"

  def run(self, ps, new: int) -> dict:
    import jaxinfer
    e = self.llm.engine
    first = e.num_steps
    sp = jaxinfer.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = self.llm.generate(ps, sp)
    wall = time.perf_counter() - t
    assert all(len(o.token_ids) == new for o in outs), "a request ended early"
    steps = e.steps[len(e.steps) - (e.num_steps - first):]
    pre = [s for s in steps if s.num_prefill_tokens]
    dec = [s for s in steps if not s.num_prefill_tokens]
    full = [s for s in dec if s.num_seqs == len(ps)]  # the batch's steady decode steps
    ttft = float(np.median([o.ttft_s for o in outs]))
    by_bucket = {}  # where the job's time went: seconds and steps per bucket, largest first
    for s in steps:
      k = "x".join(map(str, s.bucket))
      secs, n = by_bucket.get(k, (0.0, 0))
      by_bucket[k] = (secs + s.duration, n + 1)
    return {"wall_s": wall, "ttft_s": ttft, "out_tok_s": len(ps) * new / wall,
            "decode_tok_s": len(ps) * (new - 1) / max(wall - max(o.ttft_s for o in outs),
                                                       1e-9),
            "prefill_s": sum(s.duration for s in pre), "decode_s": sum(s.duration for s in dec),
            "steps": len(steps), "padded_tokens": sum(s.padded_tokens for s in steps),
            "decode_step_ms": 1e3 * float(np.median([s.duration for s in full]))
            if full else None,
            "decode_bucket": list(full[-1].bucket) if full else None,
            "buckets": [{"bucket": k, "seconds": v[0], "steps": v[1]} for k, v in sorted(
                by_bucket.items(), key=lambda kv: -kv[1][0])]}

  def exact_step_s(self, batch: int, context: int) -> float:
    """The same batch's decode step packed at exactly its shape, on the same executor."""
    from jaxinfer import benchmarking as bm
    step, _ = bm.uniform_step(batch, context, page_size=self.llm.executor.page_size)
    return bm.time_step(self.llm.executor, step, repeats=5)


class Hf:
  name = "HF transformers"

  def __init__(self, path):
    from jaxinfer.benchmarking import hf_model
    self.model = hf_model(path)

  def _gen(self, ids, n):
    import torch
    t = time.perf_counter()
    with torch.no_grad():
      self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t

  def run(self, ps, new: int) -> dict:
    import torch
    ids = torch.tensor(ps)
    ttft = self._gen(ids, 1)
    wall = self._gen(ids, new)
    time.sleep(0.1)  # let torch's threads settle before the next system
    return {"wall_s": wall, "ttft_s": ttft, "out_tok_s": len(ps) * new / wall,
            "decode_tok_s": len(ps) * (new - 1) / max(wall - ttft, 1e-9)}


class LlamaCpp:
  name = "llama.cpp"

  def __init__(self, path, n_ctx):
    from jaxinfer.benchmarking import llama_cpp_model
    self.llm = llama_cpp_model(path, n_ctx)

  def run(self, ps, new: int) -> dict:
    total, ttfts, wall = 0, [], 0.0
    for p in ps:  # one at a time: its native path; reset() forgets the previous prompt
      self.llm.reset()
      t = time.perf_counter()
      n = 0
      for _ in self.llm.generate(p, temp=0.0, reset=True):
        n += 1
        if n == 1:
          ttfts.append(time.perf_counter() - t)
        if n == new:
          break
      wall += time.perf_counter() - t
      total += n
    ttft = float(np.median(ttfts))
    return {"wall_s": wall, "ttft_s": ttft, "out_tok_s": total / wall,
            "decode_tok_s": (total - len(ps)) / max(wall - sum(ttfts), 1e-9),
            "sequential_prompts": len(ps)}


def floors(costs, weight_bytes, n, prompt_len, new, bw, rate):
  """(prefill floor s, decode floor s) of a job: n prompts of prompt_len, new tokens each;
  rate: the matmul FLOP/s at the prefill's rows (the compute floor of every step: fewer
  rows only lower the rate, by the memory bound the bandwidth term already charges)."""
  prefill = n * costs.step_flops([(prompt_len, 0)], sampled=1) / rate
  decode = 0.0
  for k in range(new - 1):  # the first token comes with the prefill
    seqs = [(1, prompt_len + k)] * n
    nbytes = weight_bytes + (costs.step_bytes(seqs) - costs.d_w)
    decode += max(nbytes / bw, costs.step_flops(seqs) / rate)
  return prefill, decode


def median_of(rows, key):
  vals = [r[key] for r in rows if r.get(key) is not None]
  return float(np.median(vals)) if vals else None


def main(argv):
  del argv
  import jax
  from jaxinfer import benchmarking as bm
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.loading import load_model
  from jaxinfer.loading.registry import resolve_model
  for s in FLAGS.scenarios:
    if s not in ("single", "batch"):
      print(f"error: --scenarios: unknown {s!r} (single, batch)", file=sys.stderr)
      sys.exit(2)
  for wf in FLAGS.weight_formats + [FLAGS.batch_weight_format]:
    if wf not in WEIGHT_FORMATS:
      print(f"error: unknown weight format {wf!r} {WEIGHT_FORMATS}", file=sys.stderr)
      sys.exit(2)
  if FLAGS.rounds < 1 or FLAGS.prompt_len < 1 or FLAGS.single_new_tokens < 2 or \
      FLAGS.batch_new_tokens < 2:
    print("error: --rounds and --prompt_len must be >= 1, new tokens >= 2", file=sys.stderr)
    sys.exit(2)
  sizes = [int(b) for b in FLAGS.batch_sizes]
  path = resolve_model(FLAGS.model)
  gguf = load_model(FLAGS.model, weight_format="gguf") if path.endswith(".gguf") else None
  cfg = (gguf or load_model(FLAGS.model)).cfg
  costs = ModelCosts(cfg, 4.0, "f32", 16)
  wbytes = {"dense": costs.d_w}
  if gguf is not None:
    # a gguf decode step reads the blocks as held (codes + float32 scales)
    wbytes["gguf"] = wbytes["gguf_f32"] = sum(a.nbytes for a in jax.tree_util.tree_leaves(
        gguf.params.get("blocks", {})))
  bw_probe = bm.ReadProbe()
  hf = Hf(path) if FLAGS.hf and path.endswith(".gguf") else None
  if hf is not None and hf.model is None:
    hf = None
  llama = None
  if FLAGS.llama_cpp and path.endswith(".gguf"):
    llama = LlamaCpp(path, FLAGS.prompt_len + max(FLAGS.single_new_tokens,
                                                  FLAGS.batch_new_tokens) + 16)
    if llama.llm is None:
      llama = None
  out = {"machine": machine(), "model": cfg.name, "prompt_len": FLAGS.prompt_len,
         "single": [], "batch": []}

  def job(kind, n, new, wf, engines):
    ps = prompts(n, FLAGS.prompt_len, cfg.vocab_size)
    ours = engines[0]
    budget = ours.llm.buckets.max_tokens
    rate_pre = bm.MatmulRateProbe(cfg, min(budget, n * FLAGS.prompt_len), lm_rows=n)
    peers = [p for p in (hf, llama) if p is not None]
    rounds = []
    for r in range(FLAGS.rounds):
      # each probe its median of three (one run swings with the VM), before and after
      bws, rps = [bw_probe.median(3)], [rate_pre(3)]
      got = {}
      for e in (engines if r % 2 == 0 else engines[::-1]):  # each goes first in turn
        got[e.name] = e.run(ps, new)
      ctx = FLAGS.prompt_len + new // 2
      got["exact_step_ms"] = 1e3 * ours.exact_step_s(n, ctx)
      for p in peers:
        sub = ps if (p is not llama or kind == "single") else ps[:FLAGS.llama_cpp_batch_prompts]
        got[p.name] = p.run(sub, new)
      bws.append(bw_probe.median(3))
      rps.append(rate_pre(3))
      bw, rp = max(bws), max(rps)
      fp, fd = floors(costs, wbytes[wf], n, FLAGS.prompt_len, new, bw, rp)
      got.update({"bw_gbs": bw / 1e9, "matmul_prefill_gflops": rp / 1e9, "floor_s": fp + fd,
                  "floor_prefill_s": fp, "floor_decode_s": fd,
                  "bw_gbs_readings": [b / 1e9 for b in bws],
                  "matmul_gflops_readings": [x / 1e9 for x in rps]})
      for e in engines:
        o = got[e.name]
        o["x_floor"] = o["wall_s"] / got["floor_s"]
        # decode alone: the time after the last first token over the decode floor
        o["decode_x_floor"] = n * (new - 1) / o["decode_tok_s"] / fd
        o["prefill_rate_x_matmul"] = fp / max(o["prefill_s"], 1e-9)
        o["engine_over_exact"] = (o["decode_step_ms"] / got["exact_step_ms"]
                                  if o["decode_step_ms"] else None)
        for p in peers:
          o[f"x {p.name}"] = o["out_tok_s"] / got[p.name]["out_tok_s"]
        print(f"  {kind} n={n} {wf} {e.policy} round {r + 1}: ours {o['wall_s']:.2f}s "
              f"({o['out_tok_s']:.1f} tok/s, x floor {o['x_floor']:.2f})", flush=True)
        print("    longest buckets (T x R x P x Q x Rp): " + ", ".join(
            f"{b['bucket']} {b['steps']} steps {b['seconds']:.1f}s" for b in o["buckets"][:3]),
            flush=True)
      rounds.append(got)
      print("    peers: " + " ".join(f"{p.name} {got[p.name]['out_tok_s']:.1f} tok/s"
                                     for p in peers), flush=True)
    for e in engines:
      row = {"prompts": n, "new_tokens": new, "weight_format": wf, "policy": e.policy,
             "rounds": [{k: v for k, v in g.items()
                         if k == e.name or not k.startswith("jaxinfer ")} for g in rounds],
             "start_s": e.start_s, "decode_bucket": rounds[-1][e.name]["decode_bucket"]}
      ours_rows = [g[e.name] for g in rounds]
      for k in ("wall_s", "ttft_s", "out_tok_s", "decode_tok_s", "prefill_s", "decode_s",
                "decode_step_ms", "x_floor", "decode_x_floor", "prefill_rate_x_matmul",
                "engine_over_exact", *[f"x {p.name}" for p in peers]):
        row[k] = median_of(ours_rows, k)
      for k in ("floor_s", "exact_step_ms", "bw_gbs", "matmul_prefill_gflops"):
        row[k] = median_of(rounds, k)
      for p in peers:
        row[p.name] = {k: median_of([g[p.name] for g in rounds], k)
                       for k in ("wall_s", "ttft_s", "out_tok_s", "decode_tok_s")}
      out[kind].append(row)


  if "single" in FLAGS.scenarios:
    for wf in FLAGS.weight_formats:
      if wf.startswith("gguf") and gguf is None:
        print(f"single {wf} skipped: the model is not a .gguf file", file=sys.stderr)
        continue
      ours = Ours(gguf if wf.startswith("gguf") else FLAGS.model, wf, 1)
      job("single", 1, FLAGS.single_new_tokens, wf, [ours])
      del ours
      jax.clear_caches()
  if "batch" in FLAGS.scenarios:
    wf = FLAGS.batch_weight_format
    for n in sizes:
      engines = [Ours(gguf if wf.startswith("gguf") else FLAGS.model, wf, n, pol)
                 for pol in FLAGS.policies]
      job("batch", n, FLAGS.batch_new_tokens, wf, engines)
      del engines
      jax.clear_caches()
  print_tables(out)
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "bench_e2e.json"), "w") as f:
      strict_json.dump(out, f, indent=1)


def _f(x, spec=".2f"):
  return "-" if x is None else format(x, spec)


def print_tables(out):
  m = out["machine"]
  print(f"\n{m['cpu']}, {m['cores']} cores, jax {m['jax']}, {m['date']}")
  for kind in ("single", "batch"):
    rows = out[kind]
    if not rows:
      continue
    peers = [k for k in ("HF transformers", "llama.cpp") if k in rows[0]]
    print(f"\n{kind}: prompt {out['prompt_len']} tokens")
    head = ["prompts", "weights", "policy", "new", "wall s", "tok/s", "TTFT s", "floor s", "x floor",
            "decode x floor", "prefill x matmul", "decode bucket", "step ms", "exact ms", "engine/exact"]
    for p in peers:
      head += [f"{p} tok/s", f"{p} TTFT s", f"x {p}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
      cells = [str(r["prompts"]), r["weight_format"], r.get("policy", "-"),
               str(r["new_tokens"]), _f(r["wall_s"]),
               _f(r["out_tok_s"], ".1f"), _f(r["ttft_s"], ".3f"), _f(r["floor_s"]),
               _f(r["x_floor"]), _f(r["decode_x_floor"]), _f(r["prefill_rate_x_matmul"]),
               "x".join(map(str, r["decode_bucket"])) if r["decode_bucket"] else "-",
               _f(r["decode_step_ms"], ".1f"), _f(r["exact_step_ms"], ".1f"),
               _f(r["engine_over_exact"])]
      for p in peers:
        cells += [_f(r[p]["out_tok_s"], ".1f"), _f(r[p]["ttft_s"], ".3f"), _f(r[f"x {p}"])]
      print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
  app.run(main)
