// Helpers shared by the host-tier tests.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

namespace terrace::testing {

// Pages of [p, p + bytes) the kernel reports resident (mincore); p is page-aligned.
inline std::size_t ResidentPages(const void* p, std::size_t bytes) {
  std::vector<unsigned char> vec((bytes + 4095) / 4096);
  REQUIRE(::mincore(const_cast<void*>(p), bytes, vec.data()) == 0);
  std::size_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

}  // namespace terrace::testing
