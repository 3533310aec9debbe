// Prefill attention for XLA:CPU, as an XLA FFI custom call (see prefill.py): slots of up
// to Q new tokens each, every query attending its slot's cached tokens (read from the
// pool's pages by kv_rows.h, every KV format) and its slot's new tokens causally up to
// itself (8.2.2's chunked prefill: a chunk after cached pages of its own prompt).
//
// Work items are (slot, KV head, chunk of kQueryChunk queries). An item copies the keys
// its queries read into a transposed block (K^T [H, keys]) and their values into rows
// (V [keys, H]), then takes its G x queries rows six at a time: scores for 64 keys at once
// are six broadcast query values times four 16-key vectors of K^T per head dimension (24
// accumulators, as panels.cc's matmul), an online softmax per row over the 64 keys, and
// the weighted values six broadcast weights times four 16-dimension vectors of V per key.
// Scores and weights stay in registers and one small buffer per six rows, where the
// XLA-op form (paged_attention/xla.py) writes each chunk's scores, masks and weights to
// memory between fusions (docs/design.md has the step times).
//
// Rows past a slot's query_len are written as zeros (the caller drops them). Metadata out
// of range is clipped, as decode.cc does, rather than read out of bounds.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "fast_exp.h"
#include "kv_rows.h"
#include "native_items.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxinfer;  // NOLINT: kv_rows.h's Pool and formats

constexpr int64_t kQueryChunk = 64;  // queries per work item
constexpr int64_t kKeys = 64;        // keys per score block (four 16-float vectors)
constexpr int kRows = 6;             // query rows per pass
constexpr int64_t kMaxH = 256;

struct Args {
  const float *q, *k_new, *v_new;
  Pool kp, vp;
  int64_t layer;
  const int32_t *page_table, *query_start, *query_len, *cached_len;
  float* out;  // [R, Q, N, H]
  int64_t R, Q, T, N, K, G, H, pages_per_slot, chunks;
  float scale;
};

#if defined(__AVX512F__)
// Rows [r0, r0 + MR) of an item: scores against keys [0, limit[m]) each, online softmax,
// weighted values; o[m] <- the rows' outputs (normalised).
template <int MR>
void Rows(const Args& a, const float* qs, const float* kt, const float* vr, int64_t keys_pad,
          const int64_t* limit, float* const* o) {
  const int64_t H = a.H;
  alignas(64) float s[kRows][kKeys];
  alignas(64) float acc[kRows][kMaxH];
  float m[kRows], l[kRows];
  int64_t most = 0;
  for (int r = 0; r < MR; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    most = std::max(most, limit[r]);
    for (int64_t h = 0; h < H; ++h) acc[r][h] = 0.0f;
  }
  for (int64_t kb = 0; kb < most; kb += kKeys) {
    {  // s = q . K^T for keys [kb, kb + 64)
      __m512 d[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) d[r][j] = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; ++h) {
        const float* row = kt + h * keys_pad + kb;
        __m512 kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(row + 16 * j);
        for (int r = 0; r < MR; ++r) {
          const __m512 b = _mm512_set1_ps(qs[r * H + h]);
          for (int j = 0; j < 4; ++j) d[r][j] = _mm512_fmadd_ps(b, kv[j], d[r][j]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&s[r][16 * j], d[r][j]);
    }
    int64_t used = 0;  // keys of this block any row reads
    for (int r = 0; r < MR; ++r) {
      const int64_t n = std::min<int64_t>(kKeys, limit[r] - kb);
      if (n <= 0) {  // this row's keys ended before the block
        for (int64_t t = 0; t < kKeys; ++t) s[r][t] = 0.0f;
        continue;
      }
      used = std::max(used, n);
      // the block's keys past n masked to -inf (their weights then 0), 16 at a time
      __m512 v[4], mv = _mm512_set1_ps(m[r]);
      __mmask16 keep[4];
      for (int j = 0; j < 4; ++j) {
        const int64_t left = n - 16 * j;
        keep[j] = left >= 16 ? 0xffff : (left <= 0 ? 0 : (1u << left) - 1);
        v[j] = _mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), keep[j], &s[r][16 * j]);
        mv = _mm512_max_ps(mv, v[j]);
      }
      const float mx = _mm512_reduce_max_ps(mv);
      const float alpha = FastExp(m[r] - mx);
      m[r] = mx;
      __m512 sum = _mm512_setzero_ps();
      const __m512 vmx = _mm512_set1_ps(mx);
      for (int j = 0; j < 4; ++j) {
        const __m512 p = _mm512_maskz_mov_ps(keep[j], Exp16(_mm512_sub_ps(v[j], vmx)));
        _mm512_store_ps(&s[r][16 * j], p);
        sum = _mm512_add_ps(sum, p);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      if (alpha != 1.0f) {
        const __m512 a = _mm512_set1_ps(alpha);
        for (int64_t h = 0; h < H; h += 16)
          _mm512_store_ps(&acc[r][h], _mm512_mul_ps(a, _mm512_load_ps(&acc[r][h])));
      }
    }
    // acc += s V, 64 dimensions at a time (4 vectors per row in registers)
    for (int64_t h0 = 0; h0 < H; h0 += 64) {
      __m512 c[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) c[r][j] = _mm512_load_ps(&acc[r][h0 + 16 * j]);
      for (int64_t t = 0; t < used; ++t) {
        const float* v = vr + (kb + t) * H + h0;
        __m512 vv[4];
        for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
        for (int r = 0; r < MR; ++r) {
          const __m512 w = _mm512_set1_ps(s[r][t]);
          for (int j = 0; j < 4; ++j) c[r][j] = _mm512_fmadd_ps(w, vv[j], c[r][j]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&acc[r][h0 + 16 * j], c[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t h = 0; h < H; ++h) o[r][h] = acc[r][h] * inv;
  }
}

// One item: slot r, KV head k, queries [c * kQueryChunk, ...) of the slot.
void Item(const Args& a, int64_t item) {
  const int64_t c = item % a.chunks, rk = item / a.chunks;
  const int64_t r = rk / a.K, k = rk % a.K;
  const int64_t H = a.H, G = a.G, ps = a.kp.ps;
  const int64_t qs = std::clamp<int64_t>(a.query_start[r], 0, a.T);
  const int64_t ql = std::clamp<int64_t>(a.query_len[r], 0, std::min(a.Q, a.T - qs));
  const int64_t cl = std::clamp<int64_t>(a.cached_len[r], 0, a.pages_per_slot * ps);
  const int64_t i0 = c * kQueryChunk, i1 = std::min(a.Q, i0 + kQueryChunk);
  const int64_t iv = std::min(i1, ql);  // the item's real queries: [i0, iv)
  auto out_row = [&](int64_t i, int64_t g) {
    return a.out + ((r * a.Q + i) * a.N + k * G + g) * H;
  };
  for (int64_t i = std::max(i0, iv); i < i1; ++i)  // padding rows
    for (int64_t g = 0; g < G; ++g) std::fill(out_row(i, g), out_row(i, g) + H, 0.0f);
  if (i0 >= iv) return;
  // the keys the item's queries read: cached [0, cl), then new [0, iv)
  const int64_t keys = cl + iv;
  const int64_t keys_pad = (keys + kKeys - 1) / kKeys * kKeys;
  thread_local std::vector<float> ktv, vv, qv;
  if (ktv.size() < static_cast<size_t>(H * keys_pad)) ktv.resize(H * keys_pad);
  if (vv.size() < static_cast<size_t>(keys_pad * H)) vv.resize(keys_pad * H);
  if (qv.size() < static_cast<size_t>(kQueryChunk * G * H)) qv.resize(kQueryChunk * G * H);
  float* kt = ktv.data();
  float* vr = vv.data();
  alignas(64) float kbuf[kMaxH], vbuf[kMaxH];
  const int64_t lk = a.layer * a.K + k;
  auto put = [&](int64_t t, const float* krow, float ks, const float* vrow, float vs) {
    for (int64_t h = 0; h < H; ++h) kt[h * keys_pad + t] = krow[h] * ks;
    float* v = vr + t * H;
    for (int64_t h = 0; h < H; ++h) v[h] = vrow[h] * vs;
  };
  for (int64_t t = 0; t < cl; ++t) {
    const int64_t page = a.kp.ClampPage(a.page_table[r * a.pages_per_slot + t / ps]);
    put(t, a.kp.Row(lk, page, t % ps, kbuf), a.kp.PageScale(lk, page),
        a.vp.Row(lk, page, t % ps, vbuf), a.vp.PageScale(lk, page));
  }
  for (int64_t j = 0; j < iv; ++j)
    put(cl + j, a.k_new + ((qs + j) * a.K + k) * H, 1.0f, a.v_new + ((qs + j) * a.K + k) * H,
        1.0f);
  for (int64_t t = keys; t < keys_pad; ++t) {  // never read, zeroed: no stale NaN
    for (int64_t h = 0; h < H; ++h) kt[h * keys_pad + t] = 0.0f;
    std::fill(vr + t * H, vr + (t + 1) * H, 0.0f);
  }
  // rows (query i, head g), i-major, scaled
  const int64_t rows = (iv - i0) * G;
  float* qs_rows = qv.data();
  for (int64_t i = i0; i < iv; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + ((qs + i) * a.N + k * G + g) * H;
      float* dst = qs_rows + ((i - i0) * G + g) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * a.scale;
    }
  for (int64_t x = 0; x < rows; x += kRows) {
    const int64_t n = std::min<int64_t>(kRows, rows - x);
    int64_t limit[kRows];
    float* o[kRows];
    for (int64_t y = 0; y < n; ++y) {
      const int64_t i = i0 + (x + y) / G;
      limit[y] = cl + i + 1;
      o[y] = out_row(i, (x + y) % G);
    }
    const float* qx = qs_rows + x * H;
    switch (n) {
      case 1: Rows<1>(a, qx, kt, vr, keys_pad, limit, o); break;
      case 2: Rows<2>(a, qx, kt, vr, keys_pad, limit, o); break;
      case 3: Rows<3>(a, qx, kt, vr, keys_pad, limit, o); break;
      case 4: Rows<4>(a, qx, kt, vr, keys_pad, limit, o); break;
      case 5: Rows<5>(a, qx, kt, vr, keys_pad, limit, o); break;
      default: Rows<6>(a, qx, kt, vr, keys_pad, limit, o); break;
    }
  }
}

struct Shared {
  Args args;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The chunks of a (slot, head) last to first: the longest (causal) first.
void Drain(Shared* sh) {
  const int64_t chunks = sh->args.chunks;
  DrainAhead(sh, sh->items, [sh, chunks](int64_t i, int64_t) {
    Item(sh->args, i / chunks * chunks + (chunks - 1 - i % chunks));
  });
}
#endif  // __AVX512F__

ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                       ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                       ffi::AnyBuffer k_codes, ffi::AnyBuffer v_codes,
                       ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                       ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> query_len,
                       ffi::Buffer<ffi::S32> cached_len,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t fmt, float scale) {
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512f"))
    return ffi::Error::Internal("cpu prefill attention: this CPU lacks AVX-512F");
  const auto qd = q.dimensions();
  const auto cd = k_codes.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 3 || cd.size() != 5 || page_table.dimensions().size() != 2 ||
      od.size() != 4)
    return ffi::Error::InvalidArgument("cpu prefill attention: q [T,N,H], pool "
                                       "[L,K,P,ps,Hc], page_table [R,P], out [R,Q,N,H] "
                                       "expected");
  auto sh = std::make_shared<Shared>();
  Args& a = sh->args;
  a.T = qd[0];
  a.N = qd[1];
  a.H = qd[2];
  a.K = cd[1];
  a.R = od[0];
  a.Q = od[1];
  if (a.K < 1 || a.N % a.K || a.H % 64 || a.H > kMaxH || cd[3] > 64 ||
      page_table.dimensions()[0] != a.R)
    return ffi::Error::InvalidArgument("cpu prefill attention: query heads a multiple of "
                                       "the KV heads, head_dim a multiple of 64 up to 256, "
                                       "page_size <= 64");
  a.G = a.N / a.K;
  const int64_t L = cd[0];
  a.layer = layer.typed_data()[0];
  if (a.layer < 0 || a.layer >= L)
    return ffi::Error::InvalidArgument("cpu prefill attention: layer outside the pool");
  a.q = q.typed_data();
  a.k_new = k_new.typed_data();
  a.v_new = v_new.typed_data();
  a.page_table = page_table.typed_data();
  a.pages_per_slot = page_table.dimensions()[1];
  a.query_start = query_start.typed_data();
  a.query_len = query_len.typed_data();
  a.cached_len = cached_len.typed_data();
  a.out = out->typed_data();
  a.scale = scale;
  a.kp = PoolOf(fmt, k_codes, k_scales, a.H);
  a.vp = PoolOf(fmt, v_codes, v_scales, a.H);
  a.chunks = (a.Q + kQueryChunk - 1) / kQueryChunk;
  sh->items = a.R * a.K * a.chunks;
  if (sh->items == 0) return ffi::Error::Success();
  RunItems(pool, sh, sh->items, sh->items > 1, a.Q, Drain);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("cpu prefill attention: built without AVX-512F");
#endif
}

}  // namespace

extern "C" int JaxinferPrefillAvailable() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferPrefillAttention, PrefillImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q [T, N, H]
        .Arg<ffi::Buffer<ffi::F32>>()   // k_new [T, K, H]
        .Arg<ffi::Buffer<ffi::F32>>()   // v_new [T, K, H]
        .Arg<ffi::AnyBuffer>()          // k codes [L, K, P, ps, Hc]
        .Arg<ffi::AnyBuffer>()          // v codes
        .Arg<ffi::AnyBuffer>()          // k scales (or a 1-element placeholder)
        .Arg<ffi::AnyBuffer>()          // v scales
        .Arg<ffi::Buffer<ffi::S32>>()   // layer []
        .Arg<ffi::Buffer<ffi::S32>>()   // page_table [R, pages]
        .Arg<ffi::Buffer<ffi::S32>>()   // query_start [R]
        .Arg<ffi::Buffer<ffi::S32>>()   // query_len [R]
        .Arg<ffi::Buffer<ffi::S32>>()   // cached_len [R]
        .Ret<ffi::Buffer<ffi::F32>>()   // out [R, Q, N, H]
        .Attr<int32_t>("fmt")
        .Attr<float>("scale"));
