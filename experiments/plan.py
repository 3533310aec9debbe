"""The chapter's planner (chapter 8.2.1, 8.3.4, 8.4.3, 8.5, 8.6.3) on the cost model.

  python -m experiments.plan capacity --model=qwen3-8b --kv_budget_gib=12 --json
  python -m experiments.plan batch --context=2048 --output_dir=out/plan
  python -m experiments.plan prefix_value --prefix_tokens=6144 --p_hit=0.5
  python -m experiments.plan offload --offload_sets=9 --prefetch_buffers=2
  python -m experiments.plan spec --acceptance=0.7 --num_draft=8
  python -m experiments.plan select --kv_budget_gib=12 --output_tokens=256 --output_dir=out/plan
  python -m experiments.plan lora --rank=16 --targets=q,v --num_adapters=100 --json
  python -m experiments.plan rates --json         # 8.6.3's r_P, r_D, t_GPU (prefix cached)
  python -m experiments.plan weights --params_b=70  # 8.4.1's formats against device memory
  python -m experiments.plan kv_format            # 8.4.2's fitted ITL lines, crossover
  python -m experiments.plan snapshots            # 8.3.3's recurrent-state snapshots
  python -m experiments.plan spec --draft_model=qwen3-0.6b --drafting=parallel  # 8.5.3
  python -m experiments.plan tp --model=qwen3-8b --tp=1,2,4 --json   # tensor parallel
"""
from __future__ import annotations

import dataclasses
import math
import os

from absl import app, flags

from jaxinfer import costmodel
from jaxinfer.costmodel import formulas as F
from jaxinfer.costmodel.select import plot_plane, select
from jaxinfer.plotting import pyplot, save
from jaxinfer.costmodel import accounting
from jaxinfer import strict_json

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "qwen3-8b", "model config")
flags.DEFINE_string("hardware", "rtx-pro-6000", "hardware profile (configs/hardware)")
flags.DEFINE_string("kv_format", "bf16", "KV format")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_float("kv_budget_gib", 12.0, "KV + auxiliary budget")
flags.DEFINE_integer("input_tokens", 8192, "L")
flags.DEFINE_integer("output_tokens", 256, "G")
flags.DEFINE_integer("shared_prefix", 6144, "tokens of a shared prefix")
flags.DEFINE_integer("step_tokens", 256, "capacity: most new tokens one step writes for a "
                     "request (a chunk: what a sliding-window request reserves beyond its "
                     "window)", lower_bound=1)
flags.DEFINE_integer("num_requests", 16, "simultaneous requests (select)")
flags.DEFINE_float("deadline_s", 7.0, "deadline, arrival to last token")
flags.DEFINE_integer("context", 2048, "batch: context length")
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64", "128"], "batch: sizes")
flags.DEFINE_integer("prefix_tokens", 6144, "prefix_value: prefix length")
flags.DEFINE_float("p_hit", 0.5, "prefix_value: hit probability")
flags.DEFINE_float("maintain_ms", None, "prefix_value: upkeep time T_m per interval "
                   "(default: one transfer of the prefix over the host link, as 8.3.4)")
flags.DEFINE_integer("offload_sets", 9, "offload: FFN sets moved to host memory")
flags.DEFINE_integer("prefetch_buffers", 2, "offload: 1 (serial) or 2 (overlapped)")
flags.DEFINE_float("acceptance", 0.7, "spec: per-position acceptance a")
flags.DEFINE_integer("num_draft", 8, "spec: longest draft considered")
flags.DEFINE_float("draft_ms", 0.5, "spec: drafting time per drafted token (no --draft_model)")
flags.DEFINE_string("draft_model", "", "spec: a draft model config (e.g. qwen3-0.6b): its "
                    "forwards on --hardware are the drafting cost (8.5.3)")
flags.DEFINE_enum("drafting", "sequential", ["sequential", "parallel"],
                  "spec: a draft model drafts m tokens in m forwards (sequential) or in one "
                  "forward of m positions (parallel, DFlash-style)")
flags.DEFINE_list("verify_buckets", [], "spec: compiled row counts a verify step pads to "
                  "(8.5.4: 9 positions run the 16-row graph); empty: exact shapes")
flags.DEFINE_integer("row_group", 1, "spec: rows padded to a multiple of this (a group-of-4 "
                     "kernel tile: 4)", lower_bound=1)
flags.DEFINE_float("params_b", 0.0, "weights: parameters in billions (0: --model's)",
                   lower_bound=0.0)
flags.DEFINE_integer("match_tokens", 10752, "snapshots: tokens of a prefix match",
                     lower_bound=0)
flags.DEFINE_integer("snapshot_interval", 4096, "snapshots: tokens between state snapshots",
                     lower_bound=4)
flags.DEFINE_float("snapshot_mib", 53.6, "snapshots: one snapshot's size per device (8.3.3's "
                   "figure; the recurrent state is not modelled here)", lower_bound=0.0)
flags.DEFINE_list("contexts", ["1024", "4096", "7000", "16384", "32768"],
                  "kv_format: contexts at which the fitted ITL lines are evaluated")
flags.DEFINE_integer("rank", 16, "lora: adapter rank")
flags.DEFINE_list("targets", ["q", "v"], "lora: adapted weights (q,k,v,o,gate,up,down or all)")
flags.DEFINE_integer("num_adapters", 100, "lora: adapters registered (host memory)")
flags.DEFINE_integer("max_loras", 8, "lora: adapter slots on the device")
flags.DEFINE_integer("batch", 16, "lora: decode batch of the round-time rows")
flags.DEFINE_list("tp", ["1", "2", "4"], "tp: tensor-parallel device counts")
flags.DEFINE_float("memory_utilization", 0.9, "tp: share of each device's memory for weights "
                   "and KV (vLLM's gpu_memory_utilization)", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_string("variants", "", "select: variants config (default configs/plan_select.json)")
flags.DEFINE_integer("gpus", 8, "disagg: GPUs to split into prefill and decode replicas")
flags.DEFINE_float("rate", 12.0, "disagg: requests per second of --input_tokens in, "
                   "--output_tokens out")
flags.DEFINE_float("link_gbs", 50.0, "disagg: the link K/V cross after prefill, GB/s")
flags.DEFINE_float("link_latency_us", 20.0, "disagg: that link's latency per transfer")
flags.DEFINE_integer("max_running", 64, "disagg: the most requests a decode replica runs")
flags.DEFINE_float("slo_ttft_s", 1.0, "disagg: TTFT objective")
flags.DEFINE_float("slo_itl_ms", 40.0, "disagg: inter-token objective")
flags.DEFINE_bool("json", False, "emit JSON")
flags.DEFINE_string("output_dir", "", "write JSON and figures here")

MIB = 2**20


def _model():
  return costmodel.RooflineStepModel.for_names(FLAGS.model, FLAGS.hardware, FLAGS.kv_format,
                                               FLAGS.page_size)


def cmd_capacity():
  rm = _model()
  k = rm.costs.kv_bytes_per_token
  out = {}
  windows = rm.costs.cfg.windows if any(rm.costs.cfg.windows) else ()
  for name, shared in (("independent", 0), ("shared_prefix", FLAGS.shared_prefix)):
    c = accounting.capacity(k, FLAGS.kv_budget_gib * 2**30, FLAGS.input_tokens,
                            FLAGS.output_tokens, FLAGS.page_size, shared,
                            layer_windows=windows if not shared else (),
                            step_tokens=FLAGS.step_tokens)
    row = {k: v for k, v in dataclasses.asdict(c).items()
           if c.windowed_end_bytes or not k.startswith(("windowed", "requests_fit_windowed"))}
    out[name] = dict(row, kv_end_mib=c.kv_end_bytes / MIB,
                     private_end_mib=c.private_end_bytes / MIB,
                     shared_prefix_mib=c.shared_prefix_bytes / MIB)
    if c.windowed_end_bytes:
      out[name].update(windowed_end_mib=c.windowed_end_bytes / MIB,
                       windowed_step_mib=c.windowed_step_bytes / MIB)
    out[name]["kv_after_prefill_mib"] = c.kv_after_prefill_bytes / MIB
  cfg = rm.costs.cfg
  out["weight_bytes"] = rm.costs.weight_bytes
  out["d_w"] = rm.costs.d_w
  out["parameters"] = cfg.param_count()
  out["weights_gib"] = {f: cfg.param_count() * WEIGHT_FORMATS[f][0] / WEIGHT_FORMATS[f][1]
                        / 2**30 for f in WEIGHT_FORMATS}
  if cfg.num_experts:  # the weights one decode step reads grow with its batch
    out["active_parameters"] = cfg.active_param_count()
    out["weights_read_batch1_bytes"] = rm.costs.weights_read(1)
  return out


def cmd_batch():
  rm = _model()
  c = rm.costs
  # 8.2.1's L k: the KV a step reads per request, each layer up to its sliding window
  L = c.kv_read_tokens(FLAGS.context)
  k = c.kv_bytes_per_token
  rows = []
  for b in (int(x) for x in FLAGS.batches):
    d_w = c.weights_read(b)  # a mixture of experts reads the experts b tokens reach
    br = rm.breakdown([(1, FLAGS.context)] * b)
    row = {"batch": b, "bytes_per_round": F.bytes_per_round(d_w, b, L, k),
           "bytes_per_output_token": F.bytes_per_output_token(d_w, b, L, k),
           "bytes_per_output_token_rom": F.bytes_per_output_token(d_w, b, L, k, True),
           "round_ms": 1e3 * rm.decode_round(b, FLAGS.context), "round_flops": br["flops"],
           "mbu": br["mbu"], "mfu": br["mfu"], "bound": br["bound"]}
    if c.cfg.num_experts:
      row.update(experts_touched=c.cfg.expected_experts_touched(b), weights_read=d_w)
    rows.append(row)
  out = {"context": FLAGS.context, "kv_read_tokens": L, "b_kv": F.b_kv(c.d_w, L, k),
         "rows": rows}
  if FLAGS.output_dir:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [r["batch"] for r in rows]
    ax.loglog(bs, [r["bytes_per_output_token"] / 1e6 for r in rows], "o-", label="weights + KV")
    ax.loglog(bs, [r["bytes_per_output_token_rom"] / 1e6 for r in rows], "s--",
              label="KV only (weights in ROM)")
    ax.axvline(out["b_kv"], color="gray", linestyle=":", label=f"b_KV = {out['b_kv']}")
    ax.set_xlabel("batch")
    ax.set_ylabel("MB read per output token")
    ax.set_title(f"{FLAGS.model}, context {FLAGS.context} (8.2.1)")
    ax.legend(fontsize=8)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    save(fig, os.path.join(FLAGS.output_dir, "plan_batch.png"), dpi=110)
  return out


def cmd_prefix_value():
  rm = _model()
  hw = rm.hw
  n = FLAGS.prefix_tokens
  size = n * rm.costs.kv_bytes_per_token
  t_r = rm.prefill_time(1, n)  # recompute the prefix
  t_f = size / hw.link_bandwidth if hw.host_link_gbs else 0.0  # fetch from host memory
  t_m = t_f if FLAGS.maintain_ms is None else FLAGS.maintain_ms / 1e3
  return {"prefix_tokens": n, "size_mib": size / MIB, "t_recompute_s": t_r, "t_fetch_s": t_f,
          "t_maintain_s": t_m, "t_maintain_source": "one host transfer (8.3.4 default)"
          if FLAGS.maintain_ms is None else "--maintain_ms",
          "value_s": F.prefix_value(FLAGS.p_hit, t_r, t_f, t_m),
          "p_hit_threshold": F.hit_probability_threshold(t_r, t_f, t_m),
          "saving_per_mib_s": F.saving_per_mib(FLAGS.p_hit, t_r, t_f, t_m, size)}


def cmd_offload():
  from jaxinfer.costmodel import offload
  rm = _model()
  c, hw = rm.costs, rm.hw
  off = offload.OffloadConfig.count(c.cfg.num_layers, FLAGS.offload_sets, FLAGS.prefetch_buffers)
  k = c.kv_bytes_per_token
  acc = offload.account(c.cfg, off, hw.link_bandwidth, FLAGS.input_tokens * k,
                        (FLAGS.input_tokens + FLAGS.output_tokens - 1) * k)
  round_s = rm.decode_round(1, FLAGS.input_tokens)
  step = offload.step_time(round_s, c.cfg, off, hw.link_bandwidth)
  total = rm.prefill_time(1, FLAGS.input_tokens) + (FLAGS.output_tokens - 1) * step
  return {**dataclasses.asdict(acc), "layers": list(off.layers),
          "prefetch_buffers": off.prefetch_buffers, "link": hw.host_link,
          "round_ms_plain": 1e3 * round_s, "round_ms_offload": 1e3 * step, "request_s": total,
          "meets_deadline": total <= FLAGS.deadline_s}


def _positive_ints(name: str):
  out = []
  for v in getattr(FLAGS, name):
    try:
      out.append(int(v))
    except ValueError:
      raise app.UsageError(f"--{name}: {v!r} is not an integer") from None
    if out[-1] < 1:
      raise app.UsageError(f"--{name}: {v} must be >= 1")
  return out


def _draft_cost():
  """m -> seconds of drafting m tokens for one request at --input_tokens of context:
  --draft_ms each, or a draft model's forwards on --hardware (one per token sequential,
  one of m positions parallel), and what it was from."""
  if not FLAGS.draft_model:
    return (lambda m: m * FLAGS.draft_ms / 1e3), f"{FLAGS.draft_ms} ms per drafted token"
  dm = costmodel.RooflineStepModel.for_names(FLAGS.draft_model, FLAGS.hardware,
                                             FLAGS.kv_format, FLAGS.page_size)
  L = FLAGS.input_tokens
  if FLAGS.drafting == "parallel":
    return (lambda m: dm.step_time([(m, L)], logits_rows=m) if m else 0.0), \
        f"{FLAGS.draft_model}: one forward of m positions"
  return (lambda m: sum(dm.step_time([(1, L + j)]) for j in range(m))), \
      f"{FLAGS.draft_model}: m sequential forwards"


def cmd_spec():
  """8.5.2-8.5.4: per draft length m, the verify round (m + 1 positions and LM-head rows
  at --input_tokens of context) plus drafting, E[N] and time per token; the draft model's
  own forward when --draft_model is given (8.5.3)."""
  rm = _model()
  buckets = sorted(_positive_ints("verify_buckets"))

  def rows(m):  # the verify step's rows after padding to a compiled shape (8.2.4, 8.5.4)
    n = -(-(m + 1) // FLAGS.row_group) * FLAGS.row_group
    if buckets:
      fit = [b for b in buckets if b >= n]
      if not fit:
        raise app.UsageError(f"{m + 1} verify rows exceed the largest --verify_buckets "
                             f"size {buckets[-1]}")
      n = fit[0]
    return n

  t_verify = lambda m: rm.step_time([(rows(m), FLAGS.input_tokens)],  # noqa: E731
                                    logits_rows=rows(m))
  draft, source = _draft_cost()
  plain = t_verify(0)
  table = []
  for m in range(FLAGS.num_draft + 1):
    t = t_verify(m) + draft(m)
    e = F.expected_tokens(FLAGS.acceptance, m)
    table.append({"draft_len": m, "verify_rows": rows(m), "round_ms": 1e3 * t,
                  "expected_tokens": e,
                  "ms_per_token": 1e3 * t / e,
                  "break_even_tokens": F.draft_break_even(t, plain)})
  best = 0
  for m in range(1, len(table)):  # 8.5.4: lengthen while dT/dN < T/N
    a, b = table[m - 1], table[m]
    if not F.should_lengthen(a["round_ms"], a["expected_tokens"], b["round_ms"],
                             b["expected_tokens"]):
      break
    best = m
  return {"acceptance": FLAGS.acceptance, "plain_step_ms": 1e3 * plain, "drafting": source,
          "draft_forward_ms": 1e3 * draft(1), "verify_buckets": buckets,
          "row_group": FLAGS.row_group, "rows": table, "chosen_draft_len": best}


def cmd_rates():
  """8.6.3: r_P (new prefill tokens per accelerator second), r_D (decode calls per
  second: a batch step counts one call per request, its time once) and t_GPU = L/r_P +
  (G - 1)/r_D per request, for --num_requests prompts of --input_tokens with
  --shared_prefix cached (the prefix's KV read once per batch), --output_tokens out."""
  rm = _model()
  B, L, G, P = FLAGS.num_requests, FLAGS.input_tokens, FLAGS.output_tokens, FLAGS.shared_prefix
  prefill = rm.prefill_time(B, L - P, P, P)
  ctx = L + G // 2  # the mean context over the decode
  rnd = rm.decode_round(B, ctx, P)
  r_p, r_d = B * (L - P) / prefill, B / rnd
  phases = {name: rm.breakdown(seqs, P) for name, seqs in (
      ("prefill", [(L - P, P)] * B), ("decode_round", [(1, ctx)] * B))}
  return {"batch": B, "input_tokens": L, "cached_prefix": P, "output_tokens": G,
          "prefill_s": prefill, "decode_round_ms": 1e3 * rnd, "mean_context": ctx,
          "r_prefill_tok_s": r_p, "r_decode_calls_s": r_d,
          "t_gpu_s": (L - P) / r_p + (G - 1) / r_d,
          "request_s": prefill + (G - 1) * rnd,
          "phases": [dict(phase=k, **v) for k, v in phases.items()]}


# 8.4.1: weight formats as (bytes per block, values per block); GGML's block layouts.
WEIGHT_FORMATS = {"bf16": (2, 1), "fp8": (1, 1), "q8_0": (34, 32), "q6_K": (210, 256),
                  "q5_K": (176, 256), "q4_K": (144, 256), "q4_0": (18, 32),
                  "q3_K": (110, 256), "q2_K": (84, 256)}
WEIGHT_CODE_BITS = {"bf16": 16, "fp8": 8, "q8_0": 8, "q6_K": 6, "q5_K": 5, "q4_K": 4,
                    "q4_0": 4, "q3_K": 3, "q2_K": 2}


def cmd_weights():
  """8.4.1: bits per value with block metadata, the metadata's share, and the resident
  size of --model (or --params_b billion parameters) in each format against the memory of
  --hardware: whether it fits one device with room for KV, and how many devices it needs
  (weights only, 90% of each device usable)."""
  rm = _model()
  hw = rm.hw
  n = FLAGS.params_b * 1e9 if FLAGS.params_b else rm.costs.weight_bytes / \
      rm.costs.bytes_per_param
  cap = hw.memory_gb * 1e9 if hw.memory_gb else None
  rows = []
  for name, (nbytes, values) in WEIGHT_FORMATS.items():
    bits = 8 * nbytes / values
    size = n * bits / 8
    row = {"format": name, "bits_per_value": bits,
           "metadata_share": 1 - WEIGHT_CODE_BITS[name] / bits, "weights_gib": size / 2**30}
    if cap:
      row.update(fits_one_device=size <= 0.9 * cap,
                 kv_room_gib=max(0.9 * cap - size, 0) / 2**30,
                 devices_needed=math.ceil(size / (0.9 * cap)))
    rows.append(row)
  return {"model": FLAGS.model if not FLAGS.params_b else f"{FLAGS.params_b:g}B parameters",
          "parameters": n, "hardware": hw.name, "device_memory_gb": hw.memory_gb,
          "mmap_note": "memory-mapped weights need their touched pages resident",
          "formats": rows}


# 8.4.2's fitted ITL lines on H100 for Llama-3.1-8B: ms = a + b * context.
KV_ITL_LINES = {"bf16": (6.44, 4.37e-5), "fp8": (6.58, 2.37e-5)}


def cmd_kv_format():
  """8.4.2: the fitted ITL lines and where they cross (FP8 reads fewer bytes but pays a
  conversion: the crossover is where dT = dD / beta - T_c turns positive), next to this
  cost model's bytes per value and per token for every KV format."""
  from pallas_kernels import kv_codec
  (a0, b0), (a1, b1) = KV_ITL_LINES["bf16"], KV_ITL_LINES["fp8"]
  crossover = (a1 - a0) / (b0 - b1)
  rows = [{"context": L, "bf16_itl_ms": a0 + b0 * L, "fp8_itl_ms": a1 + b1 * L,
           "fp8_gain_ms": (a0 + b0 * L) - (a1 + b1 * L)} for L in _positive_ints("contexts")]
  rm = _model()
  formats = []
  for name in ("bf16", "fp8", "q8_0", "q4_0"):
    fmt = kv_codec.get_format(name)
    k = costmodel.ModelCosts(rm.costs.cfg, rm.costs.bytes_per_param, name,
                             FLAGS.page_size).kv_bytes_per_token
    formats.append({"format": name, "bytes_per_value": fmt.bytes_per_value(),
                    "kv_bytes_per_token": k})
  return {"itl_lines": {k: {"fixed_ms": a, "per_token_ms": b} for k, (a, b) in
                        KV_ITL_LINES.items()},
          "source": "the chapter's fitted H100 ITLs, Llama-3.1-8B (8.4.2)",
          "crossover_tokens": crossover, "rows": rows, "model": rm.costs.cfg.name,
          "formats": formats}


def cmd_snapshots():
  """8.3.3: a recurrent / hybrid model restores a prefix match from its latest state
  snapshot at or before the match and recomputes the rest; snapshots every
  --snapshot_interval tokens cost --snapshot_mib each per device."""
  rm = _model()
  m, every = FLAGS.match_tokens, FLAGS.snapshot_interval
  restore = F.snapshot_restore(m, every)
  rows = []
  for interval in sorted({every // 4, every // 2, every, every * 2} - {0}):
    r = F.snapshot_restore(m, interval)
    rows.append({"interval": interval, "restore_from": r, "recompute_tokens": m - r,
                 "recompute_s": rm.prefill_time(1, m - r, r) if m > r else 0.0,
                 "snapshots_kept": m // interval,
                 "storage_mib": m // interval * FLAGS.snapshot_mib})
  return {"match_tokens": m, "snapshot_interval": every, "restore_from": restore,
          "recompute_tokens": m - restore, "snapshot_mib": FLAGS.snapshot_mib,
          "intervals": rows}


def cmd_select():
  results, chosen = select(FLAGS.variants or None, output_tokens=FLAGS.output_tokens,
                           num_requests=FLAGS.num_requests, kv_budget_gib=FLAGS.kv_budget_gib,
                           deadline_s=FLAGS.deadline_s)
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    plot_plane(results, FLAGS.kv_budget_gib, FLAGS.deadline_s,
               os.path.join(FLAGS.output_dir, "plan_select.png"), chosen)
  return {"variants": [dataclasses.asdict(r) for r in results], "chosen": chosen,
          "kv_budget_gib": FLAGS.kv_budget_gib, "output_tokens": FLAGS.output_tokens,
          "deadline_s": FLAGS.deadline_s}


def cmd_lora():
  """8.2.1: one adapter's bytes next to the model's matrix weights, N adapters in host
  memory, the device slots, and the decode round at --batch as the distinct adapters in
  it grow (each read once, its tokens' low-rank FLOPs added)."""
  from jaxinfer.costmodel import lora
  rm = _model()
  cfg, hw = rm.costs.cfg, rm.hw
  targets = lora.parse_targets(FLAGS.targets)
  bpv = rm.costs.bytes_per_param
  params = lora.adapter_params(cfg, FLAGS.rank, targets)
  one = params * bpv
  cost = lora.LoraCost.for_hardware(hw, bpv)
  B, L = FLAGS.batch, FLAGS.input_tokens
  plain = rm.decode_round(B, L)
  rows = []
  for k in (1, 2, 4, 8, 16, 32):
    if k > B:
      break
    t = plain + sum(cost.step_s(params, B // k + (i < B % k)) for i in range(k))
    rows.append({"distinct_adapters": k, "round_ms": 1e3 * t, "vs_base": t / plain})
  return {"model": cfg.name, "rank": FLAGS.rank, "targets": list(targets),
          "bytes_per_value": bpv, "adapter_params": params, "adapter_mib": one / MIB,
          "num_adapters": FLAGS.num_adapters,
          "all_adapters_mib": FLAGS.num_adapters * one / MIB,
          "matrix_weights_mib": rm.costs.d_w / MIB,
          "adapter_share_of_weights": one / rm.costs.d_w,
          "max_loras": FLAGS.max_loras, "device_slots_mib": (FLAGS.max_loras + 1) * one / MIB,
          "load_ms": 1e3 * cost.load_s(params), "link": hw.host_link or "device memory",
          "batch": B, "context": L, "round_ms_base": 1e3 * plain, "rounds": rows}


def _simulate(rm, num_pages: int, requests: int, input_tokens: int, output_tokens: int):
  """`requests` prompts arriving together through the real scheduler on the simulated
  clock (chunked prefill, 8192-token steps): makespan and output tokens per second."""
  from jaxinfer.buckets import BucketTable
  from jaxinfer.config import SamplingParams
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  eng = Engine(SimExecutor(rm, num_pages=num_pages, page_size=FLAGS.page_size),
               SchedulerConfig("chunked", min(requests, 256), 8192, 8192),
               buckets=BucketTable.default(8192, 256, accounting.pages_for(
                   input_tokens + output_tokens, FLAGS.page_size)))
  sp = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
  reqs = [eng.add_request([7] * input_tokens, sp, arrival_time=0.0) for _ in range(requests)]
  eng.run()
  end = max(r.token_times[-1] for r in reqs)
  return {"makespan_s": end, "output_tok_s": requests * output_tokens / end,
          "mean_ttft_s": sum(r.ttft for r in reqs) / requests,
          "preemptions": sum(r.num_preemptions for r in reqs)}


def cmd_tp():
  """Tensor parallelism over tp devices (jaxinfer/sharding.py's layout): each device
  reads 1/tp of the weights and KV and runs 1/tp of the FLOPs, and each layer adds two
  ring all-reduces of the step's [T, D] activations over the device-to-device link
  (RooflineStepModel.comm_time). Per configuration: the decode round of --batch requests
  at --context, one --input_tokens prefill, the KV capacity in the devices' memory at
  --memory_utilization, and --num_requests requests run through the simulator."""
  tps = _positive_ints("tp")
  rows = []
  for tp in tps:
    try:
      rm = costmodel.RooflineStepModel.for_names(FLAGS.model, FLAGS.hardware, FLAGS.kv_format,
                                                 FLAGS.page_size, tp=tp)
    except ValueError as e:
      raise app.UsageError(f"--tp={tp}: {e}") from None
    hw, c = rm.hw, rm.costs
    if not hw.memory_gb:
      raise app.UsageError(f"--hardware={hw.name} has no memory size in its profile")
    dec_seqs = [(1, FLAGS.context)] * FLAGS.batch
    rnd, rnd_comm = rm.step_time(dec_seqs), rm.comm_time(dec_seqs)
    pre_seqs = [(FLAGS.input_tokens, 0)]
    pre, pre_comm = rm.step_time(pre_seqs), rm.comm_time(pre_seqs)
    kv_bytes = tp * FLAGS.memory_utilization * hw.memory_gb * 1e9 - c.weight_bytes
    kv_tokens = max(int(kv_bytes // c.kv_bytes_per_token), 0)
    per_req = accounting.pages_for(FLAGS.input_tokens + FLAGS.output_tokens, FLAGS.page_size)
    pages = kv_tokens // FLAGS.page_size
    row = {"tp": tp, "link": hw.interconnect if tp > 1 else "-",
           "weights_per_device_gib": c.weight_bytes / tp / 2**30,
           "decode_round_ms": 1e3 * rnd, "decode_comm_share": rnd_comm / rnd,
           "decode_tok_s": FLAGS.batch / rnd,
           "prefill_s": pre, "prefill_comm_share": pre_comm / pre,
           "kv_capacity_tokens": kv_tokens, "max_requests": pages // per_req}
    if pages >= per_req:
      row.update(_simulate(rm, pages, FLAGS.num_requests, FLAGS.input_tokens,
                           FLAGS.output_tokens))
    rows.append(row)
  return {"model": FLAGS.model, "hardware": FLAGS.hardware, "batch": FLAGS.batch,
          "context": FLAGS.context, "input_tokens": FLAGS.input_tokens,
          "output_tokens": FLAGS.output_tokens, "num_requests": FLAGS.num_requests,
          "rows": rows}


def cmd_disagg():
  """Disaggregated serving: every split of --gpus into prefill and decode replicas for a
  stream of --rate requests/s (--input_tokens in, --output_tokens out): the prefill
  pool's utilisation and predicted TTFT (M/D/1 queueing + the K/V transfer over
  --link_gbs), the decode replicas' steady batch (Little's law with the round time at
  that batch) and ITL; the suggested split meets both objectives with its busier pool
  least busy. experiments.fleet's disaggregated part checks it in the simulator."""
  from jaxinfer.costmodel.disagg import plan
  from jaxinfer.runtime.fleet import KVTransfer
  rm = _model()
  L, G = FLAGS.input_tokens, FLAGS.output_tokens
  transfer = KVTransfer(rm.costs.kv_bytes_per_token, FLAGS.link_gbs * 1e9,
                        FLAGS.link_latency_us * 1e-6).seconds(L)
  splits, best = plan(rm, FLAGS.gpus, FLAGS.rate, L, G, transfer, FLAGS.max_running,
                      FLAGS.kv_budget_gib * 2**30, FLAGS.slo_ttft_s, FLAGS.slo_itl_ms / 1e3)
  return {"gpus": FLAGS.gpus, "rate": FLAGS.rate, "input_tokens": L, "output_tokens": G,
          "transfer_ms": 1e3 * transfer, "suggested": f"{best.prefill}:{best.decode}"
          if best else "none feasible", "splits": [dataclasses.asdict(x) for x in splits]}


COMMANDS = {"capacity": cmd_capacity, "disagg": cmd_disagg, "batch": cmd_batch,
            "prefix_value": cmd_prefix_value, "offload": cmd_offload, "spec": cmd_spec, "select": cmd_select, "lora": cmd_lora,
            "rates": cmd_rates, "weights": cmd_weights, "kv_format": cmd_kv_format,
            "snapshots": cmd_snapshots, "tp": cmd_tp}


def _print(out, indent=""):
  for k, v in out.items():
    if isinstance(v, list) and v and isinstance(v[0], dict):
      print(f"{indent}{k}:")
      keys = list(v[0])
      print(indent + "  " + " ".join(f"{c:>14}" for c in keys))
      for row in v:
        print(indent + "  " + " ".join(
            f"{x:>14.4g}" if isinstance(x, float) else f"{str(x):>14}" for x in row.values()))
    elif isinstance(v, dict):
      print(f"{indent}{k}:")
      _print(v, indent + "  ")
    else:
      print(f"{indent}{k}: {v}")


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: python -m experiments.plan {{{'|'.join(COMMANDS)}}} [--flags]")
  out = COMMANDS[argv[1]]()
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, f"plan_{argv[1]}.json"), "w") as f:
      strict_json.dump(out, f, indent=1, default=str)
  if FLAGS.json:
    print(strict_json.dumps(out, indent=1, default=str))
  else:
    _print(out)


if __name__ == "__main__":
  app.run(main)
