"""What the study binaries share: the config flag, output files, progress lines."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import List, Optional, Sequence

from jaxinfer import strict_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_path(study: str) -> str:
  return os.path.join(ROOT, "configs", "studies", f"{study}.py")


def run_binary(study: str, run_study, show) -> None:
  """A study's __main__: --config (its file in configs/studies; `path:small` for the CI
  size; fields overridable as --config.field=value) and --output_dir, then
  show(run_study(config, output_dir)). Flags are defined here, under __main__ only:
  absl refuses a flag defined twice, and the tests import several studies."""
  from absl import app, flags
  from ml_collections import config_flags
  config = config_flags.DEFINE_config_file("config", config_path(study),
                                           f"ml-collections config of the {study} study")
  flags.DEFINE_string("output_dir", f"out/{study}", "write JSON and PNG figures here")

  def main(argv):
    del argv
    show(run_study(config.value, flags.FLAGS.output_dir))

  app.run(main)


def write_json(output_dir: str, name: str, obj) -> str:
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, name)
  with open(path, "w") as f:
    strict_json.dump(obj, f, indent=1, default=str)
  return path


class Progress:
  """One line per unit of work on stderr, with elapsed time and a linear ETA."""

  def __init__(self, total: int, label: str):
    self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()

  def step(self, what: str = "") -> None:
    self.done += 1
    el = time.perf_counter() - self.t0
    eta = el / self.done * (self.total - self.done)
    print(f"[{self.label}] {self.done}/{self.total} {what} ({el:.0f}s elapsed, ~{eta:.0f}s "
          "left)", file=sys.stderr, flush=True)


def few_buckets(step_tokens: int, chunk: int, max_running: int, max_len: int,
                prefill_slots=None):
  """A few pre-compiled shapes (8.2.4), all compiled (Engine.warmup) before a measured
  run so that none of its steps pays for a compile: one request-slot size R, one page
  size, token sizes R, 2R, 4R, ... up to the largest step, prefill slots (default: powers
  of two up to R)."""
  from jaxinfer.buckets import BucketTable
  R = max_running
  sizes, t = [R], R
  while t < step_tokens:
    t = min(2 * t, step_tokens)
    sizes.append(t)
  return BucketTable(token_sizes=tuple(sizes), request_sizes=(R,),
                     page_table_sizes=(-(-max_len // 16),), query_sizes=(min(chunk, sizes[-1]),),
                     prefill_slot_sizes=tuple(prefill_slots or ()))


def project_texts() -> List[str]:
  """The project's own prose (experiments/data/texts.txt), one paragraph each."""
  with open(os.path.join(ROOT, "experiments", "data", "texts.txt")) as f:
    return [t.strip() for t in f.read().split("\n\n") if t.strip()]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(args: Sequence[str], port: int, log_path: str,
                 timeout_s: float = 600.0) -> subprocess.Popen:
  """`python -m jaxinfer serve --port=PORT ARGS...` with its output in `log_path` (a file,
  not a pipe nobody reads: a full pipe blocks the server), once /health answers; raises
  RuntimeError naming the log if it exits or is not up within timeout_s (bounded)."""
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  log = open(log_path, "w")
  proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", f"--port={port}",
                           *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited {proc.returncode}; its log: {log_path}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
        if r.status == 200:
          return proc
    except OSError:
      time.sleep(0.5)
  proc.kill()
  raise RuntimeError(f"server did not come up in {timeout_s:.0f} s; its log: {log_path}")


def post_raw(base: str, path: str, body: bytes, api_key: str,
             content_length: Optional[int] = None, timeout: float = 120.0) -> socket.socket:
  """A POST over a plain socket (the body may be cut short or never sent, or the socket
  closed mid-answer): the open socket."""
  port = int(base.rsplit(":", 1)[1])
  sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
  n = len(body) if content_length is None else content_length
  sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api_key}"
                f"\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n").encode()
               + body)
  return sock


def read_response(sock: socket.socket):
  """(status, headers text, body bytes) of one Content-Length framed response."""
  data = b""
  while b"\r\n\r\n" not in data:
    got = sock.recv(65536)
    if not got:
      raise ConnectionError(f"connection closed before the headers: {data[:200]!r}")
    data += got
  head, _, rest = data.partition(b"\r\n\r\n")
  m = re.search(rb"content-length: (\d+)", head, re.I)
  if m is None:
    raise ValueError(f"no Content-Length: {head[:300]!r}")
  while len(rest) < int(m.group(1)):
    got = sock.recv(65536)
    if not got:
      break
    rest += got
  return int(head.split()[1]), head.decode(errors="replace"), rest
