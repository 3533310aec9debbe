// Work items shared by the calling thread and helpers (the library's own spinning threads
// or tasks on XLA's intra-op thread pool), for the native CPU calls built by
// pallas_kernels/cpu/native.py (gguf.cc, tiles.cc, panels.cc, decode.cc).
#ifndef JAXINFER_NATIVE_ITEMS_H_
#define JAXINFER_NATIVE_ITEMS_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Helper threads of the library's own, which spin between calls. Handing work to XLA's
// intra-op pool costs the caller the wake-up of a sleeping thread, which on a VM can take
// longer than a small call's work. These threads poll for a job, yielding the core between
// polls, for kSpinMicros after their last job, then sleep on a condition variable.
//
// They serve calls of up to kMaxRows rows (matmul rows, decode slots): there a call is short
// and its hand-off is the cost. Larger calls keep XLA's pool, whose threads then stay awake
// for XLA's own parallel ops (docs/design.md, native CPU backend, has the step times).
//
// One job at a time: a caller that finds them busy (a second XLA thread) hands its items to
// XLA's pool. JAXINFER_SPIN_HELPERS=0 turns them off (every call then uses XLA's pool).
class Helpers {
 public:
  static constexpr int64_t kSpinMicros = 2000;
  static constexpr int64_t kMaxRows = 16;

  // The process's helpers (built on first use, never destroyed: a thread may still be
  // polling at exit).
  static Helpers& Get() {
    static Helpers* h = new Helpers();
    return *h;
  }

  int64_t count() const { return count_; }

  // Runs fn(arg) on up to `n` helpers and returns true, or returns false at once if
  // another caller's job holds them. The caller runs its own share, then calls Finish().
  bool Start(int64_t n, void (*fn)(void*), void* arg) {
    if (n <= 0 || count_ == 0 || busy_.exchange(true, std::memory_order_acquire)) return false;
    fn_ = fn;
    arg_ = arg;
    want_.store(n, std::memory_order_relaxed);
    open_.store(++gen_, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    return true;
  }

  // Closes the job and waits until no helper is inside fn (arg may then go away).
  void Finish() {
    open_.store(0, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
    busy_.store(false, std::memory_order_release);
  }

 private:
  Helpers() {
    const char* env = std::getenv("JAXINFER_SPIN_HELPERS");
    int64_t cpus = static_cast<int64_t>(std::thread::hardware_concurrency());
    cpu_set_t set;  // the CPUs this process may run on (taskset, cgroups' cpusets)
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
    const int64_t want = (env && std::string(env) == "0") || cpus < 2 ? 0 : cpus - 1;
    try {  // as many as start (a process limited in threads gets fewer, or none)
      for (; count_ < want; ++count_) std::thread([this] { Loop(); }).detach();
    } catch (const std::system_error&) {
    }
    // A forked child has none of these threads (and may have copied a job in flight): its
    // calls run on XLA's pool.
    pthread_atfork(nullptr, nullptr, [] { Get().count_ = 0; });
  }

  void Loop() {
    uint64_t last = 0;
    auto idle_since = std::chrono::steady_clock::now();
    for (;;) {
      const uint64_t g = open_.load(std::memory_order_acquire);
      if (g != 0 && g != last) {
        last = g;
        // Dekker-style: counted inside before the second look at open_, so Finish() (which
        // closes, then waits for inside_ == 0) either sees this helper or this helper sees
        // the job closed and never touches fn_ / arg_.
        inside_.fetch_add(1, std::memory_order_seq_cst);
        if (open_.load(std::memory_order_seq_cst) == g &&
            want_.fetch_sub(1, std::memory_order_relaxed) > 0)
          fn_(arg_);
        inside_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - idle_since <
          std::chrono::microseconds(kSpinMicros)) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lock, [&] {
        const uint64_t o = open_.load(std::memory_order_seq_cst);
        return o != 0 && o != last;
      });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      idle_since = std::chrono::steady_clock::now();
    }
  }

  int64_t count_ = 0;
  std::atomic<bool> busy_{false};
  uint64_t gen_ = 0;  // written only by the caller holding busy_
  std::atomic<uint64_t> open_{0};
  std::atomic<int64_t> inside_{0}, want_{0}, sleepers_{0};
  void (*fn_)(void*) = nullptr;
  void* arg_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs drain(sh) on the caller and, when `parallel`, on up to pool.num_threads() helpers
// (never more than items - 1): the library's spinning Helpers for a call of up to
// Helpers::kMaxRows `rows` where they are free, else tasks on XLA's pool. Then waits until
// sh->done counts `items`: each drain takes items from sh->next and counts them in
// sh->done, so the caller waits only for items that were taken and a helper that never
// starts cannot stall the call.
template <typename Shared, typename Drain>
void RunItems(xla::ffi::ThreadPool& pool, const std::shared_ptr<Shared>& sh, int64_t items,
              bool parallel, int64_t rows, Drain drain) {
  int64_t helpers = parallel ? pool.num_threads() : 0;
  if (helpers > items - 1) helpers = items - 1;
  struct Job {
    Shared* sh;
    Drain drain;
    static void Run(void* p) {
      Job* j = static_cast<Job*>(p);
      j->drain(j->sh);
    }
  } job{sh.get(), drain};
  Helpers& spin = Helpers::Get();
  const int64_t n = rows > Helpers::kMaxRows ? 0
                    : (helpers < spin.count() ? helpers : spin.count());
  const bool own = spin.Start(n, &Job::Run, &job);
  if (!own)
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh, drain] { drain(sh.get()); });
  drain(sh.get());
  while (sh->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
  if (own) spin.Finish();
}

// Calls pass(std::integral_constant<int, MR>{}, m0) over rows [0, M) in passes of six rows,
// then one pass of the 1-5 left: a register-blocked kernel's row loop with MR known at
// compile time (panels.cc, tiles.cc: six rows x four column blocks of
// accumulators).
template <typename Pass>
inline void SixRowPasses(int64_t M, Pass pass) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) pass(std::integral_constant<int, 6>{}, m);
  switch (M - m) {
    case 1: pass(std::integral_constant<int, 1>{}, m); break;
    case 2: pass(std::integral_constant<int, 2>{}, m); break;
    case 3: pass(std::integral_constant<int, 3>{}, m); break;
    case 4: pass(std::integral_constant<int, 4>{}, m); break;
    case 5: pass(std::integral_constant<int, 5>{}, m); break;
    default: break;
  }
}

// Whether this CPU is AMD's. The native calls ask for data further ahead than the
// hardware's own prefetchers (SixRowPassesAhead's next item's weights, decode.cc's pages
// kDeepTokens ahead) on AMD CPUs only: it made steps faster on AMD Zen 4 and slower on
// Intel Sapphire Rapids, whose cores stalled with every line-fill buffer waiting
// (docs/design.md).
inline bool IsAmd() {
#if defined(__x86_64__)
  static const bool amd = [] {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u &&
           c == 0x444d4163u;  // "AuthenticAMD"
  }();
  return amd;
#else
  return false;
#endif
}

// A thread's next item's weights, pulled into L2 while it computes the one it holds:
// `per_k` 64-byte lines at each k of a pass, `left` of them in all.
struct WeightsAhead {
  const char* p = nullptr;
  int64_t left = 0;
  int64_t per_k = 0;

  inline void Step() {
    if (left <= 0) return;
    const int64_t n = per_k < left ? per_k : left;
    for (int64_t t = 0; t < n; ++t) __builtin_prefetch(p + 64 * t, 0, 2);
    p += 64 * n;
    left -= n;
  }
};

// SixRowPasses over rows [m0, m0 + M) for a register-blocked matmul whose next item on this
// thread reads `lines` 64-byte lines of weights at `next` (null: none). The first pass
// streams this item's own weights from memory while its FMAs wait on them; the passes after
// it read them again from L2 and fetch the next item's meanwhile, spread evenly over their
// K steps, so the next first pass finds its weights in L2 and memory and compute overlap.
// pass(mr, m0, ahead) calls ahead.Step() once per k. Calls of 1-12 rows (one or two passes)
// fetch nothing ahead: they are bound by reading, and a second pass's burst of prefetches
// slowed them (docs/design.md).
template <typename Pass>
inline void SixRowPassesAhead(int64_t m0, int64_t M, int64_t K, const void* next,
                              int64_t lines, Pass pass) {
  WeightsAhead pf, none;
  const int64_t passes = (M + 5) / 6;
  if (next != nullptr && passes > 2 && IsAmd()) {
    const int64_t spread = (passes - 1) * K;
    pf.p = static_cast<const char*>(next);
    pf.left = lines;
    pf.per_k = (lines + spread - 1) / spread;
  }
  int64_t done = 0;
  SixRowPasses(M, [&](auto mr, int64_t m) { pass(mr, m0 + m, done++ > 0 ? pf : none); });
}

// Rows of a matmul's column group per work item: all M, or, when a call has more than 32
// rows and fewer than 24 column groups, half of them each (a multiple of six), so two
// threads share such a call's items evenly (SmolLM2's o and down have 9 groups of 64
// columns: whole, one thread ran 5 of them and the other 4).
inline int64_t RowsPerItem(int64_t M, int64_t groups) {
  if (M <= 32 || groups >= 24) return M;
  return ((M + 11) / 12) * 6;
}

// The work items of a matmul over column groups of up to `group` blocks of 16 columns
// (panels.cc, tiles.cc's dot products): item i is column group i / parts and rows
// [Row0(i), Row0(i) + Rows(i)) of M, each group's rows in `parts` parts of `rows` rows
// (RowsPerItem where `split`, else all M in one).
struct GroupItems {
  int64_t blocks = 0, group = 1, groups = 0, M = 0, rows = 0, parts = 1;

  GroupItems() = default;
  GroupItems(int64_t blocks_, int64_t group_, int64_t M_, bool split)
      : blocks(blocks_), group(group_), groups((blocks_ + group_ - 1) / group_), M(M_),
        rows(split ? RowsPerItem(M_, groups) : M_), parts(rows > 0 ? (M_ + rows - 1) / rows : 1) {}

  int64_t items() const { return groups * parts; }
  int64_t Group(int64_t i) const { return i / parts; }
  // Column blocks in group g (the last may hold fewer than `group`).
  int64_t Blocks(int64_t g) const {
    return blocks - g * group < group ? blocks - g * group : group;
  }
  int64_t Row0(int64_t i) const { return i % parts * rows; }
  int64_t Rows(int64_t i) const { return M - Row0(i) < rows ? M - Row0(i) : rows; }
  // The group whose weights a thread's next item reads: -1 for none or this item's own.
  int64_t NextGroup(int64_t i, int64_t next) const {
    const int64_t gn = next < 0 ? -1 : Group(next);
    return gn == Group(i) ? -1 : gn;
  }
};

// Takes items until none are left, each thread claiming its next item before it runs the
// one it holds (so that item's weights can be fetched meanwhile): run(i, next) with next
// -1 for a thread's last. Counts sh->done.
template <typename Sh, typename Run>
inline void DrainAhead(Sh* sh, int64_t items, Run run) {
  int64_t i = sh->next.fetch_add(1);
  while (i < items) {
    const int64_t n = sh->next.fetch_add(1);
    run(i, n < items ? n : -1);
    sh->done.fetch_add(1, std::memory_order_release);
    i = n;
  }
}

}  // namespace jaxinfer

#endif  // JAXINFER_NATIVE_ITEMS_H_
