// Work items shared by the calling thread and tasks on XLA's intra-op thread pool, for the
// native CPU calls built by pallas_kernels/native.py (cpu_tiles.cc, cpu_panels.cc,
// cpu_decode.cc).
#ifndef JAXINFER_NATIVE_ITEMS_H_
#define JAXINFER_NATIVE_ITEMS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Runs drain(sh) on the caller and, when `parallel`, on up to pool.num_threads() helper
// tasks (never more than items - 1), then waits until sh->done counts `items`: each drain
// takes items from sh->next and counts them in sh->done, so the caller waits only for
// items that were taken and a task that never starts cannot stall the call.
template <typename Shared, typename Drain>
void RunItems(xla::ffi::ThreadPool& pool, const std::shared_ptr<Shared>& sh, int64_t items,
              bool parallel, Drain drain) {
  int64_t helpers = parallel ? pool.num_threads() : 0;
  if (helpers > items - 1) helpers = items - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh, drain] { drain(sh.get()); });
  drain(sh.get());
  while (sh->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

// Calls pass(std::integral_constant<int, MR>{}, m0) over rows [0, M) in passes of six rows,
// then one pass of the 1-5 left: a register-blocked kernel's row loop with MR known at
// compile time (cpu_panels.cc, cpu_tiles.cc: six rows x four column blocks of
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

}  // namespace jaxinfer

#endif  // JAXINFER_NATIVE_ITEMS_H_
