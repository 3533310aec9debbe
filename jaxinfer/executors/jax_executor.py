"""JaxExecutor: runs packed steps on the jitted model, owning the donated KV pool."""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Tuple

import jax
import numpy as np

from jaxinfer import attention, platforms
from jaxinfer.buckets import Bucket
from jaxinfer.config import ModelConfig
from jaxinfer.kv import allocate_pool, kv_layout
from jaxinfer.lora import AdapterError, TARGETS as LORA_TARGETS, ops as lora_ops, union_targets
from jaxinfer.lora.adapter import LoraAdapter, check_finite
from jaxinfer.executors.base import StepResult
from jaxinfer.runtime.batcher import StepInput, empty_step_arrays
from jaxinfer.structured import mask_words
from jaxinfer.step import (copy_pages_jit, enable_compilation_cache, forward_inputs,
                           read_pages_jit, sample_inputs, steps_for, write_pages_jit)

log = logging.getLogger(__name__)


class JaxExecutor:
  virtual_clock = False
  step_model = None  # steps are timed, not modelled

  def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
               kv_format: str = "f32", backend: str = "xla", offload=None,
               q_precision: str = "compute", overlap_masks: Optional[bool] = None,
               lora_adapters: Sequence = (), max_loras: int = 0, max_lora_rank: int = 0,
               lora_targets: Sequence[str] = (), lora_mode: Optional[str] = None,
               devices: Optional[Sequence] = None, ep: int = 1,
               gguf_activations: str = "q8"):
    """q_precision: Q against the KV format (attention.AttentionSpec, 8.4.4).
    offload: an OffloadConfig — those layers' FFN weights stay in host memory and are
    streamed in each step (executors/offload.py).
    overlap_masks: a step with structured-output requests dispatches its forward, fills
    the token masks on the host meanwhile, then samples under them; False: masks first,
    then the forward and the sampler (every step is these two dispatches: step.py).
    Default: overlap on accelerators; not on XLA:CPU, where the host and the "device"
    share the same cores (measured in tools/bench_sampling.py: the overlapped step was
    slower there).
    lora_adapters (LoraAdapter), max_loras, max_lora_rank, lora_targets: multi-LoRA
    (8.2.1): a device pool of max_loras slots of rank max_lora_rank over lora_targets
    (default: every target of the given adapters); the adapters wait in host memory
    until a request needs them (jaxinfer.runtime.adapter_slots). lora_mode: one of lora.ops.MODES
    for every step carrying adapters (benchmarks, tests); default: the measured winners
    (ops.DECODE_MODE for decode-only steps, ops.PREFILL_MODE otherwise).
    devices: the devices this executor runs on (default: the first one); several: tensor
    parallel over them (jaxinfer/sharding.py: weights split by their logical axes, the
    KV pool by KV heads, attention per shard); ep: of them, groups splitting a mixture
    of experts' experts (expert parallel; tp = devices / ep within each group)."""
    self.cfg = cfg
    self.vocab_size = cfg.vocab_size
    self.params = params
    self.num_pages = num_pages
    self.page_size = page_size
    self.kv_format = kv_format
    layout = kv_layout(cfg)  # page tables per layer group (sliding + full layers)
    self.kv_groups = layout.num_groups
    self.kv_windows = layout.windows if layout.num_groups > 1 else ()
    self.backend = attention.check_backend(backend, q_precision)
    self.overlap_masks = (jax.default_backend() != "cpu") if overlap_masks is None else \
        bool(overlap_masks)
    enable_compilation_cache()
    self.tp = None
    self.devices = list(devices) if devices else [jax.devices()[0]]
    from jaxinfer import sharding
    sharding.check_single_device_features(len(self.devices),
                                          self.devices[0] != jax.devices()[0], offload,
                                          bool(max_loras))
    if len(self.devices) > 1:
      self.tp = sharding.make_tp(cfg, self.devices, ep)
      self.backend = self.backend._replace(tp=self.tp)
      self.params = sharding.shard_params(params, cfg, self.tp)
      pool = jax.eval_shape(lambda: allocate_pool(cfg, kv_format, num_pages, page_size))
      self.pool = jax.jit(lambda: {k: jax.numpy.zeros(a.shape, a.dtype) for k, a in
                                   pool.items()}, out_shardings=self.tp.pool_sharding())()
    else:
      if self.devices[0] != jax.devices()[0]:  # a data-parallel replica's own device
        self.params = jax.device_put(params, self.devices[0])
      self.pool = allocate_pool(cfg, kv_format, num_pages, page_size, self.devices[0])
      # the weights in the forms this platform runs fastest (CPU: packed layouts)
      self.params = platforms.room(self.devices[0].platform).prepare(
          self.params, gguf_activations=gguf_activations)
    self.host_pages = {}  # host-tier slot -> {component: numpy page}
    self._steps = steps_for(params, self.devices[0].platform)
    self.streamer = None
    if offload is not None and offload.layers:
      from jaxinfer.executors.offload import LayerStreamer
      bpp = np.dtype(params["embed"].dtype).itemsize
      self.streamer = LayerStreamer(cfg, params, offload, bpp)
      self.params = None  # the device keeps only the streamer's resident weights
    self.max_loras = int(max_loras)
    if lora_mode is not None and lora_mode not in lora_ops.MODES:
      raise ValueError(f"lora_mode must be one of {lora_ops.MODES} or None, got {lora_mode!r}")
    self.lora_mode = lora_mode
    self.lora_adapters = {}  # name -> LoraAdapter (host memory)
    self.lora_pool = None
    if self.max_loras:
      self._init_lora(lora_adapters, max_lora_rank, lora_targets)

  # --- multi-LoRA (8.2.1) -------------------------------------------------------------------
  def _init_lora(self, adapters, max_rank: int, targets) -> None:
    if self.streamer is not None:
      raise ValueError("LoRA adapters cannot be combined with weight offload (the streamed "
                       "layers do not run the adapters' low-rank products)")
    rank = max_rank or max([a.rank for a in adapters] or [0])
    if rank < 1:
      raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
    targets = tuple(targets) or union_targets(adapters)
    for t in targets:
      if t not in LORA_TARGETS:
        raise ValueError(f"unknown LoRA target {t!r}; choose from {LORA_TARGETS}")
    # the compute dtype: the embedding's (the first leaf may be a uint8 block of
    # weight_format="gguf": a pool of that dtype held zeros for every adapter)
    dtype = self.params["embed"].dtype
    self.lora_rank, self.lora_targets = rank, targets
    self.lora_pool = jax.device_put(
        lora_ops.allocate(self.cfg, targets, self.max_loras, rank, dtype), self.devices[0])
    for a in adapters:
      self.register_lora(a)

  def register_lora(self, adapter) -> None:
    """Keep an adapter in host memory, ready to load into a slot (checked first)."""
    if self.lora_pool is None:
      raise ValueError("this executor has no LoRA slots (max_loras=0)")
    if adapter.rank > self.lora_rank:
      raise AdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above "
                         f"max_lora_rank={self.lora_rank}")
    extra = [t for t in adapter.targets if t not in self.lora_targets]
    if extra:
      raise AdapterError(f"LoRA adapter {adapter.name!r} targets {extra}, which the adapter "
                         f"pool was not built for (lora_targets={list(self.lora_targets)})")
    check_finite(adapter)
    self.lora_adapters[adapter.name] = adapter

  def unload_lora(self, name: str, slot: int) -> None:
    """Forget a registered adapter; its device slot (0: it held none) is zeroed."""
    self.lora_adapters.pop(name, None)
    if slot:  # an adapter of no targets: slot_data gives zeros for every one
      zeros = lora_ops.slot_data(self.lora_pool, LoraAdapter(name, 0, {}))
      self.lora_pool = lora_ops.write_slot(self.lora_pool, np.int32(slot), zeros)

  def load_lora(self, loads: Sequence[Tuple[int, str]]) -> None:
    """Copy adapters from host memory into their device slots, before the step."""
    for slot, name in loads:
      data = lora_ops.slot_data(self.lora_pool, self.lora_adapters[name])
      self.lora_pool = lora_ops.write_slot(self.lora_pool, np.int32(slot), data)

  def _with_lora(self, arrays, bucket: Bucket):
    """A step carrying adapters: the pool and the index arrays of the mode that measured
    fastest for its kind of step (jaxinfer.lora.ops), or lora_mode."""
    arrays = dict(arrays)
    slots = arrays.pop("lora_slot")
    mode = self.lora_mode or (lora_ops.PREFILL_MODE if bucket.prefill_slots else
                              lora_ops.DECODE_MODE)
    arrays.update(lora_ops.index_arrays(slots, self.max_loras, mode, self.lora_rank),
                  lora=self.lora_pool)
    return arrays

  def copy_pages(self, copies: Sequence[Tuple[int, int]]) -> None:
    """Copy-on-write page copies, done before the step that writes the copies."""
    if not copies:
      return
    n = 1 << (len(copies) - 1).bit_length()  # pad to a power of two: few shapes
    src = np.array([c[0] for c in copies] + [copies[0][0]] * (n - len(copies)), np.int32)
    dst = np.array([c[1] for c in copies] + [copies[0][1]] * (n - len(copies)), np.int32)
    self.pool = copy_pages_jit(self.pool, src, dst)

  def memory_report(self) -> dict:
    """Device bytes of weights and KV pool; with offload, what it freed and keeps (8.4.3)."""
    from jaxinfer.kv import pool_bytes
    rep = {"kv_pool_bytes": pool_bytes(self.cfg, self.kv_format, self.num_pages, self.page_size)}
    if self.lora_pool is not None:
      rep["lora_pool_bytes"] = sum(a.nbytes for a in jax.tree_util.tree_leaves(self.lora_pool))
      rep["lora_host_bytes"] = sum(a.nbytes for a in self.lora_adapters.values())
    if self.streamer is None:
      rep["weight_bytes"] = sum(a.nbytes for a in jax.tree_util.tree_leaves(self.params))
      return rep
    st = self.streamer
    n, b = len(st.host), min(st.off.prefetch_buffers, len(st.host))
    resident = sum(a.nbytes for a in jax.tree_util.tree_leaves([st.top, st.layers]))
    rep.update(weight_bytes=resident + b * st.set_bytes, offloaded_sets=n,
               freed_bytes=n * st.set_bytes, buffer_bytes=b * st.set_bytes,
               net_bytes=(n - b) * st.set_bytes, bytes_moved=st.bytes_moved)
    return rep

  def launch(self, step: StepInput, plan=None):
    """Dispatch the step (JAX runs it asynchronously); `collect` waits for its result."""
    t0 = time.perf_counter()
    arrays = step.arrays
    if "lora_slot" in arrays:
      arrays = self._with_lora(arrays, step.bucket)
    if self.streamer is not None:
      if step.mask_fn is not None:  # layer by layer: no single forward to overlap with
        arrays = dict(arrays, token_mask=step.mask_fn())
      out, self.pool = self.streamer.forward(self.pool, arrays, step.bucket.attn_shape,
                                             self.backend)
      return out, t0
    if step.mask_fn is not None and not self.overlap_masks:
      arrays = dict(arrays, token_mask=step.mask_fn())
    logits, self.pool = self._steps.forward(self.params, self.pool, forward_inputs(arrays),
                                           cfg=self.cfg, attn_shape=step.bucket.attn_shape,
                                           backend=self.backend)
    if step.mask_fn is not None and self.overlap_masks:
      arrays = dict(arrays, token_mask=step.mask_fn())  # host work while the forward runs
    return self._steps.sample(logits, sample_inputs(arrays), backend=self.backend), t0

  def collect(self, handle) -> StepResult:
    out, t0 = handle
    packed = np.asarray(out)  # the one device -> host copy of the step
    return StepResult.from_packed(packed, time.perf_counter() - t0)

  def execute(self, step: StepInput, plan=None) -> StepResult:
    return self.collect(self.launch(step, plan))

  def offload_pages(self, moves: Sequence[Tuple[int, int]]) -> None:
    """Host tier: copy (page, slot) pages to host memory before their device pages are
    reused: one jitted gather and one device -> host copy for all of them."""
    if not moves:
      return
    pages = _pad_pow2([p for p, _ in moves], self.num_pages)
    data = {k: np.asarray(a) for k, a in read_pages_jit(self.pool, pages).items()}
    for i, (_, slot) in enumerate(moves):
      self.host_pages[slot] = {k: a[:, :, i].copy() for k, a in data.items()}

  def fetch_pages(self, moves: Sequence[Tuple[int, int]]) -> None:
    """Host tier: write (slot, page) pages back, in one donated (in-place) device call;
    an eager .at[].set copied the whole pool once per page."""
    if not moves:
      return
    pages = _pad_pow2([p for _, p in moves], self.num_pages)  # padding: dropped writes
    slots = [self.host_pages.pop(s) for s, _ in moves]
    data = {}
    for k, a in self.pool.items():
      rows = np.zeros(a.shape[:2] + (len(pages),) + a.shape[3:], a.dtype)
      for i, d in enumerate(slots):
        rows[:, :, i] = d[k]
      data[k] = rows
    self.pool = write_pages_jit(self.pool, pages, data)

  def logits(self, step: StepInput):
    """The step run with its logits returned too (quality studies, oracles): (its
    StepResult, duration 0: not timed; logits [S, vocab] float32 numpy)."""
    if self.streamer is not None:
      raise ValueError("logits are not returned with weight offload")
    arrays = step.arrays
    if "lora_slot" in arrays:
      arrays = self._with_lora(arrays, step.bucket)
    (packed, logits), self.pool = self._steps.model(
        self.params, self.pool, arrays, cfg=self.cfg, attn_shape=step.bucket.attn_shape,
        backend=self.backend, return_logits=True)
    return StepResult.from_packed(np.asarray(packed), 0.0), np.asarray(logits)

  # --- early-exit self-drafting (8.5.3) --------------------------------------------------
  def check_draft(self, num_layers: int) -> None:
    """Raise unless this executor can run early-exit draft steps of `num_layers` layers."""
    if self.streamer is not None:
      raise ValueError("the early-exit drafter needs the target's weights on the device "
                       "(not available with weight offload)")
    if not 0 < num_layers < self.cfg.num_layers:
      raise ValueError(f"early-exit layers must be in [1, {self.cfg.num_layers - 1}], "
                       f"got {num_layers}")

  def draft(self, step: StepInput, num_layers: int) -> np.ndarray:
    """Greedy draft tokens [S] from the first `num_layers` layers and the LM head; writes
    those layers' K/V of the step's positions into the pool."""
    out, self.pool = self._steps.draft(self.params, self.pool, step.arrays, cfg=self.cfg,
                                      attn_shape=step.bucket.attn_shape, backend=self.backend,
                                      num_layers=num_layers)
    return np.asarray(out)

  def warmup_draft(self, buckets: Sequence[Bucket], num_layers: int) -> float:
    """Compile the draft step at every decode-only bucket among `buckets`; seconds."""
    t0 = time.perf_counter()
    for b in buckets:
      if b.prefill_slots == 0 and b.num_logits == b.num_requests:
        self.draft(StepInput(empty_step_arrays(b, self.num_pages,
                                               groups=self.kv_groups), b, [], 0),
                   num_layers)
    return time.perf_counter() - t0

  def warmup(self, buckets: Sequence[Bucket], masked: bool = False) -> float:
    """Compile every given bucket ahead of time; returns seconds spent. masked: the
    variants that take a token mask (steps carrying structured-output requests). With
    LoRA slots, also every shape's variant that carries adapters."""
    _check_map_budget(len(buckets) * (2 if self.lora_pool is not None else 1))
    t0 = time.perf_counter()
    words = mask_words(self.vocab_size)
    for b in buckets:
      for lora in ((False, True) if self.lora_pool is not None else (False,)):
        a = empty_step_arrays(b, self.num_pages, words, groups=self.kv_groups)
        mask = a.pop("token_mask")
        if lora:
          a["lora_slot"] = np.zeros(b.num_tokens, np.int32)
        self.launch(StepInput(a, b, [], 0, mask_fn=(lambda m=mask: m) if masked else None))
    jax.block_until_ready(self.pool)
    return time.perf_counter() - t0


# Memory mappings one compiled step holds on XLA:CPU (measured: SmolLM2's step, 33 / 21 /
# 128 shapes added 12,693 / 8,470 / 51,248 mappings). Linux caps a process at
# vm.max_map_count (65,530 by default); past it XLA crashes in its next compile.
MAPS_PER_CPU_EXECUTABLE = 400


def _check_map_budget(num_shapes: int) -> None:
  if jax.default_backend() != "cpu":
    return
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
  except (OSError, ValueError):
    return
  need = num_shapes * MAPS_PER_CPU_EXECUTABLE
  if need > 0.8 * limit:
    log.warning("%d bucket shapes hold about %d memory mappings on XLA:CPU, near this "
                "machine's vm.max_map_count of %d (XLA crashes when it is reached): use a "
                "smaller bucket table or raise vm.max_map_count", num_shapes, need, limit)


def _pad_pow2(pages, fill: int) -> np.ndarray:
  """pages padded with `fill` to a power of two: few compiled shapes."""
  n = 1 << (len(pages) - 1).bit_length()
  return np.array(list(pages) + [fill] * (n - len(pages)), np.int32)


