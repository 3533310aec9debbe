"""Measuring this machine and one fixed-shape model step: the floors every benchmark
prints beside its figures, and the one helper that builds a step of a given shape.

- read bandwidth (bytes/s): the best of a full reduction and a vector-matrix product;
- matmul FLOP/s: square f32 products, and the weight matmuls of a step at its own
  shapes (M = the step's tokens), which is what bounds a batched decode step;
- `uniform_step`: `batch` requests, each running `new_tokens` tokens after `context`
  cached ones, packed at exactly that shape (decode: new_tokens = 1). The KV values are
  whatever the pool holds: a step's time does not depend on them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.runtime.batcher import SeqWork, StepInput, pack_exact
from jaxinfer.costmodel.accounting import pages_for


def machine_stamp(command: str) -> dict:
  """Where and how a benchmark ran: CPU model, cores, jax version and backend, UTC date,
  the exact command (stamped on every benchmark JSON and the pages made from it)."""
  import os
  import platform
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command}


def median_time(fn: Callable, *args, repeats: int = 5, warm: bool = True) -> float:
  """Median seconds of fn(*args), after one untimed call (compilation, first touch) unless
  warm=False (the caller made it)."""
  if warm:
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


class ReadProbe:
  """The read bandwidth of this machine at the moment it is called: bytes/s of the faster
  of two read-once patterns over `mib` MiB, a full reduction and a vector-matrix product
  x[1, D] @ W[D, n] (a decode step's weight read). Built once (the array, both compiles);
  each call times one run of each, so a benchmark can take it beside every figure."""

  def __init__(self, mib: int = 512):
    n = mib * 2**20 // 4
    self.bytes = n * 4
    self.x = jnp.asarray(np.random.default_rng(0).standard_normal(n, dtype=np.float32))
    self.w = self.x.reshape(512, n // 512)
    self.v = jnp.ones((1, 512), jnp.float32)
    self._sum = jax.jit(jnp.sum)
    self._mv = jax.jit(lambda a, b: a @ b)
    self.seconds()  # compiles, first touch

  def seconds(self) -> Tuple[float, float]:
    """(reduction, vector-matrix) seconds of one run each."""
    out = []
    for fn, args in ((self._sum, (self.x,)), (self._mv, (self.v, self.w))):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out.append(time.perf_counter() - t)
    return out[0], out[1]

  def __call__(self) -> float:
    return self.bytes / min(self.seconds())

  def median(self, repeats: int) -> float:
    """bytes/s of the faster pattern, each pattern its median of `repeats` runs."""
    ts = np.array([self.seconds() for _ in range(repeats)])
    return self.bytes / float(np.median(ts, axis=0).min())


def measure_read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
  """Best bytes/s over two read-once patterns (ReadProbe), each its median of `repeats`."""
  return ReadProbe(mib).median(repeats)


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
  a = jnp.ones((n, n), dtype)
  b = jnp.ones((n, n), dtype)
  return 2 * n**3 / median_time(jax.jit(lambda x, y: x @ y), a, b, repeats=repeats)


def weight_matmul_shapes(cfg: ModelConfig) -> Tuple[Tuple[int, int, int], ...]:
  """(in, out, count) of every weight matmul one step runs per token row: the layers'
  q, k, v, o, gate, up, down and the LM head (count = how many layers have it)."""
  D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
  NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return ((D, NH, L), (D, KH, 2 * L), (NH, D, L), (D, F, 2 * L), (F, D, L),
          (D, cfg.vocab_size, 1))


def native_kernel(cfg: ModelConfig, dtype=jnp.float32):
  """The native CPU matmul module (pallas_kernels.cpu.panels / .tiles) a single-device CPU
  executor runs this model's `dtype` weights on (pallas_kernels.cpu.weights.prepare), or
  None (XLA's dot: no kernel for the dtype, a shape the layout cannot hold, or not a CPU)."""
  from pallas_kernels.cpu.weights import kernel_for
  found = kernel_for(dtype) if jax.default_backend() == "cpu" else None
  if found is None:
    return None
  kernel = found[0]
  ok = all(kernel.packable(jax.ShapeDtypeStruct((d_in, d_out), dtype))
           for d_in, d_out, _ in weight_matmul_shapes(cfg))
  return kernel if ok else None


class MatmulRateProbe:
  """FLOP/s of the weight matmuls of a step at its own shapes, at the moment it is called:
  `rows` token rows through each layer matmul, `lm_rows` (default rows) through the LM head;
  dtype: of both operands (bf16: float32 accumulation and result, as the model's
  linear.Dense). native=True: the native CPU matmul a CPU executor runs such weights on
  instead (pallas_kernels.cpu.weights: bf16 tiles on AMX / AVX512-BF16, f32 panels on
  AVX-512 or AVX2; x float32, the weight in its packed layout); None (the default): native
  wherever `native_kernel` says the executor runs one. The compute floor of a step is its
  FLOPs over the rate of what runs it. Built once (inputs, packed weights, compiles); each call times
  every shape `repeats` times (median)."""

  def __init__(self, cfg: ModelConfig, rows: int, lm_rows: int | None = None,
               dtype=jnp.float32, native: bool | None = None):
    lm_rows = rows if lm_rows is None else lm_rows
    rng = np.random.default_rng(0)
    kernel = native_kernel(cfg, dtype)
    native = kernel is not None if native is None else native
    if native and kernel is None:
      raise ValueError(f"no native CPU matmul runs {jnp.dtype(dtype).name} weights of "
                       f"{cfg.name} here (native_kernel)")
    if native:
      fn = jax.jit(kernel.matmul)
    else:
      fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    self.calls = []  # (fn, x, w, count)
    self.flops = 0.0
    for d_in, d_out, count in weight_matmul_shapes(cfg):
      m = lm_rows if d_out == cfg.vocab_size else rows
      x = jnp.asarray(rng.standard_normal((m, d_in), np.float32), dtype)
      w = jnp.asarray(rng.standard_normal((d_in, d_out), np.float32), dtype)
      if native:
        x, w = x.astype(jnp.float32), kernel.pack(w)
      jax.block_until_ready(fn(x, w))  # compiles, first touch
      self.calls.append((fn, x, w, count))
      self.flops += 2 * m * d_in * d_out * count

  def __call__(self, repeats: int = 1) -> float:
    secs = sum(median_time(fn, x, w, repeats=repeats, warm=False) * count
               for fn, x, w, count in self.calls)
    return self.flops / secs


def step_matmul_rate(cfg: ModelConfig, rows: int, lm_rows: int | None = None,
                     repeats: int = 5, dtype=jnp.float32, native: bool | None = None) -> float:
  """MatmulRateProbe's FLOP/s, each shape its median of `repeats`."""
  return MatmulRateProbe(cfg, rows, lm_rows, dtype, native)(repeats)


def uniform_step(batch: int, context: int, new_tokens: int = 1, page_size: int = 16,
                 token_ids: int = 7, page_width: int = 0) -> Tuple[StepInput, int]:
  """A step of `batch` requests with `new_tokens` each after `context` cached tokens,
  packed at exactly its own shape, or with page tables `page_width` pages wide (a bucket
  wider than the context, as a table with few page tiers runs it). Returns (step, pages
  the pool needs)."""
  pages = pages_for(context + new_tokens, page_size)
  works = [SeqWork([token_ids] * new_tokens, context, list(range(i * pages, (i + 1) * pages)))
           for i in range(batch)]
  return pack_exact(works, page_size, batch * pages, page_width), batch * pages


def time_step(executor, step: StepInput, repeats: int = 5) -> float:
  """Median seconds of one executor step (launch to result on the host)."""
  return time_steps([executor], step, repeats)[0]


def time_steps(executors, step: StepInput, repeats: int = 5) -> list:
  """Median seconds of one step of each executor, their steps taken in turn (round by
  round): on a machine whose speed drifts from minute to minute (the 2-core VM's swings
  reach 2x) the executors then share each spell, and their ratios hold where figures
  measured one after the other did not."""
  for ex in executors:
    ex.execute(step)  # compiles
  ts = [[] for _ in executors]
  for _ in range(repeats):
    for i, ex in enumerate(executors):
      t = time.perf_counter()
      ex.execute(step)
      ts[i].append(time.perf_counter() - t)
  return [float(np.median(t)) for t in ts]


# --- the peer every benchmark prints beside its figures: HF transformers, same run ---
def hf_model(path):
  """The HF transformers peer of a GGUF model (f32, eval), or None when the test extra
  (torch, transformers) is not installed. transformers dequantizes a GGUF in Python (24 s
  for SmolLM2 here), so the first load also saves its float32 weights under the cache
  (JAXINFER_CACHE/hf, keyed by the file's content and the transformers version) and later
  loads read those (about 1 s): the same tensors HF's own conversion produced."""
  import importlib.util
  import os
  if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
    logging.getLogger(__name__).warning(
        "HF peer skipped: torch/transformers not installed (pip install -e '.[test]')")
    return None
  import torch
  import transformers
  from transformers import AutoModelForCausalLM
  from jaxinfer.loading import registry
  saved = os.path.join(registry.default_cache_dir(), "hf",
                       registry.cache_key(path, f"hf-{transformers.__version__}"))
  if os.path.isfile(os.path.join(saved, "model.safetensors")):
    try:
      return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 -- a damaged entry: convert again
      logging.getLogger(__name__).warning("ignoring unusable HF weights in %s (%s: %s)",
                                          saved, type(e).__name__, e)
      import shutil
      shutil.rmtree(saved, ignore_errors=True)
  d, f = os.path.split(path)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
  try:
    _save_hf(model, saved)
  except OSError as e:  # a read-only cache must not stop the comparison
    logging.getLogger(__name__).warning("could not cache HF weights in %s: %s", saved, e)
  return model


def _save_hf(model, out_dir: str) -> None:
  """config.json + model.safetensors (tied weights stored once), published atomically."""
  import json
  import os
  from safetensors.torch import save_model
  from jaxinfer.loading import registry

  def write(tmp):
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights saved are plain float32
    with open(os.path.join(tmp, "config.json"), "w") as fh:
      json.dump(config, fh, allow_nan=False)
    save_model(model, os.path.join(tmp, "model.safetensors"))

  registry.publish_dir(out_dir, write,
                       lambda d: os.path.isfile(os.path.join(d, "model.safetensors")))


class HfDecode:
  """HF's decode forward, one token per request, on a DynamicCache that starts with
  `context` random tokens and grows by one each step; each call times one step."""

  def __init__(self, model, cfg, batch: int, context: int):
    import torch
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    K, H = cfg.num_kv_heads, cfg.head_dim
    dtype = next(model.parameters()).dtype  # the cache in the model's own dtype
    self.model, self.batch, self.pos = model, batch, context
    self.cache = DynamicCache(config=model.config)
    for layer in range(cfg.num_layers):
      self.cache.update(torch.randn(batch, K, context, H, generator=g).to(dtype),
                        torch.randn(batch, K, context, H, generator=g).to(dtype), layer)
    self.ids = torch.full((batch, 1), 7)
    self()  # untimed: its first step

  def __call__(self) -> float:
    import torch
    with torch.no_grad():
      t = time.perf_counter()
      self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True,
                 attention_mask=torch.ones(self.batch, self.pos + 1, dtype=torch.long),
                 position_ids=torch.full((self.batch, 1), self.pos))
      t = time.perf_counter() - t
    self.pos += 1
    return t


def hf_decode_step(model, cfg, batch, context, repeats):
  """Median seconds of HF's decode forward (HfDecode) over `repeats` consecutive steps."""
  step = HfDecode(model, cfg, batch, context)
  return float(np.median([step() for _ in range(repeats)]))


def hf_prefill(model, n, repeats):
  import torch
  ids = torch.full((1, n), 7)
  ts = []
  with torch.no_grad():
    for _ in range(repeats + 1):
      t = time.perf_counter()
      model(input_ids=ids, use_cache=True)
      ts.append(time.perf_counter() - t)
  return float(np.median(ts[1:]))


# --- llama.cpp (optional: tools/install_peers.sh builds llama-cpp-python) ---------------
def llama_cpp_model(path: str, n_ctx: int):
  """llama.cpp on the GGUF itself (its own quantized weights, all cores), or None when
  llama-cpp-python is not installed."""
  import importlib.util
  import os
  if importlib.util.find_spec("llama_cpp") is None:
    logging.getLogger(__name__).info("llama.cpp peer skipped: run tools/install_peers.sh")
    return None
  from llama_cpp import Llama
  return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=os.cpu_count(),
               verbose=False)


def llama_cpp_decode_step(llm, context: int, repeats: int, steps: int = 16) -> float:
  """Median seconds of llama.cpp's batch-1 decode step after `context` cached tokens:
  the prompt evaluated once, then `steps` single-token evaluations timed, per repeat."""
  ts = []
  for r in range(repeats):
    llm.reset()
    llm.eval([100 + (7 * i + r) % 20000 for i in range(context)])
    t = time.perf_counter()
    for i in range(steps):
      llm.eval([200 + i])
    ts.append((time.perf_counter() - t) / steps)
  return float(np.median(ts))


def llama_cpp_prefill(llm, n: int, repeats: int) -> float:
  """Median seconds of llama.cpp evaluating one n-token prompt from an empty context."""
  ts = []
  for r in range(repeats):
    llm.reset()
    ids = [100 + (11 * i + r) % 20000 for i in range(n)]
    t = time.perf_counter()
    llm.eval(ids)
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))
