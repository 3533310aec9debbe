// KV pool rows for the attention calls (decode.cc, prefill.cc): every format of
// kv_codec.py read as float32, a row at a time, and prefetched ahead of use.
#ifndef JAXINFER_KV_ROWS_H_
#define JAXINFER_KV_ROWS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace jaxinfer {

enum Format : int32_t { kF32 = 0, kBF16 = 1, kFP8 = 2, kQ8_0 = 3, kQ4_0 = 4 };
constexpr int kGroup = 32;

inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction where the target has F16C (x86-64-v3 does)
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    f = std::ldexp(static_cast<float>(man), -24);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (man << 13))
                            : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Eight floats, in whatever vector registers the target has (GCC / Clang extension).
typedef float V8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t V8i __attribute__((vector_size(32), aligned(4)));
typedef uint16_t U16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint8_t U8x8 __attribute__((vector_size(8), aligned(1)));

// Unaligned loads and stores of W-float vectors (decode.cc's V pass, two widths).
template <int W>
struct Vecs;
template <>
struct Vecs<8> {
  using T = V8;
  static T Load(const float* p) { return *reinterpret_cast<const V8*>(p); }
  static void Store(float* p, T v) { *reinterpret_cast<V8*>(p) = v; }
};
#if defined(__AVX512F__)
template <>
struct Vecs<16> {
  using T = __m512;
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, T v) { _mm512_storeu_ps(p, v); }
};
#endif

struct Pool {
  Format fmt;
  const void* codes;       // [L, K, P, ps, Hc]
  const void* scales;      // q8_0 / q4_0: uint16 [L, K, P, ps, H/32]; fp8: float [L, K, P]
  int64_t P, ps, H, Hc;
  int64_t code_bytes;  // bytes per code element

  // Ask for rows [o0, o1) of a page ahead of use: pages lie at random places in the pool,
  // where the hardware prefetcher cannot follow (measured: loads stalled on misses
  // otherwise). The caller spreads a page's rows over the work of the page before, a few
  // lines per token: asking for a whole page at once filled the core's line-fill buffers,
  // and the prefetches then stalled the loop (55% of the kernel's samples sat on them).
  // (Measured again with the column-block V pass, batch 16 / context 4096: without any
  // prefetch within 3-4%, pages in order or shuffled; kept for the batch-64 cells. With
  // 1024-token chunks on the AMD EPYC VM: K a page ahead in the K pass and V a page ahead
  // in the V pass, 3-7% faster than both in the K pass; see decode.cc.)
  // kLocality: __builtin_prefetch's (3: into L1, 2: into L2).
  template <int kLocality = 3>
  void PrefetchRows(int64_t lk, int64_t page, int64_t o0, int64_t o1) const {
    const int64_t row = Hc * code_bytes;
    const char* base = static_cast<const char*>(codes) + ((lk * P + page) * ps + o0) * row;
    for (int64_t off = 0; off < (o1 - o0) * row; off += 64)
      __builtin_prefetch(base + off, 0, kLocality);
  }

  // A page-table entry clipped into the pool, as XLA's gathers clip (a bad table must not
  // make a call read outside its buffers).
  int64_t ClampPage(int64_t page) const { return page < 0 ? 0 : (page >= P ? P - 1 : page); }

  // The factor Row's values of a page lack: the fp8 page scale times 2^8, else 1.
  float PageScale(int64_t lk, int64_t page) const {
    return fmt == kFP8 ? static_cast<const float*>(scales)[lk * P + page] * 256.0f : 1.0f;
  }

  // Row (layer, head, page, slot) decoded to float, times 1 / PageScale; f32 rows are
  // returned in place.
  const float* Row(int64_t lk, int64_t page, int64_t slot, float* buf) const {
    const int64_t row = (lk * P + page) * ps + slot;
    switch (fmt) {
      case kF32:
        return static_cast<const float*>(codes) + row * Hc;
      case kBF16: {
        const uint16_t* c = static_cast<const uint16_t*>(codes) + row * Hc;
        // Eight at a time, stored as vectors: scalar stores read back by the vector loads
        // stall store forwarding (measured: bf16 slower than f32 before).
        for (int64_t h = 0; h < H; h += 8) {
          const V8i bits = __builtin_convertvector(*reinterpret_cast<const U16x8*>(c + h), V8i)
                           << 16;
          *reinterpret_cast<V8*>(buf + h) = reinterpret_cast<const V8&>(bits);
        }
        return buf;
      }
      case kFP8: {
        // e4m3fn moved into an IEEE half (sign in place, exponent and mantissa one bit
        // lower) reads as the value times 2^-8, subnormals included, and F16C widens it:
        // the page scale times 2^8 (PageScale) is applied by the caller, to q for K and to
        // the softmax weights for V. S.1111.111 is NaN: those lanes are set to all ones.
        const uint8_t* c = static_cast<const uint8_t*>(codes) + row * Hc;
#if defined(__AVX2__) && defined(__FMA__)
        const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xbf80));
        const __m128i mag = _mm_set1_epi16(0x3f80);
        for (int64_t h = 0; h < H; h += 8) {
          // sign-extended, << 7: the sign lands on bits 15 and 14, bit 14 is cleared
          const __m128i x = _mm_and_si128(keep, _mm_slli_epi16(_mm_cvtepi8_epi16(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + h))), 7));
          const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, mag), mag);
          _mm256_storeu_ps(buf + h, _mm256_cvtph_ps(_mm_or_si128(x, nan)));
        }
#else
        for (int64_t h = 0; h < H; ++h) {
          const uint32_t u = c[h];
          const uint32_t bits = (u & 0x7fu) == 0x7fu ? 0x7fc00000u
                                                     : ((u & 0x80u) << 24) | ((u & 0x7fu) << 20);
          float x;
          std::memcpy(&x, &bits, 4);
          buf[h] = x * 0x1p112f;  // the value times 2^-8, as above
        }
#endif
        return buf;
      }
      case kQ8_0: {
        const int8_t* c = static_cast<const int8_t*>(codes) + row * Hc;
        const uint16_t* s = static_cast<const uint16_t*>(scales) + row * (H / kGroup);
        for (int64_t g = 0; g < H / kGroup; ++g) {  // (vectorised by the compiler, as fp8)
          const float d = HalfToFloat(s[g]);
          for (int j = 0; j < kGroup; ++j) buf[g * kGroup + j] = c[g * kGroup + j] * d;
        }
        return buf;
      }
      case kQ4_0: {
        const uint8_t* c = static_cast<const uint8_t*>(codes) + row * Hc;
        const uint16_t* s = static_cast<const uint16_t*>(scales) + row * (H / kGroup);
        for (int64_t g = 0; g < H / kGroup; ++g) {
          const float d = HalfToFloat(s[g]);
          const uint8_t* b = c + g * (kGroup / 2);
          for (int j = 0; j < kGroup / 2; j += 8) {  // low nibbles: values j, high: j + 16
            const V8i x = __builtin_convertvector(*reinterpret_cast<const U8x8*>(b + j), V8i);
            *reinterpret_cast<V8*>(buf + g * kGroup + j) =
                __builtin_convertvector((x & 0xf) - 8, V8) * d;
            *reinterpret_cast<V8*>(buf + g * kGroup + j + kGroup / 2) =
                __builtin_convertvector((x >> 4) - 8, V8) * d;
          }
        }
        return buf;
      }
    }
    return buf;
  }
};

// The Pool of a K or V codes buffer [L, K, P, ps, Hc] and its scales, read as H-float
// rows (an XLA FFI AnyBuffer: the attention calls' operands).
template <typename AnyBuffer>
inline Pool PoolOf(int32_t fmt, const AnyBuffer& codes, const AnyBuffer& scales, int64_t H) {
  const auto cd = codes.dimensions();
  Pool p;
  p.fmt = static_cast<Format>(fmt);
  p.P = cd[2];
  p.ps = cd[3];
  p.Hc = cd[4];
  p.H = H;
  const int64_t n = static_cast<int64_t>(codes.element_count());
  p.code_bytes = n > 0 ? static_cast<int64_t>(codes.size_bytes()) / n : 4;
  p.codes = codes.untyped_data();
  p.scales = scales.untyped_data();
  return p;
}

}  // namespace jaxinfer

#endif  // JAXINFER_KV_ROWS_H_
