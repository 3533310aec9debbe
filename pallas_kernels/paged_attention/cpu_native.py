"""The CPU decode attention custom call: build `cpu_decode.cc`, register it, call it.

XLA:CPU has no way to read a page table inside a fused loop: every form of paged decode
attention written in XLA ops gathers each block of pages into a fresh buffer, masks it
and reduces it with separate fusions, so each KV byte crosses memory 3-4 times
(measured: 5x the KV bandwidth floor at batch 16, context 4096). `cpu_decode.cc` reads
the pages where they lie, once, in an XLA FFI handler that runs on XLA's own intra-op
thread pool.

The library is compiled on first use with the machine's C++ compiler (about 3 s) into
the cache (`$JAXINFER_CACHE/native`, default ~/.cache/jaxinfer/native), keyed by the
source, the flags, the compiler and jax's version, and written atomically so concurrent
processes can build it at once. Without a compiler, on a platform other than x86-64
Linux, or with JAXINFER_NATIVE_DECODE=0, `available()` is False and the `xla` backend
keeps its XLA-op decode path (logged once).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_codec

log = logging.getLogger(__name__)

TARGET = "jaxinfer_paged_decode"
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.cc")
_FORMATS = {"f32": 0, "bf16": 1, "fp8": 2, "q8_0": 3, "q4_0": 4}
# Below this many (cached token, KV head) pairs a call runs on the calling thread alone:
# scheduling a helper costs more than it saves. Measured (SmolLM2's shapes, 30 calls, two
# cores): 192 pairs 0.60 ms with helpers vs 0.32 alone, 768 pairs 0.98 vs 0.99, 3072
# pairs 2.81 vs 3.65 (one request) and 2.46 vs 4.09 (four).
MIN_PARALLEL_TOKENS = 1024

_lock = threading.Lock()
_state: dict = {}


def _cxx() -> str | None:
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _flags() -> list:
  flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
           "-ffp-contract=fast"]
  try:
    with open("/proc/cpuinfo") as f:
      cpu = f.read()
  except OSError:
    cpu = ""
  if platform.machine() in ("x86_64", "AMD64") and " avx2" in cpu and " fma" in cpu \
      and " f16c" in cpu:
    flags.append("-march=x86-64-v3")  # AVX2 + FMA; not -march=native (see install_peers.sh)
  return flags


def _cache_dir() -> str:
  root = os.environ.get("JAXINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "jaxinfer")
  return os.path.join(root, "native")


def build() -> str:
  """Compile the library if the cache lacks it; returns its path. Raises RuntimeError with
  the compiler's output when the build fails."""
  cxx = _cxx()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
  flags = _flags()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  with open(_SRC, "rb") as f:
    src = f.read()
  key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                   jax.__version__.encode()])).hexdigest()[:20]
  out = os.path.join(_cache_dir(), f"cpu_decode-{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
  os.close(fd)
  cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), _SRC, "-o", tmp]
  res = subprocess.run(cmd, capture_output=True, text=True)
  if res.returncode:
    os.unlink(tmp)
    raise RuntimeError(f"building {os.path.basename(_SRC)} failed ({' '.join(cmd)}):\n"
                       f"{res.stderr[-4000:]}")
  os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
  return out


def available() -> bool:
  """Whether the custom call is registered for the CPU platform (built on first call)."""
  if os.environ.get("JAXINFER_NATIVE_DECODE", "1") == "0":
    return False
  with _lock:
    if "ok" not in _state:
      _state["ok"] = False
      if not sys.platform.startswith("linux"):
        log.warning("native CPU decode attention: only built on Linux; using XLA ops")
        return False
      try:
        lib = ctypes.cdll.LoadLibrary(build())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferPagedDecode),
                                    platform="cpu")
        _state["lib"] = lib  # keep the library loaded
        _state["ok"] = True
      except (RuntimeError, OSError, AttributeError) as e:
        log.warning("native CPU decode attention unavailable (%s); using XLA ops", e)
    return _state["ok"]


def decode_attention(q, k_new, v_new, pool, layer, page_table, cached_len, *, scale,
                     min_parallel_tokens: int = MIN_PARALLEL_TOKENS):
  """Same contract as xla.decode_attention (q [R, N, H], k_new / v_new [R, K, H], the
  slot's page_table [R, P] and cached_len [R]) -> [R, N, H] float32. CPU only."""
  fmt = kv_codec.pool_format(pool)
  none = jnp.zeros((1,), jnp.float32)
  if fmt == "fp8":
    ks, vs = pool["k_ps"], pool["v_ps"]
  elif fmt in ("q8_0", "q4_0"):
    ks, vs = pool["k_gs"], pool["v_gs"]
  else:
    ks = vs = none
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32),
              pool["k"], pool["v"], ks, vs, jnp.asarray(layer, jnp.int32),
              page_table.astype(jnp.int32), cached_len.astype(jnp.int32),
              fmt=np.int32(_FORMATS[fmt]), scale=np.float32(scale),
              min_parallel_tokens=np.int64(min_parallel_tokens))
