"""KV formats: exact bytes per token (8.1, 8.4.2) and quantize round trips."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import QWEN3_8B, SMOLLM2_135M
from jaxinfer.kv import allocate_pool, bytes_per_token, gather_pages, write_tokens
from pallas_kernels import kv_codec


def test_bytes_per_token_qwen3_8b():
  assert bytes_per_token(QWEN3_8B, "bf16") == 147_456  # 144 KiB, chapter 8.1
  assert bytes_per_token(QWEN3_8B, "q8_0") == 147_456 * 34 / 64
  assert bytes_per_token(QWEN3_8B, "q4_0") == 147_456 * 18 / 64
  assert bytes_per_token(QWEN3_8B, "f32") == 2 * 147_456
  # fp8: one byte per value plus a f32 scale per page per KV head for K and V.
  assert bytes_per_token(QWEN3_8B, "fp8", page_size=16) == 73_728 + 2 * 36 * 8 * 4 / 16


def test_unknown_format_is_an_error():
  with pytest.raises(ValueError, match="unknown KV format 'int3'"):
    bytes_per_token(SMOLLM2_135M, "int3")


@pytest.mark.parametrize("fmt,tol", [("f32", 0), ("bf16", 4e-3), ("q8_0", 1e-2),
                                     ("q4_0", 0.15)])
def test_group_round_trip(fmt, tol):
  f = kv_codec.get_format(fmt)
  x = np.random.default_rng().standard_normal((5, 3, 64)).astype(np.float32)
  codes, scales = kv_codec.encode(f, jnp.asarray(x))
  y = np.asarray(kv_codec.decode(f, codes, scales))
  err = np.abs(y - x).max(axis=-1) / np.abs(x).max(axis=-1)
  assert err.max() <= tol + 1e-7


def test_q4_0_matches_ggml_layout():
  """Value j of a group in the low nibble of byte j, value j+16 in the high nibble."""
  x = np.linspace(-1, 1, 32, dtype=np.float32)
  codes, scale_bits = kv_codec.quantize_q4_0(jnp.asarray(x))
  d = float(np.asarray(kv_codec.bits_to_f16(scale_bits)).reshape(()))
  assert d == pytest.approx(0.125, rel=1e-3)  # d = (first largest-magnitude value, -1) / -8
  q = np.clip(np.floor(x / d + 8.5), 0, 15).astype(np.uint8)
  np.testing.assert_array_equal(np.asarray(codes), q[:16] | (q[16:] << 4))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8", "q8_0", "q4_0"])
def test_pool_write_then_gather(fmt):
  cfg = SMOLLM2_135M.replace(num_layers=2)
  pool = allocate_pool(cfg, fmt, num_pages=6, page_size=4)
  rng = np.random.default_rng()
  T = 7
  k = rng.standard_normal((2, T, 3, 64)).astype(np.float32)
  v = rng.standard_normal((2, T, 3, 64)).astype(np.float32)
  pages = np.array([4, 4, 4, 4, 1, 1, 6], np.int32)  # last token is padding (dropped)
  offs = np.array([0, 1, 2, 3, 0, 1, 0], np.int32)
  pool = write_tokens(pool, jnp.asarray(k), jnp.asarray(v), pages, offs)
  kk, vv = gather_pages(pool, 1, jnp.array([[4, 1]], jnp.int32))
  tol = {"f32": 1e-7, "bf16": 1e-2, "fp8": 0.07, "q8_0": 0.02, "q4_0": 0.3}[fmt]
  kk, vv = (np.asarray(a).transpose(1, 2, 0, 3) for a in (kk, vv))  # -> [R, S, K, H]
  got = kk[0, :6]
  want = k[1, :6]
  assert np.abs(got - want).max() <= tol * np.abs(want).max()
  np.testing.assert_allclose(vv[0, :6], v[1, :6], atol=tol * np.abs(v).max())


def test_fp8_page_scale_grows_and_requantizes():
  """A later, larger token in the same page raises the page scale; earlier tokens keep
  their values (re-encoded), nothing saturates."""
  cfg = SMOLLM2_135M.replace(num_layers=1)
  pool = allocate_pool(cfg, "fp8", num_pages=2, page_size=4)
  small = np.full((1, 1, 3, 64), 0.5, np.float32)
  big = np.full((1, 1, 3, 64), 40.0, np.float32)
  pool = write_tokens(pool, small, small, np.array([0]), np.array([0]))
  pool = write_tokens(pool, big, big, np.array([0]), np.array([1]))
  kk, _ = gather_pages(pool, 0, jnp.array([[0]], jnp.int32))
  kk = np.asarray(kk).transpose(1, 2, 0, 3)[0]
  np.testing.assert_allclose(kk[0], 0.5, rtol=0.07)
  np.testing.assert_allclose(kk[1], 40.0, rtol=0.07)


@pytest.mark.parametrize("fmt", ["f32", "fp8", "q4_0"])
def test_host_tier_offload_and_fetch_round_trip(fmt):
  """JaxExecutor's host tier moves pages out and back in one batched call each, bit for
  bit, to other device pages; pages not named are untouched."""
  import jax
  from jaxinfer.config import SMOLLM2_135M
  from jaxinfer.executors.jax_executor import JaxExecutor
  cfg = SMOLLM2_135M.replace(num_layers=2)
  ex = JaxExecutor(cfg, None, num_pages=8, page_size=4, kv_format=fmt)
  rng = np.random.default_rng(0)
  ex.pool = jax.device_put({k: rng.integers(0, 255, a.shape).astype(a.dtype)
                            for k, a in ex.pool.items()})
  before = {k: np.asarray(a) for k, a in ex.pool.items()}
  ex.offload_pages([(1, 10), (5, 11), (6, 12)])
  ex.fetch_pages([(10, 7), (11, 0), (12, 2)])
  after = {k: np.asarray(a) for k, a in ex.pool.items()}
  for k in before:
    for src, dst in ((1, 7), (5, 0), (6, 2)):
      np.testing.assert_array_equal(after[k][:, :, dst], before[k][:, :, src])
    for p in (1, 3, 4, 5, 6):
      np.testing.assert_array_equal(after[k][:, :, p], before[k][:, :, p])
  assert not ex.host_pages
