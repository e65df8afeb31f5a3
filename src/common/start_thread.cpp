#include "src/common/start_thread.h"

#include <atomic>

#include <fmt/format.h>

namespace terrace::thread_internal {
namespace {

std::atomic<int> g_starts_left{-1};  // the seam: < 0 off; else starts that may still succeed

}  // namespace

Status StartFailed(std::string_view what, std::string_view reason) {
  return Status::Unavailable(fmt::format(
      "cannot start {}: {}; the process is at a limit on threads or memory (see ulimit -u and ulimit -v, "
      "and the threads the other components of this process run)",
      what, reason));
}

void FailThreadStartsAfter(int succeed) { g_starts_left.store(succeed < 0 ? -1 : succeed, std::memory_order_relaxed); }

bool InjectedStartFailure() {
  int left = g_starts_left.load(std::memory_order_relaxed);
  while (left > 0 && !g_starts_left.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
  }
  return left == 0;
}

}  // namespace terrace::thread_internal
