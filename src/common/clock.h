// The one clock of the library's latency statistics: the steady clock, in nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>

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

}  // namespace terrace
