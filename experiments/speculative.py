"""Plain decoding vs each drafter on the real model, and the simulated counterparts for
Qwen3-8B on RTX PRO 6000 (chapter 8.5).

  python -m experiments.speculative --output_dir=out/speculative [--small]

Real: SmolLM2 on this CPU, tasks where context lookup should shine (repeat or lightly
edit a given text) and where it should not (open-ended), at concurrency 1 and 8:
time per output token (sum T / sum N), tokens per round, acceptance by position.
Simulated: the roofline model with per-position acceptance a, draft lengths m.
"""
from __future__ import annotations

import os
import time

from absl import app, flags

from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.runtime import speculative
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "target model")
flags.DEFINE_list("drafters", ["none", "ngram", "early_exit"], "drafters to compare")
flags.DEFINE_list("concurrency", ["1", "8"], "requests at once")
flags.DEFINE_integer("num_draft", 4, "longest draft")
flags.DEFINE_integer("max_tokens", 64, "tokens per request")
flags.DEFINE_bool("adaptive_draft", False, "8.5.4 adaptive draft length")
flags.DEFINE_bool("small", False, "CI size: 1 task per kind, 8 tokens, concurrency 1")
flags.DEFINE_string("output_dir", "", "write speculative.json here")
flags.DEFINE_float("sim_draft_ms", 0.5, "simulation: drafting time per drafted token (ms)")

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
           "with a single step. All that glitters is not gold.")
TASKS = {
    "repeat": [f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:\n",
               f"Copy this sentence word for word: {PASSAGE}\nCopy:"],
    "open": ["Write a short poem about the sea.", "Give three tips for learning to cook."],
}


def run_real(llm_model, drafter, tasks, conc, max_tokens, num_draft, adaptive):
  from jaxinfer.llm import LLM
  llm = LLM(llm_model, warmup=False, num_pages=512, speculative=drafter, num_draft=num_draft,
            adaptive_draft=adaptive,
            buckets=BucketTable.default(max_tokens=128, max_requests=8, max_pages=32))
  prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in tasks]
  prompts = (prompts * conc)[:max(conc, len(prompts))]
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  for i in range(0, len(prompts), conc):  # warm-up: compile every shape the run uses
    llm.generate(prompts[i:i + conc], sp)
  eng = llm.engine
  if eng.speculator is not None:
    eng.speculator.draft_time_s = 0.0
  n_steps = len(eng.steps)
  t0 = time.perf_counter()
  outs = []
  for i in range(0, len(prompts), conc):
    outs += llm.generate(prompts[i:i + conc], sp)
  wall = time.perf_counter() - t0
  reqs = [eng.requests[o.request_id] for o in outs]
  steps = eng.steps[n_steps:]
  decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
  n_tokens = sum(len(r.output_token_ids) - 1 for r in reqs)  # tokens after the first
  t_decode = sum(s.duration for s in decode_steps)
  draft_s = eng.speculator.draft_time_s if eng.speculator is not None else 0.0
  s = speculative.summarize(reqs)
  if not s["rounds"]:
    s["mean_tokens_per_round"] = 1.0  # plain decoding: one token per step
  return {"drafter": drafter, "concurrency": conc, "wall_s": wall,
          "ms_per_output_token": 1e3 * (t_decode + draft_s) / max(n_tokens, 1),
          "draft_s": draft_s, "verify_s": t_decode, **s,
          "texts": [o.text[:80] for o in outs[:2]]}


def run_sim(acceptances=(0.5, 0.7, 0.9), lengths=(1, 3, 7), batch=1, draft_ms=0.0):
  """draft_ms: drafting time per drafted token (charged on top of the verify steps)."""
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  rows = []
  for a in acceptances:
    for m in (0,) + tuple(lengths):
      ex = SimExecutor(rm, num_pages=5000, page_size=16, acceptance=a, seed=0)
      eng = Engine(ex, SchedulerConfig("continuous", 64, 1 << 20, 1 << 20),
                   buckets=BucketTable.default(1 << 15, 64, 1024),
                   drafter=speculative.FixedDrafter() if m else None,
                   draft_policy=speculative.DraftLengthPolicy(m))
      for _ in range(batch):
        eng.add_request([1] * 2048, SamplingParams(max_tokens=257, ignore_eos=True),
                        arrival_time=0.0)
      reqs = eng.run()
      dec = [s for s in eng.steps[1:]]
      n = sum(len(r.output_token_ids) - 1 for r in reqs)
      summ = speculative.summarize(reqs)
      t = sum(s.duration for s in dec) + summ["drafted"] * draft_ms / 1e3
      rows.append({"acceptance": a, "draft_len": m, "batch": batch, "draft_ms": draft_ms,
                   "ms_per_output_token": 1e3 * t / n, "rounds": summ["rounds"],
                   "mean_tokens_per_round": summ["mean_tokens_per_round"] if m else 1.0})
  return rows


def main(argv):
  del argv
  from jaxinfer.loading import load_model
  m = load_model(FLAGS.model)
  tasks = {k: v[:1] for k, v in TASKS.items()} if FLAGS.small else TASKS
  concs = [1] if FLAGS.small else [int(c) for c in FLAGS.concurrency]
  max_tokens = 8 if FLAGS.small else FLAGS.max_tokens
  real = []
  for kind, prompts in tasks.items():
    for conc in concs:
      for d in FLAGS.drafters:
        r = run_real(m, d, prompts, conc, max_tokens, FLAGS.num_draft, FLAGS.adaptive_draft)
        r["task"] = kind
        real.append(r)
  sim = run_sim(lengths=(3,) if FLAGS.small else (1, 3, 7), draft_ms=FLAGS.sim_draft_ms)
  print(f"real model ({FLAGS.model}, this CPU): time per output token = sum T / sum N")
  print(f"{'task':>7} {'conc':>4} {'drafter':>10} {'ms/token':>9} {'tok/round':>9} "
        f"{'acc/round':>9}  acceptance by position")
  for r in real:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"] if a is not None)
    print(f"{r['task']:>7} {r['concurrency']:>4} {r['drafter']:>10} "
          f"{r['ms_per_output_token']:>9.1f} {r['mean_tokens_per_round']:>9.2f} "
          f"{r['accepted_per_round']:>9.2f}  {acc}")
  print(f"\nsimulated Qwen3-8B on RTX PRO 6000 (roofline), batch 1, 2K context, drafting "
        f"{FLAGS.sim_draft_ms} ms per drafted token")
  print(f"{'a':>4} {'m':>3} {'ms/token':>9} {'tok/round':>9}")
  for r in sim:
    print(f"{r['acceptance']:>4} {r['draft_len']:>3} {r['ms_per_output_token']:>9.2f} "
          f"{r['mean_tokens_per_round']:>9.2f}")
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "speculative.json"), "w") as f:
      strict_json.dump({"real": real, "sim": sim}, f, indent=1)
    plot(real, sim, os.path.join(FLAGS.output_dir, "speculative.png"))


def plot(real, sim, path: str) -> None:
  """Left: time per output token on this CPU per task, concurrency and drafter; right:
  simulated Qwen3-8B time per token against the draft length, one line per acceptance."""
  from jaxinfer.plotting import pyplot, save
  plt = pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
  groups = sorted({(r["task"], r["concurrency"]) for r in real})
  drafters = list(dict.fromkeys(r["drafter"] for r in real))
  width = 0.8 / max(len(drafters), 1)
  for j, d in enumerate(drafters):
    ys = [next((r["ms_per_output_token"] for r in real if (r["task"], r["concurrency"]) == g
                and r["drafter"] == d), 0.0) for g in groups]
    ax1.bar([i + j * width for i in range(len(groups))], ys, width, label=d)
  ax1.set_xticks([i + width * (len(drafters) - 1) / 2 for i in range(len(groups))])
  ax1.set_xticklabels([f"{t}\nconc {c}" for t, c in groups])
  ax1.set_ylabel("ms per output token")
  ax1.set_title("SmolLM2 on this CPU (real)")
  ax1.legend(fontsize=8)
  for a in sorted({r["acceptance"] for r in sim}):
    rows = sorted((r for r in sim if r["acceptance"] == a), key=lambda r: r["draft_len"])
    ax2.plot([r["draft_len"] for r in rows], [r["ms_per_output_token"] for r in rows], "o-",
             label=f"acceptance {a}")
  ax2.set_xlabel("draft length (0: plain decoding)")
  ax2.set_ylabel("ms per output token")
  ax2.set_title("Qwen3-8B on RTX PRO 6000 (simulated)")
  ax2.legend(fontsize=8)
  save(fig, path, dpi=110)


if __name__ == "__main__":
  app.run(main)
