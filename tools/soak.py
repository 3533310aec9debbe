"""Soak and chaos run against the real server: `python tools/soak.py --minutes=30`.

Starts `python -m jaxinfer serve` on 127.0.0.1 (a free port, warm-up on, a random LoRA
adapter served as model "soak") and drives it from --concurrency client threads until the
time is up, each picking at random: chat (whole or streamed), streamed completions,
structured output (JSON Schema, choice, regex; the answer is checked against it), LoRA
requests, clients that disconnect mid-answer (streaming and not), malformed bodies and
oversized prompts and bodies. Then it checks, and writes `soak.json` under --output_dir:

- every request got exactly one proper outcome: a complete answer (finish stop or length,
  streams ending with `[DONE]`), an OpenAI error object with the expected status, or the
  disconnect the client made; nothing else (a violation is counted and described);
- nothing lost or duplicated: the requests the server's /metrics counts as ended (by
  reason) equal the requests the clients had admitted, and its HTTP refusals equal the
  refusals the clients saw;
- the pool is idle at the end (no running or waiting request, no KV page in use);
- the server's resident memory at the end is within --rss_tolerance of its level after
  --warmup_frac of the run;
- SIGTERM ends the server with exit code 0.

Exit code 0 when every check holds, 1 otherwise.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from experiments.common import (free_port, post_raw, project_texts,  # noqa: E402
                                read_response, start_server)

FLAGS = flags.FLAGS
flags.DEFINE_float("minutes", 30.0, "how long the clients drive the server")
flags.DEFINE_integer("concurrency", 8, "client threads, each with one request at a time")
flags.DEFINE_string("model", "smollm2-135m-instruct", "model served")
flags.DEFINE_integer("max_num_seqs", 8, "server: largest request bucket")
flags.DEFINE_integer("max_num_batched_tokens", 128, "server: largest token bucket")
flags.DEFINE_integer("max_model_len", 1024, "server: context window")
flags.DEFINE_integer("max_prompt_chars", 6000, "server: --max_prompt_chars")
flags.DEFINE_integer("max_body_bytes", 100_000, "server: --max_body_bytes")
flags.DEFINE_float("warmup_frac", 0.2, "the part of the run before the memory baseline")
flags.DEFINE_float("rss_tolerance", 0.05, "allowed relative change of the server's RSS")
flags.DEFINE_integer("seed", 0, "the clients' random choices")
flags.DEFINE_string("output_dir", "out/soak", "soak.json and the server's log")

KEY = "soak-key"
MIX = {"chat": 3, "chat_stream": 3, "completion_stream": 2, "constrained": 3, "lora": 2,
       "disconnect_stream": 1, "disconnect_whole": 1, "malformed": 1, "oversized": 1}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["red", "green", "blue", "yellow"]
REGEX = r"[0-9]{3}-[0-9]{4}"


def _get(url: str, timeout: float = 10.0) -> str:
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return r.read().decode()


def metrics(base: str) -> Dict[str, float]:
  """Prometheus text -> {'name{labels}': value} (the model_name label dropped)."""
  out = {}
  for line in _get(base + "/metrics").splitlines():
    if line.startswith("#") or not line.strip():
      continue
    key, value = line.rsplit(" ", 1)
    name, _, labels = key.partition("{")
    kept = [x for x in re.findall(r'\w+="[^"]*"', labels) if not x.startswith("model_name=")]
    out[name + (",".join(kept).join("{}") if kept else "")] = float(value)
  return out


def rss_bytes(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS")


class Soak:

  def __init__(self, base: str, texts: List[str], deadline: float, seed: int):
    import openai
    self.base = base
    self.client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                                timeout=300)
    self.openai = openai
    self.texts = texts
    self.deadline = deadline
    self.seed = seed
    self.lock = threading.Lock()
    self.records: List[dict] = []

  # one request of each kind -> (outcome, detail); outcome in OUTCOMES
  def _prompt(self, rng) -> str:
    return rng.choice(self.texts)[:rng.randint(80, 600)]

  def _chat(self, rng, stream: bool, model: str = "default", extra=None):
    msgs = [{"role": "user", "content": "Summarize: " + self._prompt(rng)}]
    kw = dict(model=model, messages=msgs, max_tokens=rng.randint(4, 48),
              temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randint(0, 1000))
    kw.update(extra or {})
    if not stream:
      r = self.client.chat.completions.create(**kw)
      return "complete", r.choices[0].finish_reason, r.choices[0].message.content
    text, reason, chunks = "", None, 0
    for c in self.client.chat.completions.create(stream=True, **kw):
      chunks += 1
      if c.choices:
        text += c.choices[0].delta.content or ""
        reason = c.choices[0].finish_reason or reason
    if reason is None:
      return "violation", f"a stream of {chunks} chunks ended without a finish reason", text
    return "complete", reason, text

  def run_one(self, rng, kind: str) -> dict:
    t0 = time.perf_counter()
    rec = {"kind": kind}
    try:
      if kind in ("chat", "chat_stream"):
        out, reason, _ = self._chat(rng, kind == "chat_stream")
        rec.update(outcome=out, detail=reason)
      elif kind == "lora":
        out, reason, _ = self._chat(rng, rng.random() < 0.5, model="soak")
        rec.update(outcome=out, detail=reason)
      elif kind == "completion_stream":
        reason, n = None, 0
        for c in self.client.completions.create(model="default", prompt=self._prompt(rng),
                                                max_tokens=rng.randint(4, 48), temperature=0,
                                                stream=True):
          n += 1
          reason = c.choices[0].finish_reason or reason
        rec.update(outcome="complete" if reason else "violation",
                   detail=reason or f"{n} chunks without a finish reason")
      elif kind == "constrained":
        rec.update(self._constrained(rng))
      elif kind.startswith("disconnect"):
        rec.update(self._disconnect(rng, kind == "disconnect_stream"))
      elif kind == "malformed":
        rec.update(self._malformed(rng))
      elif kind == "oversized":
        rec.update(self._oversized(rng))
    except self.openai.APIStatusError as e:  # an error object: proper, counted by status
      body = e.body if isinstance(e.body, dict) else {}
      ok = isinstance(body.get("message"), str) and e.status_code in (429, 500, 503)
      rec.update(outcome="server_error" if ok else "violation",
                 detail=f"{e.status_code}: {str(body.get('message'))[:200]}")
    except Exception as e:  # noqa: BLE001 -- anything else is a fault to report
      rec.update(outcome="violation", detail=f"{type(e).__name__}: {str(e)[:300]}")
    rec["seconds"] = time.perf_counter() - t0
    return rec

  def _constrained(self, rng) -> dict:
    what = rng.choice(["json_schema", "choice", "regex"])
    extra = {"json_schema": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}),
             "choice": dict(extra_body={"guided_choice": CHOICES}),
             "regex": dict(extra_body={"guided_regex": REGEX})}[what]
    msgs = [{"role": "user", "content": "Answer: " + self._prompt(rng)[:200]}]
    r = self.client.chat.completions.create(model="default", messages=msgs, max_tokens=64,
                                            temperature=rng.choice([0.0, 0.8]), **extra)
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    if reason != "stop":  # cut by max_tokens: nothing to check
      return dict(outcome="complete", detail=f"{what}: {reason}")
    if what == "json_schema":
      obj = json.loads(text)
      good = (isinstance(obj, dict) and set(obj) == {"name", "age"}
              and isinstance(obj["age"], int) and 0 <= obj["age"] <= 150)
    elif what == "choice":
      good = text in CHOICES
    else:
      good = re.fullmatch(REGEX, text) is not None
    return dict(outcome="complete" if good else "violation",
                detail=f"{what}: stop" if good else f"{what} broken: {text[:100]!r}")

  def _disconnect(self, rng, stream: bool) -> dict:
    body = json.dumps({"model": "default", "prompt": self._prompt(rng), "max_tokens": 200,
                       "temperature": 0, "ignore_eos": True, "stream": stream}).encode()
    sock = post_raw(self.base, "/v1/completions", body, KEY)
    with contextlib.closing(sock):
      if stream:  # read the headers and a first event or two, then go away
        got, events = b"", rng.randint(1, 3)
        while got.count(b"data:") < events:
          more = sock.recv(4096)
          if not more:
            break
          got += more
      else:
        time.sleep(rng.uniform(0.05, 1.0))
    return dict(outcome="disconnected", detail="stream" if stream else "whole")

  def _malformed(self, rng) -> dict:
    bodies = [(b"{not json", 400), (b"[" * 5000 + b"]" * 5000, 400),
              (json.dumps({"model": "default", "messages": "hi"}).encode(), 400),
              (json.dumps({"model": "default", "prompt": "x", "max_tokens": -3}).encode(), 400),
              (json.dumps({"model": "default", "prompt": "x", "temperature": "hot"}).encode(),
               400),
              (b'{"model": "default", "prompt": "x", "max_tokens": NaN}', 400),
              (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404)]
    body, want = rng.choice(bodies)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with contextlib.closing(post_raw(self.base, path, body, KEY)) as sock:
      status, _, raw = read_response(sock)
    err = json.loads(raw).get("error", {})
    good = status == want and isinstance(err.get("message"), str)
    return dict(outcome="refused" if good else "violation",
                detail=f"{status}" if good else f"{status} (want {want}): {raw[:200]!r}")

  def _oversized(self, rng) -> dict:
    if rng.random() < 0.5:  # a prompt over --max_prompt_chars: 400 before tokenizing
      body = json.dumps({"model": "default", "prompt": "word " * (FLAGS.max_prompt_chars // 4),
                         "max_tokens": 4}).encode()
      want, declared = 400, None
    else:  # a body declared larger than --max_body_bytes, never sent: 413 at once
      body, want, declared = b"", 413, FLAGS.max_body_bytes * 50
    with contextlib.closing(post_raw(self.base, "/v1/completions", body, KEY,
                                     declared)) as sock:
      status, _, raw = read_response(sock)
    good = status == want and isinstance(json.loads(raw).get("error", {}).get("message"), str)
    return dict(outcome="refused" if good else "violation",
                detail=f"{status}" if good else f"{status} (want {want}): {raw[:200]!r}")

  def worker(self, i: int) -> None:
    rng = random.Random(self.seed * 1000 + i)
    kinds, weights = zip(*MIX.items())
    while time.time() < self.deadline:
      rec = self.run_one(rng, rng.choices(kinds, weights)[0])
      rec["t"] = time.time()
      with self.lock:
        self.records.append(rec)


def _adapter(path: str) -> None:
  from jaxinfer.config import get_model_config
  from jaxinfer.lora import save_peft
  from jaxinfer.lora.adapter import random_adapter_factors
  cfg = get_model_config(FLAGS.model)
  a, b = random_adapter_factors(cfg, 4, ("wq", "wv"), seed=3)
  save_peft(path, a, b, cfg, rank=4, alpha=8)


def main(argv):
  del argv
  import logging
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  adapter = os.path.join(FLAGS.output_dir, "adapter")
  _adapter(adapter)
  port = free_port()
  args = [f"--model={FLAGS.model}", f"--api_key={KEY}", "--served_model_name=default",
          f"--lora=soak={adapter}", "--structured_output", "--max_queue=64",
          f"--max_num_seqs={FLAGS.max_num_seqs}",
          f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}",
          f"--max_model_len={FLAGS.max_model_len}",
          f"--max_prompt_chars={FLAGS.max_prompt_chars}",
          f"--max_body_bytes={FLAGS.max_body_bytes}", "--drain_timeout_s=10"]
  t_start = time.time()  # load + warm-up of every shape: minutes on 2 cores
  proc = start_server(args, port, os.path.join(FLAGS.output_dir, "server.log"))
  try:
    report = _drive(proc, f"http://127.0.0.1:{port}", time.time() - t_start)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  out = os.path.join(FLAGS.output_dir, "soak.json")
  with open(out, "w") as f:
    json.dump(report, f, indent=1, allow_nan=False)
  _print(report)
  print(f"wrote {out}")
  sys.exit(0 if all(c["ok"] for c in report["checks"].values()) else 1)


def _drive(proc, base: str, ready_s: float) -> dict:
  print(f"server ready in {ready_s:.0f} s; driving it for {FLAGS.minutes:g} min at "
        f"concurrency {FLAGS.concurrency}", file=sys.stderr)
  before = metrics(base)
  t0 = time.time()
  deadline = t0 + FLAGS.minutes * 60
  soak = Soak(base, project_texts(), deadline, FLAGS.seed)
  threads = [threading.Thread(target=soak.worker, args=(i,), daemon=True)
             for i in range(FLAGS.concurrency)]
  for t in threads:
    t.start()
  rss = []
  while any(t.is_alive() for t in threads):
    rss.append((time.time() - t0, rss_bytes(proc.pid)))
    time.sleep(5.0)
  for t in threads:
    t.join()
  for _ in range(300):  # bounded: the last aborts land within a few steps
    m = metrics(base)
    if m.get("jaxinfer:num_requests_running") == 0 and \
        m.get("jaxinfer:num_requests_waiting") == 0 and m.get("jaxinfer:kv_pages_used") == 0:
      break
    time.sleep(0.1)
  time.sleep(1.0)
  after = metrics(base)
  rss.append((time.time() - t0, rss_bytes(proc.pid)))
  proc.send_signal(signal.SIGTERM)
  try:
    exit_code = proc.wait(120)
  except subprocess.TimeoutExpired:
    exit_code = None
  return _report(soak.records, before, after, rss, exit_code, ready_s, time.time() - t0)


def _delta(before, after, prefix):
  return {k[len(prefix):].strip("{}"): after[k] - before.get(k, 0.0)
          for k in after if k.startswith(prefix) and not k.endswith("_created")}


def _report(records, before, after, rss, exit_code, ready_s, run_s) -> dict:
  by_kind = collections.defaultdict(collections.Counter)
  secs = collections.defaultdict(list)
  for r in records:
    by_kind[r["kind"]][r["outcome"]] += 1
    secs[r["kind"]].append(r["seconds"])
  outcomes = collections.Counter(r["outcome"] for r in records)
  violations = [r for r in records if r["outcome"] == "violation"]
  ended = _delta(before, after, "jaxinfer:request_success_total")
  refused_http = _delta(before, after, "jaxinfer:http_rejected_total")
  admitted = outcomes["complete"] + outcomes["disconnected"] + sum(
      1 for r in records if r["outcome"] == "server_error" and r["detail"][:3] in ("500",
                                                                                 "503"))
  server_ended = sum(ended.values())
  # every error object a handler returns is counted by the server's http_rejected, also a
  # 500 / 503 for a request the engine had admitted
  client_refused = outcomes["refused"] + outcomes["server_error"]
  warm = [b for t, b in rss if t >= FLAGS.warmup_frac * run_s]
  base_rss = float(np.median(warm[:3])) if warm else float(rss[0][1])
  end_rss = float(np.median([b for _, b in rss[-3:]]))
  checks = {
      "every response proper": {"ok": not violations,
                                "detail": f"{len(violations)} violations"},
      "none lost or duplicated": {
          "ok": server_ended == admitted,
          "detail": f"server ended {server_ended:g} ("
                    f"{', '.join(f'{k}: {v:g}' for k, v in sorted(ended.items()))}); "
                    f"clients had {admitted} admitted"},
      "refusals agree": {"ok": sum(refused_http.values()) == client_refused,
                         "detail": f"server refused {sum(refused_http.values()):g}, clients "
                                   f"saw {client_refused}"},
      "pool idle": {"ok": after.get("jaxinfer:num_requests_running") == 0
                    and after.get("jaxinfer:num_requests_waiting") == 0
                    and after.get("jaxinfer:kv_pages_used") == 0,
                    "detail": f"running {after.get('jaxinfer:num_requests_running')}, waiting "
                              f"{after.get('jaxinfer:num_requests_waiting')}, pages used "
                              f"{after.get('jaxinfer:kv_pages_used')}"},
      "memory steady": {"ok": abs(end_rss / base_rss - 1) <= FLAGS.rss_tolerance,
                        "detail": f"RSS {base_rss / 2**20:.0f} MiB after warm-up, "
                                  f"{end_rss / 2**20:.0f} MiB at the end "
                                  f"({100 * (end_rss / base_rss - 1):+.1f}%)"},
      "SIGTERM exits 0": {"ok": exit_code == 0, "detail": f"exit code {exit_code}"},
  }
  from jaxinfer.benchmarking import machine_stamp
  return {
      "machine": machine_stamp("python tools/soak.py " + " ".join(sys.argv[1:])),
      "config": {k: getattr(FLAGS, k) for k in ("minutes", "concurrency", "model",
                                                 "max_num_seqs", "max_num_batched_tokens",
                                                 "max_model_len", "max_prompt_chars",
                                                 "max_body_bytes", "seed")},
      "date": time.strftime("%Y-%m-%d %H:%M"), "server_ready_s": ready_s, "run_s": run_s,
      "requests": len(records), "outcomes": dict(outcomes),
      "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
      "seconds_p50_p99": {k: [float(np.percentile(v, 50)), float(np.percentile(v, 99))]
                          for k, v in sorted(secs.items())},
      "server_ended": ended, "server_refused": refused_http,
      "generated_tokens": after.get("jaxinfer:generation_tokens_total", 0.0) - before.get(
          "jaxinfer:generation_tokens_total", 0.0),
      "rss_mib": [[round(t, 1), round(b / 2**20, 1)] for t, b in rss],
      "violations": violations[:50], "checks": checks,
  }


def _print(rep: dict) -> None:
  print(f"{rep['requests']} requests in {rep['run_s'] / 60:.1f} min, "
        f"{rep['generated_tokens']:.0f} tokens generated; outcomes {rep['outcomes']}")
  print("| kind | outcomes | p50 s | p99 s |\n|---|---|---|---|")
  for k, v in rep["by_kind"].items():
    p50, p99 = rep["seconds_p50_p99"][k]
    print(f"| {k} | {', '.join(f'{o} {n}' for o, n in sorted(v.items()))} | {p50:.2f} | "
          f"{p99:.2f} |")
  print("| check | holds | detail |\n|---|---|---|")
  for name, c in rep["checks"].items():
    print(f"| {name} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |")
  for v in rep["violations"][:10]:
    print(f"violation: {v['kind']}: {v['detail']}")


if __name__ == "__main__":
  app.run(main)
