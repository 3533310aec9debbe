"""Goodput under a request stream (chapter 8.6.1-8.6.2) on SmolLM2 on this CPU.

  python -m experiments.goodput --output_dir=out/goodput
  python -m experiments.goodput --config=configs/studies/goodput.py:small  # CI size

An arrival-process load generator (Poisson or fixed rate) sends windows of requests —
retrieval questions with known answers — to the engine in each admission mode:
  sequential   one request at a time (FCFS),
  continuous   continuous batching with chunked prefill,
  all_at_once  the window's requests are held until its last one has arrived and then
               run together as one static batch,
  deadline     continuous, with deadline-aware admission (8.6.1): a request whose
               predicted finish (step-time model fitted to steps measured here first)
               is past its deadline is rejected at once instead of run late.
Time is counted from each request's *scheduled* arrival, including any time it waited
outside the engine. Per window: completion throughput (all completions / T_obs) and
goodput (correct and within the deadline / T_obs), T_obs from the window's first
scheduled arrival to its last finish.
"""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

from experiments.common import Progress, few_buckets, run_binary, write_json
from experiments.kv_quality import is_correct, make_tasks
from jaxinfer.plotting import pyplot, save

MODES = ("sequential", "continuous", "all_at_once", "deadline")


def arrival_times(process: str, rate: float, n: int, seed: int) -> np.ndarray:
  """Scheduled arrival offsets (s) of n requests; the first arrives at 0."""
  if rate <= 0:
    raise ValueError(f"arrival rate must be > 0, got {rate}")
  if process == "fixed":
    return np.arange(n) / rate
  if process == "poisson":
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
  raise ValueError(f"unknown arrival process {process!r}: 'poisson' or 'fixed'")


def make_llm(loaded, mode: str, c):
  """An LLM whose few bucket shapes are all compiled before any window runs."""
  from jaxinfer.llm import LLM
  from jaxinfer.runtime.scheduler import SchedulerConfig
  if mode not in MODES:
    raise ValueError(f"unknown admission mode {mode!r}; choose one of {MODES}")
  n, b = c.window, c.token_budget
  key = (loaded.cfg.name, "", "f32")
  max_len = c.prompt_pages * 16
  if mode == "all_at_once":  # the whole window's prefill in one step, then decodes
    sched = SchedulerConfig("fixed", n, n * max_len, n * max_len, cache_key=key)
    buckets = few_buckets(n * max_len, max_len, n, max_len, prefill_slots=(n,))
  else:
    sched = SchedulerConfig("continuous" if mode == "sequential" else "chunked",
                            1 if mode == "sequential" else n, b, b, cache_key=key,
                            deadline_admission=mode == "deadline")
    # sequential: one request slot, so its decode steps are not padded to n slots
    buckets = few_buckets(b, b, 1 if mode == "sequential" else n, max_len)
  llm = LLM.from_loaded(loaded, warmup=False, buckets=buckets, num_pages=n * c.prompt_pages + 8,
                        scheduler=sched)
  llm.engine.warmup()
  return llm


def _left(deadline_s: float, held_s: float):
  """The deadline left when a request held outside the engine for held_s is submitted;
  None (none to admit against) when it has already passed: the request still runs and
  is judged late from its latency."""
  left = deadline_s - held_s
  return left if left > 0 else None


def _window(engine, ids_for, sp, correct_for, mode: str, offsets: np.ndarray,
            deadline_s: float, lead_s: float) -> Dict:
  """One window: request i (ids_for(i)) arrives at its scheduled offset (all_at_once: held
  until the last arrival); correct_for(i, request) grades it. Completion and goodput."""
  t0 = engine.now() + lead_s
  reqs = []
  for i, off in enumerate(offsets):
    sched = t0 + float(off)
    submit = t0 + float(offsets[-1]) if mode == "all_at_once" else sched
    r = engine.add_request(ids_for(i), sp, arrival_time=submit,
                           deadline_s=_left(deadline_s, submit - sched))
    reqs.append((i, r, sched))
  engine.run()
  recs = []
  for i, r, sched in reqs:
    done = r.state.value == "finished"
    lat = (r.finished_at - sched) if done else None
    recs.append({"request_id": r.request_id, "scheduled_s": sched - t0,
                 "finished_s": (r.finished_at - t0) if r.finished_at is not None else None,
                 "state": r.state.value, "reject_reason": r.reject_reason,
                 "latency_s": lat, "text": r.text, "correct": done and correct_for(i, r),
                 "on_time": done and lat <= deadline_s})
  t_obs = max(x["finished_s"] for x in recs if x["finished_s"] is not None)
  good = sum(x["correct"] and x["on_time"] for x in recs)
  done = [x for x in recs if x["state"] == "finished"]
  lats = [x["latency_s"] for x in done]
  return {"t_obs_s": t_obs, "completed": len(done), "good": good,
          "correct": sum(x["correct"] for x in recs),
          "on_time": sum(x["on_time"] for x in recs),
          "rejected": sum(x["state"] == "rejected" for x in recs),
          "completion_rps": len(done) / t_obs, "goodput_rps": good / t_obs,
          "latency_p50_s": float(np.median(lats)) if lats else None,
          "latency_max_s": max(lats) if lats else None, "requests": recs}


def run_window(engine, prompts: List[List[int]], answers: List[str], mode: str,
               offsets: np.ndarray, deadline_s: float, max_tokens: int) -> Dict:
  from jaxinfer.config import SamplingParams
  return _window(engine, lambda i: prompts[i % len(prompts)],
                 SamplingParams(max_tokens=max_tokens, stop=("\n",)),
                 lambda i, r: is_correct(r.text, answers[i % len(answers)]), mode, offsets,
                 deadline_s, 0.02)


def make_sim_engine(mode: str, c):
  """Simulated Qwen3-8B on RTX PRO 6000 (roofline, BF16 KV; 8.6.2's conditions); the
  deadline mode predicts with the simulator's own step model."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  if mode not in MODES:
    raise ValueError(f"unknown admission mode {mode!r}; choose one of {MODES}")
  rm = RooflineStepModel.for_names(c.sim_model, c.sim_hardware, "bf16", 16)
  n, longest = c.window, max(c.sim_prompt_tokens) + c.max_tokens
  num_pages = int(c.sim_kv_budget_gib * 2**30 // (rm.costs.kv_bytes_per_token * 16))
  if mode == "all_at_once":
    sched = SchedulerConfig("fixed", n, n * longest, n * longest)
  else:
    sched = SchedulerConfig("continuous" if mode == "sequential" else "chunked",
                            1 if mode == "sequential" else n, c.sim_token_budget,
                            c.sim_token_budget, deadline_admission=mode == "deadline")
  return Engine(SimExecutor(rm, num_pages=num_pages, page_size=16), sched,
                buckets=BucketTable.default(max(n * longest, c.sim_token_budget), 64,
                                            -(-longest // 16)))


def run_sim_window(engine, c, mode: str, offsets: np.ndarray) -> Dict:
  """One window on the simulated clock; request i asks question i mod 8, correct as the
  config's per-task correctness says (the simulator generates no text)."""
  from jaxinfer.config import SamplingParams
  rng = np.random.default_rng(c.seed)
  n = len(c.sim_prompt_tokens)
  res = _window(engine, lambda i: rng.integers(100, 100000, c.sim_prompt_tokens[i % n]).tolist(),
                SamplingParams(max_tokens=c.max_tokens, ignore_eos=True),
                lambda i, r: bool(c.sim_correct[i % n]), mode, offsets, c.deadline_s, 0.0)
  res["joules_per_good"] = c.sim_power_w * res["t_obs_s"] / res["good"] if res["good"] else None
  return res


def run_study(c, output_dir: str = "") -> Dict:
  if c.executor not in ("real", "sim"):
    raise ValueError(f"executor must be 'real' or 'sim', got {c.executor!r}")
  if c.executor == "sim":
    if len(c.sim_correct) != len(c.sim_prompt_tokens) or not c.sim_prompt_tokens:
      raise ValueError(f"sim_correct ({len(c.sim_correct)} tasks) and sim_prompt_tokens "
                       f"({len(c.sim_prompt_tokens)} tasks) must describe the same tasks")
    if min(c.sim_prompt_tokens) < 1:
      raise ValueError(f"sim_prompt_tokens must be >= 1, got {c.sim_prompt_tokens}")
    return _study(c, output_dir, None, lambda m: make_sim_engine(m, c),
                  lambda eng, m, offs: run_sim_window(eng, c, m, offs))
  from jaxinfer.executors.sim_executor import AffineStepModel
  from jaxinfer.loading import load_model
  loaded = load_model(c.model)
  tok = loaded.tokenizer
  tasks = make_tasks(tok, [c.records], c.questions, c.seed)
  prompts = [tok.encode(t.prompt) for t in tasks]
  answers = [t.answer for t in tasks]
  pages = max(-(-(len(p) + c.max_tokens) // 16) for p in prompts)
  if pages > c.prompt_pages:
    raise ValueError(f"a question needs {pages} pages; config prompt_pages={c.prompt_pages}")
  fitted = None
  busy = arrival_times("fixed", max(c.rates), c.window, 0)

  def engine_for(m):
    nonlocal fitted
    llm = make_llm(loaded, m, c)  # compiles every shape
    if m in ("continuous", "deadline") and fitted is None:
      n0 = len(llm.engine.steps)  # the deadline model, fitted on one busy window
      run_window(llm.engine, prompts, answers, "continuous", busy, 1e9, c.max_tokens)
      fitted = AffineStepModel.fit(llm.engine.steps[n0:])
    if m == "deadline":
      llm.engine.set_step_model(fitted)
    return llm.engine

  res = _study(c, output_dir, lambda: fitted, engine_for, lambda eng, m, offs: run_window(
      eng, prompts, answers, m, offs, c.deadline_s, c.max_tokens))
  return res


def _study(c, output_dir, fitted_model, engine_for, run_one) -> Dict:
  """Every (process, rate, mode) condition over c.windows windows; summary, JSON, figure."""
  conds = [(p, r, m) for p in c.processes for r in c.rates for m in c.modes]
  prog = Progress(len(conds) * c.windows + len(c.modes), "goodput")
  engines = {}
  for m in c.modes:
    engines[m] = engine_for(m)
    prog.step(f"warm-up {m}")
  windows = []
  for p, rate, m in conds:
    for w in range(c.windows):
      offs = arrival_times(p, rate, c.window, seed=c.seed * 100 + w)
      res = run_one(engines[m], m, offs)
      res.update(process=p, rate=rate, mode=m, window=w)
      windows.append(res)
      prog.step(f"{p} {rate}/s {m} window {w}: {res['good']}/{c.window} good, "
                f"{res['completed']} done in {res['t_obs_s']:.1f}s")
  summary = []
  for p, rate, m in conds:
    ws = [x for x in windows if (x["process"], x["rate"], x["mode"]) == (p, rate, m)]
    row = {"process": p, "rate": rate, "mode": m}
    for k in ("completion_rps", "goodput_rps", "good", "completed", "correct", "on_time",
              "rejected", "t_obs_s"):
      row[k] = float(np.mean([x[k] for x in ws]))
    row["completion_rps_std"] = float(np.std([x["completion_rps"] for x in ws]))
    row["goodput_rps_std"] = float(np.std([x["goodput_rps"] for x in ws]))
    lat = [x["latency_p50_s"] for x in ws if x["latency_p50_s"] is not None]
    row["latency_p50_s"] = float(np.mean(lat)) if lat else None
    if c.executor == "sim":  # energy per good result at the power cap (8.6.2)
      good, t = sum(x["good"] for x in ws), sum(x["t_obs_s"] for x in ws)
      row["joules_per_good"] = c.sim_power_w * t / good if good else None
    summary.append(row)
  fitted = fitted_model() if fitted_model else None
  res = {"config": c.to_dict(), "step_model": None if fitted is None else
         {"fixed_ms": 1e3 * fitted.fixed_s, "per_token_ms": 1e3 * fitted.per_token_s},
         "summary": summary, "windows": windows}
  if output_dir:
    write_json(output_dir, "goodput.json", res)
    plot(summary, c, os.path.join(output_dir, "goodput.png"))
  return res


def plot(summary: List[Dict], c, path: str) -> None:
  """Completion throughput and goodput vs arrival rate per mode (figures 8-33 / 8-34)."""
  plt = pyplot()
  procs = list(dict.fromkeys(s["process"] for s in summary))
  fig, axes = plt.subplots(len(procs), 2, figsize=(10, 3.6 * len(procs)), squeeze=False)
  for i, p in enumerate(procs):
    for j, (k, title) in enumerate([("completion_rps", "completion throughput"),
                                    ("goodput_rps", "goodput")]):
      ax = axes[i][j]
      for m in dict.fromkeys(s["mode"] for s in summary):
        rows = [s for s in summary if s["process"] == p and s["mode"] == m]
        ax.errorbar([s["rate"] for s in rows], [s[k] for s in rows],
                    yerr=[s[k + "_std"] for s in rows], marker="o", capsize=3, label=m)
      rates = sorted({s["rate"] for s in summary})
      top = max(s["completion_rps"] + s["completion_rps_std"] for s in summary)
      ax.plot(rates, rates, color="gray", linestyle=":", label="offered load")
      ax.set_ylim(0, 1.3 * top)
      ax.set_xscale("log")
      ax.set_xticks(rates, [f"{r:g}" for r in rates])
      ax.minorticks_off()
      ax.set_xlabel("arrival rate (req/s)")
      ax.set_ylabel("req/s")
      ax.set_title(f"{title} ({p} arrivals, deadline {c.deadline_s} s)", fontsize=9)
      ax.legend(fontsize=7)
  save(fig, path)


def print_table(res: Dict) -> None:
  c = res["config"]
  sim = c["executor"] == "sim"
  if sim:
    print(f"simulated {c['sim_model']} on {c['sim_hardware']}: prompts of "
          f"{sorted(set(c['sim_prompt_tokens']))} tokens and the per-task correctness are "
          f"this config's inputs; energy at {c['sim_power_w']:g} W")
  print(f"{'process':>8} {'rate':>5} {'mode':>12} {'completion/s':>13} {'goodput/s':>10} "
        f"{'good':>5} {'correct':>8} {'on time':>8} {'rejected':>9} {'p50 lat s':>10}"
        + (f" {'J/good':>8}" if sim else ""))
  for s in res["summary"]:
    lat = "-" if s["latency_p50_s"] is None else f"{s['latency_p50_s']:.2f}"
    joules = ""
    if sim:
      joules = " " + ("-" if s["joules_per_good"] is None else f"{s['joules_per_good']:.0f}"
                      ).rjust(8)
    print(f"{s['process']:>8} {s['rate']:>5g} {s['mode']:>12} {s['completion_rps']:>13.2f} "
          f"{s['goodput_rps']:>10.2f} {s['good']:>5.1f} {s['correct']:>8.1f} "
          f"{s['on_time']:>8.1f} {s['rejected']:>9.1f} {lat:>10}{joules}")
  if res["step_model"]:
    sm = res["step_model"]
    print(f"deadline admission's step model (fitted here): {sm['fixed_ms']:.1f} ms + "
          f"{sm['per_token_ms']:.3f} ms/token")


if __name__ == "__main__":
  run_binary("goodput", run_study, print_table)
