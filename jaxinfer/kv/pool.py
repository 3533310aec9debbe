"""The paged KV pool as a pytree of device arrays, in any KV format (8.3.1, 8.4.2).

Layout, one array per component, layer-major so a step writes every layer once:
  k, v         [L, K, P, page_size, Hc]   codes (see pallas_kernels.kv_codec); multi-head
                                          latent attention: k only, K = 1, H = its latent
                                          plus RoPE key (the values are the latent)
  k_gs, v_gs   [L, K, P, page_size, H/32] uint16 fp16 group scales (q8_0, q4_0)
  k_ps, v_ps   [L, K, P] float32          page scales (fp8)
KV-head-major, so a request's gathered pages feed a dot batched over (head, request)
without a transpose.
Pools are allocated with zeros (jnp.empty is uninitialized on jax 0.11);
attention masks stale positions, so a page's old contents never matter.

A model that mixes sliding-window and full-attention layers (Gemma 2 / 3) has its layers
split into groups of equal size, each with its own page tables (`KVLayout`): a page then
holds one group's layers (L above is the group size), every group's pages come from the
one pool, and a windowed group's pages behind its window go back to the pool while the
full-attention group keeps the whole context (8.3.1's footprint, bounded by the window).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from pallas_kernels import kv_codec
from pallas_kernels.kv_codec import KVFormat, get_format, pool_format

KVPool = Dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """Which layers a page holds and which page table each layer reads.

  slots: layers a page holds; groups: (window, layer ids) per page-table group (window
  0: full attention); a layer's K/V sit at slot `slot_of[i]` of group `group_of[i]`'s pages.
  One group of every layer (slots = L) is the plain layout.
  """
  slots: int
  groups: Tuple[Tuple[int, Tuple[int, ...]], ...]

  @property
  def num_groups(self) -> int:
    return len(self.groups)

  @property
  def windows(self) -> Tuple[int, ...]:
    return tuple(w for w, _ in self.groups)

  @functools.cached_property
  def group_of(self) -> Tuple[int, ...]:
    out = {i: g for g, (_, ids) in enumerate(self.groups) for i in ids}
    return tuple(out[i] for i in range(len(out)))

  @functools.cached_property
  def slot_of(self) -> Tuple[int, ...]:
    out = {i: j for _, ids in self.groups for j, i in enumerate(ids)}
    return tuple(out[i] for i in range(len(out)))


@functools.lru_cache(maxsize=None)
def kv_layout(cfg: ModelConfig) -> KVLayout:
  """The pool layout of a model (grouped_layout of its layers' windows; a latent
  attention pool is never grouped)."""
  return grouped_layout((0,) * cfg.num_layers if cfg.mla else cfg.windows)


def grouped_layout(windows) -> KVLayout:
  """One group of every layer, or, where layers of different windows mix (sliding and
  full attention), groups of as many layers as the rarest kind has (vLLM's hybrid
  allocator makes the same choice): Gemma 2's 21 + 21 layers are two groups of 21;
  Gemma 3's 5:1 pattern over 26 layers (22 windowed, 4 full) is one full group of 4 and
  six windowed groups of 4 (the last holds 2: its other slots stay unused). Full
  attention's group comes first."""
  L = len(windows)
  kinds = sorted(set(windows))  # 0 (full attention) first
  if len(kinds) == 1:
    return KVLayout(L, ((windows[0], tuple(range(L))),))
  members = {w: [i for i in range(L) if windows[i] == w] for w in kinds}
  size = min(len(m) for m in members.values())
  groups = tuple((w, tuple(m[j:j + size])) for w in kinds for m in (members[w],)
                 for j in range(0, len(m), size))
  return KVLayout(size, groups)


def bytes_per_token(cfg: ModelConfig, kv_format: str = "bf16", page_size: int = 16) -> float:
  """k of 8.1: 2 (K and V) x layers x kv_heads x head_dim x bytes per value; multi-head
  latent attention stores one latent of kv_lora_rank + qk_rope_head_dim values instead
  (8.4.2: DeepSeek-V3 bf16, 61 x 576 x 2 = 70,272 B).

  fp8's per-page-per-head f32 scale adds (components) x L x heads x 4 / page_size bytes per
  token. Qwen3-8B bf16: 147,456 B; q8_0 and q4_0 are 34/64 and 18/64 of that.
  """
  fmt = get_format(kv_format)
  kv_codec.check_head_dim(fmt, cfg.cache_dim)
  parts = 1 if cfg.mla else 2  # MLA: the latent serves as both key and value
  per_token = parts * cfg.num_layers * cfg.cache_heads * cfg.cache_dim * fmt.bytes_per_value()
  if fmt.page_scales:
    per_token += parts * cfg.num_layers * cfg.cache_heads * 4 / page_size
  return per_token


def page_bytes(cfg: ModelConfig, kv_format: str, page_size: int) -> float:
  """Bytes of one page of the pool: page_size tokens of the layers a page holds (all of
  them, or one group's: kv_layout)."""
  share = kv_layout(cfg).slots / cfg.num_layers
  return bytes_per_token(cfg, kv_format, page_size) * page_size * share


def pool_bytes(cfg: ModelConfig, kv_format: str, num_pages: int, page_size: int) -> int:
  return int(round(page_bytes(cfg, kv_format, page_size) * num_pages))


def allocate_pool(cfg: ModelConfig, kv_format: str, num_pages: int, page_size: int,
                  device=None) -> KVPool:
  fmt = get_format(kv_format)
  kv_codec.check_head_dim(fmt, cfg.cache_dim)
  L, K, H = kv_layout(cfg).slots, cfg.cache_heads, cfg.cache_dim
  shape = (L, K, num_pages, page_size, fmt.code_dim(H))
  parts = ("k",) if cfg.mla else ("k", "v")  # MLA: the latent is key and value
  pool = {}
  for n in parts:
    pool[n] = jnp.zeros(shape, fmt.code_dtype)
    if fmt.group_scales:
      pool[n + "_gs"] = jnp.zeros((L, K, num_pages, page_size, fmt.scale_dim(H)), jnp.uint16)
    if fmt.page_scales:
      pool[n + "_ps"] = jnp.zeros((L, K, num_pages), jnp.float32)
  # Commit to the device like the step's outputs, so the first step and later ones hit
  # the same compiled executable (jit keys on committed-ness).
  return jax.device_put(pool, jax.devices()[0] if device is None else device)


def _write_one(pool, name, fmt: KVFormat, x, page_ids, offsets):
  """Write x [L, T, K, H] at (page_ids[t], offsets[t]); out-of-range pages are dropped."""
  codes = pool[name]  # [L, K, P, page, Hc]
  _, K, num_pages = codes.shape[:3]
  L = x.shape[0]  # the first L layers (all of them, or an early-exit drafter's)
  li = jnp.arange(L)[:, None, None]  # indices broadcast to [L, T, K]
  ki = jnp.arange(K)[None, None, :]
  p = page_ids[None, :, None]
  o = offsets[None, :, None]
  if fmt.page_scales:
    ps_name = name + "_ps"
    scales = pool[ps_name]  # [L, K, P]
    # A token at offset 0 starts a fresh page: forget the scale of the page's last owner.
    fresh = jnp.where(offsets == 0, page_ids, num_pages)[None, :, None]
    scales = scales.at[li, ki, fresh].set(0.0, mode="drop")
    old = scales
    need = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / kv_codec.FP8_MAX  # [L, T, K]
    scales = scales.at[li, ki, p].max(need, mode="drop")
    # Re-encode the touched pages' existing codes where the scale grew (same value for
    # duplicates, so the scatter is deterministic), then write the new tokens over them.
    pc = jnp.clip(p, 0, num_pages - 1)
    new_s = scales[li, ki, pc]  # [L, T, K]
    ratio = old[li, ki, pc] / jnp.where(new_s > 0, new_s, 1.0)
    page_codes = codes[li, ki, pc]  # [L, T, K, page, H]
    rescaled = kv_codec.quantize_fp8(
        kv_codec.dequantize_fp8(page_codes, ratio[..., None, None]), 1.0)
    codes = codes.at[li, ki, p].set(rescaled, mode="drop")
    new = kv_codec.quantize_fp8(x, new_s[..., None])
    pool[name] = codes.at[li, ki, p, o].set(new, mode="drop")
    pool[ps_name] = scales
    return
  # One update window [L, K, 1, 1, Hc] per token (indices on the page and offset axes
  # only): T updates instead of L * T * K rows, since XLA:CPU's loop emitter runs a
  # scatter one update at a time.
  c, s = kv_codec.encode(fmt, x)
  pool[name] = codes.at[:L, :, page_ids, offsets].set(c.swapaxes(1, 2), mode="drop")
  if s is not None:
    gs = pool[name + "_gs"]
    pool[name + "_gs"] = gs.at[:L, :, page_ids, offsets].set(s.swapaxes(1, 2), mode="drop")


def write_tokens(pool: KVPool, k, v, page_ids, offsets, layout: KVLayout | None = None
                 ) -> KVPool:
  """Store new tokens' K/V [L, T, K, H] at pages/offsets [T] (page id >= num_pages: skip).

  One scatter per component per step (per layer group), into the donated pool, so the
  stacked pool is updated in place rather than copied by a write from every layer.
  A grouped layout (page_ids [G, T]: each group's pages) writes each group's layers at
  their slots of that group's pages; an early-exit drafter's first L layers only those.
  """
  fmt = get_format(pool_format(pool))
  pool = dict(pool)
  parts = ((("k", k), ("v", v)) if "v" in pool  # an MLA pool holds its latent under "k"
           else (("k", k),))
  if page_ids.ndim == 1:
    for name, x in parts:
      _write_one(pool, name, fmt, x, page_ids, offsets)
    return pool
  run = k.shape[0]
  for g, (_, ids) in enumerate(layout.groups):
    ids = [i for i in ids if i < run]  # slots 0..len(ids)-1 of the group's pages
    if not ids:
      continue
    for name, x in parts:
      _write_one(pool, name, fmt, x[jnp.asarray(ids)], page_ids[g], offsets)
  return pool


def copy_pages(pool: KVPool, src, dst) -> KVPool:
  """Copy whole pages src[i] -> dst[i] in every layer (copy-on-write, 8.3.2)."""
  return {name: a.at[:, :, dst].set(a[:, :, src]) for name, a in pool.items()}
