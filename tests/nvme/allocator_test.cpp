#include <catch2/catch.hpp>

#include <map>
#include <random>

#include "tiers/nvme/extent_allocator.h"

using terrace::nvme::Extent;
using terrace::nvme::ExtentAllocator;

namespace {
constexpr std::uint64_t kU = 4096;

// Independent oracle: free ranges must exactly complement the live allocations, be coalesced
// (no two free extents touch) and lie in range.
void CheckInvariants(const ExtentAllocator& a, const std::map<std::uint64_t, std::uint64_t>& live,
                     std::uint64_t begin, std::uint64_t end) {
  std::vector<Extent> all;
  std::uint64_t free_sum = 0;
  std::uint64_t prev_free_end = UINT64_MAX;
  a.ForEachFree([&](Extent e) {
    REQUIRE(e.offset % kU == 0);
    REQUIRE(e.length % kU == 0);
    REQUIRE(e.length > 0);
    REQUIRE(e.offset != prev_free_end);  // coalesced
    prev_free_end = e.offset + e.length;
    free_sum += e.length;
    all.push_back(e);
  });
  for (auto [off, len] : live) all.push_back({off, (len + kU - 1) / kU * kU});
  std::sort(all.begin(), all.end(), [](const Extent& x, const Extent& y) { return x.offset < y.offset; });
  std::uint64_t cursor = begin;
  for (const Extent& e : all) {
    REQUIRE(e.offset == cursor);  // no gap, no overlap
    cursor += e.length;
  }
  REQUIRE(cursor == end);
  REQUIRE(free_sum == a.free_bytes());
}
}  // namespace

TEST_CASE("extent allocator: random churn keeps a consistent, coalesced map", "[nvme][alloc]") {
  const std::uint64_t begin = kU, end = kU + 4096 * kU;
  ExtentAllocator a(begin, end, kU);
  std::map<std::uint64_t, std::uint64_t> live;
  std::mt19937_64 rng(GENERATE(1, 2, 3));
  for (int step = 0; step < 4000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      std::uint64_t bytes = 1 + rng() % (64 * kU);
      auto off = a.Allocate(bytes);
      if (off) {
        REQUIRE(*off % kU == 0);
        REQUIRE(live.emplace(*off, bytes).second);
      } else {
        REQUIRE(a.largest_free() < (bytes + kU - 1) / kU * kU);  // fails only when nothing fits
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      a.Free(it->first, it->second);
      live.erase(it);
    }
    if (step % 97 == 0) CheckInvariants(a, live, begin, end);
  }
  for (auto [off, len] : live) a.Free(off, len);
  live.clear();
  CheckInvariants(a, live, begin, end);
  REQUIRE(a.free_extents() == 1);  // freeing everything yields one extent: no lasting fragmentation
  REQUIRE(a.free_bytes() == end - begin);
}

TEST_CASE("extent allocator: best fit reuses holes and is sequential on an empty map", "[nvme][alloc]") {
  ExtentAllocator a(0, 100 * kU, kU);
  auto x = a.Allocate(kU);
  auto y = a.Allocate(3 * kU);
  auto z = a.Allocate(kU);
  REQUIRE(x == 0u);
  REQUIRE(y == kU);
  REQUIRE(z == 4 * kU);
  a.Free(*y, 3 * kU);
  auto w = a.Allocate(2 * kU);  // fits the 3-unit hole rather than the tail
  REQUIRE(w == kU);
  REQUIRE_FALSE(a.Allocate(200 * kU).has_value());
  ExtentAllocator b(0, 10 * kU, kU);
  std::vector<Extent> used = {{kU, kU}, {5 * kU, 2 * kU}};
  b.ResetWithUsed(used);
  REQUIRE(b.free_bytes() == 7 * kU);
  REQUIRE(b.free_extents() == 3);
  REQUIRE(b.largest_free() == 3 * kU);
}
