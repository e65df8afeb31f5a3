// A Get never returns bytes that fail their checksum: bad copies are dropped, the next copy is
// tried, and with none left the error is Corruption naming the key and tier.
#include <catch2/catch.hpp>

#include <random>

#include "store_test_util.h"
#include "tiers/fault/fault_tier.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kCorruptionBlock = 2048;

struct FaultStore {
  FaultInjectingTier* host = nullptr;
  FaultInjectingTier* nvme = nullptr;
  std::unique_ptr<Store> store;
  explicit FaultStore(const StoreOptions& o) {
    std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
    auto h = std::make_unique<FaultInjectingTier>(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
    auto n = std::make_unique<FaultInjectingTier>(std::make_unique<FakeTier>(TierId::kNvme, 1 << 22));
    host = h.get();
    nvme = n.get();
    tiers[1] = std::move(h);
    tiers[2] = std::move(n);
    auto r = Store::OpenWithTiers(o, std::move(tiers));
    REQUIRE(r.ok());
    store = std::move(*r);
  }
};

TEST_CASE("A bit flip on the only copy yields Corruption naming key and tier; the copy is dropped") {
  FaultStore fs(Quiet());
  BlockKey key = TestKey(1);
  REQUIRE(fs.store->Put(key, TestBytes(1, kCorruptionBlock), {Codec::kRaw, TierId::kNvme}).ok());
  fs.nvme->FlipBitInNextGets(1);
  auto r = GetBytes(*fs.store, key);
  REQUIRE(r.status().IsCorruption());
  CHECK_THAT(r.status().message(), Catch::Contains(key.ToString()));
  CHECK_THAT(r.status().message(), Catch::Contains("nvme"));
  CHECK_FALSE(fs.store->Contains(key));
  CHECK(fs.store->Stats().corruptions_dropped == 1);
}

TEST_CASE("Inclusive: a corrupt upper copy is dropped and the lower copy is returned") {
  StoreOptions o = Quiet();
  o.placement = Placement::kInclusive;
  FaultStore fs(o);
  BlockKey key = TestKey(2);
  auto bytes = TestBytes(2, kCorruptionBlock);
  REQUIRE(fs.store->Put(key, bytes, {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(GetBytes(*fs.store, key).ok());  // promoted; nvme keeps its copy
  REQUIRE(TierOf(*fs.store, key) == TierId::kHost);
  fs.host->FlipBitInNextGets(2);  // the fast path and the locked re-read both see a flip
  auto r = GetBytes(*fs.store, key);
  REQUIRE(r.ok());
  CHECK(*r == bytes);
  CHECK(fs.store->Stats().corruptions_dropped == 1);
}

TEST_CASE("Corruption at rest in a lower tier is caught and never returned") {
  FaultStore fs(Quiet());
  fs.nvme->CorruptNextPuts(1);
  REQUIRE(fs.store->Put(TestKey(3), TestBytes(3, kCorruptionBlock), {Codec::kRaw, TierId::kNvme}).ok());
  auto r = GetBytes(*fs.store, TestKey(3));
  CHECK(r.status().IsCorruption());
  CHECK_FALSE(fs.store->Contains(TestKey(3)));
}

TEST_CASE("I/O errors surface as IoError and keep the block") {
  FaultStore fs(Quiet());
  REQUIRE(fs.store->Put(TestKey(4), TestBytes(4, kCorruptionBlock), {Codec::kRaw, TierId::kNvme}).ok());
  fs.nvme->FailNextGets(1, FaultInjectingTier::Eio(true));
  auto r = GetBytes(*fs.store, TestKey(4));
  REQUIRE(r.status().IsIoError());
  CHECK(r.status().retryable());
  CHECK_THAT(r.status().message(), Catch::Contains(TestKey(4).ToString()));
  CHECK(*GetBytes(*fs.store, TestKey(4)) == TestBytes(4, kCorruptionBlock));
}

TEST_CASE("Random faults: every successful Get returns exactly the bytes put") {
  auto placement = GENERATE(Placement::kExclusive, Placement::kInclusive);
  StoreOptions o = Quiet();
  o.placement = placement;
  FaultStore fs(o);
  RandomFaults rf;
  rf.get_bit_flip = 0.2;
  rf.get_error = 0.1;
  rf.seed = 99;
  constexpr int kKeys = 40;
  for (int i = 0; i < kKeys; ++i) REQUIRE(fs.store->Put(TestKey(i), TestBytes(i, kCorruptionBlock), {Codec::kRaw, TierId::kNvme}).ok());
  fs.nvme->SetRandom(rf);
  fs.host->SetRandom(rf);
  std::mt19937 rng(5);
  int ok = 0, failed = 0;
  for (int n = 0; n < 400; ++n) {
    int i = static_cast<int>(rng() % kKeys);
    auto r = GetBytes(*fs.store, TestKey(i));
    if (r.ok()) {
      ++ok;
      REQUIRE(*r == TestBytes(i, kCorruptionBlock));
    } else {
      ++failed;
      CHECK((r.status().IsCorruption() || r.status().IsIoError() || r.status().IsNotFound()));
    }
  }
  CHECK(ok > 0);
  CHECK(failed > 0);
}

}  // namespace
}  // namespace terrace::testing
