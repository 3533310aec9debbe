"""Benchmark JSON -> the docs' performance page: tables and a figure, stamped with the
machine, the jax version, the date and the exact command of each run. The page holds the
current figures only; earlier ones live in git history.

  python tools/report.py out/bench_e2e/bench_e2e.json --output=docs/performance.md

Inputs: bench_e2e.json files (tools/bench_e2e.py), whose figures go beside the page
(`<output dir>/img/performance_e2e.png`), serve_bench.json files (experiments.serve_bench:
the server beside the offline run of the same prompts) and soak.json files (tools/soak.py).
"""
from __future__ import annotations

import json
import os
import sys

SYSTEMS = ("HF transformers", "llama.cpp")


def _f(x, spec=".2f"):
  return "-" if x is None else format(x, spec)


def _stamp(m: dict) -> str:
  return (f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores), jax {m['jax']} "
          f"({m['backend']}), by `{m['command']}`.")


def e2e_section(data: dict, img_rel: str | None) -> str:
  out = [f"## End to end: what a user runs ({data['model']})", "", _stamp(data["machine"]),
         "",
         "`x floor`: wall time over the job's floor (its prompts' FLOPs at the matmul rate "
         "measured in the same round, then every decode step's max(bytes / read bandwidth, "
         "FLOPs / that rate); rate and bandwidth are the faster of the readings before and "
         "after the round's runs). `engine/exact`: the engine's decode step for the batch (at "
         "the bucket it ran) over the same batch packed at exactly its shape. Peers run the "
         "same prompts in the same rounds; each ratio is the median of the rounds' own "
         "ratios.", ""]
  for kind, title in (("single", "One user"), ("batch", "Batch jobs")):
    rows = data.get(kind) or []
    if not rows:
      continue
    peers = [p for p in SYSTEMS if p in rows[0]]
    head = ["prompts", "weights", "policy", "in / out", "wall s", "tok/s", "TTFT s", "x floor",
            "decode x floor", "prefill x matmul", "decode bucket", "engine/exact"]
    for p in peers:
      head += [f"{p} tok/s", f"x {p}"]
    out += [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
      bucket = "x".join(map(str, r["decode_bucket"][:3])) if r.get("decode_bucket") else "-"
      cells = [str(r["prompts"]), r["weight_format"], r.get("policy", "-"),
               f"{data['prompt_len']} / {r['new_tokens']}", _f(r["wall_s"]),
               _f(r["out_tok_s"], ".1f"), _f(r["ttft_s"], ".3f"), _f(r["x_floor"]),
               _f(r.get("decode_x_floor")), _f(r["prefill_rate_x_matmul"]), bucket,
               _f(r["engine_over_exact"])]
      for p in peers:
        cells += [_f(r[p]["out_tok_s"], ".1f"), _f(r[f"x {p}"])]
      out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if kind == "batch" and "llama.cpp" in peers:
      out += ["llama.cpp runs the batch's prompts one after another (its per-request rate, "
              "over the first few prompts).", ""]
  if img_rel:
    out += [f"![tokens per second by system]({img_rel})", ""]
  return "\n".join(out)


def serve_section(data: dict) -> str:
  """experiments.serve_bench's run: each policy's server beside LLM.chat over the same
  prompts, with the machine's floors of one decode step."""
  fl = data["flags"]
  rate = fl["request_rate"]
  rounds = next(iter(data["policies"].values()), {}).get("rounds")
  sent = "all at once" if not rate else f"at {rate:g} per second ({fl['arrival']})"
  out = [f"## Serving: the server beside the offline run ({fl['model']})", "",
         f"{fl['num_prompts']} chat requests of {fl['max_tokens']} tokens each, sent {sent} "
         f"to `jaxinfer serve` (max_num_seqs {fl['max_num_seqs']}, token budget "
         f"{fl['max_num_batched_tokens']}); the offline run sends the same prompts through "
         "`LLM.chat` in the same process setup"
         + (f", alternated over {len(rounds)} rounds (the median round's figures; served / "
            "offline is the median of the rounds' own ratios)" if rounds else "")
         + (". " + _stamp(data["machine"]) if data.get("machine") else
            ". Command: `python -m experiments.serve_bench "
            f"--num_prompts={fl['num_prompts']} --request_rate={rate:g} "
            f"--max_tokens={fl['max_tokens']}`."), "",
         "| policy | served tok/s | offline tok/s | served / offline | TTFT mean ms | TTFT p99 "
         "ms | TPOT mean ms | goodput req/s |", "|---|---|---|---|---|---|---|---|"]
  for name, pol in data["policies"].items():
    off = (data.get("offline") or {}).get(name)
    off_tps = off["output_tokens"] / off["wall_s"] if off else None
    ratio = pol.get("served_over_offline") or (pol["output_tok_s"] / off_tps if off_tps
                                               else None)
    out.append(f"| {name} | {pol['output_tok_s']:.1f} | {_f(off_tps, '.1f')} | "
               f"{_f(ratio)} | "
               f"{pol['ttft']['mean_ms']:.0f} | {pol['ttft']['p99_ms']:.0f} | "
               f"{pol['tpot']['mean_ms']:.1f} | {pol['goodput_rps']:.2f} |")
  for name, pol in data["policies"].items():
    if pol.get("rounds"):
      out += ["", f"{name}: served / offline by round " + ", ".join(
          _f(r["served_over_offline"]) for r in pol["rounds"]) + "."]
  f = data.get("floors")
  if f:
    out += ["", f"Floors of a decode step at this batch, measured in the run: bandwidth "
            f"{f['bandwidth_floor_ms']:.1f} ms, compute {f['compute_floor_ms']:.1f} ms."]
  return "\n".join(out) + "\n"


def soak_section(data: dict) -> str:
  """tools/soak.py's run: requests by kind and outcome, latency, and its checks."""
  c = data["config"]
  command = (data.get("machine") or {}).get("command") or (
      f"python tools/soak.py --minutes={c['minutes']:g} --concurrency={c['concurrency']}")
  where = (f" on {data['machine']['cpu']} ({data['machine']['cores']} cores), jax "
           f"{data['machine']['jax']}" if data.get("machine") else "")
  out = [f"## Soak: the server under a mixed, faulty load ({c['model']})", "",
         f"Measured {data['date']}{where}, by `{command}`: {data['requests']} requests from "
         f"{c['concurrency']} clients in {data['run_s'] / 60:.1f} min, "
         f"{data['generated_tokens']:.0f} tokens generated.", "",
         "| kind | outcomes | p50 s | p99 s |", "|---|---|---|---|"]
  for kind, outcomes in data["by_kind"].items():
    p50, p99 = data["seconds_p50_p99"][kind]
    out.append(f"| {kind} | {', '.join(f'{o} {n}' for o, n in sorted(outcomes.items()))} | "
               f"{p50:.2f} | {p99:.2f} |")
  out += ["", "| check | holds | detail |", "|---|---|---|"]
  for name, chk in data["checks"].items():
    out.append(f"| {name} | {'yes' if chk['ok'] else 'NO'} | {chk['detail']} |")
  return "\n".join(out) + "\n"


def figure(data: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [("single", r) for r in data.get("single", [])] + \
         [("batch", r) for r in data.get("batch", [])]
  labels = [f"{r['prompts']} x {r['weight_format']}" for _, r in rows]
  systems = [("jaxinfer", lambda r: r["out_tok_s"])] + \
      [(p, lambda r, p=p: (r.get(p) or {}).get("out_tok_s")) for p in SYSTEMS]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  w = 0.8 / len(systems)
  for i, (name, get) in enumerate(systems):
    vals = [get(r) or 0.0 for _, r in rows]
    ax.bar([j + i * w for j in range(len(rows))], vals, w, label=name)
  ax.set_xticks([j + w * (len(systems) - 1) / 2 for j in range(len(rows))], labels)
  ax.set_ylabel("output tokens / s")
  ax.set_xlabel("prompts x weights")
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render(inputs, output: str, plot: bool = True) -> str:
  parts = ["# Performance", "",
           "Generated by `python tools/report.py` from benchmark JSON; rerun the command "
           "under each table to refresh it. The 2-core development VM's speed drifts from "
           "day to day: compare ratios measured in the same run, not figures across runs.",
           ""]
  for i, path in enumerate(inputs):
    with open(path) as f:
      data = json.load(f)
    if "checks" in data and "by_kind" in data:
      parts.append(soak_section(data))
      continue
    if "policies" in data and "flags" in data:
      parts.append(serve_section(data))
      continue
    if "single" not in data and "batch" not in data:
      raise ValueError(f"{path}: neither a bench_e2e.json (no 'single' or 'batch' rows), a "
                       "serve_bench.json nor a soak.json")
    img = None
    if plot:
      img = f"img/performance_e2e{'' if i == 0 else f'_{i}'}.png"
      figure(data, os.path.join(os.path.dirname(os.path.abspath(output)), img))
    parts.append(e2e_section(data, img))
  text = "\n".join(parts).rstrip() + "\n"
  with open(output, "w") as f:
    f.write(text)
  return text


def main(argv) -> int:
  inputs, output, plot = [], "docs/performance.md", True
  for a in argv[1:]:
    if a.startswith("--output="):
      output = a.split("=", 1)[1]
    elif a == "--noplot":
      plot = False
    elif a.startswith("--"):
      print(f"error: unknown flag {a} (--output=PATH, --noplot)", file=sys.stderr)
      return 2
    else:
      inputs.append(a)
  if not inputs:
    print("error: give one or more bench_e2e.json, serve_bench.json or soak.json files",
          file=sys.stderr)
    return 2
  try:
    render(inputs, output, plot)
  except (OSError, ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {output}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
