"""The jitted model step: forward over a packed ragged batch, sample, write KV.

A serving step is two executables: `forward_step` `(params, pool, inputs) -> (logits,
pool)`, pool donated, then `sample_step` `(logits, inputs) -> packed results`; the fused
`model_step` also returns logits for studies and oracles. The model config,
the query-length bucket and the attention backend are static; everything that varies
per step or per request is an array of a bucket shape, so a warm step never retraces.
"""
from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer import attention, platforms, sampling
from jaxinfer.model import transformer


def sample_packed(logits, inputs, argmax=sampling.greedy):
  """Sample / verify every logits row and pack the step's result: [S, 3] float32 of
  (token id, logprob, draft accepted), the step's one device -> host copy (what
  `StepResult.from_packed` decodes); with `top_logprobs` in the inputs, [S, 3 + 2 * 20]:
  then the 20 most likely token ids and their logprobs. Optional inputs are part of the traced
  structure, so a step without them compiles and runs without that work:
  `token_mask` (structured output, min_tokens); `min_p`, `repetition`, `seen` and
  `logit_add` (penalties, logit_bias, min_p: one group). argmax: the platform's greedy
  pick (jaxinfer.platforms)."""
  raw = logits
  if "logit_add" in inputs:
    logits = sampling.apply_penalties(logits, inputs["seen"], inputs["repetition"],
                                      inputs["logit_add"])
  ids, lp, accepted = sampling.sample_rows(logits, inputs["temperature"], inputs["top_k"],
                                           inputs["top_p"], inputs["seed"], inputs["counter"],
                                           inputs["draft_ids"], inputs.get("token_mask"),
                                           inputs.get("min_p"), raw, argmax)
  cols = [ids.astype(jnp.float32)[:, None], lp[:, None], accepted.astype(jnp.float32)[:, None]]
  if "top_logprobs" in inputs:
    top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(raw, axis=-1), sampling.TOP_LOGPROBS)
    cols += [top_ids.astype(jnp.float32), top_lp]
  return jnp.concatenate(cols, axis=-1)


def _on_every_device(x, backend):
  """Under tensor parallelism, the step's host-bound results are replicated, so every
  process of a multi-process mesh can read them."""
  tp = backend.tp if isinstance(backend, attention.AttentionSpec) else None
  if tp is None or tp.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, tp.replicated())


def _step(params, pool, inputs, *, cfg, attn_shape, backend, return_logits,
          argmax=sampling.greedy):
  logits, pool = transformer.forward(params, pool, inputs, cfg, attn_shape=attn_shape,
                                     backend=backend)
  packed = _on_every_device(sample_packed(logits, inputs, argmax), backend)
  if return_logits:
    return (packed, _on_every_device(logits, backend)), pool
  return packed, pool


# A serving step runs in two dispatches: the forward (logits stay on the device), then
# sampling / verification of those logits. The sampler's executable depends only on the
# logits rows and the sampling features in use, not on the pool, the page size, the KV
# format, adapters or the token bucket, so one sampler serves every shape that shares
# its rows (it was 60% of a fused step's compile: 1.4 of 2.4 s for SmolLM2 at 4 rows).
# Structured-output steps may also fill their token masks on the host while the device
# runs the forward (JaxExecutor.overlap_masks). The fused `model_step` remains for the
# steps that return their logits too (JaxExecutor.logits).
SAMPLE_KEYS = ("temperature", "top_k", "top_p", "seed", "counter", "draft_ids", "min_p",
               "repetition", "seen", "logit_add", "top_logprobs", "token_mask")


def _forward(params, pool, inputs, *, cfg, attn_shape, backend):
  return transformer.forward(params, pool, inputs, cfg, attn_shape=attn_shape, backend=backend)


def _sample(logits, inputs, *, backend=None, argmax=sampling.greedy):
  return _on_every_device(sample_packed(logits, inputs, argmax), backend)


def sample_inputs(arrays) -> dict:
  """The step inputs the sampler reads (SAMPLE_KEYS present in `arrays`)."""
  return {k: arrays[k] for k in SAMPLE_KEYS if k in arrays}


def forward_inputs(arrays) -> dict:
  """The step inputs the forward reads: all but the sampler's, so that a step with
  penalties, masks or top logprobs runs the same forward executable as one without."""
  return {k: a for k, a in arrays.items() if k not in SAMPLE_KEYS}


def copy_pages_step(pool, src, dst):
  from jaxinfer.kv import copy_pages
  return copy_pages(pool, src, dst)


copy_pages_jit = jax.jit(copy_pages_step, donate_argnums=(0,))


def _read_pages(pool, pages):
  """Every component's rows of `pages` [n] (page axis 2): the host tier's offload copy."""
  return {k: jnp.take(a, pages, axis=2, mode="clip") for k, a in pool.items()}


def _write_pages(pool, pages, data):
  """Write data[k] [L, K, n, ...] into `pages` [n]; pages >= num_pages are dropped."""
  return {k: a.at[:, :, pages].set(data[k], mode="drop") for k, a in pool.items()}


read_pages_jit = jax.jit(_read_pages)
write_pages_jit = jax.jit(_write_pages, donate_argnums=(0,))  # in place: no pool copy


def enable_compilation_cache(path: str | None = None) -> str:
  """Persist compiled executables across processes (measured: 11.3 s -> 2.4 s)."""
  if os.environ.get("JAXINFER_XLA_CACHE") == "off":
    return ""
  path = path or os.environ.get("JAXINFER_XLA_CACHE") or os.path.join(
      os.environ.get("JAXINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                       "jaxinfer"), "xla")
  if jax.config.jax_compilation_cache_dir != path:  # once: every executor calls this
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def _draft_step(params, pool, inputs, *, cfg, attn_shape, backend, num_layers,
                argmax=sampling.greedy):
  """Early-exit self-draft (8.5.3): the target's first `num_layers` layers, its final
  norm and LM head; writes those layers' K/V for the drafted positions (the verify step
  rewrites every layer there). Returns greedy draft tokens [S] and the pool."""
  x, ks, vs = transformer.hidden_states(params, pool, inputs, cfg, attn_shape=attn_shape,
                                        backend=backend, num_layers=num_layers)
  pool = transformer.write_step_kv(pool, ks, vs, inputs, cfg, backend)
  logits = transformer.lm_head(params, x[inputs["logits_idx"]], cfg)
  return _on_every_device(argmax(logits), backend), pool


class Steps(NamedTuple):
  model: Any     # fused forward + sample, returning logits too
  forward: Any   # (params, pool, inputs) -> (logits, pool)
  draft: Any     # early-exit draft step
  sample: Any    # (logits, inputs) -> packed results


def _make_steps(options: dict | None, argmax=sampling.greedy) -> Steps:
  kw = {"compiler_options": options} if options else {}
  return Steps(
      jax.jit(functools.partial(_step, argmax=argmax),
              static_argnames=("cfg", "attn_shape", "backend", "return_logits"),
              donate_argnums=(1,), **kw),
      jax.jit(_forward, static_argnames=("cfg", "attn_shape", "backend"), donate_argnums=(1,),
              **kw),
      jax.jit(functools.partial(_draft_step, argmax=argmax),
              static_argnames=("cfg", "attn_shape", "backend", "num_layers"),
              donate_argnums=(1,), **kw),
      jax.jit(functools.partial(_sample, argmax=argmax), static_argnames=("backend",), **kw))


DEFAULT_STEPS = _make_steps(None)  # XLA's default options: every platform
model_step, forward_step, draft_step, sample_step = DEFAULT_STEPS
_variants: dict = {}  # (platform, unrolled) -> Steps (jit compiles lazily, when first run)


def _all_steps():
  return (DEFAULT_STEPS,) + tuple(_variants.values())


def num_compiled_steps() -> int:
  """Executables this process compiled for its step functions (forward, sampler, fused
  and draft steps, every variant): what a warm engine must not grow."""
  return sum(f._cache_size() for steps in _all_steps() for f in steps)


def num_compiled(kind: str) -> int:
  """Executables compiled for one step function ("forward", "sample", ...) over every
  variant."""
  return sum(getattr(steps, kind)._cache_size() for steps in _all_steps())


def steps_for(params, platform: str) -> Steps:
  """The step functions for a params layout on a platform (params may be None: an
  executor used only for its pool): the platform's compile options and greedy pick
  (jaxinfer.platforms), compiled lazily, once per (platform, layout)."""
  layers = params.get("layers") if isinstance(params, dict) else None
  unrolled = isinstance(layers, (list, tuple))
  key = (platform, unrolled)
  if key not in _variants:
    r = platforms.room(platform)
    if r is platforms.GENERIC:
      return DEFAULT_STEPS
    _variants[key] = _make_steps(r.compiler_options(unrolled), r.argmax)
  return _variants[key]
