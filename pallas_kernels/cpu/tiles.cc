// bfloat16 weight matmul for XLA:CPU, as an XLA FFI custom call (see tiles.py):
// y[M, N] = bf16(x)[M, K] . W[K, N], float32 accumulation, with W held in AMX's tile layout
// and read where it lies (a leading layer axis and a layer operand, as gguf.cc: a
// scanned model never copies a layer's slice out). Two engines run the same layout: Intel
// AMX tiles, and AVX512-BF16 dot products (VDPBF16PS) where a CPU has those but no AMX
// (AMD Zen 4, Intel Cooper Lake) and for calls of 1-4 rows on AMX machines.
//
// Tile layout of W [K, N] (tiles.pack): [N / 16, K / 2, 16, 2] bfloat16 bits, i.e. for each
// block of 16 output columns, rows of 16 column pairs (k, k + 1): one 64-byte row of a B tile
// per pair of K, so a B tile (16 rows: 32 values of K for 16 columns) is 1 KiB contiguous,
// and one such row is the second operand of one VDPBF16PS.
//
// x is rounded to bf16 (round to nearest even, as XLA's convert) once per call (AMX: into
// [ceil(M / 16) * 16, K] with zero rows past M). Work items are groups of up to four column
// blocks (64 columns), shared by the caller and helpers (native_items.h's RunItems); the
// dot products split a group's rows in two for calls of many rows and few groups
// (RowsPerItem) and fetch a thread's next item's weights ahead (SixRowPassesAhead).
// AMX: per item, each 16-row block of x runs K in steps of 32: one A tile, then a B tile
// and a TDPBF16PS per column block into four C tiles; each thread loads its
// tile configuration once per call and releases it at the end. Dot products: per item, x
// rows in passes of up to six, each pair of K loading the group's four W rows once for six
// broadcast pairs of x (24 accumulators + 4 + 1 of the 32 zmm registers), as the f32 panel
// matmul (panels.cc) does with FMAs. Both engines flush bf16 subnormals to zero (the
// instructions' own rule).
//
// AMX needs the CPU's AMX-TILE and AMX-BF16 (cpuid) and Linux's permission for the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked for once); the dot products need
// AVX512-BF16. JaxinferTilesAvailable() reports them as bits (2: AMX, 1: dot products), and
// tiles.py keeps XLA's matmul where it says 0.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"
#include "native_items.h"

// AMX intrinsics need GCC 11 / Clang 12 or later; older compilers build the library
// without this path (the call then reports an error and tiles.py never selects it).
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JX_HAVE_AMX 1
#define JX_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define JX_BF16DOT __attribute__((target("avx512f,avx512bf16")))
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 16;        // output columns per block (a C tile's width)
constexpr int64_t kKStep = 32;       // K per tile step (a row of A: 32 bf16 = 64 bytes)
constexpr int64_t kGroup = 4;        // column blocks per work item (four C tiles)
constexpr int64_t kMinParallelItems = 4;
constexpr int64_t kMaxDotRows = 4;   // up to this many rows on AMX machines: dot products

#ifdef JX_HAVE_AMX
bool AskAmx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  if (!tile || !bf16) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

const bool kAmx = AskAmx();

bool AskBf16Dot() {  // AVX512_BF16: cpuid leaf 7, subleaf 1, EAX bit 5
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

const bool kBf16Dot = AskBf16Dot();

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct Args {
  const uint16_t* xb;  // [Mp, K] bf16 bits
  const uint16_t* w;   // this layer's [N / 16, K / 2, 16, 2]
  float* y;            // [M, N]
  int64_t M, Mp, N, K;
  // groups of kGroup column blocks; the dot products split rows (RowsPerItem), AMX items
  // take every row
  jaxinfer::GroupItems it;
};

JX_AMX void Configure() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {  // C0-C3: 16 x 16 f32; A (4), B (5, 6): 16 x 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One 16-row block of x (from row m0) against NB column blocks from block j0.
template <int NB>
JX_AMX void Tile(const Args& a, int64_t m0, int64_t j0, float* tmp) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t xs = a.K * 2, half = a.K / 2;
  const uint16_t* xrow = a.xb + m0 * a.K;
  const uint16_t* w0 = a.w + j0 * half * 32;  // a column block: (K / 2) rows of 32 values
  const int64_t blk = half * 32;
  for (int64_t k = 0; k < a.K; k += kKStep) {
    _tile_loadd(4, xrow + k, xs);
    const uint16_t* b = w0 + (k / 2) * 32;  // 16 rows of 64 bytes from pair k / 2
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) {
      _tile_loadd(6, b + blk, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NB > 2) {
      _tile_loadd(5, b + 2 * blk, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (NB > 3) {
      _tile_loadd(6, b + 3 * blk, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  const int64_t rows = a.M - m0 < 16 ? a.M - m0 : 16;
  float* out = a.y + m0 * a.N + j0 * kCols;
  if (rows == 16) {  // straight into y
    _tile_stored(0, out, a.N * 4);
    if (NB > 1) _tile_stored(1, out + kCols, a.N * 4);
    if (NB > 2) _tile_stored(2, out + 2 * kCols, a.N * 4);
    if (NB > 3) _tile_stored(3, out + 3 * kCols, a.N * 4);
    return;
  }
  _tile_stored(0, tmp, kGroup * kCols * 4);  // the valid rows through a scratch block
  if (NB > 1) _tile_stored(1, tmp + kCols, kGroup * kCols * 4);
  if (NB > 2) _tile_stored(2, tmp + 2 * kCols, kGroup * kCols * 4);
  if (NB > 3) _tile_stored(3, tmp + 3 * kCols, kGroup * kCols * 4);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * a.N, tmp + r * kGroup * kCols, NB * kCols * 4);
}

// The dot-product engine. On AMX machines it takes calls of up to kMaxDotRows rows (decode
// at small batches), where a 16-row A tile would carry mostly padding and the B tiles'
// stream reads slower than this path; elsewhere it takes every call. Each 64-byte row of a
// column block (16 columns, a pair of K each) meets a row's pair of x in one VDPBF16PS;
// the MR x NB accumulators are independent chains.
template <int MR, int NB>
JX_BF16DOT void DotPass(const Args& a, int64_t m0, int64_t j0, jaxinfer::WeightsAhead& pf) {
  const int64_t half = a.K / 2, blk = half * 32;
  const uint16_t* w0 = a.w + j0 * blk;
  __m512 acc[MR][NB];
  const uint32_t* xp[MR];
  for (int m = 0; m < MR; ++m) {
    xp[m] = reinterpret_cast<const uint32_t*>(a.xb + (m0 + m) * a.K);
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < half; ++p) {
    pf.Step();
    __m512i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_si512(w0 + j * blk + p * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512i xa = _mm512_set1_epi32(static_cast<int>(xp[m][p]));
      for (int j = 0; j < NB; ++j)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xa, (__m512bh)b[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j)
      _mm512_storeu_ps(a.y + (m0 + m) * a.N + (j0 + j) * kCols, acc[m][j]);
}

// Item `item`'s passes, fetching the weights of item `next` (a line per pair of K of a
// column block) meanwhile unless they are this item's.
template <int NB>
void DotPasses(const Args& a, int64_t item, int64_t next) {
  const int64_t half = a.K / 2;
  const int64_t g = a.it.Group(item), gn = a.it.NextGroup(item, next);
  const uint16_t* nw = gn < 0 ? nullptr : a.w + gn * kGroup * half * 32;
  const int64_t lines = gn < 0 ? 0 : a.it.Blocks(gn) * half;
  jaxinfer::SixRowPassesAhead(a.it.Row0(item), a.it.Rows(item), half, nw, lines,
                              [&](auto mr, int64_t m, jaxinfer::WeightsAhead& pf) {
                                DotPass<mr.value, NB>(a, m, g * kGroup, pf);
                              });
}

// A thread's state across the items it takes: the AMX engine's scratch block and whether
// this thread loaded its tile configuration.
struct Scratch {
  alignas(64) float tmp[16 * kGroup * kCols];
  bool configured = false;
};

JX_BF16DOT void DotItem(const Args& a, int64_t item, int64_t next, Scratch*) {
  switch (a.it.Blocks(a.it.Group(item))) {
    case 1: DotPasses<1>(a, item, next); break;
    case 2: DotPasses<2>(a, item, next); break;
    case 3: DotPasses<3>(a, item, next); break;
    default: DotPasses<4>(a, item, next); break;
  }
}

JX_AMX void TileItem(const Args& a, int64_t item, int64_t, Scratch* s) {
  if (!s->configured) {
    Configure();
    s->configured = true;
  }
  const int64_t g = a.it.Group(item), j0 = g * kGroup, nb = a.it.Blocks(g);
  for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
    switch (nb) {
      case 1: Tile<1>(a, m0, j0, s->tmp); break;
      case 2: Tile<2>(a, m0, j0, s->tmp); break;
      case 3: Tile<3>(a, m0, j0, s->tmp); break;
      default: Tile<4>(a, m0, j0, s->tmp); break;
    }
  }
}

JX_AMX void ReleaseTiles() { _tile_release(); }

struct Shared {
  Args args;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Takes items until none are left, with either engine's item function.
template <void (*ItemFn)(const Args&, int64_t, int64_t, Scratch*)>
void Drain(Shared* sh) {
  Scratch s;
  jaxinfer::DrainAhead(sh, sh->args.it.items(),
                       [sh, &s](int64_t i, int64_t n) { ItemFn(sh->args, i, n, &s); });
  if (s.configured) ReleaseTiles();
}

// float32 -> bfloat16 bits, round to nearest even (NaN kept a quiet NaN), as XLA converts.
inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
#endif  // JX_HAVE_AMX

// dot_only: 1 runs the dot-product engine at every row count (tiles.matmul(engine="dot"):
// the tests reach it on AMX machines too); 0 chooses as the header says.
ffi::Error TilesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                     ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y,
                     int32_t dot_only) {
#ifdef JX_HAVE_AMX
  if (!kAmx && !kBf16Dot)
    return ffi::Error::Internal("bf16 tile matmul: this CPU has neither AMX (with the OS's "
                               "permission) nor AVX512-BF16");
  if (dot_only && !kBf16Dot)
    return ffi::Error::Internal("bf16 tile matmul: dot products asked for, and this CPU has "
                               "no AVX512-BF16");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 4 && wd.size() != 5) || wd[wd.size() - 1] != 2 ||
      wd[wd.size() - 2] != kCols)
    return ffi::Error::InvalidArgument("bf16 tile matmul: x [M, K], w [(L,) N/16, K/2, 16, 2] "
                                       "expected");
  const bool stacked = wd.size() == 5;
  const int64_t L = stacked ? wd[0] : 1;
  const int64_t blocks = wd[stacked ? 1 : 0], half = wd[stacked ? 2 : 1];
  auto sh = std::make_shared<Shared>();
  Args& a = sh->args;
  a.M = xd[0];
  a.K = xd[1];
  a.N = blocks * kCols;
  if (a.K != 2 * half || a.K % kKStep)
    return ffi::Error::InvalidArgument("bf16 tile matmul: K must match w and be a multiple of 32");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("bf16 tile matmul: layer outside L");
  if (a.M == 0 || a.N == 0) return ffi::Error::Success();
  a.w = w.typed_data() + l * blocks * half * 32;
  a.y = y->typed_data();
  const bool dot = kBf16Dot && (dot_only || !kAmx || a.M <= kMaxDotRows);
  a.Mp = dot ? a.M : (a.M + 15) / 16 * 16;
  // every element written once: x's rows rounded, then zeros in the rows AMX pads to 16
  std::unique_ptr<uint16_t[]> xb(new uint16_t[a.Mp * a.K]);
  const float* xf = x.typed_data();
  for (int64_t i = 0; i < a.M * a.K; ++i) xb[i] = ToBf16(xf[i]);
  std::fill(xb.get() + a.M * a.K, xb.get() + a.Mp * a.K, uint16_t{0});
  a.xb = xb.get();
  a.it = jaxinfer::GroupItems(blocks, kGroup, a.M, dot);
  const int64_t items = a.it.items();
  const bool parallel = items >= kMinParallelItems;
  if (dot)
    jaxinfer::RunItems(pool, sh, items, parallel, a.M, Drain<DotItem>);
  else
    jaxinfer::RunItems(pool, sh, items, parallel, a.M, Drain<TileItem>);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("bf16 tile matmul: built without AMX / AVX512-BF16 support "
                              "(x86-64 Linux, GCC 11 or Clang 12)");
#endif
}

}  // namespace

extern "C" int JaxinferTilesAvailable() {
#ifdef JX_HAVE_AMX
  return (kAmx ? 2 : 0) | (kBf16Dot ? 1 : 0);
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferBf16TileMatmul, TilesImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
        .Arg<ffi::Buffer<ffi::U16>>()   // w [(L,) N/16, K/2, 16, 2] bf16 bits
        .Arg<ffi::Buffer<ffi::S32>>()   // layer []
        .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
        .Attr<int32_t>("dot_only"));
