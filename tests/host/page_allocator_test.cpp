#include <catch2/catch.hpp>

#include <random>
#include <vector>

#include "tiers/host/page_allocator.h"

using terrace::tiers::PageAllocator;
using terrace::tiers::PageExtent;

TEST_CASE("Size classes partition run lengths in order") {
  for (std::uint32_t n = 1; n < 100000; n += (n < 4096 ? 1 : 97)) {
    int c = PageAllocator::ClassOf(n);
    REQUIRE(c >= 0);
    REQUIRE(c < PageAllocator::kClasses);
    CHECK(PageAllocator::ClassFloor(c) <= n);
    CHECK(PageAllocator::ClassFloor(c + 1) > n);
    CHECK(PageAllocator::ClassFloor(c + 1) > PageAllocator::ClassFloor(c));
  }
  CHECK(PageAllocator::ClassOf(0xffffffffu) < PageAllocator::kClasses);
  // Spacing: consecutive floors differ by at most 25% above 4 pages (bounded search slack).
  for (int c = 3; c < 60; ++c) {
    CHECK(PageAllocator::ClassFloor(c + 1) * 4 <= PageAllocator::ClassFloor(c) * 5);
  }
}

namespace {

// Oracle: which pages are in use, per chunk; checks extents never overlap and stay in their chunk.
struct Oracle {
  std::vector<std::vector<bool>> used;
  bool Take(const PageExtent& e) {
    if (e.chunk >= used.size() || e.page + e.pages > used[e.chunk].size()) return false;
    for (std::uint32_t p = e.page; p < e.page + e.pages; ++p) {
      if (used[e.chunk][p]) return false;
      used[e.chunk][p] = true;
    }
    return true;
  }
  void Give(const PageExtent& e) {
    for (std::uint32_t p = e.page; p < e.page + e.pages; ++p) used[e.chunk][p] = false;
  }
};

}  // namespace

TEST_CASE("Random allocate/free never overlaps and fully coalesces") {
  const std::uint32_t kPages = 512;
  PageAllocator a(kPages, 4);
  Oracle o;
  for (int c = 0; c < 3; ++c) {
    a.AddChunk(c == 2 ? kPages / 2 : kPages);  // last chunk smaller, like a capacity remainder
    o.used.emplace_back(c == 2 ? kPages / 2 : kPages, false);
  }
  std::mt19937_64 rng(7);
  std::vector<PageExtent> live;
  std::uint64_t live_pages = 0;
  for (int step = 0; step < 20000; ++step) {
    bool alloc = live.empty() || rng() % 100 < 55;
    if (alloc) {
      std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % (rng() % 8 == 0 ? 200 : 16));
      auto e = a.Allocate(n);
      if (e) {
        REQUIRE(e->pages == n);
        REQUIRE(o.Take(*e));
        live.push_back(*e);
        live_pages += n;
      } else {
        // A failure is only allowed when no free run of n pages exists anywhere.
        REQUIRE(a.largest_free_run() < n);
      }
    } else {
      std::size_t i = rng() % live.size();
      a.Free(live[i]);
      o.Give(live[i]);
      live_pages -= live[i].pages;
      live[i] = live.back();
      live.pop_back();
    }
    REQUIRE(a.free_pages() + live_pages == a.total_pages());
    if (step % 997 == 0) REQUIRE(a.CheckInvariants());
  }
  for (const auto& e : live) a.Free(e);
  REQUIRE(a.CheckInvariants());
  CHECK(a.free_pages() == a.total_pages());
  CHECK(a.largest_free_run() == kPages);  // every chunk coalesced back into one run
  CHECK(a.Allocate(kPages + 1) == std::nullopt);
  CHECK(a.Allocate(0).has_value());
}

TEST_CASE("Steady-state churn at half occupancy never fails (no fragmentation growth)") {
  // 8 chunks of 256 pages; the live set is held near 50% of all pages with mixed run lengths.
  const std::uint32_t kPages = 256, kChunks = 8;
  PageAllocator a(kPages, kChunks);
  for (std::uint32_t c = 0; c < kChunks; ++c) a.AddChunk(kPages);
  const std::uint64_t target = std::uint64_t{kPages} * kChunks / 2;
  std::mt19937_64 rng(11);
  std::vector<PageExtent> live;
  std::uint64_t live_pages = 0;
  std::uint32_t min_largest_after_warmup = kPages;
  for (int step = 0; step < 100000; ++step) {
    if (live_pages < target) {
      std::uint32_t n = 1 + static_cast<std::uint32_t>(rng() % 32);
      auto e = a.Allocate(n);
      REQUIRE(e.has_value());  // live + n <= 50% + 32 pages of the arena: must always fit
      live.push_back(*e);
      live_pages += n;
    } else {
      std::size_t i = rng() % live.size();
      a.Free(live[i]);
      live_pages -= live[i].pages;
      live[i] = live.back();
      live.pop_back();
    }
    if (step > 20000 && step % 1000 == 0) min_largest_after_warmup = std::min(min_largest_after_warmup, a.largest_free_run());
  }
  REQUIRE(a.CheckInvariants());
  // Free space stays usable: a run of the largest request size is always available.
  CHECK(min_largest_after_warmup >= 32);
}
