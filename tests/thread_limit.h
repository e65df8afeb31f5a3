// Test helpers for the paths that start threads (src/common/start_thread.h): the seam that makes a
// chosen thread start fail, and a real refusal by the OS in a forked child.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "src/common/start_thread.h"
#include "test_util.h"

namespace terrace::testing {

// While it lives, the first `succeed` thread starts of the process succeed and every later one
// fails as a refused pthread_create would (thread_internal::FailThreadStartsAfter).
class FailThreadStarts {
 public:
  explicit FailThreadStarts(int succeed) { thread_internal::FailThreadStartsAfter(succeed); }
  ~FailThreadStarts() { thread_internal::FailThreadStartsAfter(-1); }
  FailThreadStarts(const FailThreadStarts&) = delete;
  FailThreadStarts& operator=(const FailThreadStarts&) = delete;
};

// How a child run by RunWithNoRoomForThreads ended: its exit code, or -signal, or -1000 when it
// was still running after the timeout (and was killed).
inline std::string DescribeChildEnd(int end) {
  if (end == -1000) return "the child hung and was killed";
  if (end < 0) return "the child was killed by signal " + std::to_string(-end) + " (6: SIGABRT, std::terminate)";
  if (end == 95) return "an exception left the call under test (a program that does not catch it ends in std::terminate)";
  return "the child exited " + std::to_string(end);
}

// Runs `body` in a forked child whose address space is capped (RLIMIT_AS) at what it maps now plus
// 2 MiB: no new thread's stack (16 MiB, set as the child's default) fits, so pthread_create fails
// with EAGAIN as at a real thread or memory limit, while small allocations still succeed. `body` runs after `before`
// (which runs without the cap, e.g. to open what needs threads) and returns the child's exit code.
// An exception out of `body` ends the child with 95. Returns the child's end as DescribeChildEnd
// reads it. The test process itself is unaffected.
inline int RunWithNoRoomForThreads(const std::function<int()>& before, const std::function<int()>& body,
                                   std::chrono::seconds timeout = std::chrono::seconds(120)) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -2000;
  if (pid == 0) {
    try {
      if (int rc = before(); rc != 0) ::_exit(rc);
    } catch (...) {
      ::_exit(96);  // a failed REQUIRE in `before`: the child must never go on to run Catch's other tests
    }
    // New threads get 16 MiB stacks: glibc reuses a cached stack of a thread joined before the
    // fork (8 MiB) only for a request no larger than it, so every start below must map a new one.
    pthread_attr_t attr;
    if (::pthread_attr_init(&attr) != 0 || ::pthread_attr_setstacksize(&attr, 16u << 20) != 0 ||
        ::pthread_setattr_default_np(&attr) != 0)
      ::_exit(89);
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages <= 0) ::_exit(90);
    rlimit lim{};
    if (::getrlimit(RLIMIT_AS, &lim) != 0) ::_exit(91);
    lim.rlim_cur = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (2u << 20);
    if (lim.rlim_max != RLIM_INFINITY && lim.rlim_cur > lim.rlim_max) ::_exit(92);
    if (::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(93);
    // Proof that the cap holds: a thread cannot be had here.
    try {
      std::thread t([] {});
      t.join();
      ::_exit(94);
    } catch (...) {
    }
    int rc = 95;  // an exception left `body`: what ends a program that does not catch it (std::terminate)
    try {
      rc = body();
    } catch (...) {
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -3000;
    if (r < 0) return -2001;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1000;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace terrace::testing
