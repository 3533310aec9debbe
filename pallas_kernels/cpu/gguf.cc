// Weight matmul over GGUF block-quantized weights for XLA:CPU, as an XLA FFI custom call
// (see block_codec.py / gguf.py): y[M, N] = x[M, K] . W[N, K]^T with W kept in the file's
// own blocks of 32 values along K (chapter 8.4.1), never as a float32 copy.
//
//   q4_1: 16 code bytes per block (byte j holds value j in its low nibble and value j+16
//         in its high nibble) and a (d, m) pair per block: w = d * q + m
//   q8_0: 32 signed code bytes per block and a scale d per block: w = d * q
//
// The scales are the file's own fp16 values (read as float32 exactly), so each weight here
// equals the dequantized float32 weight bit for bit (d * q is exact in float32); only the
// order of the sums differs from a float32 matmul.
//
// Work items are (block of up to 32 x rows, 32 weight rows), taken from a shared counter
// by the caller and helpers (native_items.h's RunItems). Paths, chosen
// per item: on AVX-512 (checked at run time) up to 64 x rows, in groups of 8, multiply
// each block as soon as it is decoded in registers (RowsFused512); with AVX2 only, 1-2 x
// rows do the same at 8 lanes (RowsFused); otherwise (or fused=false) panels of 4 weight
// rows are decoded into an L1 buffer and a 2 x 4 register tile of sums runs over K.
// The weights may carry a leading layer axis ([L, N, ...]) with the layer passed as an
// operand, so a scanned model reads layer i in place (no slice copy).
//
// xq8=true multiplies in integers instead, as llama.cpp does on CPUs: each x row is first
// quantized per block of 32 (d = max|x| / 127, q = round-to-nearest-even(x / d), and
// s = d * sum(q) for q4_1's offset term), then per block and weight row
//   y += d_w * d_x * sum_j(q_w,j * q_x,j)  (+ m_w * s_x for q4_1)
// with the integer sums exact (AVX-512 VNNI / AVX-VNNI dot products, or AVX2's
// maddubs + madd, or scalar); block_codec.reference(activations="q8") is its oracle. The
// products then differ from the float32 ones by x's rounding (about 0.4% of a block's
// largest |x|), and cost a fraction of the float path's instructions per weight.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "native_items.h"

#if defined(__x86_64__)
#include <immintrin.h>  // AVX2 code needs -mavx2; the AVX-512 functions carry their target
#endif

namespace ffi = xla::ffi;

namespace {

enum Format : int32_t { kQ4_1 = 0, kQ8_0 = 1 };
constexpr int kBlock = 32;
constexpr int kPanel = 4;     // weight rows decoded together
constexpr int kRowsPerItem = 32;  // weight rows per work item (8 panels)
constexpr int kFused512 = 64;  // x rows up to which the AVX-512 path decodes in registers
constexpr int kXBlock = 32;    // x rows per work item: 32 x 1536 f32 = 192 KiB (L2)
constexpr int kMinParallelItems = 8;  // fewer items run on the calling thread alone

typedef float V8 __attribute__((vector_size(32), aligned(4)));
inline V8 Load(const float* p) { return *reinterpret_cast<const V8*>(p); }
inline float Sum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// An fp16 scale as float32 (exact).
inline float H(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (f << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (f << 13);
  } else if (f == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    uint32_t m = f;
    while (!(m & 0x400)) { m <<= 1; ++shift; }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

struct Args {
  const float* x;
  const uint8_t* codes;    // this layer's [N, K * bits / 8]
  const uint16_t* scales;  // this layer's [N, K / 32, S] fp16
  float* y;
  int64_t M, N, K, row_bytes, row_scales;
  Format fmt;
  int64_t x_blocks, row_items;
  bool fused;  // false: the panel path only (tests cover it on any CPU)
  // xq8: x quantized per block (QuantizeX): codes [M, nb * 32] (q4_1: each pair of blocks
  // as [b0 0-15 | b1 0-15 | b0 16-31 | b1 16-31], the pair's nibble order; an odd last
  // block and q8_0 in their natural order), per block d and s, and per pair of blocks
  // those two spread over 8 lanes in the order the pair's integer sums come out (xde,
  // xse: s / 4 per lane, four lanes to a block)
  bool xq8 = false;
  const int8_t* xq = nullptr;
  const float *xd = nullptr, *xs = nullptr, *xde = nullptr, *xse = nullptr;
};

// Lane l of a pair's 8 integer sums belongs to block (2p + kLaneBlock[fmt][l]).
constexpr int kLaneBlock[2][8] = {{0, 0, 0, 0, 1, 1, 1, 1},   // q4_1: one dpbusd per half
                                  {0, 0, 1, 1, 0, 0, 1, 1}};  // q8_0: hadd of two blocks

struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> d, s, de, se;
};

// Quantizes x's rows per block into xq (the layout above) and points a's fields at it.
void QuantizeX(Args& a, XQuant& xq) {
  const int64_t nb = a.K / kBlock, np = (nb + 1) / 2;
  xq.q.assign(a.M * nb * kBlock, 0);
  xq.d.assign(a.M * nb, 0.f);
  xq.s.assign(a.M * nb, 0.f);
  xq.de.assign(a.M * np * 8, 0.f);
  xq.se.assign(a.M * np * 8, 0.f);
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = a.x + m * a.K + b * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* out = xq.q.data() + m * nb * kBlock;
      const bool paired = a.fmt == kQ4_1 && (b / 2) * 2 + 1 < nb;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int q = static_cast<int>(std::nearbyint(x[j] * id));
        sum += q;
        const int64_t at = paired ? (b / 2) * 64 + (j < 16 ? 0 : 32) + 16 * (b % 2) + (j & 15)
                                  : b * kBlock + j;
        out[at] = static_cast<int8_t>(q);
      }
      xq.d[m * nb + b] = d;
      xq.s[m * nb + b] = d * static_cast<float>(sum);
    }
    for (int64_t p = 0; p < np; ++p)
      for (int l = 0; l < 8; ++l) {
        const int64_t b = std::min<int64_t>(2 * p + kLaneBlock[a.fmt][l], nb - 1);
        xq.de[(m * np + p) * 8 + l] = xq.d[m * nb + b];
        xq.se[(m * np + p) * 8 + l] = 0.25f * xq.s[m * nb + b];
      }
  }
  a.xq = xq.q.data();
  a.xd = xq.d.data();
  a.xs = xq.s.data();
  a.xde = xq.de.data();
  a.xse = xq.se.data();
}

// Block b's value j of x row m (quantized), wherever the layout put it.
inline int XqAt(const Args& a, int64_t m, int64_t b, int j) {
  const int64_t nb = a.K / kBlock;
  const bool paired = a.fmt == kQ4_1 && (b / 2) * 2 + 1 < nb;
  const int64_t at = paired ? (b / 2) * 64 + (j < 16 ? 0 : 32) + 16 * (b % 2) + (j & 15)
                            : b * kBlock + j;
  return a.xq[m * nb * kBlock + at];
}

// One block's term of y[m, n] in integers (the portable path, and odd last blocks).
inline float BlockInt(const Args& a, int64_t n, int64_t m, int64_t b) {
  const uint8_t* c = a.codes + n * a.row_bytes;
  const uint16_t* s = a.scales + n * a.row_scales;
  const int64_t nb = a.K / kBlock;
  int32_t sum = 0;
  if (a.fmt == kQ4_1) {
    for (int j = 0; j < 16; ++j) {
      sum += (c[16 * b + j] & 15) * XqAt(a, m, b, j);
      sum += (c[16 * b + j] >> 4) * XqAt(a, m, b, j + 16);
    }
    return H(s[2 * b]) * a.xd[m * nb + b] * static_cast<float>(sum) +
           H(s[2 * b + 1]) * a.xs[m * nb + b];
  }
  const int8_t* q = reinterpret_cast<const int8_t*>(c) + kBlock * b;
  for (int j = 0; j < kBlock; ++j) sum += q[j] * XqAt(a, m, b, j);
  return H(s[b]) * a.xd[m * nb + b] * static_cast<float>(sum);
}

void RowsIntPortable(const Args& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const int64_t nb = a.K / kBlock;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float y = 0.f;
      for (int64_t b = 0; b < nb; ++b) y += BlockInt(a, n, m, b);
      a.y[m * a.N + n] = y;
    }
}

// Decodes weight row n into out[K].
void DecodeRow(const Args& a, int64_t n, float* out) {
  const uint8_t* c = a.codes + n * a.row_bytes;
  const uint16_t* s = a.scales + n * a.row_scales;
  const int64_t nb = a.K / kBlock;
  if (a.fmt == kQ4_1) {
    for (int64_t b = 0; b < nb; ++b, c += 16, out += kBlock) {
      const float d = H(s[2 * b]), m = H(s[2 * b + 1]);
#if defined(__AVX2__) && defined(__FMA__)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
      const __m128i mask = _mm_set1_epi8(0x0f);
      const __m128i lo = _mm_and_si128(raw, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
      const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
      auto put = [&](__m128i bytes, float* dst) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(q, vd, vm));
      };
      put(lo, out);
      put(_mm_srli_si128(lo, 8), out + 8);
      put(hi, out + 16);
      put(_mm_srli_si128(hi, 8), out + 24);
#else
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>(c[j] & 15) + m;
        out[j + 16] = d * static_cast<float>(c[j] >> 4) + m;
      }
#endif
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(c);
    for (int64_t b = 0; b < nb; ++b, q += kBlock, out += kBlock) {
      const float d = H(s[b]);
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 vd = _mm256_set1_ps(d);
      for (int j = 0; j < kBlock; j += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j));
        _mm256_storeu_ps(out + j,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd));
      }
#else
      for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j]);
#endif
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// One or two x rows (MM): each weight row is decoded in registers and used at once, with
// no store of the decoded row (the panel path's stores and reloads cost more than the
// sums when only one or two rows use them). Accumulators: one per 8 lanes of a block and
// per x row, so the FMA chains stay independent.
template <int MM>
void RowsFused(const Args& a, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t nb = a.K / kBlock;
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = a.codes + n * a.row_bytes;
    const uint16_t* s = a.scales + n * a.row_scales;
    __m256 acc[MM][4];
    for (int m = 0; m < MM; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      if (a.fmt == kQ4_1) {
        const __m256 vd = _mm256_set1_ps(H(s[2 * b])), vm = _mm256_set1_ps(H(s[2 * b + 1]));
        const __m128i r0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 16 * b));
        const __m128i r1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 16 * b + 8));
        const __m128i q[4] = {_mm_and_si128(r0, mask), _mm_and_si128(r1, mask),
                              _mm_and_si128(_mm_srli_epi16(r0, 4), mask),
                              _mm_and_si128(_mm_srli_epi16(r1, 4), mask)};
        for (int j = 0; j < 4; ++j)
          w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j])), vd, vm);
      } else {
        const __m256 vd = _mm256_set1_ps(H(s[b]));
        const uint8_t* qb = c + kBlock * b;
        for (int j = 0; j < 4; ++j) {
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j));
          w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
        }
      }
      for (int m = 0; m < MM; ++m) {
        const float* x = a.x + (m0 + m) * a.K + kBlock * b;
        for (int j = 0; j < 4; ++j)
          acc[m][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[m][j]);
      }
    }
    for (int m = 0; m < MM; ++m) {
      const __m256 t = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                     _mm256_add_ps(acc[m][2], acc[m][3]));
      V8 v;
      std::memcpy(&v, &t, sizeof(v));
      a.y[(m0 + m) * a.N + n] = Sum(v);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Four u8 x s8 products summed into each int32 lane (exact: |sum| < 2^15 per pair).
inline __m256i Dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}


constexpr int64_t kAheadBytes = 8192;

inline float HSum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// MM quantized x rows against RR weight rows at a time, a pair of blocks per step: the
// integer sums of the pair land in 8 lanes (kLaneBlock), scaled by d_w * d_x per lane
// (and q4_1's m_w * s_x / 4 added per lane) into float accumulators.
template <Format F, int MM, int RR>
void RowsInt(const Args& a, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t nb = a.K / kBlock, np = nb / 2, npx = (nb + 1) / 2, xstride = nb * kBlock;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i idx_d = F == kQ4_1 ? _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)
                                   : _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
  const __m256i idx_m = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
  // the codes and scales of the rows kAheadBytes further on, asked for while these run: a
  // call reads each weight once, and the hardware's prefetchers alone left it at half the
  // machine's read bandwidth (docs/design.md)
  const int64_t ahead_rows = (kAheadBytes + a.row_bytes - 1) / a.row_bytes;
  const int64_t ahead = ahead_rows * a.row_bytes, ahead_s = ahead_rows * a.row_scales;
  int64_t n = n0;
  for (; n + RR <= n1; n += RR) {
    __m256 acc[RR][MM];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; ++p) {
      __m256i wa[RR], wb[RR];
      __m256 wd[RR], wm[RR];
      for (int r = 0; r < RR; ++r) {
        const uint8_t* c = a.codes + (n + r) * a.row_bytes;
        const uint16_t* sc = a.scales + (n + r) * a.row_scales;
        // (a prefetch past the weights' end is harmless: prefetches never fault)
        const char* pc = reinterpret_cast<const char*>(c + ahead + (F == kQ4_1 ? 32 : 64) * p);
        _mm_prefetch(pc, _MM_HINT_T0);
        if (F == kQ8_0) _mm_prefetch(pc + 32, _MM_HINT_T0);
        if ((p & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(sc + ahead_s + (F == kQ4_1 ? 4 : 2) * p),
                       _MM_HINT_T0);
        if (F == kQ4_1) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p));
          wa[r] = _mm256_and_si256(raw, mask);
          wb[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          const __m256 sv = _mm256_castps128_ps256(
              _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 4 * p))));
          wd[r] = _mm256_permutevar8x32_ps(sv, idx_d);
          wm[r] = _mm256_permutevar8x32_ps(sv, idx_m);
        } else {
          wa[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p));
          wb[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p + 32));
          int32_t pair;
          std::memcpy(&pair, sc + 2 * p, sizeof(pair));
          const __m256 sv = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(pair)));
          wd[r] = _mm256_permutevar8x32_ps(sv, idx_d);
        }
      }
      for (int m = 0; m < MM; ++m) {
        const int8_t* xq = a.xq + (m0 + m) * xstride + 64 * p;
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        const __m256 de = _mm256_loadu_ps(a.xde + ((m0 + m) * npx + p) * 8);
        if (F == kQ4_1) {
          const __m256 se = _mm256_loadu_ps(a.xse + ((m0 + m) * npx + p) * 8);
          for (int r = 0; r < RR; ++r) {
            const __m256i i = Dot4(Dot4(_mm256_setzero_si256(), wa[r], xa), wb[r], xb);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(wd[r], de),
                                        acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(wm[r], se, acc[r][m]);
          }
        } else {
          for (int r = 0; r < RR; ++r) {
            const __m256i i0 = Dot4(_mm256_setzero_si256(), _mm256_abs_epi8(wa[r]),
                                    _mm256_sign_epi8(xa, wa[r]));
            const __m256i i1 = Dot4(_mm256_setzero_si256(), _mm256_abs_epi8(wb[r]),
                                    _mm256_sign_epi8(xb, wb[r]));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(i0, i1)),
                                        _mm256_mul_ps(wd[r], de), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m) {
        float y = HSum(acc[r][m]);
        if (nb & 1) y += BlockInt(a, n + r, m0 + m, nb - 1);
        a.y[(m0 + m) * a.N + n + r] = y;
      }
  }
  if (n < n1) RowsInt<F, MM, 1>(a, n, n1, m0);
}

// x rows g.. g + mm (mm <= 4) against weight rows n0..n1 in integers.
template <Format F>
void Int(const Args& a, int64_t n0, int64_t n1, int64_t g, int64_t mm) {
  switch (mm) {
    case 1: RowsInt<F, 1, 4>(a, n0, n1, g); break;
    case 2: RowsInt<F, 2, 2>(a, n0, n1, g); break;
    case 3: RowsInt<F, 3, 2>(a, n0, n1, g); break;
    default: RowsInt<F, 4, 2>(a, n0, n1, g); break;
  }
}
#endif

#if defined(__x86_64__)
// The same with 16 lanes where the CPU has AVX-512 (checked at run time; the library is
// built for AVX2): a block is two vectors. RR weight rows at a time share each x load
// and keep 2 * RR * MM independent FMA chains (one chain per block stalls on the FMA's
// latency: measured 12.7 vs 14.7+ Gw/s at one x row).
#define JX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

template <Format F>
JX_AVX512 inline void DecodeBlock512(const uint8_t* c, const uint16_t* s, int64_t b, __m512 iota,
                                     __m512* w0, __m512* w1) {
  if (F == kQ4_1) {
    // the block's 16 possible weights d * j + m in one register, looked up by nibble:
    // vpermps reads only an index's low 4 bits, so byte i widened to lane i indexes its
    // low nibble, and the same shifted right by 4 its high nibble (d * j + m rounds once,
    // as the float32 dequantization does)
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(H(s[2 * b])),
                                         _mm512_set1_ps(H(s[2 * b + 1])));
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * b)));
    *w0 = _mm512_permutexvar_ps(bytes, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const __m512 vd = _mm512_set1_ps(H(s[b]));
    const __m128i* qb = reinterpret_cast<const __m128i*>(c + kBlock * b);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb))), vd);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1))),
                        vd);
  }
}

template <Format F, int MM, int RR>
JX_AVX512 void RowsFused512(const Args& a, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t nb = a.K / kBlock;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = n0;
  for (; n + RR <= n1; n += RR) {
    __m512 acc[RR][MM][2];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w0[RR], w1[RR];
      for (int r = 0; r < RR; ++r)
        DecodeBlock512<F>(a.codes + (n + r) * a.row_bytes, a.scales + (n + r) * a.row_scales,
                          b, iota, &w0[r], &w1[r]);
      for (int m = 0; m < MM; ++m) {
        const float* x = a.x + (m0 + m) * a.K + kBlock * b;
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        for (int r = 0; r < RR; ++r) {
          acc[r][m][0] = _mm512_fmadd_ps(w0[r], x0, acc[r][m][0]);
          acc[r][m][1] = _mm512_fmadd_ps(w1[r], x1, acc[r][m][1]);
        }
      }
    }
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m)
        a.y[(m0 + m) * a.N + n + r] =
            _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
  }
  if (n < n1) RowsFused512<F, MM, 1>(a, n, n1, m0);
}

// x rows g.. g + mm (mm <= 8) against weight rows n0..n1.
template <Format F>
void Fused512(const Args& a, int64_t n0, int64_t n1, int64_t g, int64_t mm) {
  switch (mm) {
    case 1: RowsFused512<F, 1, 4>(a, n0, n1, g); break;
    case 2: RowsFused512<F, 2, 2>(a, n0, n1, g); break;
    case 3: RowsFused512<F, 3, 2>(a, n0, n1, g); break;
    case 4: RowsFused512<F, 4, 2>(a, n0, n1, g); break;
    case 5: RowsFused512<F, 5, 2>(a, n0, n1, g); break;
    case 6: RowsFused512<F, 6, 2>(a, n0, n1, g); break;
    case 7: RowsFused512<F, 7, 1>(a, n0, n1, g); break;
    default: RowsFused512<F, 8, 1>(a, n0, n1, g); break;
  }
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
#endif

// y rows m0..m1 of a 4-column panel from the decoded rows w[4][K]; row m of the panel's
// output starts at y + (m - m0) * ldy.
void Panel(const Args& a, const float* w, float* y, int64_t ldy, int64_t m0, int64_t m1) {
  const int64_t K = a.K;
  const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  int64_t m = m0;
  for (; m + 2 <= m1; m += 2) {
    const float* x0 = a.x + m * K;
    const float* x1 = x0 + K;
    V8 s00 = {}, s01 = {}, s02 = {}, s03 = {}, s10 = {}, s11 = {}, s12 = {}, s13 = {};
    for (int64_t k = 0; k < K; k += 8) {
      const V8 a0 = Load(x0 + k), a1 = Load(x1 + k);
      const V8 b0 = Load(w0 + k), b1 = Load(w1 + k), b2 = Load(w2 + k), b3 = Load(w3 + k);
      s00 += a0 * b0; s01 += a0 * b1; s02 += a0 * b2; s03 += a0 * b3;
      s10 += a1 * b0; s11 += a1 * b1; s12 += a1 * b2; s13 += a1 * b3;
    }
    float* y0 = y + (m - m0) * ldy;
    float* y1 = y0 + ldy;
    y0[0] = Sum(s00); y0[1] = Sum(s01); y0[2] = Sum(s02); y0[3] = Sum(s03);
    y1[0] = Sum(s10); y1[1] = Sum(s11); y1[2] = Sum(s12); y1[3] = Sum(s13);
  }
  if (m < m1) {
    const float* x0 = a.x + m * K;
    V8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int64_t k = 0; k < K; k += 8) {
      const V8 a0 = Load(x0 + k);
      s0 += a0 * Load(w0 + k); s1 += a0 * Load(w1 + k);
      s2 += a0 * Load(w2 + k); s3 += a0 * Load(w3 + k);
    }
    float* y0 = y + (m - m0) * ldy;
    y0[0] = Sum(s0); y0[1] = Sum(s1); y0[2] = Sum(s2); y0[3] = Sum(s3);
  }
}

void Item(const Args& a, int64_t item, std::vector<float>& buf) {
  const int64_t xb = item % a.x_blocks, rb = item / a.x_blocks;
  const int64_t m0 = xb * kXBlock, m1 = std::min<int64_t>(a.M, m0 + kXBlock);
  const int64_t n_end = std::min<int64_t>(a.N, (rb + 1) * kRowsPerItem);
  if (a.xq8) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t g = m0; g < m1; g += 4) {
      const int64_t mm = std::min<int64_t>(4, m1 - g);
      if (a.fmt == kQ4_1) {
        Int<kQ4_1>(a, rb * kRowsPerItem, n_end, g, mm);
      } else {
        Int<kQ8_0>(a, rb * kRowsPerItem, n_end, g, mm);
      }
    }
#else
    RowsIntPortable(a, rb * kRowsPerItem, n_end, m0, m1);
#endif
    return;
  }
#if defined(__x86_64__)
  if (a.fused && kHasAvx512 && m1 - m0 <= kFused512) {
    // groups of up to 8 x rows; each group decodes the item's weight rows again
    for (int64_t g = m0; g < m1; g += 8) {
      const int64_t mm = std::min<int64_t>(8, m1 - g);
      if (a.fmt == kQ4_1) {
        Fused512<kQ4_1>(a, rb * kRowsPerItem, n_end, g, mm);
      } else {
        Fused512<kQ8_0>(a, rb * kRowsPerItem, n_end, g, mm);
      }
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (a.fused && m1 - m0 <= 2) {
    if (m1 - m0 == 1) {
      RowsFused<1>(a, rb * kRowsPerItem, n_end, m0);
    } else {
      RowsFused<2>(a, rb * kRowsPerItem, n_end, m0);
    }
    return;
  }
#endif
  buf.resize(kPanel * a.K);
  for (int64_t n0 = rb * kRowsPerItem; n0 < n_end; n0 += kPanel) {
    for (int r = 0; r < kPanel; ++r) {
      if (n0 + r < a.N) {
        DecodeRow(a, n0 + r, buf.data() + r * a.K);
      } else {
        std::memset(buf.data() + r * a.K, 0, sizeof(float) * a.K);
      }
    }
    if (n0 + kPanel <= a.N) {
      Panel(a, buf.data(), a.y + m0 * a.N + n0, a.N, m0, m1);
    } else {  // the last rows of N (N % 4 != 0): into a scratch panel, copied in part
      std::vector<float> tmp(kPanel * (m1 - m0));
      Panel(a, buf.data(), tmp.data(), kPanel, m0, m1);
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t r = 0; n0 + r < a.N; ++r) a.y[m * a.N + n0 + r] = tmp[(m - m0) * kPanel + r];
    }
  }
}

struct Shared {
  Args args;
  XQuant xquant;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(Shared* sh) {
  thread_local std::vector<float> buf;
  for (;;) {
    const int64_t i = sh->next.fetch_add(1);
    if (i >= sh->items) return;
    Item(sh->args, i, buf);
    sh->done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                      ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::S32> layer,
                      ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t fmt,
                      int64_t min_parallel_macs, bool fused, bool xq8) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto sd = scales.dimensions();
  if (xd.size() != 2 || (cd.size() != 2 && cd.size() != 3) || sd.size() != cd.size() + 1)
    return ffi::Error::InvalidArgument("block matmul: x [M, K], codes [(L,) N, C], scales "
                                       "[(L,) N, K/32, S] expected");
  if (fmt != kQ4_1 && fmt != kQ8_0)
    return ffi::Error::InvalidArgument("block matmul: fmt must be 0 (q4_1) or 1 (q8_0)");
  auto sh = std::make_shared<Shared>();
  Args& a = sh->args;
  a.fmt = static_cast<Format>(fmt);
  a.fused = fused;
  a.M = xd[0];
  a.K = xd[1];
  const bool stacked = cd.size() == 3;
  const int64_t L = stacked ? cd[0] : 1;
  a.N = cd[stacked ? 1 : 0];
  a.row_bytes = cd[stacked ? 2 : 1];
  const int64_t per = a.fmt == kQ4_1 ? 2 : 1;
  a.row_scales = sd[sd.size() - 2] * sd[sd.size() - 1];
  if (a.K % kBlock || a.row_bytes * (a.fmt == kQ4_1 ? 2 : 1) != a.K ||
      sd[sd.size() - 2] != a.K / kBlock || sd[sd.size() - 1] != per)
    return ffi::Error::InvalidArgument("block matmul: codes / scales do not match K");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("block matmul: layer outside L");
  a.codes = static_cast<const uint8_t*>(codes.untyped_data()) + l * a.N * a.row_bytes;
  a.scales = static_cast<const uint16_t*>(scales.untyped_data()) + l * a.N * a.row_scales;
  a.x = x.typed_data();
  a.y = y->typed_data();
  a.x_blocks = (a.M + kXBlock - 1) / kXBlock;
  a.row_items = (a.N + kRowsPerItem - 1) / kRowsPerItem;
  sh->items = a.x_blocks * a.row_items;
  if (a.M == 0 || a.N == 0) return ffi::Error::Success();
  a.xq8 = xq8;

  if (xq8) QuantizeX(a, sh->xquant);
  // Few items (K and V projections: 192 rows = 6 items) split unevenly between threads,
  // so small calls stay on the calling thread (gguf.py's MIN_PARALLEL_MACS).
  const bool parallel = a.M * a.N * a.K >= min_parallel_macs && sh->items >= kMinParallelItems;
  jaxinfer::RunItems(pool, sh, sh->items, parallel, a.M, Drain);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferBlockMatmul, MatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
        .Arg<ffi::AnyBuffer>()          // codes [(L,) N, K/2 (q4_1) or K (q8_0)] uint8/int8
        .Arg<ffi::Buffer<ffi::F16>>()   // scales [(L,) N, K/32, 2 (q4_1) or 1 (q8_0)] fp16
        .Arg<ffi::Buffer<ffi::S32>>()   // layer []
        .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
        .Attr<int32_t>("fmt")
        .Attr<int64_t>("min_parallel_macs")
        .Attr<bool>("fused")
        .Attr<bool>("xq8"));
