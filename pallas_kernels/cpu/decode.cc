// Paged decode attention for XLA:CPU, as an XLA FFI custom call (see decode.py; the
// pool's rows are read by kv_rows.h, the softmax's exp is fast_exp.h's).
//
// One new token per request slot: for each (slot r, KV head k) the G = N / K query rows
// of that head start the online softmax with the slot's own new token, then read its
// cached tokens page by page straight from the pool (no gathered copy). Only
// tokens below cached_len are read, so stale data in a page's tail or in unused page-table
// entries is never touched. Every KV format of kv_codec.py is decoded row by row in
// registers' reach: f32, bf16 (uint16 bits), fp8 e4m3fn (uint8 bits, a float32 scale per
// page and head), q8_0 and q4_0 (GGML blocks of 32 values with an fp16 scale). Under a
// sliding window only the keys after cached_len - window are read (from the page holding
// the first: pages wholly behind it may have been released); scores may be soft-capped.
//
// Work items (slot, head) are taken from a shared counter by the calling thread and by
// helpers (native_items.h's RunItems); the caller waits only for items that were taken,
// so a helper that never starts cannot stall the call.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "native_items.h"
#include "fast_exp.h"
#include "kv_rows.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxinfer;  // NOLINT: kv_rows.h's Pool, V8 and formats

constexpr int kMaxH = 256;
constexpr int kMaxG = 16;
constexpr int64_t kMinSplitTokens = 512;  // context tokens per split-K part, at least
constexpr int64_t kMaxSplits = 8;
// Tokens per online-softmax chunk: the K pass scores this many tokens (their K rows read
// as one stream), then the V pass reads their V rows (another stream). Long chunks switch
// between the two streams rarely; the size was chosen by step times (docs/design.md).
constexpr int64_t kChunkTokens = 1024;
// How far ahead, in tokens, a K or V page's rows are asked into L2 besides the next page's
// into L1 (Pool::PrefetchRows): the next page alone left a thread reading pages well below
// the machine's rate, above all in a shuffled order. On AMD CPUs only (native_items.h's
// IsAmd); the distance was chosen by step times (docs/design.md).
constexpr int64_t kDeepTokens = 64;
// Vector registers the compiler may use (AVX-512VL gives 8-float vectors 32 of them).
#ifdef __AVX512VL__
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif

// An unaligned vector load (V8 is declared 4-byte aligned); a memcpy here compiled to two
// 16-byte moves through the stack and a stalled 32-byte reload.
inline V8 Load(const float* p) { return *reinterpret_cast<const V8*>(p); }

inline float Sum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

struct Args {
  const float *q, *k_new, *v_new;
  Pool kp, vp;
  int64_t layer;
  const int32_t *page_table, *cached_len;
  float* out;
  int64_t R, N, K, G, H, pages_per_slot;
  float scale;
  // Split-K over the context (flash-decoding) when there are fewer (slot, head) items
  // than threads can share: each of `splits` parts of a slot's context is an item of its
  // own, leaving (m, l, unnormalised acc) per query row in `part` [R, K, splits, G, H + 2]
  // for the merge after the call's items are done.
  int64_t splits = 1;
  float* part = nullptr;
  int64_t deep = 0;  // pages ahead of the one read whose rows go to L2 (kDeepTokens;
  // 0: none, not IsAmd)
  int64_t window = 0;  // sliding window: keys after cached_len - window only (0: all)
  float softcap = 0;   // scores capped at +-softcap by softcap * tanh(s / softcap) (0: none)
};

// A slot's context length, clipped to its page table (see ItemTokens).
inline int64_t Context(const Args& a, int64_t r) {
  const int64_t e = a.cached_len[r], most = a.pages_per_slot * a.kp.ps;
  return e < 0 ? 0 : (e > most ? most : e);
}

// The first cached token a slot's query reads: cached_len - window + 1 under a sliding
// window (the query sits at cached_len), else 0.
inline int64_t FirstKey(const Args& a, int64_t r) {
  if (a.window <= 0) return 0;
  const int64_t lo = Context(a, r) - a.window + 1;
  return lo < 0 ? 0 : lo;
}

inline float Cap(const Args& a, float x) {
  return a.softcap > 0 ? a.softcap * std::tanh(x / a.softcap) : x;
}

// An item's context tokens [*tb, *n): the slot's whole context, or one split-K part of it
// in whole pages. Out-of-range metadata is clipped, as XLA's gathers do, rather than read
// out of bounds (common.validate_values checks it only when the values are concrete; under
// jit a bad table must not fault the process).
inline void ItemTokens(const Args& a, int64_t r, int64_t split, int64_t* tb, int64_t* n) {
  const int64_t ps = a.kp.ps;
  int64_t e = Context(a, r);
  // from the page holding the first key the window reads (the tokens before it on that
  // page are masked in Attend): pages wholly behind the window are never read, and may
  // have been released
  int64_t b = FirstKey(a, r) / ps * ps;
  if (a.splits > 1) {
    const int64_t lo = b;
    const int64_t chunk = ((e - lo + a.splits - 1) / a.splits + ps - 1) / ps * ps;
    b = lo + split * chunk < e ? lo + split * chunk : e;
    e = b + chunk < e ? b + chunk : e;
  }
  *tb = b;
  *n = e;
}

inline int64_t PageAt(const Args& a, int64_t r, int64_t t) {
  const int64_t page = a.page_table[r * a.pages_per_slot + t / a.kp.ps];
  return a.kp.ClampPage(page);
}

// A page's first rows to prefetch: the next page of an item, or the first page of the item
// a thread runs next.
struct Ahead {
  int64_t lk = 0, page = 0, cnt = 0;
  int64_t r = -1, tb = 0, n = 0;  // the item: its slot (-1: none) and tokens [tb, n)
};

// The first page of item (r, k, split), for the thread that will run it.
inline Ahead FirstPage(const Args& a, int64_t r, int64_t k, int64_t split) {
  int64_t tb, n;
  ItemTokens(a, r, split, &tb, &n);
  Ahead h;
  if (n > tb) {
    h.lk = a.layer * a.K + k;
    h.page = PageAt(a, r, tb);
    h.cnt = n - tb < a.kp.ps ? n - tb : a.kp.ps;
    h.r = r;
    h.tb = tb;
    h.n = n;
  }
  return h;
}

// A page further along a thread's reading order, whose rows go to L2 a row per token read.
struct DeepPage {
  const Pool* pool = nullptr;  // null: none
  int64_t lk = 0, page = 0;
};

// The page a.deep pages after page j of the chunk at token c0 of item (r, lk, tokens below
// n), in the K pass (v false) or the V pass, in the order a thread reads pages: a chunk's K
// pages, its V pages, the next chunk's K pages, then `after`'s (the thread's next item), so
// a chunk's first pages are asked for too, not only those within the pass.
inline DeepPage Deep(const Args& a, int64_t r, int64_t lk, int64_t c0, int64_t n, int64_t j,
                     bool v, const Ahead& after) {
  const int64_t ps = a.kp.ps, chunk = ps * (kChunkTokens / ps);
  auto pages = [&](int64_t c, int64_t e) {
    return ((e - c < chunk ? e - c : chunk) + ps - 1) / ps;
  };
  if (a.deep == 0) return {};  // not IsAmd: no look-ahead here
  int64_t t = j + a.deep;
  const int64_t np = pages(c0, n);
  if (!v) {
    if (t < np) return {&a.kp, lk, PageAt(a, r, c0 + t * ps)};
    t -= np;
  }
  if (t < np) return {&a.vp, lk, PageAt(a, r, c0 + t * ps)};
  t -= np;
  if (c0 + chunk < n) {
    if (t < pages(c0 + chunk, n)) return {&a.kp, lk, PageAt(a, r, c0 + chunk + t * ps)};
    return {};
  }
  if (after.r >= 0 && t < pages(after.tb, after.n))
    return {&a.kp, after.lk, PageAt(a, after.r, after.tb + t * ps)};
  return {};
}

// What to prefetch while reading the page of token t0: the item's next page, or `after`.
inline Ahead Next(const Args& a, int64_t r, int64_t lk, int64_t t0, int64_t n, Ahead after) {
  const int64_t ps = a.kp.ps;
  if (t0 + ps >= n) return after;
  Ahead h;
  h.lk = lk;
  h.page = PageAt(a, r, t0 + ps);
  h.cnt = n - t0 - ps < ps ? n - t0 - ps : ps;
  return h;
}

// Column vectors per block of the V pass: the most that divide a row's `vectors` and keep
// the G x CB accumulators, CB V vectors and a weight in `regs` vector registers (one spilled
// accumulator made every token wait on a store and its reload); 1 where the shape is not
// known. SmolLM2 (8 8-float vectors a row, G = 3): 2 with AVX2's 16 registers, 4 with
// AVX-512's 32. AVX-512F builds take 16-float vectors where the shape is known: SmolLM2
// all 4 at once, Qwen3-8B (8 a row, G = 4) 2 blocks of 4.
constexpr int64_t ColumnBlock(int vectors, int g, int regs = kVecRegs) {
  int64_t cb = 1;
  for (int64_t c = 1; vectors && g && c <= vectors && (g + 1) * c + 1 <= regs; ++c)
    if (vectors % c == 0) cb = c;
  return cb;
}

// One (slot, KV head): G query rows over the slot's cached tokens and its own new token.
// HV = H / 8 and GG = G when known at compile time (SmolLM2: 8 and 3, Qwen3-8B: 16 and 4;
// the accumulators then stay in registers), 0 for any other shape.
template <int HV, int GG>
void Attend(const Args& a, int64_t r, int64_t k, int64_t split, bool first_fetched,
            Ahead after) {
  const int64_t G = GG ? GG : a.G, ps = a.kp.ps;
  const int64_t hv = HV ? HV : a.H / 8;
  V8 q[kMaxG][kMaxH / 8], acc[kMaxG][kMaxH / 8];
  alignas(64) float kbuf[kMaxH];
  alignas(64) float vpage[64 * kMaxH];  // a page's decoded V rows
#if defined(__AVX2__) && defined(__FMA__)
  alignas(64) float kbuf4[4][kMaxH];  // the four-token path's decoded K rows
#endif
  float m[kMaxG], l[kMaxG];
  float* s[kMaxG];  // the chunk's scores, then its softmax weights, per query row
  {
    thread_local std::vector<float> scores;
    if (scores.size() < static_cast<size_t>(G * kChunkTokens)) scores.resize(G * kChunkTokens);
    for (int64_t g = 0; g < G; ++g) s[g] = scores.data() + g * kChunkTokens;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = a.q + (r * a.N + k * G + g) * a.H;
    for (int64_t c = 0; c < hv; ++c) q[g][c] = Load(qg + 8 * c) * a.scale;
  }
  // The slot's own token starts the online softmax: m = its score, l = 1, acc = its V.
  const float* kn = a.k_new + (r * a.K + k) * a.H;
  const float* vn = a.v_new + (r * a.K + k) * a.H;
  for (int64_t g = 0; g < G; ++g) {
    if (split > 0) {  // a later part of the context: an empty softmax state
      m[g] = -INFINITY;
      l[g] = 0.0f;
      for (int64_t c = 0; c < hv; ++c) acc[g][c] = V8{0, 0, 0, 0, 0, 0, 0, 0};
      continue;
    }
    V8 d = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t c = 0; c < hv; ++c) {
      d += q[g][c] * Load(kn + 8 * c);
      acc[g][c] = Load(vn + 8 * c);
    }
    m[g] = Cap(a, Sum(d));
    l[g] = 1.0f;
  }
  int64_t tb, n;
  ItemTokens(a, r, split, &tb, &n);
  const int64_t lk = a.layer * a.K + k;
  if (n > tb && !first_fetched) {  // nothing ran before to overlap the first page with
    const int64_t cnt0 = n - tb < ps ? n - tb : ps;
    a.kp.PrefetchRows(lk, PageAt(a, r, tb), 0, cnt0);
  } else if (n <= tb && after.cnt > 0) {  // no page here: the next item's, as promised
    a.kp.PrefetchRows(after.lk, after.page, 0, after.cnt);
  }
  // Tokens are taken a chunk of whole pages at a time (kChunkTokens): one online-softmax
  // update and rescale per chunk.
  const int64_t chunk = ps * (kChunkTokens / ps);
  for (int64_t c0 = tb; c0 < n; c0 += chunk) {
    const int64_t cn = n - c0 < chunk ? n - c0 : chunk;
    float mb[kMaxG];
    for (int64_t g = 0; g < G; ++g) mb[g] = m[g];
    for (int64_t p0 = 0; p0 < cn; p0 += ps) {
      const int64_t page = PageAt(a, r, c0 + p0);
      const int64_t cnt = cn - p0 < ps ? cn - p0 : ps;
      // the next page's K rows (or, on the last page, the first page of the thread's next
      // item) during this page's scores; V rows are asked for a page ahead in the V pass
      // (asking for both here, V then read a chunk later, was slower)
      const Ahead nx = Next(a, r, lk, c0 + p0, n, after);
      const DeepPage dp = Deep(a, r, lk, c0, n, p0 / ps, false, after);
      const int64_t cnt_next = nx.cnt;
      const float ks = a.kp.PageScale(lk, page);  // fp8: folded into q (Row leaves it out)
      V8 qs[kMaxG][kMaxH / 8];
      const V8(*qq)[kMaxH / 8] = q;
      if (ks != 1.0f) {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < hv; ++c) qs[g][c] = q[g][c] * ks;
        qq = qs;
      }
      int64_t o = 0;
#if defined(__AVX2__) && defined(__FMA__)
      // Four tokens at a time: 4 G independent FMA chains instead of G (one token's chains
      // are H / 8 FMAs long, each waiting on the last), and their scores reduced together
      // by horizontal adds (four tokens' sums in five instructions).
      for (; o + 4 <= cnt; o += 4) {
        if (o < cnt_next) {
          a.kp.PrefetchRows(nx.lk, nx.page, o, o + 4 < cnt_next ? o + 4 : cnt_next);
        }
        if (dp.pool) dp.pool->PrefetchRows<2>(dp.lk, dp.page, o, o + 4);
        const float* kr[4];
        for (int t = 0; t < 4; ++t) kr[t] = a.kp.Row(lk, page, o + t, kbuf4[t]);
        __m256 d[kMaxG][4];
        for (int64_t g = 0; g < G; ++g)
          for (int t = 0; t < 4; ++t) d[g][t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < hv; ++c) {
          __m256 kc[4];
          for (int t = 0; t < 4; ++t) kc[t] = _mm256_loadu_ps(kr[t] + 8 * c);
          for (int64_t g = 0; g < G; ++g) {
            // V8 is declared 4-byte aligned: an unaligned load, not an __m256 reference
            const __m256 qc = _mm256_loadu_ps(reinterpret_cast<const float*>(&qq[g][c]));
            for (int t = 0; t < 4; ++t) d[g][t] = _mm256_fmadd_ps(qc, kc[t], d[g][t]);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(d[g][0], d[g][1]),
                                          _mm256_hadd_ps(d[g][2], d[g][3]));
          const __m128 sc = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
          _mm_storeu_ps(&s[g][p0 + o], sc);
          for (int t = 0; t < 4; ++t) mb[g] = s[g][p0 + o + t] > mb[g] ? s[g][p0 + o + t] : mb[g];
        }
      }
#endif
      for (; o < cnt; ++o) {
        if (o < cnt_next) {
          a.kp.PrefetchRows(nx.lk, nx.page, o, o + 1);
        }
        if (dp.pool) dp.pool->PrefetchRows<2>(dp.lk, dp.page, o, o + 1);
        const float* kr = a.kp.Row(lk, page, o, kbuf);
        V8 d[kMaxG];
        for (int64_t g = 0; g < G; ++g) d[g] = V8{0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t c = 0; c < hv; ++c) {
          const V8 kc = Load(kr + 8 * c);
          for (int64_t g = 0; g < G; ++g) d[g] += qq[g][c] * kc;
        }
        for (int64_t g = 0; g < G; ++g) {
          const float x = Sum(d[g]);
          s[g][p0 + o] = x;
          mb[g] = x > mb[g] ? x : mb[g];
        }
      }
    }
    if (a.window > 0 || a.softcap > 0) {
      // capped scores, and the keys before the window's first one on its page dropped
      // (their weight underflows to FastExp's floor; their V rows are real tokens)
      const int64_t lo = FirstKey(a, r);
      for (int64_t g = 0; g < G; ++g) {
        float mx = m[g];
        for (int64_t i = 0; i < cn; ++i) {
          const float x = c0 + i < lo ? -1e30f : Cap(a, s[g][i]);
          s[g][i] = x;
          mx = x > mx ? x : mx;
        }
        mb[g] = mx;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float alpha = FastExp(m[g] - mb[g]);
      m[g] = mb[g];
      l[g] = l[g] * alpha + ExpShifted(s[g], cn, mb[g]);
      if (alpha != 1.0f)
        for (int64_t c = 0; c < hv; ++c) acc[g][c] *= alpha;
    }
    for (int64_t p0 = 0; p0 < cn; p0 += ps) {
      const int64_t page = PageAt(a, r, c0 + p0);
      const int64_t cnt = cn - p0 < ps ? cn - p0 : ps;
      // The page's V rows (decoded into vpage unless f32), then acc += s V a block of CB
      // column vectors at a time, tokens innermost: G x CB accumulators stay in registers.
      // The chunk's next page of V rows is asked for a row per token during the first
      // column block (the whole page at once stalled on the line-fill buffers).
      const int64_t vnext = p0 + ps < cn ? PageAt(a, r, c0 + p0 + ps) : 0;
      const DeepPage vdp = Deep(a, r, lk, c0, n, p0 / ps, true, after);
      const int64_t vcnt = p0 + ps < cn ? (cn - p0 - ps < ps ? cn - p0 - ps : ps) : 0;
      const float* vr[64];
      for (int64_t o = 0; o < cnt; ++o) vr[o] = a.vp.Row(lk, page, o, vpage + o * kMaxH);
      const float vs = a.vp.PageScale(lk, page);  // fp8: folded into the weights
      // acc += s V a block of NB vectors of W floats at a time, tokens innermost
      auto v_blocks = [&](auto width, auto nb) {
        constexpr int W = decltype(width)::value;
        constexpr int64_t NB = decltype(nb)::value;
        using VW = Vecs<W>;
        for (int64_t b = 0; b < hv * 8 / W; b += NB) {
          typename VW::T ac[kMaxG][NB];
          float* accg[kMaxG];
          for (int64_t g = 0; g < G; ++g) {
            accg[g] = reinterpret_cast<float*>(&acc[g][0]) + W * b;
            for (int64_t j = 0; j < NB; ++j) ac[g][j] = VW::Load(accg[g] + W * j);
          }
          const int64_t vpf = b == 0 ? vcnt : 0;
          for (int64_t o = 0; o < cnt; ++o) {
            if (o < vpf) a.vp.PrefetchRows(lk, vnext, o, o + 1);
            if (b == 0 && vdp.pool) vdp.pool->PrefetchRows<2>(vdp.lk, vdp.page, o, o + 1);
            typename VW::T vc[NB];
            for (int64_t j = 0; j < NB; ++j) vc[j] = VW::Load(vr[o] + W * (b + j));
            for (int64_t g = 0; g < G; ++g) {
              const float sw = s[g][p0 + o] * vs;
              for (int64_t j = 0; j < NB; ++j) ac[g][j] += sw * vc[j];
            }
          }
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < NB; ++j) VW::Store(accg[g] + W * j, ac[g][j]);
        }
      };
#if defined(__AVX512F__)
      // 16-float vectors: SmolLM2's V rows in one pass, not two. Alternated steps, Intel VM:
      // batch 16 / 4096 f32 261.2 -> 237.7 ms (259.4 -> 257.0 in the other order), bf16 223.0
      // -> 212.7, bf16 16 / 1024 82.7 -> 72.2; one thread (tools/attend_harness.cc) 5-9%.
      if constexpr (HV > 0 && HV % 2 == 0 && GG > 0) {
        v_blocks(std::integral_constant<int, 16>{},
                 std::integral_constant<int64_t, ColumnBlock(HV / 2, GG, 32)>{});
        continue;
      }
#endif
      v_blocks(std::integral_constant<int, 8>{},
               std::integral_constant<int64_t, ColumnBlock(HV, GG)>{});
    }
  }
  if (a.splits > 1) {
    for (int64_t g = 0; g < G; ++g) {
      float* pg = a.part + (((r * a.K + k) * a.splits + split) * G + g) * (a.H + 2);
      pg[0] = m[g];
      pg[1] = l[g];
      for (int64_t c = 0; c < hv; ++c)
        for (int j = 0; j < 8; ++j) pg[2 + 8 * c + j] = acc[g][c][j];
    }
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* og = a.out + (r * a.N + k * G + g) * a.H;
    const float inv = 1.0f / l[g];
    for (int64_t c = 0; c < hv; ++c) {
      *reinterpret_cast<V8*>(og + 8 * c) = acc[g][c] * inv;
    }
  }
}

using AttendFn = void (*)(const Args&, int64_t, int64_t, int64_t, bool, Ahead);

// out = the parts' softmax states combined: m = max m_s, l = sum l_s e^(m_s - m), acc alike.
void Merge(const Args& a) {
  for (int64_t r = 0; r < a.R; ++r)
    for (int64_t q = 0; q < a.N; ++q) {
      const int64_t k = q / a.G, g = q % a.G;
      const float* p0 = a.part + ((r * a.K + k) * a.splits * a.G + g) * (a.H + 2);
      const int64_t stride = a.G * (a.H + 2);
      float m = -INFINITY;
      for (int64_t s = 0; s < a.splits; ++s) m = p0[s * stride] > m ? p0[s * stride] : m;
      float* o = a.out + (r * a.N + q) * a.H;
      for (int64_t h = 0; h < a.H; ++h) o[h] = 0.0f;
      float l = 0.0f;
      for (int64_t s = 0; s < a.splits; ++s) {
        const float* ps = p0 + s * stride;
        if (ps[1] == 0.0f) continue;  // an empty part (past the slot's context)
        const float w = std::exp(ps[0] - m);
        l += ps[1] * w;
        for (int64_t h = 0; h < a.H; ++h) o[h] += ps[2 + h] * w;
      }
      const float inv = 1.0f / l;
      for (int64_t h = 0; h < a.H; ++h) o[h] *= inv;
    }
}

template <int HV>
AttendFn ForG(int64_t G) {
  switch (G) {
    case 1: return &Attend<HV, 1>;
    case 2: return &Attend<HV, 2>;
    case 3: return &Attend<HV, 3>;
    case 4: return &Attend<HV, 4>;
    case 5: return &Attend<HV, 5>;
    case 6: return &Attend<HV, 6>;
    case 7: return &Attend<HV, 7>;
    case 8: return &Attend<HV, 8>;
    default: return &Attend<HV, 0>;
  }
}

AttendFn Select(int64_t H, int64_t G) {
  if (H == 64) return ForG<8>(G);
  if (H == 128) return ForG<16>(G);
  return &Attend<0, 0>;
}

struct Shared {
  Args args;
  AttendFn fn;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Each thread claims its next item before running the current one (DrainAhead), so that
// the next item's first pages are fetched during the current item's last.
void Drain(Shared* sh) {
  const Args& a = sh->args;
  bool fetched = false;
  jaxinfer::DrainAhead(sh, sh->items, [&](int64_t i, int64_t j) {
    Ahead after;
    if (j >= 0) {
      const int64_t rkj = j / a.splits;
      after = FirstPage(a, rkj / a.K, rkj % a.K, j % a.splits);
    }
    const int64_t rk = i / a.splits;
    sh->fn(a, rk / a.K, rk % a.K, i % a.splits, fetched, after);
    fetched = after.cnt > 0;
  });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                      ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                      ffi::AnyBuffer k_codes, ffi::AnyBuffer v_codes,
                      ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                      ffi::Buffer<ffi::S32> cached_len, ffi::Buffer<ffi::S32> window,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t fmt, float scale,
                      float softcap, int64_t min_parallel_tokens) {
  const auto qd = q.dimensions();
  const auto cd = k_codes.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || page_table.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cpu paged decode: q [R,N,H], pool [L,K,P,ps,Hc], "
                                       "page_table [R,P] expected");
  auto sh = std::make_shared<Shared>();
  Args& a = sh->args;
  a.R = qd[0];
  a.N = qd[1];
  a.H = qd[2];
  a.K = cd[1];
  if (a.K < 1 || a.N % a.K)
    return ffi::Error::InvalidArgument("cpu paged decode: query heads must be a multiple of "
                                       "the pool's KV heads");
  a.G = a.N / a.K;
  if (a.H > kMaxH || a.H % 8 || a.G > kMaxG || cd[3] > 64)
    return ffi::Error::InvalidArgument("cpu paged decode: head_dim a multiple of 8 up to 256, "
                                       "query heads per KV head <= 16, page_size <= 64");
  const int64_t L = cd[0];
  a.layer = layer.typed_data()[0];
  if (a.layer < 0 || a.layer >= L)
    return ffi::Error::InvalidArgument("cpu paged decode: layer outside the pool");
  a.q = q.typed_data();
  a.k_new = k_new.typed_data();
  a.v_new = v_new.typed_data();
  a.page_table = page_table.typed_data();
  a.pages_per_slot = page_table.dimensions()[1];
  a.cached_len = cached_len.typed_data();
  a.out = out->typed_data();
  a.scale = scale;
  a.window = window.typed_data()[0];
  a.softcap = softcap;
  a.kp = PoolOf(fmt, k_codes, k_scales, a.H);
  a.vp = PoolOf(fmt, v_codes, v_scales, a.H);
  sh->fn = Select(a.H, a.G);
  a.deep = IsAmd() ? std::max<int64_t>(2, kDeepTokens / a.kp.ps) : 0;

  // the work is the tokens each slot reads: under a window, its span only
  int64_t tokens = 0, longest = 0;
  for (int64_t r = 0; r < a.R; ++r) {
    const int64_t span = Context(a, r) - FirstKey(a, r) / a.kp.ps * a.kp.ps;
    tokens += span;
    longest = span > longest ? span : longest;
  }
  const bool parallel = tokens * a.K >= min_parallel_tokens;
  std::vector<float> part;
  if (parallel && a.R * a.K < 2 * (pool.num_threads() + 1) && longest >= 2 * kMinSplitTokens) {
    a.splits = std::min<int64_t>(kMaxSplits, longest / kMinSplitTokens);
    part.resize(a.R * a.K * a.splits * a.G * (a.H + 2));
    a.part = part.data();
  }
  sh->items = a.R * a.K * a.splits;
  jaxinfer::RunItems(pool, sh, sh->items, parallel, a.R, Drain);
  if (a.splits > 1) Merge(a);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferPagedDecode, DecodeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q [R, N, H]
        .Arg<ffi::Buffer<ffi::F32>>()   // k_new [R, K, H]
        .Arg<ffi::Buffer<ffi::F32>>()   // v_new [R, K, H]
        .Arg<ffi::AnyBuffer>()          // k codes [L, K, P, ps, Hc]
        .Arg<ffi::AnyBuffer>()          // v codes
        .Arg<ffi::AnyBuffer>()          // k scales (or a 1-element placeholder)
        .Arg<ffi::AnyBuffer>()          // v scales
        .Arg<ffi::Buffer<ffi::S32>>()   // layer []
        .Arg<ffi::Buffer<ffi::S32>>()   // page_table [R, pages]
        .Arg<ffi::Buffer<ffi::S32>>()   // cached_len [R]
        .Arg<ffi::Buffer<ffi::S32>>()   // window [] (0: none; may vary by layer at run time)
        .Ret<ffi::Buffer<ffi::F32>>()   // out [R, N, H]
        .Attr<int32_t>("fmt")
        .Attr<float>("scale")
        .Attr<float>("softcap")         // 0: none
        .Attr<int64_t>("min_parallel_tokens"));
