"""Preemption and cancellation (chapter 8.3.2), simulated and real.

  python -m experiments.preemption --output_dir=out/preemption
  python -m experiments.preemption --config=configs/studies/preemption.py:small

1. Preemption: the same requests through pools of the chapter's sizes (simulated Qwen3-8B,
   BF16 KV, RTX PRO 6000). Admission reserves only a request's first step, so a pool that
   holds the prompts but not their growth preempts the newest running request: its KV is
   freed and later recomputed from its saved input and output. Reported per pool:
   preemptions, the extra scheduled (recomputed) tokens, completion time.
2. Cancellation on the real model: abort() returns at once; the request's pages return
   to the free list only when the step in flight that reads them ends (a page is free when
   its last reference is gone and no launched work reads it). Reported: abort()'s return
   time, the time until the pages are free, and how many pages.
"""
from __future__ import annotations

import time
from typing import Dict, List

import numpy as np

from experiments.common import Progress, run_binary, write_json
from jaxinfer import strict_json
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams


def run_pool(c, pool_gib: float) -> Dict:
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names(c.sim_model, "rtx-pro-6000", "bf16", 16)
  num_pages = int(pool_gib * 2**30 // (rm.costs.kv_bytes_per_token * 16))
  ex = SimExecutor(rm, num_pages=num_pages, page_size=16)
  eng = Engine(ex, SchedulerConfig("chunked", c.num_requests, 2048, 2048, reserve="none"),
               buckets=BucketTable.default(2048, 64, 1024))
  rng = np.random.default_rng(0)
  sp = SamplingParams(max_tokens=c.output_tokens, ignore_eos=True)
  reqs = [eng.add_request(rng.integers(100, 100000, c.input_tokens).tolist(), sp,
                          arrival_time=0.0) for _ in range(c.num_requests)]
  eng.run()
  scheduled = sum(s.num_prefill_tokens + s.num_decode_tokens for s in eng.steps)
  needed = c.num_requests * (c.input_tokens + c.output_tokens - 1)
  return {"pool_gib": pool_gib, "pool_pages": num_pages,
          "preemptions": sum(r.num_preemptions for r in reqs),
          "recomputed_tokens": sum(r.recomputed_tokens for r in reqs),
          "scheduled_tokens": scheduled, "extra_scheduled_tokens": scheduled - needed,
          "last_done_s": max(r.finished_at for r in reqs)}


def measure_cancel(c, llm) -> List[Dict]:
  """Cancel the first request while a decode step reading its pages is in flight."""
  eng = llm.engine
  rng = np.random.default_rng(1)
  rows = []
  for i in range(c.cancel_repeats):
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    reqs = [eng.add_request(rng.integers(100, 40000, c.cancel_prompt_tokens).tolist(), sp)
            for _ in range(c.cancel_batch)]
    while any(not r.output_token_ids for r in reqs):  # every request past its prefill
      eng.step()
    victim = reqs[0]
    f = eng.launch()  # may take a page for the step's new tokens: count after it
    pages = len(eng.pm.page_table(victim.request_id))
    free_before = eng.pm.num_free
    t0 = time.perf_counter()
    assert eng.abort(victim.request_id)
    t_abort = time.perf_counter() - t0
    freed_at_abort = eng.pm.num_free - free_before
    eng.finish(f)
    t_free = time.perf_counter() - t0
    freed = eng.pm.num_free - free_before
    rows.append({"repeat": i, "pages": pages, "abort_return_ms": 1e3 * t_abort,
                 "pages_free_after_ms": 1e3 * t_free, "freed_at_abort": freed_at_abort,
                 "freed_after_step": freed, "step_ms": 1e3 * eng.steps[-1].duration})
    eng.abort_requests([r.request_id for r in reqs])
  return rows


def run_study(c, output_dir: str = "") -> Dict:
  prog = Progress(len(c.pools_gib) + 1, "preemption")
  pools = []
  for g in c.pools_gib:
    pools.append(run_pool(c, g))
    prog.step(f"pool {g} GiB: {pools[-1]['preemptions']} preemptions")
  from jaxinfer.llm import LLM
  llm = LLM(c.model, warmup=False, max_num_seqs=c.cancel_batch,
            max_num_batched_tokens=512, num_pages=c.cancel_batch * (
                -(-(c.cancel_prompt_tokens + 64) // 16)) + 16,
            max_model_len=c.cancel_prompt_tokens + 64)
  cancel = measure_cancel(c, llm)
  prog.step("cancellation")
  res = {"config": c.to_dict(), "pools": pools, "cancel": cancel,
         "cancel_median": {k: float(np.median([r[k] for r in cancel]))
                           for k in ("abort_return_ms", "pages_free_after_ms", "pages")}}
  if output_dir:
    write_json(output_dir, "preemption.json", res)
  return res


def print_tables(res: Dict) -> None:
  if res["config"]["json"]:
    print(strict_json.dumps(res, indent=1))
    return
  c = res["config"]
  print(f"preemption: {c['num_requests']} x ({c['input_tokens']} in, {c['output_tokens']} "
        f"out) at once, simulated {c['sim_model']} BF16 KV on RTX PRO 6000; the workload is "
        "this config's (the chapter gives only the pool sizes)")
  print(f"{'pool GiB':>8} {'pages':>6} {'preemptions':>11} {'recomputed':>10} "
        f"{'extra scheduled':>15} {'last done s':>11}")
  for p in res["pools"]:
    print(f"{p['pool_gib']:>8g} {p['pool_pages']:>6} {p['preemptions']:>11} "
          f"{p['recomputed_tokens']:>10} {p['extra_scheduled_tokens']:>15} "
          f"{p['last_done_s']:>11.2f}")
  print(f"\ncancellation on {c['model']} (this machine), {c['cancel_batch']} requests of "
        f"{c['cancel_prompt_tokens']} tokens decoding; one aborted while a step is in flight")
  print(f"{'pages':>6} {'abort returns ms':>16} {'pages free after ms':>19} {'step ms':>8}")
  for r in res["cancel"]:
    print(f"{r['pages']:>6} {r['abort_return_ms']:>16.3f} {r['pages_free_after_ms']:>19.1f} "
          f"{r['step_ms']:>8.1f}")


if __name__ == "__main__":
  run_binary("preemption", run_study, print_tables)
