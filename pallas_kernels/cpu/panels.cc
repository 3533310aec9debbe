// float32 weight matmul on AVX-512 (or AVX2 + FMA) for XLA:CPU, as an XLA FFI custom
// call (see panels.py): y[M, N] = x[M, K] . W[K, N], with W held in column panels and
// read where it lies (a leading layer axis and a layer operand, as gguf.cc): a
// scanned model never copies a layer's slice out of the stack, as XLA:CPU does for its
// own dot.
//
// Panel layout of W [K, N] (panels.pack): [N / 16, K, 16], i.e. each block of 16 output
// columns is one contiguous stream of K rows of 16 floats (one zmm register each).
//
// Work items are groups of up to four column blocks (64 columns), with their rows split in
// two for calls of many rows and few groups (native_items.h's RowsPerItem). Per item, x
// rows go in passes of up to six: each k loads the group's four W vectors once and
// multiplies them by six broadcast x values into 24 accumulators (4 + 1 + 24 of the 32 zmm
// registers); the passes after the first fetch the thread's next item's weights into L2
// (SixRowPassesAhead). Items are shared by the caller and helpers (RunItems, DrainAhead).
//
// Calls of 13-24 rows (a decode step of 16 requests) take each item's K in blocks of
// kBlockK instead (Blocked): every pass of the block reads its weights from L1, the
// accumulators are stored after each block and loaded again for the next, and while the
// passes run, the next block's weight lines (or the thread's next item's first block) are
// asked for, spread over their K steps, so that an item's memory reads overlap its FMAs
// rather than only the next item's (docs/design.md has the step times).
//
// Without AVX-512 (AVX2 + FMA: 16 ymm registers), a pass covers one panel at a time: its
// 16 columns are two ymm vectors, times six broadcast x values into 12 accumulators
// (2 + 1 + 12 of 16); the group's panels run one after another over the same x rows.
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"
#include "native_items.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define JX_HAVE_512 1
#define JX_512 __attribute__((target("avx512f,fma")))
#define JX_256 __attribute__((target("avx2,fma")))
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 16;   // a panel's width: one zmm of float32
constexpr int64_t kGroup = 4;   // panels per work item
constexpr int64_t kMinParallelItems = 4;
constexpr int64_t kBlockK = 128;  // Blocked's K block: 4 panels' 32 KB of weights in L1
constexpr int64_t kBlockedMinRows = 13, kBlockedMaxRows = 24;  // calls Blocked serves

#ifdef JX_HAVE_512
const bool kAvx512 = __builtin_cpu_supports("avx512f");
const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");

struct Args {
  const float* x;  // [M, K]
  const float* w;  // this layer's [N / 16, K, 16]
  float* y;        // [M, N]
  int64_t M, N, K;
  jaxinfer::GroupItems it;  // groups of kGroup panels, rows split by RowsPerItem
};

// Up to four panels' weight streams, asked for a line at a time round robin, `per_k`
// lines per Step.
struct StreamsAhead {
  const char* p[kGroup] = {};
  int64_t streams = 0, lines = 0, i = 0, per_k = 0;
  inline void Step() {
    for (int64_t t = 0; t < per_k && i < streams * lines; ++t, ++i)
      __builtin_prefetch(p[i % streams] + 64 * (i / streams), 0, 2);
  }
};

// MR rows x NB panels over k in [k0, k1), the accumulators starting from y (`load`) or 0;
// pf.Step() once per k (a WeightsAhead or StreamsAhead).
template <int MR, int NB, typename Ahead>
JX_512 void BlockPass(const Args& a, int64_t m0, int64_t j0, int64_t k0, int64_t k1, bool load,
                      Ahead& pf) {
  __m512 acc[MR][NB];
  float* y = a.y + m0 * a.N + j0 * kCols;
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j)
      acc[m][j] = load ? _mm512_loadu_ps(y + m * a.N + j * kCols) : _mm512_setzero_ps();
  const float* w = a.w + j0 * a.K * kCols;
  const int64_t stride = a.K * kCols;
  const float* x = a.x + m0 * a.K;
  for (int64_t k = k0; k < k1; ++k) {
    pf.Step();
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * stride + k * kCols);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * a.K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(y + m * a.N + j * kCols, acc[m][j]);
}

// Item `item`'s passes, fetching the weights of item `next` (one line per k of a panel)
// meanwhile unless they are this item's.
template <int NB>
void Passes(const Args& a, int64_t item, int64_t next) {
  const int64_t g = a.it.Group(item), gn = a.it.NextGroup(item, next);
  const float* nw = gn < 0 ? nullptr : a.w + gn * kGroup * a.K * kCols;
  const int64_t lines = gn < 0 ? 0 : a.it.Blocks(gn) * a.K;
  jaxinfer::SixRowPassesAhead(a.it.Row0(item), a.it.Rows(item), a.K, nw, lines,
                              [&](auto mr, int64_t m, jaxinfer::WeightsAhead& pf) {
                                BlockPass<mr.value, NB>(a, m, g * kGroup, 0, a.K, false, pf);
                              });
}

// One panel (16 columns) of MR rows on AVX2: two ymm vectors of W per k.
template <int MR>
JX_256 void Pass256(const Args& a, int64_t m0, int64_t j, jaxinfer::WeightsAhead& pf) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* w = a.w + j * a.K * kCols;
  const float* x = a.x + m0 * a.K;
  for (int64_t k = 0; k < a.K; ++k) {
    pf.Step();
    const __m256 w0 = _mm256_loadu_ps(w + k * kCols);
    const __m256 w1 = _mm256_loadu_ps(w + k * kCols + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_set1_ps(x[m * a.K + k]);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(a.y + (m0 + m) * a.N + j * kCols, acc[m][0]);
    _mm256_storeu_ps(a.y + (m0 + m) * a.N + j * kCols + 8, acc[m][1]);
  }
}

void Item256(const Args& a, int64_t item, int64_t next) {
  const int64_t g = a.it.Group(item), gn = a.it.NextGroup(item, next);
  const float* nw = gn < 0 ? nullptr : a.w + gn * kGroup * a.K * kCols;
  const int64_t lines = gn < 0 ? 0 : a.it.Blocks(gn) * a.K;
  const int64_t blocks = a.it.Blocks(g);
  jaxinfer::SixRowPassesAhead(a.it.Row0(item), a.it.Rows(item), a.K, nw, lines,
                              [&](auto mr, int64_t m, jaxinfer::WeightsAhead& pf) {
                                for (int64_t j = 0; j < blocks; ++j)
                                  Pass256<mr.value>(a, m, g * kGroup + j, pf);
                              });
}

// Item `item` in K blocks (see the top of the file); `next`: the thread's next item.
template <int NB>
JX_512 void Blocked(const Args& a, int64_t item, int64_t next) {
  const int64_t g = a.it.Group(item), gn = a.it.NextGroup(item, next);
  const int64_t m0 = a.it.Row0(item), M = a.it.Rows(item), passes = (M + 5) / 6;
  const int64_t stride = a.K * kCols;
  const float* w = a.w + g * kGroup * stride;
  for (int64_t kb = 0; kb < a.K; kb += kBlockK) {
    const int64_t ke = kb + kBlockK < a.K ? kb + kBlockK : a.K;
    StreamsAhead pf;
    if (ke < a.K) {  // this item's next block
      pf.streams = NB;
      for (int j = 0; j < NB; ++j)
        pf.p[j] = reinterpret_cast<const char*>(w + j * stride + ke * kCols);
      pf.lines = (ke + kBlockK < a.K ? ke + kBlockK : a.K) - ke;
    } else if (gn >= 0) {  // the first block of the thread's next item
      pf.streams = a.it.Blocks(gn);
      for (int j = 0; j < pf.streams; ++j)
        pf.p[j] = reinterpret_cast<const char*>(a.w + (gn * kGroup + j) * stride);
      pf.lines = kBlockK < a.K ? kBlockK : a.K;
    }
    const int64_t steps = passes * (ke - kb);
    pf.per_k = (pf.streams * pf.lines + steps - 1) / steps;
    jaxinfer::SixRowPasses(M, [&](auto mr, int64_t m) {
      BlockPass<mr.value, NB>(a, m0 + m, g * kGroup, kb, ke, kb > 0, pf);
    });
  }
}

JX_512 void Item(const Args& a, int64_t item, int64_t next) {
  const int64_t rows = a.it.Rows(item);
  if (rows >= kBlockedMinRows && rows <= kBlockedMaxRows) {
    switch (a.it.Blocks(a.it.Group(item))) {
      case 1: Blocked<1>(a, item, next); return;
      case 2: Blocked<2>(a, item, next); return;
      case 3: Blocked<3>(a, item, next); return;
      default: Blocked<4>(a, item, next); return;
    }
  }
  switch (a.it.Blocks(a.it.Group(item))) {
    case 1: Passes<1>(a, item, next); break;
    case 2: Passes<2>(a, item, next); break;
    case 3: Passes<3>(a, item, next); break;
    default: Passes<4>(a, item, next); break;
  }
}

struct Shared {
  Args args;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(Shared* sh) {
  jaxinfer::DrainAhead(sh, sh->args.it.items(),
                       [sh](int64_t i, int64_t n) {
                         // (no AVX-512 code may run on a CPU without it: chosen here)
                         if (kAvx512) Item(sh->args, i, n); else Item256(sh->args, i, n);
                       });
}
#endif  // JX_HAVE_512

ffi::Error PanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
#ifdef JX_HAVE_512
  if (!kAvx512 && !kAvx2)
    return ffi::Error::Internal("f32 panel matmul: this CPU has neither AVX-512 nor AVX2 "
                                "+ FMA");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || wd[wd.size() - 1] != kCols)
    return ffi::Error::InvalidArgument("f32 panel matmul: x [M, K], w [(L,) N/16, K, 16] "
                                       "expected");
  const bool stacked = wd.size() == 4;
  const int64_t L = stacked ? wd[0] : 1;
  const int64_t blocks = wd[stacked ? 1 : 0];
  auto sh = std::make_shared<Shared>();
  Args& a = sh->args;
  a.M = xd[0];
  a.K = xd[1];
  a.N = blocks * kCols;
  if (wd[stacked ? 2 : 1] != a.K)
    return ffi::Error::InvalidArgument("f32 panel matmul: K of x and w differ");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("f32 panel matmul: layer outside L");
  if (a.M == 0 || a.N == 0) return ffi::Error::Success();
  a.x = x.typed_data();
  a.w = w.typed_data() + l * a.N * a.K;
  a.y = y->typed_data();
  a.it = jaxinfer::GroupItems(blocks, kGroup, a.M, true);
  const int64_t items = a.it.items();
  jaxinfer::RunItems(pool, sh, items, items >= kMinParallelItems, a.M, Drain);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("f32 panel matmul: built for x86-64 only");
#endif
}

}  // namespace

extern "C" int JaxinferPanelsAvailable() {
#ifdef JX_HAVE_512
  return kAvx512 || kAvx2 ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferF32PanelMatmul, PanelsImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
        .Arg<ffi::Buffer<ffi::F32>>()   // w [(L,) N/16, K, 16]
        .Arg<ffi::Buffer<ffi::S32>>()   // layer []
        .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
