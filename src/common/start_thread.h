// StartThread: std::thread without the exception. The OS may refuse a new thread (pthread_create
// fails with EAGAIN at RLIMIT_NPROC or the kernel's thread limit, and when the thread's stack cannot
// be mapped under RLIMIT_AS or overcommit limits); std::thread then throws std::system_error, which
// must never cross Terrace's API (a throw out of a constructor aborted Store::Open with
// std::terminate). Every thread the library starts from a path a public function reaches starts here.
// Thread-safety: StartThread may be called from any thread.
#pragma once

#include <new>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "terrace/status.h"

namespace terrace {
namespace thread_internal {

// Unavailable: "cannot start <what>: <reason>; ..." with what to do about it.
Status StartFailed(std::string_view what, std::string_view reason);

// Test seam (tests only; no library code calls it): while set, the first `succeed` later calls of
// StartThread start their thread and every call after them fails as the OS would refuse one.
// Negative clears it. Process-wide.
void FailThreadStartsAfter(int succeed);
// Consumes one start from the seam: true when this start must fail.
bool InjectedStartFailure();

}  // namespace thread_internal

// Starts `fn` on a new thread, or returns Unavailable naming `what` ("the prefix cache's writer
// thread") when the thread cannot be had (std::system_error, or std::bad_alloc for its state).
// Never throws. The caller owns the returned thread and must join it.
template <typename F>
Result<std::thread> StartThread(std::string_view what, F&& fn) {
  if (thread_internal::InjectedStartFailure())
    return thread_internal::StartFailed(what, "Resource temporarily unavailable (injected by a test)");
  try {
    return std::thread(std::forward<F>(fn));
  } catch (const std::system_error& e) {
    return thread_internal::StartFailed(what, e.what());
  } catch (const std::bad_alloc&) {
    return thread_internal::StartFailed(what, "out of memory");
  }
}

}  // namespace terrace
