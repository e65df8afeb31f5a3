#include <catch2/catch.hpp>

#include <vector>

#include "test_util.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/hbm/hbm_tier.h"

using namespace terrace;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

// A 16 MiB emulated HBM tier with a 50 GB/s, 1.5 us link.
std::unique_ptr<Tier> EmulatedTier() {
  HbmTierOptions o;
  o.mode = HbmMode::kEmulated;
  o.capacity_bytes = 16 * kMiB;
  o.link.bandwidth_bytes_per_s = 50e9;
  o.link.latency_us = 1.5;
  auto r = CreateHbmTier(o);
  REQUIRE(r.ok());
  return std::move(r).value();
}

}  // namespace

TEST_CASE("Emulated HBM says so in caps and stats, and accounts the link model exactly") {
  auto tier = EmulatedTier();
  auto& t = *tier;
  CHECK(t.caps().id == TierId::kHbm);
  CHECK(t.caps().emulated);
  CHECK(t.caps().memory == MemoryKind::kHost);
  auto* emu = dynamic_cast<EmulatedHbmTier*>(&t);
  REQUIRE(emu != nullptr);
  CHECK(emu->LinkNanos(0) == 1500);
  CHECK(emu->LinkNanos(50'000'000) == 1'001'500);  // 50 MB at 50 GB/s = 1 ms, plus latency

  std::uint64_t expected = 0;
  for (std::uint64_t i = 0; i < 6; ++i) {
    auto data = TestBytes(i, 1000 + i * 300000);
    REQUIRE(t.Put(TestKey(i), DescribeBlock(data), data).ok());
    expected += emu->LinkNanos(data.size());
    std::vector<std::byte> out(data.size());
    BlockDesc d;
    REQUIRE(t.Get(TestKey(i), out, &d).ok());
    expected += emu->LinkNanos(data.size());
    CHECK(out == data);
  }
  std::vector<std::byte> out(16);
  BlockDesc d;
  CHECK(t.Get(TestKey(99), out, &d).IsNotFound());  // misses cross no link
  CHECK(emu->modelled_link_ns() == expected);
  auto s = t.Stats();
  CHECK(s.emulated);
  CHECK(s.name.find("emulated") != std::string::npos);
  CHECK(s.detail.find("50 GB/s") != std::string::npos);
  CHECK(s.puts == 6);
  CHECK(s.write_p50_ns >= 1500);  // op latency includes the modelled link time
}

TEST_CASE("Emulated HBM charges the link for a range's length, not the block's") {
  auto tier = EmulatedTier();
  auto& t = *tier;
  auto& emu = dynamic_cast<EmulatedHbmTier&>(t);
  auto data = TestBytes(7, 4 * kMiB);
  REQUIRE(t.Put(TestKey(7), DescribeBlock(data), data).ok());
  std::vector<std::byte> a(5000), b(1);
  std::vector<RangeOp> ops = {{TestKey(7), 12345, 5000, a, {}},
                              {TestKey(99), 0, 1, b, {}},  // a miss crosses no link
                              {TestKey(7), data.size() - 1, 1, b, {}}};
  const std::uint64_t before = emu.modelled_link_ns();
  auto st = t.GetRangeBatch(ops);
  REQUIRE(st[0].ok());
  CHECK(st[1].IsNotFound());
  REQUIRE(st[2].ok());
  CHECK(ops[0].desc == DescribeBlock(data));
  CHECK(std::equal(a.begin(), a.end(), data.begin() + 12345));
  CHECK(b[0] == data.back());
  CHECK(emu.modelled_link_ns() - before == emu.LinkNanos(5000) + emu.LinkNanos(1));
}

TEST_CASE("Emulated HBM with the link model off charges nothing") {
  HbmTierOptions o;
  o.mode = HbmMode::kEmulated;
  o.capacity_bytes = 4 * kMiB;
  o.link.enabled = false;
  auto r = CreateHbmTier(o);
  REQUIRE(r.ok());
  auto data = TestBytes(1, 100000);
  REQUIRE((*r)->Put(TestKey(1), DescribeBlock(data), data).ok());
  CHECK(dynamic_cast<EmulatedHbmTier&>(**r).modelled_link_ns() == 0);
  CHECK((*r)->Stats().detail.find("link model off") != std::string::npos);
}

TEST_CASE("HBM mode selection") {
  HbmTierOptions o;
  o.capacity_bytes = 4 * kMiB;
  o.mode = HbmMode::kOff;
  CHECK(CreateHbmTier(o).status().IsInvalidArgument());
  o.mode = HbmMode::kAuto;
  auto a = CreateHbmTier(o);
  REQUIRE(a.ok());
  CHECK((*a)->caps().emulated == !HbmCudaDeviceAvailable());
  o.mode = HbmMode::kCuda;
  auto c = CreateHbmTier(o);
  if (HbmCudaDeviceAvailable()) {
    CHECK(c.ok());
  } else {
    CHECK(c.status().code() == Code::kUnavailable);
    CHECK(c.status().message().find("emulated") != std::string::npos);
  }
  o.mode = HbmMode::kEmulated;
  o.link.bandwidth_bytes_per_s = 0;
  CHECK(CreateHbmTier(o).status().IsInvalidArgument());
}

TEST_CASE("Emulated HBM errors name the HBM tier, not the host memory that emulates it") {
  auto tier = EmulatedTier();
  // Larger than the whole 16 MiB tier (the emulation's largest block).
  auto big = TestBytes(1, 17 * kMiB);
  const Status s = tier->Put(TestKey(1), DescribeBlock(big), big);
  REQUIRE(s.IsOutOfCapacity());
  INFO(s.ToString());
  CHECK(s.message().find("hbm (emulated) tier") != std::string::npos);
  CHECK(s.message().find("host tier") == std::string::npos);
  auto data = TestBytes(2, 4096);
  REQUIRE(tier->Put(TestKey(2), DescribeBlock(data), data).ok());
  std::vector<std::byte> small(16);
  const Status g = tier->Get(TestKey(2), small, nullptr);
  REQUIRE(g.IsInvalidArgument());
  INFO(g.ToString());
  CHECK(g.message().find("hbm (emulated) tier") != std::string::npos);
}
