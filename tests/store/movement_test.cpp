// Movement between tiers: eviction with demotion, promotion, placement modes, write-through,
// watermarks, pins, and the never-drop-the-last-copy rule.
#include <catch2/catch.hpp>

#include <thread>

#include <fmt/format.h>

#include "store_test_util.h"
#include "tiers/fault/fault_tier.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kMoveBlock = 1024;

std::uint64_t Blocks(FakeTiers& f) {
  std::uint64_t n = 0;
  for (auto* t : f.fake) n += t ? t->block_count() : 0;
  return n;
}

TEST_CASE("Eviction demotes down the hierarchy and every block stays readable") {
  auto policy = GENERATE(EvictionPolicy::kLru, EvictionPolicy::kS3Fifo);
  FakeTiers f(8 * kMoveBlock, 8 * kMoveBlock, 1 << 20);
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHbm;
  o.eviction = policy;
  auto store = OpenFakeStore(f, o);
  for (int i = 0; i < 30; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  CHECK(f.at(TierId::kHbm).used_bytes() <= 8 * kMoveBlock);
  CHECK(f.at(TierId::kHost).used_bytes() <= 8 * kMoveBlock);
  CHECK(f.at(TierId::kNvme).block_count() >= 14);
  CHECK(Blocks(f) == 30);  // exclusive: exactly one copy each
  auto st = store->Stats();
  CHECK(st.demotions >= 22);
  CHECK(st.tiers[0].evictions > 0);
  for (int i = 0; i < 30; ++i) {
    auto got = GetBytes(*store, TestKey(i));
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kMoveBlock));
  }
}

TEST_CASE("When the lowest tier is full, a put fails with OutOfCapacity and nothing is lost") {
  FakeTiers f(0, 4 * kMoveBlock, 2 * kMoveBlock);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 6; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  Status s = store->Put(TestKey(6), TestBytes(6, kMoveBlock));
  REQUIRE(s.IsOutOfCapacity());
  CHECK_THAT(s.message(), Catch::Contains("never drops"));
  CHECK_FALSE(store->Contains(TestKey(6)));
  for (int i = 0; i < 6; ++i) CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kMoveBlock));
}

TEST_CASE("With no tier below, eviction from the only tier never drops blocks") {
  FakeTiers f(0, 4 * kMoveBlock, 0);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 4; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  CHECK(store->Put(TestKey(9), TestBytes(9, kMoveBlock)).IsOutOfCapacity());
  for (int i = 0; i < 4; ++i) CHECK(store->Contains(TestKey(i)));
}

TEST_CASE("lowest_tier_evicts: a cache store drops its oldest blocks' last copies instead of failing the put") {
  const auto policy = GENERATE(EvictionPolicy::kLru, EvictionPolicy::kS3Fifo);
  const auto write = GENERATE(WritePolicy::kWriteBack, WritePolicy::kWriteThrough);
  FakeTiers f(0, 4 * kMoveBlock, 8 * kMoveBlock);
  StoreOptions o = Quiet();
  o.eviction = policy;
  o.write_policy = write;
  o.lowest_tier_evicts = true;
  o.promote_on_get = false;  // the reads below move nothing (a promotion could drop another block)
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Pin(TestKey(0)).IsNotFound());
  REQUIRE(store->Put(TestKey(0), TestBytes(0, kMoveBlock)).ok());
  REQUIRE(store->Pin(TestKey(0)).ok());  // a pinned block is never dropped
  constexpr int kPuts = 40;
  for (int i = 1; i < kPuts; ++i) {
    const Status put = store->Put(TestKey(i), TestBytes(i, kMoveBlock));
    INFO("put " << i << ": " << put.ToString());
    REQUIRE(put.ok());
  }
  int present = 0;
  for (int i = 0; i < kPuts; ++i) {
    auto got = GetBytes(*store, TestKey(i));
    if (got.ok()) {
      ++present;
      CHECK(*got == TestBytes(i, kMoveBlock));  // what stays reads back exactly
    } else {
      CHECK(got.status().IsNotFound());  // a dropped block is gone, never returned wrong
    }
  }
  const StoreStats st = store->Stats();
  CHECK(GetBytes(*store, TestKey(0)).ok());
  CHECK(GetBytes(*store, TestKey(kPuts - 1)).ok());  // the newest block was admitted
  CHECK(st.dropped_blocks == static_cast<std::uint64_t>(kPuts - present));
  CHECK(st.dropped_blocks >= kPuts - 12);  // 4 + 8 blocks of room at most
  CHECK(st.blocks == static_cast<std::uint64_t>(present));
  CHECK_THAT(store->PrometheusText(),
             Catch::Contains(fmt::format("terrace_store_dropped_blocks_total {}\n", st.dropped_blocks)));
  REQUIRE(store->Unpin(TestKey(0)).ok());
}

TEST_CASE("lowest_tier_evicts: a block whose faster copy was lost reads NotFound once evicted, not Corruption") {
  FakeTiers f(0, 4 * kMoveBlock, 4 * kMoveBlock);
  StoreOptions o = Quiet();
  o.lowest_tier_evicts = true;
  o.write_policy = WritePolicy::kWriteThrough;  // a host and an NVMe copy of each block
  o.promote_on_get = false;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(0), TestBytes(0, kMoveBlock)).ok());
  REQUIRE(f.at(TierId::kHost).CorruptStored(TestKey(0)));
  auto got = GetBytes(*store, TestKey(0));  // the host copy fails its check and is dropped; NVMe serves
  REQUIRE(got.ok());
  CHECK(*got == TestBytes(0, kMoveBlock));
  for (int i = 1; i < 12; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  REQUIRE(store->Stats().dropped_blocks > 0);
  REQUIRE_FALSE(store->Contains(TestKey(0)));  // its NVMe copy was the oldest: evicted
  auto again = GetBytes(*store, TestKey(0));
  INFO(again.status().ToString());
  CHECK(again.status().IsNotFound());
}

TEST_CASE("Promotion on get: exclusive moves the block, inclusive keeps the lower copy") {
  auto placement = GENERATE(Placement::kExclusive, Placement::kInclusive);
  FakeTiers f(0, 1 << 20, 1 << 20);
  StoreOptions o = Quiet();
  o.placement = placement;
  auto store = OpenFakeStore(f, o);
  BlockKey key = TestKey(1);
  REQUIRE(store->Put(key, TestBytes(1, kMoveBlock), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  CHECK(TierOf(*store, key) == TierId::kNvme);
  REQUIRE(GetBytes(*store, key).ok());
  CHECK(TierOf(*store, key) == TierId::kHost);
  CHECK(f.at(TierId::kHost).Has(key));
  CHECK(f.at(TierId::kNvme).Has(key) == (placement == Placement::kInclusive));
  CHECK(store->Stats().promotions == 1);
}

TEST_CASE("Inclusive eviction drops the clean upper copy without writing it again") {
  FakeTiers f(0, 2 * kMoveBlock, 1 << 20);
  StoreOptions o = Quiet();
  o.placement = Placement::kInclusive;
  auto store = OpenFakeStore(f, o);
  for (int i = 0; i < 2; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock), {Codec::kRaw, TierId::kNvme}).ok());
  for (int i = 0; i < 2; ++i) REQUIRE(GetBytes(*store, TestKey(i)).ok());  // now in host too
  auto nvme_puts = f.at(TierId::kNvme).Stats().puts;
  REQUIRE(store->Put(TestKey(5), TestBytes(5, kMoveBlock)).ok());  // evicts one clean copy
  CHECK(f.at(TierId::kNvme).Stats().puts == nvme_puts);
  CHECK(store->Stats().demotions == 0);
  CHECK(store->Stats().evictions == 1);
  for (int i = 0; i < 2; ++i) CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kMoveBlock));
}

TEST_CASE("promote_on_get = false leaves the block where it is") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  StoreOptions o = Quiet();
  o.promote_on_get = false;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kMoveBlock), {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(GetBytes(*store, TestKey(1)).ok());
  CHECK(TierOf(*store, TestKey(1)) == TierId::kNvme);
  CHECK(store->Stats().tiers[2].hits == 1);
  CHECK(store->Stats().tiers[1].misses == 1);
}

TEST_CASE("GetOptions::promote overrides promote_on_get per call, for Get and GetBatch") {
  const bool store_default = GENERATE(true, false);
  CAPTURE(store_default);
  FakeTiers f(0, 1 << 20, 1 << 20);
  StoreOptions o = Quiet();
  o.promote_on_get = store_default;
  auto store = OpenFakeStore(f, o);
  for (int i = 0; i < 6; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock), {Codec::kRaw, TierId::kNvme}).ok());
  std::vector<std::byte> buf(kMoveBlock);
  // Single Gets: key 0 against the store's default, key 1 forced not to move, key 2 forced to.
  REQUIRE(store->Get(TestKey(0), buf).ok());
  CHECK(buf == TestBytes(0, kMoveBlock));
  CHECK(TierOf(*store, TestKey(0)) == (store_default ? TierId::kHost : TierId::kNvme));
  REQUIRE(store->Get(TestKey(1), buf, GetOptions{false}).ok());
  CHECK(buf == TestBytes(1, kMoveBlock));
  CHECK(TierOf(*store, TestKey(1)) == TierId::kNvme);
  REQUIRE(store->Get(TestKey(2), buf, GetOptions{true}).ok());
  CHECK(buf == TestBytes(2, kMoveBlock));
  CHECK(TierOf(*store, TestKey(2)) == TierId::kHost);
  // A batch: keys 3, 4 with promotion off, then key 5 with it on.
  std::vector<std::vector<std::byte>> out(3, std::vector<std::byte>(kMoveBlock));
  std::vector<Store::GetItem> items = {{TestKey(3), out[0], {}}, {TestKey(4), out[1], {}}};
  for (const Status& s : store->GetBatch(items, GetOptions{false})) REQUIRE(s.ok());
  std::vector<Store::GetItem> one = {{TestKey(5), out[2], {}}};
  REQUIRE(store->GetBatch(one, GetOptions{true})[0].ok());
  for (int i = 3; i < 6; ++i) CHECK(out[static_cast<std::size_t>(i - 3)] == TestBytes(i, kMoveBlock));
  CHECK(TierOf(*store, TestKey(3)) == TierId::kNvme);
  CHECK(TierOf(*store, TestKey(4)) == TierId::kNvme);
  CHECK(TierOf(*store, TestKey(5)) == TierId::kHost);
  CHECK(store->Stats().promotions == (store_default ? 3u : 2u));
}

TEST_CASE("Write-through puts reach the lowest tier before returning") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kMoveBlock)).ok());
  CHECK(f.at(TierId::kHost).Has(TestKey(1)));
  CHECK(f.at(TierId::kNvme).Has(TestKey(1)));
}

TEST_CASE("A failed write-through put leaves nothing visible") {
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  auto host = std::make_unique<FakeTier>(TierId::kHost, 1 << 20);
  auto* host_raw = host.get();
  auto fault = std::make_unique<FaultInjectingTier>(std::make_unique<FakeTier>(TierId::kNvme, 1 << 20));
  auto* fault_raw = fault.get();
  tiers[1] = std::move(host);
  tiers[2] = std::move(fault);
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = std::move(Store::OpenWithTiers(o, std::move(tiers)).value());
  fault_raw->FailNextPuts(1, FaultInjectingTier::Eio(false));
  Status s = store->Put(TestKey(1), TestBytes(1, kMoveBlock));
  CHECK(s.IsIoError());
  CHECK_FALSE(store->Contains(TestKey(1)));
  CHECK_FALSE(host_raw->Has(TestKey(1)));
}

TEST_CASE("A write-through put too large for its target tier is refused before the lowest tier is written") {
  FakeTiers f(0, 2 * kMoveBlock, 1 << 20);
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kMoveBlock)).ok());
  const std::uint64_t nvme_puts = f.at(TierId::kNvme).puts();
  Status s = store->Put(TestKey(1), TestBytes(2, 3 * kMoveBlock));  // larger than the host tier
  CHECK(s.IsOutOfCapacity());
  CHECK_THAT(s.message(), Catch::Contains("larger than tier host allows"));
  CHECK(f.at(TierId::kNvme).puts() == nvme_puts);
  auto got = GetBytes(*store, TestKey(1));
  REQUIRE(got.ok());  // the acknowledged version survives the refused put
  CHECK(*got == TestBytes(1, kMoveBlock));
  CHECK(f.at(TierId::kHost).Has(TestKey(1)));
  CHECK(store->Stats().puts_placed_lower == 0);
}

TEST_CASE("A write-through put whose target tier is full of pinned blocks is stored in the lowest tier") {
  FakeTiers f(0, 3 * kMoveBlock, 1 << 20);
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kMoveBlock)).ok());
  for (int i = 2; i < 4; ++i) {
    REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
    REQUIRE(store->Pin(TestKey(i)).ok());
  }
  // The new version needs two blocks' room in host; the only unpinned block there is its own.
  Status s = store->Put(TestKey(1), TestBytes(11, 2 * kMoveBlock));
  INFO(s.ToString());
  REQUIRE(s.ok());
  auto got = GetBytes(*store, TestKey(1));
  REQUIRE(got.ok());
  CHECK(*got == TestBytes(11, 2 * kMoveBlock));
  CHECK(TierOf(*store, TestKey(1)) == TierId::kNvme);
  CHECK_FALSE(f.at(TierId::kHost).Has(TestKey(1)));  // the previous version's host copy is gone
  CHECK(store->Stats().puts_placed_lower == 1);
  CHECK_THAT(store->PrometheusText(), Catch::Contains("terrace_store_puts_placed_lower_total 1"));
  // A key new to the store, likewise.
  REQUIRE(store->Put(TestKey(4), TestBytes(4, 2 * kMoveBlock)).ok());
  CHECK(TierOf(*store, TestKey(4)) == TierId::kNvme);
  CHECK(*GetBytes(*store, TestKey(4)) == TestBytes(4, 2 * kMoveBlock));
  CHECK(store->Stats().puts_placed_lower == 2);
  for (int i = 2; i < 4; ++i) CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kMoveBlock));
}

TEST_CASE("A failing demotion fails the put and keeps the victim") {
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[1] = std::make_unique<FakeTier>(TierId::kHost, 2 * kMoveBlock);
  auto fault = std::make_unique<FaultInjectingTier>(std::make_unique<FakeTier>(TierId::kNvme, 1 << 20));
  auto* fault_raw = fault.get();
  tiers[2] = std::move(fault);
  auto store = std::move(Store::OpenWithTiers(Quiet(), std::move(tiers)).value());
  for (int i = 0; i < 2; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  fault_raw->FailNextPuts(1000, FaultInjectingTier::Eio(true));
  Status failed = store->Put(TestKey(2), TestBytes(2, kMoveBlock));
  CHECK(failed.IsIoError());  // the demotion error, not a generic OutOfCapacity
  CHECK_THAT(failed.message(), Catch::Contains("demoted"));
  CHECK_FALSE(store->Contains(TestKey(2)));
  fault_raw->Disarm();
  for (int i = 0; i < 2; ++i) CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kMoveBlock));
  CHECK(store->Put(TestKey(2), TestBytes(2, kMoveBlock)).ok());
}

TEST_CASE("Pinned blocks are never evicted") {
  FakeTiers f(0, 4 * kMoveBlock, 1 << 20);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 4; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  REQUIRE(store->Pin(TestKey(0)).ok());
  auto handle = store->Acquire(TestKey(1));
  REQUIRE(handle.ok());
  for (int i = 10; i < 30; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  CHECK(TierOf(*store, TestKey(0)) == TierId::kHost);
  CHECK(TierOf(*store, TestKey(1)) == TierId::kHost);
  CHECK(std::equal(handle->data(), handle->data() + kMoveBlock, TestBytes(1, kMoveBlock).begin()));
}

TEST_CASE("All blocks pinned: a put that needs room fails with OutOfCapacity") {
  FakeTiers f(0, 2 * kMoveBlock, 1 << 20);
  auto store = OpenFakeStore(f);
  for (int i = 0; i < 2; ++i) {
    REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
    REQUIRE(store->Pin(TestKey(i)).ok());
  }
  CHECK(store->Put(TestKey(5), TestBytes(5, kMoveBlock)).IsOutOfCapacity());
  REQUIRE(store->Put(TestKey(5), TestBytes(5, kMoveBlock), {Codec::kRaw, TierId::kNvme}).ok());
}

TEST_CASE("A put a fragmented tier refuses says fragmented, not full, naming the free bytes") {
  FakeTiers f(0, 4 * kMoveBlock, 1 << 20);
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(TestKey(0), TestBytes(0, kMoveBlock)).ok());
  REQUIRE(store->Pin(TestKey(0)).ok());
  f.at(TierId::kHost).fragmented = true;  // 3 blocks free by count, none in one run
  const Status s = store->Put(TestKey(1), TestBytes(1, kMoveBlock), {Codec::kRaw, TierId::kHost});
  REQUIRE(s.IsOutOfCapacity());
  INFO(s.ToString());
  CHECK(s.message().find("fragmented") != std::string::npos);
  CHECK(s.message().find("tier host is full") == std::string::npos);
  const std::string used = "(" + std::to_string(kMoveBlock) + " of " + std::to_string(4 * kMoveBlock) + " bytes used)";
  CHECK(s.message().find(used) != std::string::npos);
}

TEST_CASE("Background demotion drains a tier from its high to its low watermark") {
  FakeTiers f(0, 10 * kMoveBlock, 1 << 20);
  StoreOptions o;
  o.high_watermark = 0.5;
  o.low_watermark = 0.3;
  auto store = OpenFakeStore(f, o);
  // Only the 6th put crosses the high watermark (6 > 5 blocks), so exactly one drain runs.
  for (int i = 0; i < 6; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  // Background work is asynchronous: wait (bounded) for it to reach the low watermark.
  for (int i = 0; i < 1000 && f.at(TierId::kHost).used_bytes() > 3 * kMoveBlock; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(f.at(TierId::kHost).used_bytes() <= 3 * kMoveBlock);
  CHECK(f.at(TierId::kHost).used_bytes() >= 2 * kMoveBlock);  // stops near the low watermark, not at zero
  CHECK(Blocks(f) == 6);
  for (int i = 0; i < 6; ++i) CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kMoveBlock));
}

}  // namespace
}  // namespace terrace::testing

namespace terrace::testing {
namespace {

// Hot keys read repeatedly, then a scan of one-hit puts: how many hot keys are still in host.
int HotInHostAfterScan(EvictionPolicy policy) {
  FakeTiers f(0, 20 * kMoveBlock, 1 << 20);
  StoreOptions o = Quiet();
  o.eviction = policy;
  auto store = OpenFakeStore(f, o);
  for (int i = 0; i < 10; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) REQUIRE(GetBytes(*store, TestKey(i)).ok());
  }
  for (int i = 100; i < 200; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kMoveBlock)).ok());
  int hot = 0;
  for (int i = 0; i < 10; ++i) hot += TierOf(*store, TestKey(i)) == TierId::kHost ? 1 : 0;
  return hot;
}

TEST_CASE("Store-level scan resistance: S3-FIFO keeps hot blocks in host, LRU demotes them") {
  CHECK(HotInHostAfterScan(EvictionPolicy::kS3Fifo) >= 9);
  CHECK(HotInHostAfterScan(EvictionPolicy::kLru) == 0);
}

}  // namespace
}  // namespace terrace::testing
