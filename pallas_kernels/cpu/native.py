"""The project's native CPU library: every `*.cc` XLA FFI handler, built and registered once.

Four custom calls live in it: `jaxinfer_paged_decode` (decode.cc),
`jaxinfer_block_matmul` (gguf.cc), `jaxinfer_bf16_tile_matmul`
(tiles.cc, Intel AMX or AVX512-BF16; `tiles_engines()` says which this CPU
and OS run) and `jaxinfer_f32_panel_matmul` (panels.cc, AVX-512;
`panels_available()`). The library is compiled on first use with the machine's C++
compiler into the cache (`$JAXINFER_CACHE/native`, default ~/.cache/jaxinfer/native),
keyed by the sources and the headers they share (native_items.h, kv_rows.h, fast_exp.h),
the flags, the compiler and jax's version: one object per source, compiled in parallel,
then linked and renamed into place atomically. A file lock makes concurrent processes
(test workers, a server and its client) wait for one build instead of each running its
own. Without a compiler, on a platform other than Linux, or with JAXINFER_NATIVE=0,
`available()` is False and callers keep their XLA-op paths (logged once). Calls of up
to 16 rows share their items with helper threads the library starts on first use
(native_items.h: they poll for 2 ms after a call, then sleep);
JAXINFER_SPIN_HELPERS=0 hands every call's items to XLA's thread pool instead.
"""
from __future__ import annotations

import ctypes
import fcntl
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

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = tuple(os.path.join(_HERE, h) for h in  # included by sources: part of the key
                ("native_items.h", "kv_rows.h", "fast_exp.h"))
SOURCES = tuple(os.path.join(_HERE, c) for c in ("decode.cc", "prefill.cc", "gguf.cc",
                                                   "tiles.cc", "panels.cc"))
# custom-call target -> the handler symbol the library exports
TARGETS = {"jaxinfer_paged_decode": "JaxinferPagedDecode",
           "jaxinfer_prefill_attention": "JaxinferPrefillAttention",
           "jaxinfer_block_matmul": "JaxinferBlockMatmul",
           "jaxinfer_bf16_tile_matmul": "JaxinferBf16TileMatmul",
           "jaxinfer_f32_panel_matmul": "JaxinferF32PanelMatmul"}

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
  # x86-64-v3 (AVX2, FMA, F16C) or, where the CPU has AVX-512's F, BW, CD, DQ and VL,
  # x86-64-v4: the library is built on the machine that runs it (the flags are part of its
  # key), never -march=native (see install_peers.sh). v4 gives the decode call's 8-float
  # vectors 32 registers (decode.cc's ColumnBlock).
  words = set(cpu.split())
  if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= words:
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= words
    flags.append("-march=x86-64-v4" if v4 else "-march=x86-64-v3")
    # integer dot products for gguf.cc's quantized-activation path
    if v4 and "avx512_vnni" in words:
      flags.append("-mavx512vnni")
    elif "avx_vnni" in words:
      flags.append("-mavxvnni")
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
  parts = [" ".join(flags).encode(), version.encode(), jax.__version__.encode()]
  for src in SOURCES + HEADERS:
    with open(src, "rb") as f:
      parts.append(f.read())
  key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
  out = os.path.join(_cache_dir(), f"jaxinfer_cpu-{key}.so")
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  with open(out + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
    if not os.path.exists(out):  # another process may have built it while we waited
      _compile(cxx, flags, out)
  return out


def _compile(cxx: str, flags: list, out: str) -> None:
  """Every source to an object at once (the compiles are independent), then one link."""
  with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmpdir:
    inc = ["-I", jax.ffi.include_dir(), "-I", _HERE]
    jobs = []
    for i, src in enumerate(SOURCES):
      obj = os.path.join(tmpdir, f"{i}.o")
      cmd = [cxx, *flags, *inc, "-c", src, "-o", obj]
      jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)))
    errors = [(cmd, proc.communicate()[1], proc.returncode) for cmd, _, proc in jobs]
    for cmd, err, rc in errors:
      if rc:
        raise RuntimeError(f"building the native CPU library failed ({' '.join(cmd)}):\n"
                           f"{err[-4000:]}")
    tmp = os.path.join(tmpdir, "lib.so")
    cmd = [cxx, *flags, *(obj for _, obj, _ in jobs), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
      raise RuntimeError(f"linking the native CPU library failed ({' '.join(cmd)}):\n"
                         f"{res.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: a reader sees no library or the whole one


def disabled() -> bool:
  return os.environ.get("JAXINFER_NATIVE", "1") == "0"


def available() -> bool:
  """Whether the custom calls are registered for the CPU platform (built on first call)."""
  if disabled():
    return False
  with _lock:
    if "ok" not in _state:
      _state["ok"] = False
      if not sys.platform.startswith("linux"):
        log.warning("native CPU library: only built on Linux; using XLA ops")
        return False
      try:
        lib = ctypes.cdll.LoadLibrary(build())
        for target, symbol in TARGETS.items():
          jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                      platform="cpu")
        _state["lib"] = lib  # keep the library loaded
        _state["ok"] = True
      except (RuntimeError, OSError, AttributeError) as e:
        log.warning("native CPU library unavailable (%s); using XLA ops", e)
    return _state["ok"]


def _cpu_feature(symbol: str, *envs: str) -> int:
  """0 if the library is unavailable or any of `envs` is "0" (read at each call: executors
  built after it is set keep their XLA-dot layouts), else what the library's `symbol()`
  says the CPU (and OS) run (asked of the library once)."""
  if any(os.environ.get(env, "1") == "0" for env in envs) or not available():
    return 0
  with _lock:
    if symbol not in _state:
      _state[symbol] = int(getattr(_state["lib"], symbol)())
    return _state[symbol]


def tiles_engines() -> tuple:
  """The engines the bf16 tile matmul runs here: ("amx", "dot") where the CPU has AMX-TILE
  and AMX-BF16 and Linux granted this process the tile state (AMX, and AVX512-BF16 dot
  products for a few rows), ("dot",) where it has AVX512-BF16 only (AMD Zen 4, Intel
  Cooper Lake), () otherwise or when JAXINFER_BF16_TILES is 0."""
  mode = _cpu_feature("JaxinferTilesAvailable", "JAXINFER_BF16_TILES")
  return tuple(name for bit, name in ((2, "amx"), (1, "dot")) if mode & bit)


def panels_available() -> bool:
  """Whether the f32 panel matmul can run: the CPU has AVX-512F, or AVX2 and FMA, and
  JAXINFER_PANELS is not 0."""
  return bool(_cpu_feature("JaxinferPanelsAvailable", "JAXINFER_PANELS"))


def prefill_available() -> bool:
  """Whether the prefill attention call can run: the CPU has AVX-512F and
  JAXINFER_NATIVE_PREFILL is not 0."""
  return bool(_cpu_feature("JaxinferPrefillAvailable", "JAXINFER_NATIVE_PREFILL"))


def stacked_call(target: str, x, w, layer, n: int, **attrs):
  """y [M, n] float32 = the custom call `target` of x [M, K] (as float32) and a stacked
  (or single) packed weight w at `layer` (None: 0), with the call's attributes (numpy
  scalars): the packed weight layouts' door."""
  import jax.numpy as jnp
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
  layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
  return call(x.astype(jnp.float32), w, layer, **attrs)
