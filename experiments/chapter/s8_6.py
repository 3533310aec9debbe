"""8.6: Little's law, rates and GPU-seconds, the configuration selection of 8.6.3 on the
planner, Amdahl (configs/chapter/s8_6.py)."""
from __future__ import annotations

from typing import List

from experiments.chapter import Figure, fig
from experiments.goodput import run_study as goodput_study
from jaxinfer.config import get_model_config
from jaxinfer.costmodel import ModelCosts, formulas, load_hardware
from jaxinfer.costmodel.select import evaluate

MIB, GIB = 2**20, 2**30


def _variants(i):
  """8.6.3's A-D and exercise 8-9's E, their overheads from the inputs."""
  extra_mib = i.peak_mib[1] - i.peak_mib[0]
  overhead = i.ttft_ms[1] / i.ttft_ms[0] - 1
  return [
      {"name": "A", "kv_format": "bf16", "share_prefix": False},
      {"name": "B", "kv_format": "bf16", "share_prefix": True},
      {"name": "C", "kv_format": "q8_0", "share_prefix": False},
      {"name": "D", "kv_format": "bf16", "share_prefix": True, "extra_memory_mib": extra_mib,
       "prefill_overhead": overhead, "tokens_per_round": i.draft_tokens_per_round},
      {"name": "E", "kv_format": "bf16", "share_prefix": True,
       "tokens_per_round": i.lookup_tokens_per_round, "round_overhead_ms": i.lookup_round_ms},
  ]


def _plan(i, output_tokens: int, budget_gib: float):
  return {v["name"]: evaluate(v, model=i.model, hardware=i.hardware, input_tokens=i.input_tokens,
                              shared_prefix=i.shared_prefix, output_tokens=output_tokens,
                              num_requests=i.num_requests, kv_budget_gib=budget_gib,
                              deadline_s=i.deadline_s)
          for v in _variants(i)}


def _goodput(i) -> List[Figure]:
  """8.6.2's experiment (8 questions, 3 s deadline, 1 / 4 / 16 req/s, three windows of 16)
  on the simulator: experiments.goodput's :sim conditions, one task always answered wrong
  as in the chapter's runs (its 42 errors were one task's)."""
  from configs.studies.goodput import get_config
  c = get_config("sim")
  c.processes = (i.goodput_process,)
  c.modes = ("sequential", "continuous")
  c.rates = tuple(i.goodput_rates)
  c.deadline_s = i.goodput_deadline_s
  c.sim_correct = tuple(j != i.goodput_wrong_task for j in range(len(c.sim_prompt_tokens)))
  rows = {(r["mode"], r["rate"]): r for r in goodput_study(c)["summary"]}
  lo, mid, hi = sorted(i.goodput_rates)
  src = "simulator (experiments.goodput :sim)"
  seq, cont = (lambda r, m=m: rows[(m, r)] for m in ("sequential", "continuous"))
  return [
      fig("8.6.2", "goodput_rate1", "goodput at 1 req/s, continuous", cont(lo)["goodput_rps"],
          "req/s", src),
      fig("8.6.2", "sequential_completion_rate4", "completion, sequential, 4 req/s",
          seq(mid)["completion_rps"], "req/s", src),
      fig("8.6.2", "sequential_goodput_rate4", "goodput, sequential, 4 req/s",
          seq(mid)["goodput_rps"], "req/s", src),
      fig("8.6.2", "continuous_completion_rate4", "completion, continuous, 4 req/s",
          cont(mid)["completion_rps"], "req/s", src),
      fig("8.6.2", "continuous_goodput_rate4", "goodput, continuous, 4 req/s",
          cont(mid)["goodput_rps"], "req/s", src),
      fig("8.6.2", "continuous_completion_rate16", "completion, continuous, 16 req/s",
          cont(hi)["completion_rps"], "req/s", src),
      fig("8.6.2", "continuous_goodput_rate16", "goodput, continuous, 16 req/s",
          cont(hi)["goodput_rps"], "req/s", src),
      fig("8.6.2", "goodput_drop_16_pct", "goodput lost from 4 to 16 req/s",
          100 * (1 - cont(hi)["goodput_rps"] / cont(mid)["goodput_rps"]), "%", src),
      fig("8.6.3", "joules_per_good_rate1", "energy per good result at the cap, continuous, 1/s",
          cont(lo)["joules_per_good"], "J", src),
      fig("8.6.3", "joules_per_good_rate4", "continuous, 4/s", cont(mid)["joules_per_good"], "J",
          src),
      fig("8.6.3", "joules_per_good_rate16", "continuous, 16/s", cont(hi)["joules_per_good"], "J",
          src),
      fig("8.6.3", "joules_per_good_sequential4", "sequential, 4/s", seq(mid)["joules_per_good"],
          "J", src),
      fig("8.6.3", "joules_rate16_over_rate4_pct", "16/s over 4/s",
          100 * (cont(hi)["joules_per_good"] / cont(mid)["joules_per_good"] - 1), "%", src),
  ]


def compute(i) -> List[Figure]:
  fast, slow = i.times_in_system
  figs = [
      fig("8.6.1", "little_n_fast", "requests in the system at 0.5 s each",
          formulas.littles_law(i.arrival_rate, fast), "", "formulas.littles_law"),
      fig("8.6.1", "little_n_slow", "at 2 s each", formulas.littles_law(i.arrival_rate, slow), "",
          "formulas.littles_law"),
      fig("8.6.1", "admission_request_s", "the short request's time, before any queueing",
          formulas.request_time(i.ttft_s, i.itl_s, i.output_tokens), "s", "formulas.request_time"),
  ]
  cfg = get_model_config(i.model)
  costs = ModelCosts(cfg)
  hw = load_hardware(i.hardware)
  k = costs.kv_bytes_per_token
  for b, ms in zip(i.batches, i.rounds_ms):
    nbytes = formulas.bytes_per_round(costs.d_w, b, i.context, k)
    floor = formulas.read_seconds(nbytes, hw.bandwidth)
    figs += [fig("8.6.3", f"read_b{b}_gb", f"weights + KV read per round, batch {b}", nbytes / 1e9,
                 "GB", "formulas.bytes_per_round"),
             fig("8.6.3", f"read_b{b}_ms", f"its read time at 1792 GB/s", 1e3 * floor, "ms",
                 "formulas.read_seconds"),
             fig("8.6.3", f"mbu_b{b}_pct", f"MBU, batch {b}", 100 * floor / (ms / 1e3), "%",
                 "formulas.read_seconds")]
    if b == min(i.batches):
      figs.append(fig("8.6.3", "host_overhead_b1_ms", "the round above its read floor",
                      ms - 1e3 * floor, "ms", "formulas.read_seconds"))
  new = i.input_tokens - i.shared_prefix
  r_p = i.num_requests * new / i.measured_prefill_s
  r_d = formulas.decode_throughput(i.num_requests, i.measured_round_ms / 1e3)
  t_gpu = formulas.gpu_seconds(new, i.output_tokens, r_p, r_d)
  figs += [
      fig("8.6.3", "r_prefill", "r_P: new prefill tokens per second", r_p, "tok/s",
          "formulas.gpu_seconds"),
      fig("8.6.3", "r_decode", "r_D: decode calls per second", r_d, "1/s", "formulas.decode_throughput"),
      fig("8.6.3", "gpu_s_per_request", "t_GPU per request", t_gpu, "s", "formulas.gpu_seconds"),
      fig("8.6.3", "gpu_s_16", "all 16", i.num_requests * t_gpu, "s", "formulas.gpu_seconds"),
  ]
  plan = _plan(i, i.output_tokens, i.kv_budget_gib)
  a, b, c, d, e = (plan[n] for n in "ABCDE")
  sel = "costmodel.select.evaluate (plan select)"
  rows = i.draft_verify_positions * i.num_requests  # every verified position gets logits
  verify = costs.step_flops([(i.draft_verify_positions, i.input_tokens)] * i.num_requests, rows)
  feasible = lambda p: sum(p[n].fits_memory and p[n].meets_deadline for n in "ABCD")
  figs += [
      fig("8.6.3", "a_prefill_s", "A's prefill of 16 whole prompts", a.prefill_s, "s", sel),
      fig("8.6.3", "a_prefill_tflop", "its matmul work", a.prefill_flops / 1e12, "TFLOP", sel),
      fig("8.6.3", "a_round_gb", "A's round reads", formulas.bytes_per_round(
          costs.d_w, i.num_requests, i.input_tokens, k) / 1e9, "GB", "formulas.bytes_per_round"),
      fig("8.6.3", "a_round_ms", "A's round", a.round_ms, "ms", sel),
      fig("8.6.3", "b_prefill_s", "B's prefill (prefix cached)", b.prefill_s, "s", sel),
      fig("8.6.3", "b_round_ms", "B's round", b.round_ms, "ms", sel),
      fig("8.6.3", "c_round_gb", "C's round reads (q8_0 KV)", formulas.bytes_per_round(
          costs.d_w, i.num_requests, i.input_tokens,
          ModelCosts(cfg, kv_format="q8_0").kv_bytes_per_token) / 1e9, "GB",
          "formulas.bytes_per_round"),
      fig("8.6.3", "c_round_ms", "C's round", c.round_ms, "ms", sel),
      fig("8.6.3", "d_prefill_s", "D's prefill with the draft's", d.prefill_s, "s", sel),
      fig("8.6.3", "d_rounds", "D's rounds of 3 tokens", d.rounds, "", sel),
      fig("8.6.3", "d_verify_tflop", "a round verifying 8 positions for 16 requests",
          verify / 1e12, "TFLOP", "ModelCosts.step_flops"),
      fig("8.6.3", "d_verify_ms", "its time at 58% of peak",
          1e3 * formulas.compute_seconds(verify, hw.peak_flops, i.prefill_mfu_b16), "ms",
          "formulas.compute_seconds"),
      fig("8.6.3", "d_extra_memory_gib", "the draft's added peak memory",
          (i.peak_mib[1] - i.peak_mib[0]) / 1024, "GiB", "experiment 8-5's peaks"),
      fig("8.6.3", "d_prefill_overhead_pct", "the draft's added TTFT",
          100 * (i.ttft_ms[1] / i.ttft_ms[0] - 1), "%", "experiment 8-5's TTFTs"),
      fig("8.6.3", "a_memory_mib", "A's KV", a.kv_mib, "MiB", sel),
      fig("8.6.3", "b_memory_mib", "B's KV", b.kv_mib, "MiB", sel),
      fig("8.6.3", "b_memory_gib", "B's KV", b.kv_mib / 1024, "GiB", sel),
      fig("8.6.3", "c_memory_gib", "C's KV", c.kv_mib / 1024, "GiB", sel),
      fig("8.6.3", "d_memory_mib", "D's KV + draft", d.kv_mib, "MiB", sel),
      fig("8.6.3", "d_memory_gib", "D's KV + draft", d.kv_mib / 1024, "GiB", sel),
      fig("8.6.3", "b_total_s", "B, arrival to the last token", b.total_s, "s", sel),
      fig("8.6.3", "b_measured_request_s", "B's request time (the planner's, beside the measured "
          "median)", b.total_s, "s", sel),
      fig("8.6.3", "b_decode_s", "B's 255 rounds", b.rounds * b.round_ms / 1e3, "s", sel),
      fig("8.6.3", "c_total_s", "C", c.total_s, "s", sel),
      fig("8.6.3", "d_total_s", "D", d.total_s, "s", sel),
      fig("8.6.3", "d_gpu_s_per_good", "D's GPU-seconds per good result", d.gpu_s_per_good, "s", sel),
      fig("8.6.3", "d_joules_per_good", "its energy at the 600 W cap", d.joules_per_good, "J", sel),
      fig("8.6.3", "feasible_variants", "variants A-D within 12 GiB and 7 s", feasible(plan), "", sel),
  ]
  figs += _goodput(i)
  small = _plan(i, i.output_tokens, i.small_budget_gib)
  short = _plan(i, i.short_output, i.kv_budget_gib)
  figs += [
      fig("8.6.3", "feasible_variants_6gib", "variants A-D within 6 GiB and 7 s", feasible(small), "",
          sel),
      fig("8.6.3", "b_total_16_out_s", "B with 16 output tokens", short["B"].total_s, "s", sel),
      fig("8.6.3", "d_total_16_out_s", "D with 16 output tokens", short["D"].total_s, "s", sel),
      fig("8.6.3", "d_ahead_16_out_s", "D ahead of B", short["B"].total_s - short["D"].total_s, "s",
          sel),
      fig("8.6.3", "d_extra_prefill_s", "D's extra prefill", d.prefill_s - b.prefill_s, "s", sel),
  ]
  for tag, f in zip(("half", "fifth"), i.decode_shares):
    s = formulas.amdahl(f, i.speedup)
    figs += [fig("8.6.3", f"amdahl_{tag}_task_s", f"the task with decode {f:.0%} of it, sped up 4x",
                 i.task_s / s, "s", "formulas.amdahl"),
             fig("8.6.3", f"amdahl_{tag}_speedup", "the task's speed-up", s, "x", "formulas.amdahl")]
  # exercise 8-8
  total = sum(i.task_parts_s)
  for name, part in zip(("prefill", "decode", "tools"), i.task_parts_s):
    figs.append(fig("ex8-8", f"ex8_halve_{name}_s", f"the task with its {name} halved",
                    total / formulas.amdahl(part / total, 2.0), "s", "formulas.amdahl"))
  decode = i.task_parts_s[1] / total
  figs += [fig("ex8-8", "ex8_quarter_decode_with_prep_x", "decode / 4 and 8 s of preparation",
               formulas.amdahl(decode, i.speedup, i.prep_s / total), "x", "formulas.amdahl"),
           fig("ex8-8", "ex8_break_even_prep_s", "preparation that cancels the gain",
               i.task_parts_s[1] * (1 - 1 / i.speedup), "s", "formulas.amdahl")]
  # exercise 8-9: E beside B and D, then at 6 GiB and at 16 output tokens
  pick = lambda p: min((v for v in p.values() if v.fits_memory and v.meets_deadline),
                       key=lambda v: v.gpu_s_per_good, default=None)
  figs += [fig("ex8-9", "ex9_e_memory_gib", "E's KV", e.kv_mib / 1024, "GiB", sel),
           fig("ex8-9", "ex9_e_total_s", "E's time", e.total_s, "s", sel),
           fig("ex8-9", "ex9_e_gpu_s_per_good", "E's GPU-seconds per good result", e.gpu_s_per_good,
               "s", sel),
           fig("ex8-9", "ex9_chosen_is_d", "chosen at 12 GiB is D (1) or not (0)",
               pick(plan).name == "D", "", sel),
           fig("ex8-9", "ex9_chosen_6gib_is_e", "chosen at 6 GiB is E",
               (pick(small) or e).name == "E" and pick(small) is not None, "", sel),
           fig("ex8-9", "ex9_chosen_16_out_is_e", "chosen at 16 outputs is E",
               (pick(short) or d).name == "E", "", sel)]
  return figs
