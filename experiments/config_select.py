"""Configuration selection end to end (chapter 8.6.3): the planner's choice next to simulated
runs of the variants through the real scheduler.

  python -m experiments.config_select --output_dir=out/config_select
  python -m experiments.config_select --config=configs/studies/config_select.py:small

For each scenario (KV budget, output tokens): the planner (costmodel.select: memory
first, then the deadline, then GPU-seconds per good result) scores the variants of
configs/plan_select.json; then each variant runs through the Scheduler, PageManager and
PrefixCache with the simulated executor (Qwen3-8B on RTX PRO 6000, roofline step model):
16 requests of 8192 tokens arriving at once, the 6144-token shared prefix already in
the prefix cache for the variants that share it; the pool is the KV budget less the
variant's extra memory (D's draft model). Drafting variants draft with a per-position
acceptance that gives the variant's tokens per round on average; D's prefill costs its
overhead more, E's rounds their extra time. Reported per variant: peak KV memory,
completion times, requests done by the deadline, goodput, GPU-seconds and energy per
good result; a timeline PNG per variant.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List

import numpy as np

from experiments.common import Progress, run_binary, write_json
from jaxinfer.costmodel.formulas import expected_tokens
from jaxinfer.plotting import plot_timeline, pyplot, save

MIB = 2**20


class OverheadModel:
  """A step-time model plus a variant's overheads: steps that carry a prefill chunk
  cost (1 + prefill_overhead) x; other steps (decode / verify rounds) + round_overhead_s."""

  def __init__(self, base, prefill_overhead: float = 0.0, round_overhead_s: float = 0.0,
               max_draft: int = 0):
    self.base, self.p, self.r, self.m = base, prefill_overhead, round_overhead_s, max_draft

  def step_time(self, seqs, **shared_and_rows):
    t = self.base.step_time(seqs, **shared_and_rows)
    if any(n > 1 + self.m for n, _ in seqs):
      return t * (1.0 + self.p)
    return t + self.r


def acceptance_for(tokens_per_round: float, m: int) -> float:
  """Per-position acceptance a with 1 + a + ... + a^m = tokens_per_round (8.5.2)."""
  if not 1.0 <= tokens_per_round <= m + 1:
    raise ValueError(f"{tokens_per_round} tokens per round is impossible with {m} drafts")
  lo, hi = 0.0, 1.0
  for _ in range(60):
    a = (lo + hi) / 2
    if expected_tokens(a, m) < tokens_per_round:
      lo = a
    else:
      hi = a
  return (lo + hi) / 2


def simulate_variant(v: Dict, sc: Dict, c) -> Dict:
  """Runs one variant of plan_select.json through the scheduler on the simulated clock."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.metrics import request_record, step_records
  from jaxinfer.runtime import speculative
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  fmt = v.get("kv_format", "bf16")
  rm = RooflineStepModel.for_names(sc["model"], sc["hardware"], fmt, c.page_size)
  tpr = v.get("tokens_per_round", 1)
  m = c.draft_len if tpr > 1 else 0
  model = OverheadModel(rm, v.get("prefill_overhead", 0.0), v.get("round_overhead_ms", 0) / 1e3,
                        m)
  page_bytes = rm.costs.kv_bytes_per_token * c.page_size
  pool_bytes = sc["kv_budget_gib"] * 2**30 - v.get("extra_memory_mib", 0.0) * MIB
  num_pages = int(pool_bytes // page_bytes)
  # a whole number of tokens per round: exactly that many every round, as the planner
  # counts them; a fraction: drafts accepted at random with the acceptance giving it
  exact = int(tpr) - 1 if m and float(tpr).is_integer() else None
  ex = SimExecutor(model, num_pages=num_pages, page_size=c.page_size,
                   acceptance=acceptance_for(tpr, m) if m else 0.0, seed=c.seed, token_id=1,
                   accepted_per_round=exact)
  share = bool(v.get("share_prefix", False))
  eng = Engine(ex, SchedulerConfig("chunked", sc["num_requests"], c.token_budget,
                                   c.token_budget, cache_key=(sc["model"], "", fmt)),
               buckets=BucketTable.default(c.token_budget, 64, 1024), prefix_cache=share,
               drafter=speculative.FixedDrafter(token=1) if m else None,
               draft_policy=speculative.DraftLengthPolicy(m))
  rng = np.random.default_rng(c.seed)
  L, P = sc["input_tokens"], sc["shared_prefix"]
  prefix = rng.integers(100, 100000, P).tolist()
  if share:  # the prefix is already cached (8.6.3): one earlier request put it there
    eng.add_request(prefix + [7], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0)
    eng.run()
  t0 = eng.now()
  sp = SamplingParams(max_tokens=sc["output_tokens"], ignore_eos=True)
  reqs = [eng.add_request(prefix + rng.integers(100, 100000, L - P).tolist(), sp,
                          arrival_time=t0, deadline_s=sc["deadline_s"])
          for _ in range(sc["num_requests"])]
  peak = 0
  for _ in eng.stream():
    peak = max(peak, eng.pm.num_used)
  done = [r for r in reqs if r.finished_at is not None]
  t_obs = max(r.finished_at for r in done) - t0
  good = sum(r.on_time for r in reqs)
  watts = rm.hw.power_w or 0.0
  recs = [request_record(r, t0) for r in reqs]
  steps = [s for s in step_records(eng.steps, t0) if s["start"] >= 0]
  spec = speculative.summarize(reqs) if m else {}
  return {
      "name": v["name"], "label": v.get("label", ""), "num_pages": num_pages,
      "peak_kv_mib": peak * page_bytes / MIB + v.get("extra_memory_mib", 0.0),
      "completion_s": sorted(r.finished_at - t0 for r in done),
      "t_obs_s": t_obs, "good": good, "goodput_rps": good / t_obs,
      "max_concurrent": max((s["num_seqs"] for s in steps), default=0),
      "gpu_s_per_good": t_obs / good if good else math.inf,
      "joules_per_good": t_obs * watts / good if good else math.inf,
      "tokens_per_round": spec.get("mean_tokens_per_round", 1.0),
      "requests": recs, "steps": steps}


def run_scenario(sc: Dict, variants: List[Dict], c, output_dir: str, prog) -> Dict:
  from jaxinfer.costmodel.select import evaluate
  planned = [evaluate(v, model=sc["model"], hardware=sc["hardware"],
                      input_tokens=sc["input_tokens"], shared_prefix=sc["shared_prefix"],
                      output_tokens=sc["output_tokens"], num_requests=sc["num_requests"],
                      kv_budget_gib=sc["kv_budget_gib"], deadline_s=sc["deadline_s"])
             for v in variants]
  ok = [p for p in planned if p.fits_memory and p.meets_deadline]
  chosen = min(ok, key=lambda p: p.gpu_s_per_good).name if ok else None
  sims = []
  for v in variants:
    if v["name"] not in c.simulate:
      continue
    s = simulate_variant(v, sc, c)
    sims.append(s)
    prog.step(f"{sc['name']} {v['name']}: {s['good']}/{sc['num_requests']} on time, "
              f"T_obs {s['t_obs_s']:.2f}s")
    if output_dir:
      plot_timeline(s["requests"], s["steps"],
                    os.path.join(output_dir, f"config_select_{sc['name']}_{v['name']}.png"),
                    f"{sc['name']}: variant {v['name']} ({v.get('label', '')})")
  ok_sim = [s for s in sims if s["good"] == sc["num_requests"]]
  chosen_sim = min(ok_sim, key=lambda s: s["gpu_s_per_good"])["name"] if ok_sim else None
  return {"scenario": sc, "planned": [p.__dict__ for p in planned], "chosen": chosen,
          "simulated": sims, "chosen_by_simulation": chosen_sim}


def run_study(c, output_dir: str = "") -> Dict:
  from jaxinfer.costmodel.select import DEFAULT_CONFIG
  with open(c.variants_file or DEFAULT_CONFIG) as f:
    vc = json.load(f)
  base = {k: vc[k] for k in ("model", "hardware", "input_tokens", "shared_prefix")}
  base.update(num_requests=c.num_requests, deadline_s=c.deadline_s)
  scenarios = [dict(base, name=s.name, kv_budget_gib=s.kv_budget_gib,
                    output_tokens=s.output_tokens) for s in c.scenarios]
  n_sim = sum(v["name"] in c.simulate for v in vc["variants"])
  prog = Progress(len(scenarios) * n_sim, "config_select")
  if output_dir:
    os.makedirs(output_dir, exist_ok=True)
  out = [run_scenario(sc, vc["variants"], c, output_dir, prog) for sc in scenarios]
  if output_dir:
    slim = [dict(o, simulated=[{k: v for k, v in s.items() if k not in ("requests", "steps")}
                               for s in o["simulated"]]) for o in out]
    write_json(output_dir, "config_select.json", {"config": c.to_dict(), "scenarios": slim})
    plot_summary(out, os.path.join(output_dir, "config_select.png"))
  return {"scenarios": out}


def plot_summary(out: List[Dict], path: str) -> None:
  """Per scenario: each simulated variant's completion times (dots) against the deadline,
  and its peak KV memory against the budget."""
  plt = pyplot()
  fig, axes = plt.subplots(2, len(out), figsize=(4.2 * len(out), 6.4), squeeze=False)
  for j, o in enumerate(out):
    sc, sims = o["scenario"], o["simulated"]
    names = [s["name"] for s in sims]
    ax = axes[0][j]
    for i, s in enumerate(sims):
      ax.scatter([i] * len(s["completion_s"]), s["completion_s"], s=10,
                 color="tab:green" if s["good"] == sc["num_requests"] else "tab:red")
    ax.axhline(sc["deadline_s"], color="gray", linestyle=":", label="deadline")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("completion time (s)")
    ax.set_title(f"{sc['name']}: {sc['kv_budget_gib']:g} GiB, {sc['output_tokens']} out\n"
                 f"planner: {o['chosen']}, simulation: {o['chosen_by_simulation']}", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1][j]
    ax.bar(range(len(names)), [s["peak_kv_mib"] / 1024 for s in sims], color="tab:blue")
    ax.axhline(sc["kv_budget_gib"], color="gray", linestyle=":", label="KV budget")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("peak KV + extra (GiB)")
    ax.legend(fontsize=7)
  save(fig, path)


def print_tables(res: Dict) -> None:
  for o in res["scenarios"]:
    sc = o["scenario"]
    print(f"== {sc['name']}: {sc['num_requests']} x ({sc['input_tokens']} in, "
          f"{sc['output_tokens']} out), {sc['kv_budget_gib']:g} GiB, deadline "
          f"{sc['deadline_s']} s — planner chooses {o['chosen']}, simulation "
          f"{o['chosen_by_simulation']}")
    print(f"  {'var':>3} {'plan fits':>9} {'plan s':>7} | {'sim peak GiB':>12} {'max conc':>8} "
          f"{'last done s':>11} {'on time':>7} {'goodput/s':>9} {'GPU-s/good':>10} "
          f"{'J/good':>7} {'tok/round':>9}")
    sims = {s["name"]: s for s in o["simulated"]}
    for p in o["planned"]:
      s = sims.get(p["name"])
      sim = "" if s is None else (
          f"{s['peak_kv_mib'] / 1024:>12.2f} {s['max_concurrent']:>8} {s['t_obs_s']:>11.2f} "
          f"{s['good']:>7} {s['goodput_rps']:>9.2f} {s['gpu_s_per_good']:>10.3f} "
          f"{s['joules_per_good']:>7.0f} {s['tokens_per_round']:>9.2f}")
      print(f"  {p['name']:>3} {str(p['fits_memory']):>9} {p['total_s']:>7.2f} | {sim}")


if __name__ == "__main__":
  run_binary("config_select", run_study, print_tables)
