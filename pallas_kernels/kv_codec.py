"""The byte layout of every KV format, and its quantize / dequantize in jnp (8.4.2).

This is the one definition shared by the model's reference attention, the KV pool
writer (`jaxinfer.kv`) and the Pallas kernels. A format stores, per token and KV head,
a code array and (for quantized formats) scales:

  f32    codes float32 [H]                                    4 B / value
  bf16   codes uint16 [H] (bf16 bit patterns; XLA:CPU scatters
         uint16 fast and bf16 slowly, measured here)          2 B / value
  fp8    codes uint8 [H] (float8_e4m3fn bits) + one float32
         scale per page per KV head                           1 B / value + 4 B / page / head
  q8_0   codes int8 [H] + fp16 scale per group of 32          34 B / 32 values (GGML Q8_0)
  q4_0   codes uint8 [H/2] (two 4-bit codes per byte: value j
         of a group in the low nibble of byte j, value j+16 in
         the high nibble) + fp16 scale per group of 32         18 B / 32 values (GGML Q4_0)

fp16 scales are stored as uint16 bit patterns for the same scatter reason as bf16.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32  # GGML block size for q8_0 / q4_0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class KVFormat:
  name: str
  code_dtype: np.dtype
  codes_per_value: float  # code elements per head_dim value (q4_0 packs two per byte)
  group_scales: bool  # one fp16 scale per 32 values (q8_0 / q4_0)
  page_scales: bool  # one f32 scale per page per KV head (fp8)

  def code_dim(self, head_dim: int) -> int:
    return int(head_dim * self.codes_per_value)

  def scale_dim(self, head_dim: int) -> int:
    return head_dim // GROUP if self.group_scales else 0

  def bytes_per_value(self) -> float:
    """Bytes per stored K or V value excluding per-page scales."""
    b = np.dtype(self.code_dtype).itemsize * self.codes_per_value
    if self.group_scales:
      b += 2.0 / GROUP
    return b


FORMATS = {
    "f32": KVFormat("f32", np.dtype(np.float32), 1.0, False, False),
    "bf16": KVFormat("bf16", np.dtype(np.uint16), 1.0, False, False),
    "fp8": KVFormat("fp8", np.dtype(np.uint8), 1.0, False, True),
    "q8_0": KVFormat("q8_0", np.dtype(np.int8), 1.0, True, False),
    "q4_0": KVFormat("q4_0", np.dtype(np.uint8), 0.5, True, False),
}


def get_format(name: str) -> KVFormat:
  try:
    return FORMATS[name]
  except KeyError:
    raise ValueError(f"unknown KV format {name!r}; supported: {sorted(FORMATS)}") from None


def check_head_dim(fmt: KVFormat, head_dim: int) -> None:
  if fmt.group_scales and head_dim % GROUP:
    raise ValueError(
        f"KV format {fmt.name} needs head_dim to be a multiple of {GROUP}, got {head_dim}")


# --- bit-pattern helpers ----------------------------------------------------------------

def bf16_to_bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def bits_to_bf16(b):
  return jax.lax.bitcast_convert_type(b, jnp.bfloat16)


def f16_to_bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)


def bits_to_f16(b):
  return jax.lax.bitcast_convert_type(b, jnp.float16)


def fp8_to_bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def bits_to_fp8(b):
  return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


# --- group formats (q8_0 / q4_0): quantize [..., H] -> (codes, scales) ------------------

def quantize_q8_0(x):
  """x [..., H] float -> (codes int8 [..., H], scale bits uint16 [..., H/32])."""
  g = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
  amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
  d = (amax / 127.0).astype(jnp.float16).astype(jnp.float32)
  inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
  q = jnp.clip(jnp.round(g * inv), -127, 127).astype(jnp.int8)
  return q.reshape(x.shape), f16_to_bits(d[..., 0])


def dequantize_q8_0(codes, scale_bits, dtype=jnp.float32):
  d = bits_to_f16(scale_bits).astype(jnp.float32)
  g = codes.astype(jnp.float32).reshape(*codes.shape[:-1], codes.shape[-1] // GROUP, GROUP)
  return (g * d[..., None]).reshape(codes.shape).astype(dtype)


def quantize_q4_0(x):
  """x [..., H] float -> (codes uint8 [..., H/2], scale bits uint16 [..., H/32]).

  GGML Q4_0: d = (signed value of largest magnitude) / -8, q = round(x/d + 8) in [0, 15].
  """
  g = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
  idx = jnp.argmax(jnp.abs(g), axis=-1, keepdims=True)
  vmax = jnp.take_along_axis(g, idx, axis=-1)
  d = (vmax / -8.0).astype(jnp.float16).astype(jnp.float32)
  inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
  q = jnp.clip(jnp.floor(g * inv + 8.5), 0, 15).astype(jnp.uint8)
  lo, hi = q[..., :GROUP // 2], q[..., GROUP // 2:]
  packed = (lo | (hi << 4)).astype(jnp.uint8)
  return packed.reshape(*x.shape[:-1], x.shape[-1] // 2), f16_to_bits(d[..., 0])


def dequantize_q4_0(codes, scale_bits, dtype=jnp.float32):
  d = bits_to_f16(scale_bits).astype(jnp.float32)
  b = codes.reshape(*codes.shape[:-1], codes.shape[-1] * 2 // GROUP, GROUP // 2)
  lo = (b & 0xF).astype(jnp.float32) - 8.0
  hi = (b >> 4).astype(jnp.float32) - 8.0
  g = jnp.concatenate([lo, hi], axis=-1) * d[..., None]
  return g.reshape(*codes.shape[:-1], codes.shape[-1] * 2).astype(dtype)


# --- fp8 with an external scale ---------------------------------------------------------

def quantize_fp8(x, scale):
  """x [..., H] float, scale broadcastable to x[..., :1] -> uint8 codes [..., H]."""
  inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
  y = jnp.clip(x.astype(jnp.float32) * inv, -FP8_MAX, FP8_MAX)
  return fp8_to_bits(y)


def dequantize_fp8(codes, scale, dtype=jnp.float32):
  return (bits_to_fp8(codes).astype(jnp.float32) * scale).astype(dtype)


# --- one entry point per direction --------------------------------------------------------

def encode(fmt: KVFormat, x):
  """Quantize token vectors x [..., H] for formats whose scales live with the token.

  Returns (codes, group_scales or None). fp8 needs a page scale: use `quantize_fp8`.
  """
  if fmt.name == "f32":
    return x.astype(jnp.float32), None
  if fmt.name == "bf16":
    return bf16_to_bits(x), None
  if fmt.name == "q8_0":
    return quantize_q8_0(x)
  if fmt.name == "q4_0":
    return quantize_q4_0(x)
  raise ValueError(f"encode() does not handle {fmt.name}; fp8 uses quantize_fp8 with a page scale")


def decode(fmt: KVFormat, codes, scales=None, dtype=jnp.float32):
  """Dequantize codes [..., Hc] to [..., H]. `scales`: group scales [..., H/32] for
  q8_0/q4_0, or page scales broadcastable to [..., 1] for fp8."""
  if fmt.name == "f32":
    return codes.astype(dtype)
  if fmt.name == "bf16":
    return bits_to_bf16(codes).astype(dtype)
  if fmt.name == "fp8":
    return dequantize_fp8(codes, scales, dtype)
  if fmt.name == "q8_0":
    return dequantize_q8_0(codes, scales, dtype)
  if fmt.name == "q4_0":
    return dequantize_q4_0(codes, scales, dtype)
  raise ValueError(f"unknown KV format {fmt.name!r}")


# --- the pool layout (allocated and written by jaxinfer.kv.pool) ------------------------

def pool_format(pool) -> str:
  if "k_ps" in pool:
    return "fp8"
  if "k_gs" in pool:
    return "q4_0" if pool["k"].shape[-1] * 2 == pool["k_gs"].shape[-1] * GROUP else "q8_0"
  return "bf16" if pool["k"].dtype == jnp.uint16 else "f32"


def gather_pages(pool, layer, page_table, dtype=jnp.float32):
  """K, V of one layer for each request: page_table [R, Pmax] -> two [K, R, Pmax*page, H].

  The pool is [L, K, P, page, Hc] (KV-head-major, like JAX's paged attention ops), so the
  gathered pages are already laid out for a dot batched over (KV head, request).
  """
  fmt = get_format(pool_format(pool))
  K = pool["k"].shape[1]
  ki = jnp.arange(K)[:, None, None]
  pt = page_table[None]
  out = []
  for name in ("k", "v"):
    codes = pool[name][layer, ki, pt]  # [K, R, Pmax, page, Hc]
    if fmt.group_scales:
      x = decode(fmt, codes, pool[name + "_gs"][layer, ki, pt], dtype)
    elif fmt.page_scales:
      sc = pool[name + "_ps"][layer, ki, pt]  # [K, R, Pmax]
      x = decode(fmt, codes, sc[..., None, None], dtype)
    else:
      x = decode(fmt, codes, None, dtype)
    K_, R, Pm, ps, H = x.shape
    out.append(x.reshape(K_, R, Pm * ps, H))
  return out[0], out[1]


# --- Q precision (8.4.4: storage format vs compute precision) ----------------------------

Q_PRECISIONS = ("compute", "kv")


def round_q(fmt: KVFormat, q, q_precision: str = "compute"):
  """"compute": Q stays in the compute dtype (e.g. BF16 Q against FP8 KV, variant (c) of
  8.4.4). "kv": Q is rounded through the KV format's compute path first (FP8 KV with an
  FP8 compute path, variant (b)): fp8 with a per-vector scale, q8_0 / q4_0 groups, bf16.
  q [..., H] float."""
  if q_precision == "compute" or fmt.name == "f32":
    return q
  if q_precision != "kv":
    raise ValueError(f"unknown Q precision {q_precision!r}; choose one of {Q_PRECISIONS}")
  x = q.astype(jnp.float32)
  if fmt.name == "bf16":
    return x.astype(jnp.bfloat16).astype(jnp.float32)
  if fmt.name == "fp8":
    sc = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / FP8_MAX
    return dequantize_fp8(quantize_fp8(x, sc), sc)
  codes, scales = encode(fmt, x)
  return decode(fmt, codes, scales)
