"""Bucket strategies as a study (chapter 8.2.4: static shapes, XLA's answer to CUDA graphs).

  python -m experiments.buckets --output_dir=out/buckets
  python -m experiments.buckets --config=configs/studies/buckets.py:small   # CI size

For each strategy (powers of two / four, linear, exact, and tables fitted to the trace
under caps on the number of executables):
- simulated, on the cost model, for every request of the trace at SmolLM2-on-this-CPU
  and Qwen3-8B-on-RTX-PRO-6000 scale: executables, padding, step time p50/p99, TTFT and
  ITL, once with every shape compiled ahead (warm-up) and once paying a compile the
  first time a shape runs (no warm-up);
- real, SmolLM2 on this machine, on the trace's first requests: warm-up seconds cold
  (an empty persistent cache) and again from the persistent cache, then the run's
  padding, step time, TTFT and ITL.
Figures: padding vs executables (the Pareto front) and step time vs real tokens per step
(the staircase each table draws).
"""
from __future__ import annotations

import os
import sys
import itertools
import shutil
import tempfile
import time

import numpy as np

from experiments.common import ROOT, Progress, run_binary, write_json
from jaxinfer.costmodel.accounting import pages_for


def _tables(c, shapes, max_tokens, max_seqs, max_pages, cost):
  from jaxinfer import bucket_plan as bp
  out = {}
  for s in c.strategies:
    out[s] = bp.table_for(s, max_tokens, max_seqs, max_pages)
  for cap in c.fitted_caps:
    out[f"fitted:{cap}"] = bp.fit_table(shapes, cap, max_tokens, max_seqs, max_pages,
                                        c.max_sizes, cost)[0]
  return out


def _pcts(xs):
  xs = [x for x in xs if x is not None]
  if not xs:
    return {"p50_ms": None, "p99_ms": None}
  return {"p50_ms": 1e3 * float(np.percentile(xs, 50)),
          "p99_ms": 1e3 * float(np.percentile(xs, 99))}


def _summary(eng, shapes_used=None):
  m = eng.metrics()
  steps = eng.steps
  return {"steps": len(steps), "distinct_shapes_run": len({s.bucket for s in steps}),
          "padding_fraction": m["padding_fraction"],
          "step": _pcts([s.duration for s in steps]),
          "ttft": {"p50_ms": 1e3 * m["ttft_s"]["p50"], "p99_ms": 1e3 * m["ttft_s"]["p99"]},
          "itl": {"p50_ms": 1e3 * m["itl_s"]["p50"], "p99_ms": 1e3 * m["itl_s"]["p99"]},
          "makespan_s": m["makespan_s"], "throughput_tok_s": m["throughput_tok_s"]}


def sim_trace(c, name):
  """The shipped chat trace, or one of the chapter's named workloads (experiments.workloads)."""
  from jaxinfer import bucket_plan as bp
  if name == "chat":
    return bp.load_trace(os.path.join(ROOT, c.trace))[:c.sim_requests]
  from experiments.workloads import load_workload
  return [{"arrival_s": r["arrival_ms"] / 1e3, "prompt_tokens": r["input_tokens"],
           "output_tokens": r["output_tokens"]} for r in load_workload(name)]


def simulate(c, compile_s):
  from jaxinfer import bucket_plan as bp
  from jaxinfer.config import SamplingParams
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rows = []
  n_tables = len(c.strategies) + len(c.fitted_caps)
  prog = Progress(len(c.sim_targets) * n_tables * len(c.sim_traces), "buckets sim")
  for (trace_name, T, R), target in itertools.product(c.sim_traces, c.sim_targets):
    trace = sim_trace(c, trace_name)
    longest = max(r["prompt_tokens"] + r["output_tokens"] for r in trace)
    P = pages_for(longest, 16)
    shapes = bp.trace_step_shapes(trace, T, R)
    cost = bp.roofline_cost(target)  # fitted to this target's step time
    tables = _tables(c, shapes, T, R, P, cost)
    model, hw = target.split("@")
    dtype = "f32" if hw == "local-cpu" else "bf16"
    rm = RooflineStepModel.for_names(model, hw, kv_format=dtype,
                                     bytes_per_param=4.0 if dtype == "f32" else 2.0)
    for name, table in tables.items():
      row = {"target": target, "trace": trace_name, "max_tokens": T, "max_seqs": R,
             "strategy": name, "table": table.to_json(),
             **bp.padding(table, shapes, cost)}
      row["num_shapes"] = (len({bp.select_for(table, s) for s in shapes})
                           if name == "exact" else bp.num_shapes(table))
      for mode, cs in (("warm", 0.0), ("cold", compile_s)):
        ex = SimExecutor(rm, num_pages=P * R + 16, page_size=16, token_id=1,
                         pad_to_buckets=True, compile_s=cs)
        eng = Engine(ex, SchedulerConfig("chunked", R, T, T), buckets=table,
                     max_model_len=P * 16, max_step_records=10 ** 9)
        for i, r in enumerate(trace):
          eng.add_request([2] * r["prompt_tokens"], SamplingParams(
              max_tokens=r["output_tokens"], ignore_eos=True), arrival_time=r["arrival_s"])
        eng.run()
        row[mode] = _summary(eng)
        row[mode]["compiles"] = ex.compiles
      rows.append(row)
      prog.step(f"{trace_name} {target} {name}")
  return rows


def _rss_mib() -> float:
  """Resident memory of this process (Linux /proc; 0 elsewhere)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except OSError:
    return 0.0


def _maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def real(c, trace):
  """SmolLM2 on this machine: warm-up cold and from the persistent cache, then the run."""
  import jax
  from jaxinfer import bucket_plan as bp
  from jaxinfer.config import SamplingParams
  from jaxinfer.llm import LLM
  from jaxinfer.loading import load_model
  from jaxinfer.step import num_compiled
  T, R, L = c.real_max_tokens, c.real_max_seqs, c.real_max_model_len
  # All at once, as LLM.generate submits them: the fitted table sees the same steps.
  reqs = [dict(r, arrival_s=0.0, prompt_tokens=min(r["prompt_tokens"], c.real_max_prompt),
               output_tokens=min(r["output_tokens"], c.real_max_output))
          for r in trace[:c.real_requests]]
  shapes = bp.trace_step_shapes(reqs, T, R)
  P = pages_for(L, 16)
  loaded = load_model("smollm2-135m-instruct")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(100, 20000, r["prompt_tokens"]).tolist() for r in reqs]
  sps = [SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True) for r in reqs]
  cpu_cost = bp.roofline_cost("smollm2-135m-instruct@local-cpu")
  rows = []
  prog = Progress(len(c.real_strategies), "buckets real")
  for name in c.real_strategies:
    if name.startswith("fitted:"):
      table = bp.fit_table(shapes, int(name.split(":")[1]), T, R, P, c.max_sizes,
                           cpu_cost)[0]
    else:
      table = bp.table_for(name, T, R, P)
    n = bp.num_shapes(table)
    if n > c.real_max_shapes:
      print(f"[buckets] {name}: {n} shapes > real_max_shapes={c.real_max_shapes}, skipped",
            file=sys.stderr)
      continue
    jax.clear_caches()
    llm = LLM.from_loaded(loaded, warmup=False, buckets=table, num_pages=R * P + 8,
                          max_model_len=L)
    rss0, maps0 = _rss_mib(), _maps()
    cold = llm.engine.warmup()  # this process's persistent cache is empty for these shapes
    # one forward per shape; the samplers are shared by every shape with the same rows
    executables = num_compiled("forward")  # load_model's default: layers under lax.scan
    samplers = num_compiled("sample")
    rss1, maps1 = _rss_mib(), _maps()
    jax.clear_caches()  # in-memory executables gone: the next warm-up reads the disk cache
    cached = llm.engine.warmup()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps)
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == r["output_tokens"] for o, r in zip(outs, reqs))
    row = {"strategy": name, "table": table.to_json(), "num_shapes": n,
           "executables": executables, "sampler_executables": samplers,
           "warmup_cold_s": cold, "warmup_cached_s": cached,
           "executables_rss_mib": rss1 - rss0, "executables_memory_maps": maps1 - maps0,
           "compile_s_per_shape": cold / max(n, 1), "generate_s": wall,
           **bp.padding(table, shapes, cpu_cost), "run": _summary(llm.engine),
           "staircase": [(sum(t for _, t, _ in s.members), s.bucket[0], s.duration)
                         for s in llm.engine.steps]}
    rows.append(row)
    del llm
    prog.step(f"{name}: {n} shapes, warm-up {cold:.1f}s cold / {cached:.1f}s cached")
  return rows


def run_study(c, output_dir):
  from jaxinfer import bucket_plan as bp
  # An empty persistent compile cache of the study's own: "cold" warm-ups compile.
  cache = tempfile.mkdtemp(prefix="jaxinfer-buckets-xla-")
  os.environ["JAXINFER_XLA_CACHE"] = cache
  trace = bp.load_trace(os.path.join(ROOT, c.trace))
  res = {"config": c.to_dict(), "trace_requests": len(trace)}
  try:
    res["real"] = real(c, trace) if c.real else []
  finally:
    shutil.rmtree(cache, ignore_errors=True)  # the study's executables are not reused
  measured = [r["compile_s_per_shape"] for r in res["real"]]
  compile_s = float(np.median(measured)) if measured else c.sim_compile_s
  res["sim_compile_s"] = compile_s
  res["sim_compile_s_source"] = ("measured: median seconds per shape of the real warm-ups"
                                 if measured else "config sim_compile_s")
  res["sim"] = simulate(c, compile_s)
  write_json(output_dir, "buckets.json", res)
  _figures(res, output_dir)
  return res


def _figures(res, output_dir):
  import matplotlib
  import matplotlib.ticker
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  ax = axes[0]
  sim = [r for r in res["sim"] if (r["target"], r["trace"]) == (res["sim"][0]["target"],
                                                                 res["sim"][0]["trace"])]
  for r in sim:
    ax.scatter(r["num_shapes"], 100 * r["padded_token_frac"],
               marker="o" if r["strategy"].startswith("fitted") else "s")
    ax.annotate(r["strategy"], (r["num_shapes"], 100 * r["padded_token_frac"]), fontsize=8)
  ax.set_xscale("log")
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xlabel("compiled shapes (executables)")
  ax.set_ylabel("padded token rows (%)")
  ax.set_title(f"padding vs executables ({sim[0]['trace']}, {sim[0]['target']})",
               fontsize=9)
  ax = axes[1]
  for r in res["real"]:
    st = np.array(r["staircase"], dtype=float).reshape(-1, 3)
    ax.scatter(st[:, 0], 1e3 * st[:, 2], s=8, label=r["strategy"])
  ax.set_xlabel("real tokens in the step")
  ax.set_ylabel("step time (ms)")
  ax.set_title("step time vs tokens (real SmolLM2)")
  if res["real"]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(output_dir, "buckets.png"), dpi=110)
  plt.close(fig)


def print_table(res):
  print(f"compile seconds per shape used by the simulation: {res['sim_compile_s']:.2f} "
        f"({res['sim_compile_s_source']})")
  if res["real"]:
    print("\nreal SmolLM2, this machine")
    print(f"{'strategy':>10} {'shapes':>6} {'cold s':>7} {'cached s':>8} {'exe MiB':>8} "
          f"{'pad tok':>8} "
          f"{'step p50':>9} {'step p99':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'tok/s':>6}")
    for r in res["real"]:
      u = r["run"]
      print(f"{r['strategy']:>10} {r['num_shapes']:>6} {r['warmup_cold_s']:>7.1f} "
            f"{r['warmup_cached_s']:>8.1f} {r['executables_rss_mib']:>8.1f} "
            f"{100 * r['padded_token_frac']:>7.1f}% "
            f"{u['step']['p50_ms']:>9.1f} {u['step']['p99_ms']:>9.1f} "
            f"{u['ttft']['p50_ms']:>9.0f} {u['ttft']['p99_ms']:>9.0f} "
            f"{u['itl']['p50_ms']:>8.1f} {u['itl']['p99_ms']:>8.1f} "
            f"{u['throughput_tok_s']:>6.1f}")
  print("\nsimulated (cost model); warm = every shape compiled ahead, cold = a compile "
        "charged at each shape's first use")
  print(f"{'trace':>8} {'target':>31} {'strategy':>10} {'shapes':>6} {'pad tok':>8} "
        f"{'step p50':>9} "
        f"{'step p99':>9} {'TTFT p99':>9} {'ITL p99':>8} {'cold TTFT p99':>13} "
        f"{'cold ITL p99':>12}")
  for r in res["sim"]:
    w, k = r["warm"], r["cold"]
    print(f"{r['trace']:>8} {r['target']:>31} {r['strategy']:>10} {r['num_shapes']:>6} "
          f"{100 * r['padded_token_frac']:>7.1f}% {w['step']['p50_ms']:>9.1f} "
          f"{w['step']['p99_ms']:>9.1f} {w['ttft']['p99_ms']:>9.0f} {w['itl']['p99_ms']:>8.1f} "
          f"{k['ttft']['p99_ms']:>13.0f} {k['itl']['p99_ms']:>12.0f}")


if __name__ == "__main__":
  run_binary("buckets", run_study, print_table)
