"""KV storage format vs answer quality (chapter 8.4.4) on SmolLM2 on this CPU.

  python -m experiments.kv_quality --output_dir=out/kv_quality
  python -m experiments.kv_quality --config=configs/studies/kv_quality.py:small  # CI size

Three measurements per variant ("format[:kv]"; ":kv" rounds Q through the KV format's
compute path, 8.4.4 (b); without it Q stays in the f32 compute dtype, (c)):
  1. retrieval tasks: documents of records "word: six-digit number" and one question
     each, every task run `runs` times at each concurrency (free generation with seeds
     fixed per (task, run), so the variants see the same random stream); correct/incorrect
     grids side by side (figures like 8-26..8-28) and the time to a correct answer when a
     failed attempt is retried (its time is added);
  2. teacher-forced fidelity against the f32 KV: a fixed text set fed token by token
     (every position reads the earlier positions from the quantized pool): top-1
     agreement, KL(p_f32 || p_variant) and the true next token's NLL;
  3. KV bytes per token and the measured decode step time at the end of those texts.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Dict, List

import numpy as np

from experiments.common import Progress, ROOT, run_binary, write_json
from jaxinfer.plotting import pyplot, save

TEXTS = os.path.join(ROOT, "experiments", "data", "texts.txt")

# Keys of the records; those the tokenizer keeps as one token are used.
WORDS = (
    "apple banana cherry grape lemon mango orange peach pear plum melon berry olive onion "
    "carrot potato tomato pepper garlic ginger lion tiger bear wolf fox deer horse sheep goat "
    "cow pig dog cat mouse rabbit eagle hawk owl swan duck goose crow snake frog fish shark "
    "whale seal otter zebra camel llama panda koala monkey spider bee ant moth river lake ocean "
    "mountain valley forest desert island beach cloud storm rain snow wind thunder garden "
    "bridge castle tower temple church school market village city harbor road train plane "
    "ship boat truck car bike rocket robot engine hammer knife spoon fork plate cup bottle "
    "basket candle lamp mirror window door chair table bed clock bell drum guitar piano violin "
    "flute trumpet book letter paper pencil brush paint stone metal gold silver copper iron "
    "glass wood cotton silk leather wool salt sugar honey bread cheese butter milk coffee tea "
    "wine soup rice corn wheat").split()


@dataclasses.dataclass
class Task:
  name: str  # n{records}-r{doc}
  prompt: str
  answer: str


def make_tasks(tokenizer, sizes, docs_per_size: int, seed: int) -> List[Task]:
  words = [w for w in WORDS if len(tokenizer.encode(" " + w)) == 1]
  tasks = []
  for n in sizes:
    if n > len(words):
      raise ValueError(f"a document of {n} records needs {n} distinct keys; the word list "
                       f"has {len(words)} single-token words")
    for d in range(docs_per_size):
      rng = np.random.default_rng([seed, n, d])
      keys = rng.choice(words, n, replace=False)
      vals = rng.integers(100000, 1000000, n)
      q = int(rng.integers(n))
      doc = "".join(f"{k}: {v}\n" for k, v in zip(keys, vals))
      tasks.append(Task(f"n{n}-r{d}", doc + f"\n{keys[q]}:", str(vals[q])))
  return tasks


def is_correct(text: str, answer: str) -> bool:
  """The first number in the generation must be the answer (no partial credit)."""
  m = re.search(r"\d+", text)
  return bool(m) and m.group(0) == answer


def parse_variant(v: str):
  fmt, _, q = v.partition(":")
  if q not in ("", "kv"):
    raise ValueError(f"variant {v!r}: expected 'format' or 'format:kv'")
  return fmt, "kv" if q else "compute"


def run_retrieval(loaded, variant: str, tasks: List[Task], c, progress=None) -> List[Dict]:
  """Every task `c.runs` times at each concurrency; one record per attempt."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.llm import LLM
  from jaxinfer.runtime.scheduler import SchedulerConfig
  fmt, qp = parse_variant(variant)
  longest = max(len(loaded.tokenizer.encode(t.prompt)) for t in tasks) + c.max_tokens
  pages = -(-longest // 16)
  out = []
  for conc in c.concurrency:
    buckets = BucketTable.default(max_tokens=256, max_requests=max(conc, 1),
                                  max_pages=max(4, pages))
    llm = LLM.from_loaded(loaded, warmup=False, kv_format=fmt, q_precision=qp, buckets=buckets,
                          num_pages=conc * pages + 8,
                          scheduler=SchedulerConfig("chunked", conc, 256, 256,
                                                    cache_key=(loaded.cfg.name, "", fmt)))
    greedy = SamplingParams(max_tokens=c.max_tokens)
    llm.generate([t.prompt for t in tasks], greedy)  # compile the buckets the runs use
    for run in range(c.runs):
      sps = [SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens,
                            seed=c.seed * 1000 + 10 * i + run) for i in range(len(tasks))]
      outs = llm.generate([t.prompt for t in tasks], sps)
      for t, o in zip(tasks, outs):
        r = llm.engine.requests[o.request_id]
        out.append({"variant": variant, "task": t.name, "concurrency": conc, "run": run,
                    "correct": is_correct(o.text, t.answer), "answer": t.answer,
                    "text": o.text, "ttft_s": o.ttft_s,
                    # admitted -> finished: the attempt's own time, not its wait for a slot
                    "service_s": r.finished_at - r.first_admitted_at})
      if progress:
        progress.step(f"{variant} concurrency {conc} run {run}")
  return out


def time_to_correct(attempts: List[Dict]) -> Dict:
  """Retries (8.4.4): a task's attempts in run order; a failed attempt's service time is
  added to the time to its first correct answer. Per concurrency: mean over solved tasks."""
  res = {}
  for conc in sorted({a["concurrency"] for a in attempts}):
    per_task: Dict[str, float] = {}
    unsolved = 0
    for task in sorted({a["task"] for a in attempts}):
      acc = 0.0
      for a in sorted((a for a in attempts if a["task"] == task and a["concurrency"] == conc),
                      key=lambda a: a["run"]):
        acc += a["service_s"]
        if a["correct"]:
          per_task[task] = acc
          break
      else:
        unsolved += 1
    res[conc] = {"mean_s": float(np.mean(list(per_task.values()))) if per_task else None,
                 "unsolved": unsolved}
  return res


def load_texts(tokenizer, n: int, tokens: int) -> List[List[int]]:
  with open(TEXTS) as f:
    paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
  if n > len(paras):
    raise ValueError(f"tf_texts={n}: {TEXTS} has {len(paras)} texts")
  ids = [tokenizer.encode(p)[:tokens] for p in paras[:n]]
  short = min(len(x) for x in ids)
  if short < tokens:
    raise ValueError(f"tf_tokens={tokens}: the shortest text has {short} tokens")
  return ids


def _log_softmax(x):
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def prefill_log_probs(loaded, texts: List[List[int]]) -> np.ndarray:
  """Log-probs [T-1, B, V] of every position from one f32 prefill of each whole text (no
  cached pages read): the oracle the token-by-token f32 decode is checked against."""
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.runtime.batcher import SeqWork, pack_exact
  B, T, page = len(texts), len(texts[0]), 16
  ppr = -(-T // page)
  ex = JaxExecutor(loaded.cfg, loaded.params, num_pages=B * ppr, page_size=page)
  works = [SeqWork(x[:-1], 0, list(range(i * ppr, (i + 1) * ppr)), num_logits=T - 1)
           for i, x in enumerate(texts)]
  _, logits = ex.logits(pack_exact(works, page, B * ppr))
  return _log_softmax(logits[:B * (T - 1)].reshape(B, T - 1, -1).transpose(1, 0, 2))


def teacher_forced(loaded, variant: str, texts: List[List[int]], timing_steps: int,
                   ref=None):
  """Feed the texts token by token (one decode step per position, all texts batched).
  Returns (metrics, log-probs [T-1, B, V]); with `ref` (the f32 log-probs) the metrics
  include top-1 agreement and KL(ref || variant)."""
  from jaxinfer.executors.jax_executor import JaxExecutor
  from jaxinfer.runtime.batcher import SeqWork, pack_exact
  fmt, qp = parse_variant(variant)
  B, T, page = len(texts), len(texts[0]), 16
  ppr = -(-(T + timing_steps + 2) // page)
  num_pages = B * ppr
  ex = JaxExecutor(loaded.cfg, loaded.params, num_pages=num_pages, page_size=page,
                   kv_format=fmt, q_precision=qp)
  pts = [list(range(i * ppr, (i + 1) * ppr)) for i in range(B)]

  def step(tokens, pos):
    return pack_exact([SeqWork([tok], pos, pts[i]) for i, tok in enumerate(tokens)], page,
                      num_pages, pages_per_request=ppr)

  lps = np.zeros((T - 1, B, loaded.cfg.vocab_size), np.float32)
  for t in range(T - 1):
    _, logits = ex.logits(step([x[t] for x in texts], t))
    lps[t] = _log_softmax(logits[:B])
  nxt = np.array([x[1:] for x in texts]).T  # [T-1, B] the true next tokens
  m = {"variant": variant, "positions": int((T - 1) * B),
       "nll": float(-np.take_along_axis(lps, nxt[..., None], -1).mean())}
  if ref is not None:
    m["top1_agreement"] = float((lps.argmax(-1) == ref.argmax(-1)).mean())
    p = np.exp(ref.astype(np.float64))
    kl = (p * (ref.astype(np.float64) - lps)).sum(-1)
    m["kl_mean"], m["kl_max"] = float(kl.mean()), float(kl.max())
  # Decode step time at context ~T (no logits copy; first two steps compile / warm up).
  times = []
  for s in range(timing_steps + 2):
    times.append(ex.execute(step([x[-1] for x in texts], T - 1 + s)).duration_s)
  m["step_ms"] = 1e3 * float(np.median(times[2:]))
  from jaxinfer.kv import bytes_per_token
  m["kv_bytes_per_token"] = bytes_per_token(loaded.cfg, fmt, page)
  return m, lps


def run_study(c, output_dir: str = "") -> Dict:
  from jaxinfer.loading import load_model
  loaded = load_model(c.model)
  tasks = make_tasks(loaded.tokenizer, c.sizes, c.docs_per_size, c.seed)
  texts = load_texts(loaded.tokenizer, c.tf_texts, c.tf_tokens)
  variants = list(c.variants)
  if "f32" not in variants:
    variants = ["f32"] + variants  # the teacher-forcing reference
  prog = Progress(len(variants) * (1 + len(c.concurrency) * c.runs), "kv_quality")
  attempts, fidelity, ref = [], [], None
  oracle = prefill_log_probs(loaded, texts)
  for v in variants:
    t0 = time.perf_counter()
    # f32 decoded token by token is checked against one f32 prefill of each text (its
    # agreement is computed, not assumed); every other format against f32's decode.
    m, lps = teacher_forced(loaded, v, texts, c.timing_steps,
                            oracle if v == "f32" else ref)
    if v == "f32":
      ref = lps
    fidelity.append(m)
    prog.step(f"{v} teacher-forced ({time.perf_counter() - t0:.0f}s)")
    attempts += run_retrieval(loaded, v, tasks, c, prog)
  summary = []
  for m in fidelity:
    att = [a for a in attempts if a["variant"] == m["variant"]]
    ttc = time_to_correct(att)
    summary.append(dict(m, correct=sum(a["correct"] for a in att), attempts=len(att),
                        time_to_correct={str(k): v for k, v in ttc.items()}))
  res = {"config": c.to_dict(), "tasks": [dataclasses.asdict(t) for t in tasks],
         "attempts": attempts, "summary": summary}
  if output_dir:
    write_json(output_dir, "kv_quality.json", res)
    plot_grids(attempts, os.path.join(output_dir, "kv_quality_grids.png"))
    plot_fidelity(summary, os.path.join(output_dir, "kv_quality_fidelity.png"))
  return res


def plot_grids(attempts: List[Dict], path: str) -> None:
  """Per-variant correct (green) / incorrect (red) grids: tasks x attempts (8-26..8-28)."""
  plt = pyplot()
  variants = list(dict.fromkeys(a["variant"] for a in attempts))
  tasks = list(dict.fromkeys(a["task"] for a in attempts))
  cols = sorted({(a["concurrency"], a["run"]) for a in attempts})
  fig, axes = plt.subplots(1, len(variants), figsize=(1.2 + 1.6 * len(variants),
                                                      1.2 + 0.32 * len(tasks)), squeeze=False)
  for ax, v in zip(axes[0], variants):
    grid = np.zeros((len(tasks), len(cols)))
    for a in attempts:
      if a["variant"] == v:
        grid[tasks.index(a["task"]), cols.index((a["concurrency"], a["run"]))] = a["correct"]
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_title(f"{v}\n{int(grid.sum())}/{grid.size}", fontsize=9)
    ax.set_xticks(range(len(cols)), [f"c{c}.{r}" for c, r in cols], fontsize=7, rotation=90)
    ax.set_yticks(range(len(tasks)), tasks if ax is axes[0][0] else [], fontsize=7)
  fig.suptitle("Retrieval: correct (green) / incorrect (red) per task and attempt "
               "(c = concurrency . run)", fontsize=9)
  save(fig, path)


def plot_fidelity(summary: List[Dict], path: str) -> None:
  plt = pyplot()
  names = [s["variant"] for s in summary]
  panels = [("top1_agreement", "top-1 agreement with f32"), ("kl_mean", "mean KL (nats)"),
            ("kv_bytes_per_token", "KV bytes / token"), ("step_ms", "decode step (ms)")]
  fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
  for ax, (k, title) in zip(axes, panels):
    ax.bar(range(len(names)), [s[k] for s in summary], color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=45, fontsize=8)
    ax.set_title(title, fontsize=9)
    if k == "top1_agreement":
      ax.set_ylim(min(s[k] for s in summary) - 0.05, 1.0)
  save(fig, path)


def print_table(res: Dict) -> None:
  print(f"{'variant':>9} {'correct':>8} {'top-1':>7} {'KL':>9} {'NLL':>6} {'B/token':>8} "
        f"{'step ms':>8}  time to correct s (unsolved) per concurrency")
  for s in res["summary"]:
    ttc = "  ".join("c{}: {} ({})".format(k, "-" if v["mean_s"] is None else
                                          f"{v['mean_s']:.2f}", v["unsolved"])
                    for k, v in s["time_to_correct"].items())
    print(f"{s['variant']:>9} {s['correct']:>3}/{s['attempts']:<4} {s['top1_agreement']:>7.3f} "
          f"{s['kl_mean']:>9.2e} {s['nll']:>6.3f} {s['kv_bytes_per_token']:>8.0f} "
          f"{s['step_ms']:>8.2f}  {ttc}")


if __name__ == "__main__":
  run_binary("kv_quality", run_study, print_table)
