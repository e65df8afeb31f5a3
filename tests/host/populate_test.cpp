// HostTierOptions::populate: the first populate_bytes of the capacity are mapped at open and faulted
// in before Create returns (kAtOpen) or by the background thread from open (kBackground); puts
// racing a background populate store and return exactly their bytes; the default populates nothing.
#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <map>
#include <random>
#include <vector>

#include "host_test_util.h"
#include "test_util.h"
#include "tiers/host/host_tier.h"

using namespace terrace;
using terrace::testing::ResidentPages;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

constexpr std::uint64_t kChunk = 4 * kMiB;

std::unique_ptr<HostTier> MakeHost(HostPopulate populate, std::uint64_t populate_bytes, std::uint64_t capacity,
                                   bool prefault = false) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = kChunk;
  o.pin = false;  // unpinned: only the populate (not mlock) can fault pages nobody has written
  o.prefault = prefault;
  o.populate = populate;
  o.populate_bytes = populate_bytes;
  auto t = HostTier::Create(o);
  REQUIRE(t.ok());
  return std::move(t).value();
}

// Resident pages over every arena chunk materialized so far, and the pages those chunks hold.
std::pair<std::size_t, std::size_t> Residency(const HostTier& t) {
  std::size_t resident = 0, pages = 0;
  for (const iovec& r : t.Regions()) {
    resident += ResidentPages(r.iov_base, r.iov_len);
    pages += r.iov_len / 4096;
  }
  return {resident, pages};
}

}  // namespace

TEST_CASE("Host tier populate at open leaves the pages resident before the first put") {
  SECTION("the first populate_bytes, rounded up to whole chunks") {
    auto t = MakeHost(HostPopulate::kAtOpen, 10 * kMiB, 32 * kMiB);
    CHECK(t->arena_bytes() == 12 * kMiB);  // 3 chunks of 4 MiB; the other 5 stay unmapped
    const auto [resident, pages] = Residency(*t);
    CHECK(pages == 12 * kMiB / 4096);
    CHECK(resident == pages);
    CHECK(t->block_count() == 0);
    CHECK(t->Stats().detail.find("populated 12 MiB at open") != std::string::npos);
  }
  SECTION("populate_bytes 0: the whole capacity") {
    auto t = MakeHost(HostPopulate::kAtOpen, 0, 18 * kMiB);  // 4 chunks of 4 MiB and one of 2 MiB
    CHECK(t->arena_bytes() == 18 * kMiB);
    const auto [resident, pages] = Residency(*t);
    CHECK(resident == 18 * kMiB / 4096);
    CHECK(pages == resident);
    CHECK(t->Stats().detail.find("populated 18 MiB at open") != std::string::npos);
  }
  SECTION("the default populates nothing") {
    HostTierOptions o;
    o.capacity_bytes = 32 * kMiB;
    o.chunk_bytes = kChunk;
    o.pin = false;
    auto t = HostTier::Create(o);
    REQUIRE(t.ok());
    CHECK((*t)->arena_bytes() == 0);
    CHECK((*t)->Regions().empty());
  }
  SECTION("a populated tier stores and returns blocks, and grows past the populated chunks") {
    auto t = MakeHost(HostPopulate::kAtOpen, 4 * kMiB, 16 * kMiB);
    std::vector<std::vector<std::byte>> data;
    for (std::uint64_t i = 0; i < 10; ++i) {  // 10 x 1 MiB: past the first (populated) chunk
      data.push_back(TestBytes(i + 100, 1 * kMiB));
      REQUIRE(t->Put(TestKey(i), DescribeBlock(data.back()), data.back()).ok());
    }
    CHECK(t->arena_bytes() == 12 * kMiB);
    for (std::uint64_t i = 0; i < 10; ++i) {
      std::vector<std::byte> out(data[i].size());
      REQUIRE(t->Get(TestKey(i), out, nullptr).ok());
      CHECK(out == data[i]);
    }
    CHECK(t->CheckInvariants());
  }
}

TEST_CASE("Host tier puts during a background populate return correct data") {
  for (bool prefault : {false, true}) {
    INFO("prefault " << prefault);
    const std::uint64_t capacity = terrace::testing::kSanitizedBuild ? 24 * kMiB : 64 * kMiB;
    auto t = MakeHost(HostPopulate::kBackground, 0, capacity, prefault);
    CHECK(t->arena_bytes() == capacity);  // mapped at open, faulted behind Create's back
    std::mt19937_64 rng(5);
    std::map<std::uint64_t, std::vector<std::byte>> expect;
    const int steps = terrace::testing::kSanitizedBuild ? 40 : 120;
    for (int i = 0; i < steps; ++i) {  // starts at once: the puts race the populate over the same chunks
      const std::uint64_t id = rng() % 30;
      auto data = TestBytes(id * 7919 + static_cast<std::uint64_t>(i), 1 + rng() % (700 * 1024));
      REQUIRE(t->Put(TestKey(id), DescribeBlock(data), data).ok());
      expect[id] = std::move(data);
    }
    auto check_all = [&] {
      for (const auto& [id, want] : expect) {
        std::vector<std::byte> got(want.size());
        BlockDesc d;
        REQUIRE(t->Get(TestKey(id), got, &d).ok());
        CHECK(d == DescribeBlock(want));
        CHECK(got == want);
      }
    };
    check_all();
    t->WaitForPrefault();
    const auto [resident, pages] = Residency(*t);
    CHECK(pages == capacity / 4096);
    CHECK(resident == pages);
    check_all();  // faulting the rest changed no stored byte
    CHECK(t->CheckInvariants());
  }
}
