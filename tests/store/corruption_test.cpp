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

// Acquire hands out a pointer into the tier's memory: a host-memory copy that no longer matches its
// checksum is dropped there and never handed out. With a good copy below, the handle holds its bytes
// (brought up again); with none, Acquire is Corruption. Either way the drop is counted.
TEST_CASE("Acquire of a corrupt host copy: the handle holds the lower copy's bytes, or Corruption with none") {
  const bool lower_copy = GENERATE(true, false);
  INFO("good copy in nvme: " << lower_copy);
  StoreOptions o = Quiet();
  if (lower_copy) o.write_policy = WritePolicy::kWriteThrough;  // the put also lands in nvme
  FakeTiers f(0, 1 << 20, 1 << 22);
  FakeTier& host = f.at(TierId::kHost);
  FakeTier& nvme = f.at(TierId::kNvme);
  auto store = OpenFakeStore(f, o);
  const BlockKey key = TestKey(20);
  const auto bytes = TestBytes(20, kCorruptionBlock);
  REQUIRE(store->Put(key, bytes, {Codec::kRaw, TierId::kHost}).ok());
  REQUIRE(host.Has(key));
  REQUIRE(nvme.Has(key) == lower_copy);
  REQUIRE(host.CorruptStored(key));  // at rest, in the memory a handle would point into

  auto h = store->Acquire(key, TierId::kHost);
  const StoreStats st = store->Stats();
  CHECK(st.corruptions_dropped == 1);
  CHECK(st.tiers[static_cast<int>(TierId::kHost)].corruptions == 1);
  if (lower_copy) {
    INFO(h.status().ToString());
    REQUIRE(h.ok());
    CHECK(h->tier() == TierId::kHost);
    REQUIRE(h->size() == bytes.size());
    CHECK(std::vector<std::byte>(h->data(), h->data() + h->size()) == bytes);
    h->Release();
    CHECK(*GetBytes(*store, key) == bytes);
  } else {
    REQUIRE_FALSE(h.ok());
    CHECK(h.status().IsCorruption());
    CHECK_THAT(h.status().message(), Catch::Contains(key.ToString()));
    CHECK_FALSE(store->Contains(key));
    CHECK(GetBytes(*store, key).status().IsCorruption());
  }
}

TEST_CASE("Stats: a tier read's IoError is counted in the tier's io_errors") {
  FaultStore fs(Quiet());
  REQUIRE(fs.store->Put(TestKey(4), TestBytes(4, kCorruptionBlock), {Codec::kRaw, TierId::kNvme}).ok());
  fs.nvme->FailNextGets(1, FaultInjectingTier::Eio(true));
  REQUIRE(GetBytes(*fs.store, TestKey(4)).status().IsIoError());
  CHECK(fs.store->Stats().tiers[static_cast<int>(TierId::kNvme)].io_errors == 1);
}

TEST_CASE("Stats: a Get of an absent key is a miss in every tier") {
  FaultStore fs(Quiet());
  REQUIRE_FALSE(GetBytes(*fs.store, TestKey(99)).ok());
  const StoreStats st = fs.store->Stats();
  for (const auto& s : st.slots) CHECK(s.misses == 1);
}

TEST_CASE("Stats: a put-tier copy read again on the locked path is not a lower-tier read") {
  // The unlocked read of the host copy fails once; the locked path reads the same host copy.
  FaultStore fs(Quiet());
  REQUIRE(fs.store->Put(TestKey(5), TestBytes(5, kCorruptionBlock), {Codec::kRaw, TierId::kHost}).ok());
  fs.host->FailNextGets(1, FaultInjectingTier::Eio(true));
  auto got = GetBytes(*fs.store, TestKey(5));
  REQUIRE(got.ok());
  CHECK(*got == TestBytes(5, kCorruptionBlock));
  const StoreStats st = fs.store->Stats();
  CHECK(st.tiers[static_cast<int>(TierId::kHost)].hits == 1);
  CHECK(st.lower_tier_reads == 0);
}

}  // namespace
}  // namespace terrace::testing
