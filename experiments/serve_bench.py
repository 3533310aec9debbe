"""Serving benchmark over HTTP, in the spirit of `vllm bench serve` (8.1, 8.6.2).

  python -m experiments.serve_bench --output_dir=out/serve_bench
  python -m experiments.serve_bench --policies=chunked --num_prompts=4 --max_tokens=8  # tiny

For each scheduling policy a `python -m jaxinfer serve` process is started on 127.0.0.1
(a free port; the workload runs once unmeasured so no measured step compiles); a raw
HTTP/1.1 client (--client=http, as `vllm bench serve`'s) or the official `openai` async
client (--client=openai) sends the prompts (chat, streamed, greedy, fixed output length)
at Poisson or fixed-rate arrivals, or all at once (--request_rate=0).
Per request: TTFT (send -> first text chunk), ITL (gaps between chunks), TPOT
((E2E - TTFT) / (tokens - 1)), E2E. Per run: request throughput, output tok/s, mean /
median / p99 of each, goodput against --slo (requests meeting every bound, per second),
and the server's own step time (from its /metrics). After each measured run the same
prompts run offline (`LLM.chat`, same engine flags, in this process), --rounds times
alternated: the serving overhead is the server's wall time over the offline one, minus 1,
and per decode round beside the offline decode step, from the round with the median
served / offline ratio. Beside the figures: this machine's bandwidth and compute floors of a decode step
at the run's batch, and HF transformers' static-batch decode (--hf).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Dict, List

import numpy as np
from absl import app, flags

from experiments import common
from experiments.common import write_json
from experiments.goodput import arrival_times

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "model served")
flags.DEFINE_list("policies", ["chunked", "continuous"], "one server run per policy")
flags.DEFINE_integer("num_prompts", 32, "requests per run")
flags.DEFINE_float("request_rate", 0.0, "mean arrivals per second; 0 = all at once")
flags.DEFINE_enum("arrival", "poisson", ["poisson", "fixed"], "arrival process")
flags.DEFINE_integer("max_tokens", 64, "output tokens per request (ignore_eos)")
flags.DEFINE_integer("max_num_seqs", 16, "server: largest request bucket")
flags.DEFINE_integer("max_num_batched_tokens", 128, "server: largest token bucket")
flags.DEFINE_string("slo", "ttft_ms=5000,tpot_ms=500", "goodput bounds: ttft_ms, tpot_ms, "
                    "e2e_ms (any subset)")
flags.DEFINE_bool("offline", True, "also run the prompts through LLM.chat (the overhead)")
flags.DEFINE_enum("client", "http", ["http", "openai"], "the load's client: raw HTTP/1.1 "
                  "with the server-sent events parsed as they come (as `vllm bench serve`), "
                  "or the official openai async client (heavier per chunk)")
flags.DEFINE_integer("rounds", 3, "measured runs per policy, each followed by the offline "
                     "run of the same prompts; the served / offline ratio is the median of "
                     "the rounds' own")
flags.DEFINE_bool("hf", True, "HF transformers static-batch decode as a peer")
flags.DEFINE_integer("seed", 0, "arrival process seed")
flags.DEFINE_string("output_dir", "out/serve_bench", "JSON and figure")

QUESTIONS = ("Summarize this in one sentence: {}", "What is the main topic of this text? {}",
             "List two facts from this text: {}", "Write a title for this text: {}")


def make_prompts(n: int) -> List[List[Dict[str, str]]]:
  """n chat prompts from the project's own texts (experiments/data/texts.txt)."""
  texts = common.project_texts()
  return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(
      texts[i % len(texts)][:200 + 40 * (i % 5)])}] for i in range(n)]


def parse_slo(spec: str) -> Dict[str, float]:
  out = {}
  for part in filter(None, spec.split(",")):
    k, _, v = part.partition("=")
    if k not in ("ttft_ms", "tpot_ms", "e2e_ms"):
      raise ValueError(f"--slo: unknown bound {k!r} (ttft_ms, tpot_ms, e2e_ms)")
    out[k] = float(v)
  return out


def token_bucket(policy: str) -> int:
  """Unchunked policies run a whole prompt in one step: their largest token bucket must
  hold the longest prompt (the project's prompts are under 256 tokens)."""
  return FLAGS.max_num_batched_tokens if policy == "chunked" else max(
      FLAGS.max_num_batched_tokens, 256)


def start_server(policy: str, port: int) -> subprocess.Popen:
  args = [f"--model={FLAGS.model}", f"--policy={policy}", f"--max_num_seqs={FLAGS.max_num_seqs}",
          f"--max_num_batched_tokens={token_bucket(policy)}", "--max_model_len=1024",
          f"--max_queue={max(FLAGS.num_prompts, 1)}"]
  return common.start_server(args, port, os.path.join(FLAGS.output_dir,
                                                      f"server_{policy}.log"))


async def _sse(base: str, body: Dict):
  """POST `body` to base + /v1/chat/completions and yield each server-sent event's JSON:
  HTTP/1.1 over one asyncio connection, as `vllm bench serve` does with aiohttp, so the
  client's share of the machine's two cores stays small (the openai SDK's per-chunk
  parsing costs several times the server's per-token work: --client=openai)."""
  host, port = base.split("//", 1)[1].rsplit(":", 1)
  reader, writer = await asyncio.open_connection(host, int(port))
  try:
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % (f"{host}:{port}".encode(), len(payload)) + payload)
    status = await reader.readline()
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
      k, _, v = line.partition(b":")
      chunked |= k.strip().lower() == b"transfer-encoding" and b"chunked" in v.lower()
    if status.split()[1:2] != [b"200"]:
      raise RuntimeError(f"{status.decode().strip()}: {(await reader.read()).decode()[:500]}")
    buf = b""
    while True:
      if chunked:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
          return
        buf += (await reader.readexactly(size + 2))[:-2]
      else:
        data = await reader.read(1 << 16)
        if not data:
          return
        buf += data
      while b"\n\n" in buf:
        event, _, buf = buf.partition(b"\n\n")
        if event.startswith(b"data: "):
          if event[6:] == b"[DONE]":
            return
          yield json.loads(event[6:])
  finally:
    writer.close()


async def _chunks(client, base: str, msgs):
  """(content of a chunk or None, completion tokens of the usage chunk or None) for each
  chunk of one streamed chat completion, through `client` (openai) or raw HTTP."""
  body = dict(model=FLAGS.model, messages=msgs, max_tokens=FLAGS.max_tokens, temperature=0,
              stream=True, stream_options={"include_usage": True})
  if client is None:
    async for c in _sse(base, dict(body, ignore_eos=True)):
      choices, usage = c.get("choices"), c.get("usage")
      yield (choices[0]["delta"].get("content") if choices else None,
             usage["completion_tokens"] if usage else None)
    return
  s = await client.chat.completions.create(**body, extra_body={"ignore_eos": True})
  async for c in s:
    yield (c.choices[0].delta.content if c.choices else None,
           c.usage.completion_tokens if c.usage is not None else None)


async def _one(client, base, msgs, t_sched, t0) -> Dict:
  await asyncio.sleep(max(0.0, t0 + t_sched - time.perf_counter()))
  t_send = time.perf_counter()
  chunks, n_tokens = [], 0
  async for content, usage in _chunks(client, base, msgs):
    if content:
      chunks.append(time.perf_counter())
    if usage is not None:
      n_tokens = usage
  t_end = time.perf_counter()
  ttft = chunks[0] - t_send if chunks else None
  return {"sched_s": t_sched, "send_s": t_send - t0, "ttft_s": ttft,
          "itl_s": list(np.diff(chunks)), "e2e_s": t_end - t_send, "tokens": n_tokens,
          "tpot_s": (t_end - t_send - ttft) / (n_tokens - 1) if ttft and n_tokens > 1 else None}


async def run_load(base: str, prompts, times, warm_up: bool) -> Dict:
  """One measured run of the workload against the server at `base` (after the whole
  workload once, unmeasured, when warm_up: the server compiles each bucket shape the
  first time a step needs it, so the measured runs compile nothing)."""
  client = None
  if FLAGS.client == "openai":
    import openai
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                timeout=600)
  try:
    if warm_up:
      await asyncio.gather(*(_one(client, base, m, 0.0, time.perf_counter())
                             for m in prompts))
    steps0 = step_metric(base)
    t0 = time.perf_counter()
    reqs = await asyncio.gather(*(_one(client, base, m, t, t0)
                                  for m, t in zip(prompts, times)))
    wall = time.perf_counter() - t0
    steps1 = step_metric(base)
  finally:
    if client is not None:
      await client.close()
  n = steps1[1] - steps0[1]
  return {"requests": reqs, "wall_s": wall, "server_steps": n,
          "server_step_s": steps1[0] - steps0[0]}


def step_metric(base: str):
  """(sum s, count) of the server's jaxinfer:step_duration_seconds: how long its engine
  steps took, apart from the time between them."""
  with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
    text = r.read().decode()
  vals = {}
  for line in text.splitlines():
    for k in ("sum", "count"):
      if line.startswith(f"jaxinfer:step_duration_seconds_{k}"):
        vals[k] = float(line.rsplit(" ", 1)[1])
  return vals.get("sum", 0.0), vals.get("count", 0.0)


def _stats(xs) -> Dict:
  xs = [x for x in xs if x is not None]
  if not xs:
    return {"mean_ms": None, "median_ms": None, "p99_ms": None}
  a = 1e3 * np.asarray(xs)
  return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
          "p99_ms": float(np.percentile(a, 99))}


def summarize(run: Dict, slo: Dict[str, float]) -> Dict:
  reqs, wall = run["requests"], run["wall_s"]
  good = 0
  for r in reqs:
    ok = r["ttft_s"] is not None
    ok = ok and ("ttft_ms" not in slo or 1e3 * r["ttft_s"] <= slo["ttft_ms"])
    ok = ok and ("tpot_ms" not in slo or r["tpot_s"] is None or 1e3 * r["tpot_s"] <= slo["tpot_ms"])
    ok = ok and ("e2e_ms" not in slo or 1e3 * r["e2e_s"] <= slo["e2e_ms"])
    good += ok
  tokens = sum(r["tokens"] for r in reqs)
  return {"wall_s": wall, "request_throughput": len(reqs) / wall,
          "output_tok_s": tokens / wall, "output_tokens": tokens,
          "goodput_rps": good / wall, "good": good, "requests": len(reqs),
          "ttft": _stats([r["ttft_s"] for r in reqs]),
          "tpot": _stats([r["tpot_s"] for r in reqs]),
          "itl": _stats([x for r in reqs for x in r["itl_s"]]),
          "e2e": _stats([r["e2e_s"] for r in reqs])}


def offline_llm(loaded, prompts, policy: str):
  """LLM.chat in this process with the server's engine flags for `policy`, warmed up as
  the server is: the same workload once."""
  from jaxinfer.llm import LLM
  llm = LLM(loaded, warmup=False, policy=policy, max_num_seqs=FLAGS.max_num_seqs,
            max_num_batched_tokens=token_bucket(policy), max_model_len=1024)
  llm.chat(prompts, _sampling())
  return llm


def _sampling():
  from jaxinfer.config import SamplingParams
  return SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=True)


def offline_run(llm, prompts) -> Dict:
  """One run of the prompts through `llm`: wall time, steps and the median decode-only
  step."""
  n0 = len(llm.engine.steps)
  t = time.perf_counter()
  outs = llm.chat(prompts, _sampling())
  wall = time.perf_counter() - t
  steps = llm.engine.steps[n0:]
  dec = [s.duration for s in steps if s.num_prefill_tokens == 0 and s.num_seqs > 0]
  return {"wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outs),
          "steps": len(steps), "step_s": sum(s.duration for s in steps),
          "decode_step_ms": 1e3 * float(np.median(dec)) if dec else None,
          "decode_batch": int(np.median([s.num_seqs for s in steps if s.num_prefill_tokens == 0]))
          if dec else 0}


def floors(cfg, batch: int) -> Dict:
  """Decode-step floors on this machine at `batch` (f32): the weight bytes a step reads
  over the measured read bandwidth, and the step's matmul FLOPs over the measured rate of
  the matmul that runs them (the native panel call on a CPU with AVX-512, else XLA's) at
  the step's own shapes."""
  from jaxinfer.benchmarking import measure_read_bandwidth, step_matmul_rate
  bw = measure_read_bandwidth()
  rate = step_matmul_rate(cfg, batch)
  flops = 2 * cfg.param_count() * batch
  return {"read_gb_s": bw / 1e9, "matmul_gflop_s": rate / 1e9,
          "bandwidth_floor_ms": 1e3 * cfg.weight_bytes_read_per_step(4) / bw,
          "compute_floor_ms": 1e3 * flops / rate}


def hf_peer(source: str, tokenizer, prompts, batch: int):
  """HF transformers' static-batch greedy decode on the same GGUF, `batch` of the
  prompts cut to one length (a static batch needs equal lengths)."""
  from experiments.peers import hf_generate
  ids = [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in prompts[:batch]]
  n = min(len(x) for x in ids)
  return hf_generate(source, [x[:n] for x in ids], FLAGS.max_tokens)


def main(argv):
  del argv
  slo = parse_slo(FLAGS.slo)
  if FLAGS.num_prompts < 1 or FLAGS.max_tokens < 2 or FLAGS.rounds < 1:
    raise app.UsageError("--num_prompts and --rounds must be >= 1 and --max_tokens >= 2")
  prompts = make_prompts(FLAGS.num_prompts)
  times = (np.zeros(len(prompts)) if FLAGS.request_rate <= 0 else
           arrival_times(FLAGS.arrival, FLAGS.request_rate, len(prompts), FLAGS.seed))
  results = {"flags": {k: FLAGS[k].value for k in ("model", "num_prompts", "request_rate",
                                                    "arrival", "max_tokens", "max_num_seqs",
                                                    "max_num_batched_tokens", "slo", "client",
                                                    "rounds")},
             "slo": slo, "policies": {}}
  from jaxinfer.benchmarking import machine_stamp
  results["machine"] = machine_stamp("python -m experiments.serve_bench " + " ".join(sys.argv[1:]))
  loaded = None
  if FLAGS.offline:
    from jaxinfer.loading import load_model
    loaded = load_model(FLAGS.model, "float32")
    results["offline"] = {}
  for policy in FLAGS.policies:
    # Served and offline runs alternate, round by round, with the offline engine built
    # and warmed before the server starts: the VM's speed drifts within minutes, so the
    # served / offline ratio is taken within each round and the median reported.
    llm = offline_llm(loaded, prompts, policy) if loaded is not None else None
    if llm is not None:
      cfg, source, tok = llm.cfg, llm.model.source, llm.tokenizer
    port = common.free_port()
    proc = start_server(policy, port)
    runs, offs = [], []
    try:
      for k in range(FLAGS.rounds):
        runs.append(asyncio.run(run_load(f"http://127.0.0.1:{port}", prompts, times,
                                         warm_up=k == 0)))
        if llm is not None:
          offs.append(offline_run(llm, prompts))
    finally:
      proc.send_signal(signal.SIGTERM)
      rc = proc.wait(120)
    del llm
    for k, run in enumerate(runs):
      run["summary"] = summarize(run, slo)
      if offs:
        off_tps = offs[k]["output_tokens"] / offs[k]["wall_s"]
        run["summary"]["served_over_offline"] = run["summary"]["output_tok_s"] / off_tps
    key = "served_over_offline" if offs else "output_tok_s"
    # the median round (the lower middle one of an even count)
    k = sorted(range(len(runs)), key=lambda i: runs[i]["summary"][key])[(len(runs) - 1) // 2]
    run = runs[k]
    s = dict(run["summary"], server_exit_code=rc, max_num_batched_tokens=token_bucket(policy),
             server_steps=run["server_steps"],
             server_step_ms=1e3 * run["server_step_s"] / run["server_steps"]
             if run["server_steps"] else None,
             server_step_busy=run["server_step_s"] / run["wall_s"],
             rounds=[{"served_tok_s": r["summary"]["output_tok_s"],
                      "served_wall_s": r["wall_s"],
                      "offline_wall_s": offs[i]["wall_s"] if offs else None,
                      "served_over_offline": r["summary"].get("served_over_offline")}
                     for i, r in enumerate(runs)])
    results["policies"][policy] = s
    results.setdefault("raw", {})[policy] = run["requests"]
    print(f"{policy:>10}: {s['request_throughput']:.2f} req/s  {s['output_tok_s']:.1f} out tok/s  "
          f"TTFT {s['ttft']['median_ms']:.0f} ms (p99 {s['ttft']['p99_ms']:.0f})  "
          f"TPOT {s['tpot']['median_ms']:.1f} ms  ITL p99 {s['itl']['p99_ms']:.1f} ms  "
          f"goodput {s['goodput_rps']:.2f} req/s ({s['good']}/{s['requests']})"
          + (f"  [round {k + 1} of {len(runs)}: the median]" if len(runs) > 1 else ""))
    if not offs:
      continue
    off = offs[k]
    off = dict(off, step_ms=1e3 * off["step_s"] / max(off["steps"], 1),
               step_busy=off["step_s"] / off["wall_s"])
    results["offline"][policy] = off
    print(f"   offline {policy}: {off['wall_s']:.2f} s for {off['output_tokens']} tokens; "
          f"decode step {off['decode_step_ms']:.1f} ms at batch {off['decode_batch']}")
    if FLAGS.request_rate <= 0:  # same workload all at once: wall times compare
      over = s["wall_s"] / off["wall_s"] - 1
      per_tok = 1e3 * (s["wall_s"] - off["wall_s"]) / max(FLAGS.max_tokens, 1)
      s["overhead_vs_offline"] = over
      s["overhead_ms_per_decode_round"] = per_tok
      print(f"{policy:>10}: serving overhead {100 * over:+.1f}% of the offline wall time, "
            f"{per_tok:+.1f} ms per decode round (offline step "
            f"{off['decode_step_ms']:.1f} ms); steps: server {s['server_steps']:.0f} x "
            f"{s['server_step_ms']:.1f} ms ({100 * s['server_step_busy']:.0f}% of its wall), "
            f"offline {off['steps']} x {off['step_ms']:.1f} ms "
            f"({100 * off['step_busy']:.0f}%)")
    print(f"{policy:>10}: served / offline output tok/s by round: " + ", ".join(
        f"{r['served_over_offline']:.3f}" for r in s["rounds"])
        + f"; median {s['served_over_offline']:.3f}")
  if FLAGS.offline:
    batch = max(max(o["decode_batch"] for o in results["offline"].values()), 1)
    fl = floors(cfg, batch)
    results["floors"] = fl
    print(f"   floors of a batch-{batch} decode step here: bandwidth "
          f"{fl['bandwidth_floor_ms']:.1f} ms, compute {fl['compute_floor_ms']:.1f} ms")
    if FLAGS.hf and str(source).endswith(".gguf"):
      hf = hf_peer(source, tok, prompts, batch)
      results["hf"] = hf
      if hf is not None:
        print(f"   HF transformers: decode step {hf['step_ms']:.1f} ms at batch {batch} "
              "(static batch, same GGUF)")
  path = write_json(FLAGS.output_dir, "serve_bench.json", results)
  _figure(results, os.path.join(FLAGS.output_dir, "serve_bench.png"))
  print(f"wrote {path}")


def _figure(results, path):
  from jaxinfer.plotting import pyplot, save
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for policy, reqs in results.get("raw", {}).items():
    for ax, key in zip(axes, ("ttft_s", "itl_s")):
      xs = sorted(1e3 * x for r in reqs for x in (r[key] if key == "itl_s" else [r[key]])
                  if x is not None)
      if xs:
        ax.plot(xs, np.linspace(0, 1, len(xs)), label=policy)
  for ax, name in zip(axes, ("TTFT (ms)", "ITL (ms)")):
    ax.set_xlabel(name)
    ax.set_ylabel("fraction of requests" if name.startswith("TTFT") else "fraction of gaps")
    ax.legend()
  save(fig, path)


if __name__ == "__main__":
  app.run(main)
