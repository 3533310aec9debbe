"""Prefix reuse across multi-round agent sessions (chapter 8.3.3-8.3.4).

  python -m experiments.prefix_reuse --output_dir=out/prefix_reuse
  python -m experiments.prefix_reuse --config=configs/studies/prefix_reuse.py:small  # CI size

A generator of agent sessions: a stable system prompt + tool definitions, then rounds
that append a tool result to the context and generate a short reply, with interfering
requests between rounds. Three context-update strategies: append (the context only
grows), rewrite_head (a changing header first: reuse stops at the first token),
summarize (every k rounds the history is replaced by a generated summary). Replayed
through the real scheduler and prefix cache with pool sizes that keep or lose the
prefix (and an optional host tier): hit tokens by tier (device / host / recomputed) and
TTFT. sim: Qwen3-8B on RTX PRO 6000 (roofline); jax: SmolLM2 on this CPU, scaled down.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from experiments.common import Progress, run_binary, write_json
from jaxinfer.buckets import BucketTable
from jaxinfer.config import SamplingParams
from jaxinfer.plotting import pyplot, save

@dataclasses.dataclass
class SessionShape:
  system_tokens: int = 1000  # system prompt + tool definitions
  result_tokens: int = 150  # tool result appended per round
  reply_tokens: int = 40  # assistant reply per round
  header_tokens: int = 16  # rewrite_head: a header that changes every round
  summary_every: int = 4  # summarize: every k rounds
  summary_tokens: int = 300  # summarize: the summary's length (generated)
  interfering: int = 2  # unrelated requests between rounds
  interfering_tokens: int = 3000

  def scaled(self, f: float) -> "SessionShape":
    return SessionShape(*(max(1, int(round(v * f))) if k not in ("summary_every", "interfering")
                          else v for k, v in dataclasses.asdict(self).items()))


def run_session(engine, shape: SessionShape, strategy: str, rounds: int, seed: int = 0):
  """Replays one agent session (+ interference); returns per-round records."""
  rng = np.random.default_rng(seed)
  tok = lambda n: rng.integers(100, 30000, n).tolist()  # noqa: E731
  system = tok(shape.system_tokens)
  history = []  # tool results and replies after the system prompt
  records = []
  for i in range(rounds):
    history += tok(shape.result_tokens)
    head = tok(shape.header_tokens) if strategy == "rewrite_head" else []
    prompt = head + system + history
    r = engine.add_request(prompt, SamplingParams(max_tokens=shape.reply_tokens,
                                                  ignore_eos=True), arrival_time=engine.now())
    engine.run()
    history += r.output_token_ids
    if strategy == "summarize" and (i + 1) % shape.summary_every == 0:
      s = engine.add_request(system + history, SamplingParams(
          max_tokens=shape.summary_tokens, ignore_eos=True), arrival_time=engine.now())
      engine.run()
      history = list(s.output_token_ids)
    for _ in range(shape.interfering):
      engine.add_request(tok(shape.interfering_tokens), SamplingParams(max_tokens=8,
                         ignore_eos=True), arrival_time=engine.now())
    engine.run()
    records.append({"round": i, "prompt_tokens": len(prompt), "cached_tokens": r.cached_tokens,
                    "ttft_s": r.ttft})
  return records


def run_dp_sessions(router, shape: SessionShape, sessions: int, rounds: int, seed: int = 0):
  """`sessions` append-strategy agent sessions advancing together, a round at a time
  (every session's next prompt arrives at once, then the interfering requests), through
  a data-parallel router: which replica a session's rounds land on decides its hits."""
  rng = np.random.default_rng(seed)
  tok = lambda n: rng.integers(100, 30000, n).tolist()  # noqa: E731
  systems = [tok(shape.system_tokens) for _ in range(sessions)]
  history = [[] for _ in range(sessions)]
  prompt_tokens = cached = 0
  ttfts = []
  for _ in range(rounds):
    reqs = []
    for i in range(sessions):
      history[i] += tok(shape.result_tokens)
      reqs.append(router.add_request(systems[i] + history[i], SamplingParams(
          max_tokens=shape.reply_tokens, ignore_eos=True), arrival_time=router.now()))
    for _ in range(shape.interfering):
      router.add_request(tok(shape.interfering_tokens), SamplingParams(
          max_tokens=8, ignore_eos=True), arrival_time=router.now())
    router.run()
    for i, r in enumerate(reqs):
      history[i] += r.output_token_ids
      prompt_tokens += len(r.prompt_token_ids)
      cached += r.cached_tokens
      ttfts.append(r.ttft)
  return {"session_prompt_tokens": prompt_tokens, "session_cached_tokens": cached,
          "hit_fraction": cached / prompt_tokens, "mean_ttft_s": float(np.mean(ttfts)),
          "routed": list(router.routed)}


def sim_engine(pool_gib: float, host_pages: int):
  from jaxinfer.costmodel import RooflineStepModel
  from jaxinfer.executors.sim_executor import SimExecutor
  from jaxinfer.runtime.engine import Engine
  from jaxinfer.runtime.scheduler import SchedulerConfig
  rm = RooflineStepModel.for_names("qwen3-8b", "rtx-pro-6000")
  pages = int(pool_gib * 2**30 // (rm.costs.kv_bytes_per_token * 16))
  ex = SimExecutor(rm, num_pages=pages, page_size=16, token_id=7)
  return Engine(ex, SchedulerConfig("chunked", 8, 8192, 8192,
                                    cache_key=("qwen3-8b", "", "bf16")),
                buckets=BucketTable.default(1 << 14, 8, 4096), prefix_cache=True,
                host_cache_pages=host_pages)


def jax_engine(model, pool_tokens: int, host_pages: int):
  from jaxinfer.llm import LLM
  llm = LLM(model, warmup=False, num_pages=pool_tokens // 16,
            buckets=BucketTable.default(max_tokens=256, max_requests=4, max_pages=128),
            prefix_cache=True, host_cache_pages=host_pages)
  return llm.engine


def summarize_run(engine, records):
  st = engine.cache.stats
  return {"input_tokens": st.lookup_tokens, "device_hit_tokens": st.device_hit_tokens,
          "host_hit_tokens": st.host_hit_tokens, "recomputed_tokens": st.recomputed_tokens,
          "session_cached_tokens": sum(r["cached_tokens"] for r in records),
          "session_prompt_tokens": sum(r["prompt_tokens"] for r in records),
          "mean_ttft_s": float(np.mean([r["ttft_s"] for r in records])),
          "rounds": records}


def run_study(c, output_dir: str = "") -> dict:
  n = sum(len(c.strategies) * len(c[f"{ex}_pools"]) for ex in c.executors) + len(c.dp_routing)
  prog = Progress(n, "prefix_reuse")
  results = []
  for ex in c.executors:
    if ex == "sim":
      shape = SessionShape(**c.session)
      for gib, host in c.sim_pools:
        for strat in c.strategies:
          eng = sim_engine(gib, int(host))
          res = summarize_run(eng, run_session(eng, shape, strat, c.rounds))
          results.append({"executor": ex, "pool": f"{gib:g} GiB", "host_pages": int(host),
                          "strategy": strat, **res})
          prog.step(f"sim {gib:g} GiB host {host} {strat}")
    else:
      from jaxinfer.loading import load_model
      m = load_model(c.model)
      shape = SessionShape(**c.session).scaled(c.jax_scale)
      for pool_tokens, host in c.jax_pools:
        for strat in c.strategies:
          # warm-up replay (another seed) compiles the shapes the measured replay uses
          run_session(jax_engine(m, int(pool_tokens), int(host)), shape, strat, c.rounds,
                      seed=1)
          eng = jax_engine(m, int(pool_tokens), int(host))
          res = summarize_run(eng, run_session(eng, shape, strat, c.rounds))
          results.append({"executor": ex, "pool": f"{int(pool_tokens)} tokens",
                          "host_pages": int(host), "strategy": strat, **res})
          prog.step(f"jax {pool_tokens} tokens host {host} {strat}")
  dp = []
  for routing in c.dp_routing:  # data-parallel replicas behind the router (issue: dp)
    from jaxinfer.runtime.router import Router
    router = Router([sim_engine(c.dp_pool_gib, 0) for _ in range(c.dp_replicas)], routing)
    dp.append({"routing": routing, "replicas": c.dp_replicas, "sessions": c.dp_sessions,
               **run_dp_sessions(router, SessionShape(**c.session), c.dp_sessions, c.rounds)})
    prog.step(f"sim dp={c.dp_replicas} {routing}")
  if output_dir:
    write_json(output_dir, "prefix_reuse.json", {"config": c.to_dict(), "results": results,
                                                 "dp": dp})
    plot(results, os.path.join(output_dir, "prefix_reuse.png"))
  return {"results": results, "dp": dp}


def plot(results, path: str) -> None:
  """Per executor: the agent session's prompt tokens by where they came from (device hit /
  host hit / recomputed) for each pool and strategy, its mean TTFT on a second axis."""
  plt = pyplot()
  exs = list(dict.fromkeys(r["executor"] for r in results))
  fig, axes = plt.subplots(1, len(exs), figsize=(7 * len(exs), 4.2), squeeze=False)
  for ax, ex in zip(axes[0], exs):
    rs = [r for r in results if r["executor"] == ex]
    x = np.arange(len(rs))
    # The session's own prompt tokens (interfering requests share nothing; every host
    # hit is the session's prefix coming back).
    host = np.array([r["host_hit_tokens"] for r in rs])
    dev = np.array([r["session_cached_tokens"] for r in rs]) - host
    rec = np.array([r["session_prompt_tokens"] - r["session_cached_tokens"] for r in rs])
    ax.bar(x, dev, label="device hit", color="tab:green")
    ax.bar(x, host, bottom=dev, label="host hit", color="tab:orange")
    ax.bar(x, rec, bottom=dev + host, label="recomputed", color="tab:gray")
    ax.set_xticks(x, [f"{r['pool']}{' +host' if r['host_pages'] else ''}\n{r['strategy']}"
                      for r in rs], fontsize=6, rotation=60)
    ax.set_ylabel("the session's prompt tokens")
    ax.set_ylim(0, 1.35 * max(dev + host + rec))  # room for the legends
    ax2 = ax.twinx()
    ax2.plot(x, [1e3 * r["mean_ttft_s"] for r in rs], "k^", label="session mean TTFT")
    ax2.set_ylabel("session mean TTFT (ms)")
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="upper right")
    ax.set_title({"sim": "simulated Qwen3-8B on RTX PRO 6000",
                  "jax": "SmolLM2 on this CPU (scaled session)"}.get(ex, ex), fontsize=9)
  save(fig, path)


def print_table(res: dict) -> None:
  print(f"{'exec':>4} {'pool':>12} {'host':>5} {'strategy':>13} {'session in':>10} {'cached':>7} "
        f"{'device hit':>10} {'host hit':>8} {'recomputed':>10} {'mean TTFT s':>11}")
  for r in res["results"]:
    print(f"{r['executor']:>4} {r['pool']:>12} {r['host_pages']:>5} {r['strategy']:>13} "
          f"{r['session_prompt_tokens']:>10} {r['session_cached_tokens']:>7} "
          f"{r['device_hit_tokens']:>10} {r['host_hit_tokens']:>8} {r['recomputed_tokens']:>10} "
          f"{r['mean_ttft_s']:>11.3f}")
  if res["dp"]:
    print("\ndata-parallel replicas (simulated Qwen3-8B on RTX PRO 6000), append sessions")
    print(f"{'routing':>12} {'replicas':>8} {'sessions':>8} {'session in':>10} {'cached':>8} "
          f"{'hit %':>6} {'mean TTFT s':>11}  routed")
    for r in res["dp"]:
      print(f"{r['routing']:>12} {r['replicas']:>8} {r['sessions']:>8} "
            f"{r['session_prompt_tokens']:>10} {r['session_cached_tokens']:>8} "
            f"{100 * r['hit_fraction']:>6.1f} {r['mean_ttft_s']:>11.3f}  {r['routed']}")


if __name__ == "__main__":
  run_binary("prefix_reuse", run_study, print_table)
