// The one clock of the library's latency statistics: the steady clock, in nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>
#include <ctime>

namespace terrace {

inline std::uint64_t SteadyNanos() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// Nanoseconds from `t0` to now.
inline std::uint64_t NanosSince(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

// Seconds from `t0` to now (wall time on the steady clock).
inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// This thread's CPU time in seconds (CLOCK_THREAD_CPUTIME_ID): for benchmarks on a shared machine,
// where the time a thread is descheduled should not count.
inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace terrace
