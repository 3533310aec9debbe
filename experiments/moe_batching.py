"""The batching curve of a mixture of experts (8.2.1's roofline, MoE-shaped): a decode
round reads only the experts its tokens were routed to, so its weight bytes grow with the
batch until every expert is read, where a dense model reads all of its weights at any
batch. Each MoE model is shown beside its dense twin: the same attention, and a dense MLP
as wide as the MLP share one token runs through (equal active parameters).

  python -m experiments.moe_batching --output_dir=out/moe_batching
  python -m experiments.moe_batching --config=configs/studies/moe_batching.py:small

Simulated: --config.sim_model (default Qwen3-30B-A3B) on --config.sim_hardware, decode
rounds at a fixed context, experts touched expected under uniform routing. Real: a small
random-weight MoE and its dense twin, f32 on this CPU, through the engine (the median
decode round of each batch), beside the same cost model's bytes per round; the experts
each decode call actually reached, measured (moe.observe_routing), beside the uniform
expectation and the expectation under the run's measured per-expert load.
"""
from __future__ import annotations

import os

import numpy as np

from experiments.common import Progress, run_binary, write_json
from jaxinfer.buckets import BucketTable
from jaxinfer.config import ModelConfig, SamplingParams, get_model_config
from jaxinfer.plotting import pyplot, save


def dense_twin(cfg: ModelConfig) -> ModelConfig:
  """cfg with every MLP dense, as wide as makes its parameters equal cfg's active ones
  (the router, shared expert and k routed experts per MoE layer, the dense layers' MLPs)."""
  D, L = cfg.hidden_size, cfg.num_layers
  active = cfg.layers_param_count(cfg.experts_per_token) - L * cfg.attention_param_count()
  return cfg.replace(name=cfg.name + "-dense-twin", num_experts=0, experts_per_token=0,
                     moe_intermediate_size=0, shared_expert_size=0, first_dense_layers=0,
                     intermediate_size=max(1, round(active / (3 * D * L))))


def sim_curve(cfg: ModelConfig, hardware: str, context: int, batches) -> list:
  from jaxinfer.costmodel import ModelCosts, RooflineStepModel, load_hardware
  from jaxinfer.costmodel.roofline import load_calibration
  hw = load_hardware(hardware)
  costs = ModelCosts(cfg)
  rm = RooflineStepModel(costs, hw, load_calibration(hw, costs))
  rows = []
  for b in batches:
    t = rm.decode_round(b, context)
    rows.append({"batch": b, "round_ms": 1e3 * t, "tok_s": b / t,
                 "weights_read_gb": costs.weights_read(b) / 1e9,
                 "bytes_per_round_gb": costs.step_bytes([(1, context)] * b) / 1e9,
                 "experts_touched": cfg.expected_experts_touched(b)})
  return rows


def _run(model, B: int, L: int, G: int, seed: int):
  """(LLM, its steps' records of the second of two identical runs): the first compiles."""
  from jaxinfer.llm import LLM
  pages = -(-(L + G) // 16)
  llm = LLM(model, warmup=False, num_pages=B * pages + 8,
            buckets=BucketTable.default(max_tokens=max(64, L), max_requests=B,
                                        max_pages=pages))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, model.cfg.vocab_size, L).tolist() for _ in range(B)]
  sp = SamplingParams(max_tokens=G, ignore_eos=True)
  llm.generate(prompts, sp)
  n0 = len(llm.engine.steps)
  llm.generate(prompts, sp)
  return llm.engine.steps[n0:]


def measured_routing(model, B: int, L: int, G: int, seed: int = 0):
  """The run's routing, measured: (mean experts one MoE layer's decode call reached,
  each expert's share of all assignments). Traced apart (a renamed config, so its own
  executables) with moe.observe_routing on; the timed runs carry no callback."""
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model import moe
  cfg = model.cfg
  calls = []
  moe.observe_routing(lambda counts: calls.append(np.asarray(counts)))
  try:
    _run(LoadedModel(cfg.replace(name=cfg.name + "-routing"), model.params, None,
                     model.source), B, L, G, seed)
  finally:
    moe.observe_routing(None)
  k = cfg.experts_per_token
  decode = [c for c in calls if c.sum() == B * k]  # a decode step's layers: B tokens
  total = np.sum(calls, axis=0)
  return (float(np.mean([(c > 0).sum() for c in decode])) if decode else float("nan"),
          tuple(float(x) for x in total / total.sum()))


def real_curve(cfg: ModelConfig, batches, L: int, G: int, seed: int = 0) -> list:
  import jax
  from jaxinfer.costmodel import ModelCosts
  from jaxinfer.loading.registry import LoadedModel
  from jaxinfer.model.params import init_params
  model = LoadedModel(cfg, init_params(cfg, jax.random.PRNGKey(seed)), None, "random")
  costs = ModelCosts(cfg, 4.0, "f32", 16)
  rows = []
  prog = Progress(len(batches), cfg.name)
  for B in batches:
    steps = _run(model, B, L, G, seed)
    round_s = float(np.median([s.duration for s in steps if s.num_prefill_tokens == 0]))
    row = {"batch": B, "round_ms": 1e3 * round_s, "tok_s": B / round_s,
           "weights_read_mb": costs.weights_read(B) / 1e6,
           "experts_touched": cfg.expected_experts_touched(B)}
    if cfg.num_experts:  # the routing this run took, beside the uniform expectation
      touched, load = measured_routing(model, B, L, G, seed)
      row.update(experts_touched_measured=touched,
                 experts_touched_from_load=cfg.expected_experts_touched(B, load),
                 weights_read_mb_from_load=ModelCosts(cfg, 4.0, "f32", 16, load)
                 .weights_read(B) / 1e6)
    rows.append(row)
    prog.step(f"batch {B}: {1e3 * round_s:.1f} ms per round")
  return rows


def run_study(c, output_dir: str = "") -> dict:
  sim_moe = get_model_config(c.sim_model)
  real_moe = get_model_config("qwen3-30b-a3b").replace(
      name="random-moe", intermediate_size=1, max_position=4096, **c.real.to_dict())
  res = {"config": c.to_dict()}
  for where, cfg in (("sim", sim_moe), ("real", real_moe)):
    twin = dense_twin(cfg)
    res[where] = {"moe": cfg.name, "dense": twin.name,
                  "active_params": cfg.active_param_count(), "total_params": cfg.param_count(),
                  "dense_params": twin.param_count(), "moe_rows": [], "dense_rows": []}
    if where == "sim":
      for kind, m in (("moe_rows", cfg), ("dense_rows", twin)):
        res[where][kind] = sim_curve(m, c.sim_hardware, c.sim_context, c.sim_batches)
      continue
    for B in c.batches:  # the two models alternate batch by batch (the machine drifts)
      for kind, m in (("moe_rows", cfg), ("dense_rows", twin)):
        res[where][kind] += real_curve(m, [B], c.prompt_len, c.output_tokens)
  if output_dir:
    write_json(output_dir, "moe_batching.json", res)
    plot(res, os.path.join(output_dir, "moe_batching.png"))
  return res


def plot(res: dict, path: str) -> None:
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  titles = {"sim": f"{res['sim']['moe']} on {res['config']['sim_hardware']} (simulated)",
            "real": "small random MoE, f32 on this CPU (measured)"}
  for ax, where in zip(axes, ("sim", "real")):
    r = res[where]
    for kind, label, style in (("moe_rows", "MoE", "o-"), ("dense_rows", "dense twin", "s--")):
      rows = r[kind]
      ax.plot([x["batch"] for x in rows], [x["tok_s"] for x in rows], style, label=label)
    ax2 = ax.twinx()
    rows = r["moe_rows"]
    ax2.plot([x["batch"] for x in rows], [x["experts_touched"] for x in rows], "^:",
             color="tab:red", label="experts touched per layer")
    ax2.set_ylabel("experts touched (expected)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("output tok/s")
    ax.set_title(titles[where], fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
  save(fig, path)


def print_tables(res: dict) -> None:
  for where in ("sim", "real"):
    r = res[where]
    unit, scale = ("GB", 1.0) if where == "sim" else ("MB", 1.0)
    print(f"\n{where}: {r['moe']} ({r['active_params'] / 1e9:.3g}B active of "
          f"{r['total_params'] / 1e9:.3g}B) vs {r['dense']} ({r['dense_params'] / 1e9:.3g}B)")
    key = "weights_read_gb" if where == "sim" else "weights_read_mb"
    measured = where == "real"
    print(f"{'batch':>5} {'touched':>8} " + (f"{'measured':>9} {'from load':>10} "
                                              if measured else "")
          + f"{'W read ' + unit:>11} {'MoE ms':>8} {'dense ms':>9} "
          f"{'MoE tok/s':>10} {'dense tok/s':>12} {'MoE/dense':>10}")
    for m, d in zip(r["moe_rows"], r["dense_rows"]):
      seen = (f"{m['experts_touched_measured']:>9.1f} {m['experts_touched_from_load']:>10.1f} "
              if measured else "")
      print(f"{m['batch']:>5} {m['experts_touched']:>8.1f} {seen}{m[key] * scale:>11.2f} "
            f"{m['round_ms']:>8.2f} {d['round_ms']:>9.2f} {m['tok_s']:>10.0f} "
            f"{d['tok_s']:>12.0f} {m['round_ms'] / d['round_ms']:>10.2f}")


if __name__ == "__main__":
  run_binary("moe_batching", run_study, print_tables)
