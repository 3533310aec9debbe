// Single-thread read rate of the paged decode call's inner function (Attend<8, 3>: SmolLM2's
// head_dim 64 and 3 query heads per KV head) over a synthetic f32 pool, without XLA: a way
// to compare read patterns in seconds rather than by alternated engine steps.
//
//   INC=$(python -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__))')/include
//   g++ -O3 -std=c++17 -march=x86-64-v4 -ffp-contract=fast -fno-math-errno \
//     -I pallas_kernels/cpu -I "$INC" tools/attend_harness.cc -o /tmp/attend_harness
//   /tmp/attend_harness 16 4096
//
// Arguments: slots R, context C (tokens per slot); SHUF=1 in the environment scatters the
// pages over the pool. Eight layers of K and V (2 * 8 * R * 3 * C * 256 bytes) are read per
// pass, items in the order one thread would take them; prints GB/s of five passes.
#include "decode.cc"

#include <chrono>
#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: attend_harness SLOTS CONTEXT\n");
    return 2;
  }
  const int64_t R = std::atoll(argv[1]), C = std::atoll(argv[2]);
  const int64_t L = 8, K = 3, N = 9, H = 64, ps = 16;
  if (R < 1 || C < 1) {
    std::fprintf(stderr, "SLOTS and CONTEXT must be >= 1 (got %lld, %lld)\n",
                 static_cast<long long>(R), static_cast<long long>(C));
    return 2;
  }
  const int64_t per = C / ps + 1, P = R * per;
  std::vector<float> kc(L * K * P * ps * H), vc(kc.size());
  for (size_t i = 0; i < kc.size(); ++i) {
    kc[i] = (i % 89) * 1e-3f;
    vc[i] = (i % 83) * 1e-3f;
  }
  std::vector<float> q(R * N * H, 0.01f), kn(R * K * H, 0.01f), vn(R * K * H, 0.01f);
  std::vector<float> out(R * N * H);
  std::vector<int32_t> pt(R * per), cl(R, static_cast<int32_t>(C));
  const bool shuffle = std::getenv("SHUF") != nullptr;
  for (int64_t i = 0; i < R * per; ++i) pt[i] = static_cast<int32_t>(shuffle ? (i * 7919) % P : i);
  Args a;
  a.q = q.data();
  a.k_new = kn.data();
  a.v_new = vn.data();
  for (Pool* p : {&a.kp, &a.vp}) {
    p->fmt = kF32;
    p->P = P;
    p->ps = ps;
    p->Hc = H;
    p->H = H;
    p->code_bytes = 4;
  }
  a.kp.codes = kc.data();
  a.vp.codes = vc.data();
  a.kp.scales = a.vp.scales = nullptr;
  a.page_table = pt.data();
  a.pages_per_slot = per;
  a.cached_len = cl.data();
  a.out = out.data();
  a.R = R;
  a.N = N;
  a.K = K;
  a.G = N / K;
  a.H = H;
  a.scale = 0.125f;
  a.deep = IsAmd() ? std::max<int64_t>(2, kDeepTokens / ps) : 0;
  const double bytes = 2.0 * R * K * C * H * 4 * L;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < L; ++l) {
      a.layer = l;
      for (int64_t i = 0; i < R * K; ++i) {
        Ahead after;
        if (i + 1 < R * K) after = FirstPage(a, (i + 1) / K, (i + 1) % K, 0);
        Attend<8, 3>(a, i / K, i % K, 0, i > 0, after);
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%.1f GB/s (%.1f ms)%s", bytes / s / 1e9, s * 1e3, rep < 4 ? "  " : "\n");
  }
  std::printf("out[5] = %g\n", out[5]);  // keeps the work observable
}
