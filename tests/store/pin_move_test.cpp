// Pins across moves, eviction under the thread's own lock stripe, and what the per-tier read
// counters count, over fake tiers (found by a model-based random test of the Store API).
#include <catch2/catch.hpp>

#include <chrono>
#include <thread>

#include "src/store/key_locks.h"
#include "store_test_util.h"
#include "tiers/fault/fault_tier.h"

namespace terrace::testing {
namespace {

using store_internal::KeyLocks;

std::unique_ptr<Store> OpenWithPutTier(FakeTiers& f, TierId put_tier) {
  StoreOptions o = Quiet();
  o.put_tier = put_tier;
  return OpenFakeStore(f, o);
}

TEST_CASE("An Acquire into a lower tier leaves the copy a Pin holds in its tier (exclusive placement)") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHbm);
  const BlockKey k = TestKey(1);
  const auto bytes = TestBytes(1, 100);
  REQUIRE(store->Put(k, bytes).ok());
  REQUIRE(store->Pin(k).ok());
  auto h = store->Acquire(k, TierId::kHost);
  REQUIRE(h.ok());
  CHECK(f.at(TierId::kHbm).Has(k));  // pinned there: never moved out
  CHECK(f.at(TierId::kHost).Has(k));
  h = Status::NotFound("released");  // the handle goes
  REQUIRE(store->Unpin(k).ok());
  auto got = GetBytes(*store, k);
  REQUIRE(got.ok());
  CHECK(*got == bytes);
}

TEST_CASE("A Put evicts a block on its own key's lock stripe when that block is the only victim") {
  const BlockKey x = TestKey(1);
  BlockKey y;
  for (std::uint64_t i = 2;; ++i) {  // a key on x's stripe
    y = TestKey(i);
    if (y.Hash() % KeyLocks::kStripes == x.Hash() % KeyLocks::kStripes) break;
  }
  FakeTiers f(0, 100, 1000);
  auto store = OpenFakeStore(f);
  const auto ybytes = TestBytes(2, 80), xbytes = TestBytes(1, 80);
  REQUIRE(store->Put(y, ybytes).ok());
  REQUIRE(store->Put(x, xbytes).ok());  // y is demoted to make room, though x's lock covers its stripe
  CHECK(f.at(TierId::kHost).Has(x));
  CHECK(f.at(TierId::kNvme).Has(y));
  CheckReadsBack(*store, y, ybytes);
  CheckReadsBack(*store, x, xbytes);
}

// Put(a) into hbm, whose only victim b must be written back into host, held only by a's previous
// version: that version is demoted in turn (the put may still fail, and it must survive that),
// and the put's publication removes it.
TEST_CASE("A Put whose only room below is its own key's previous version demotes that version and succeeds") {
  FakeTiers f(100, 100, 1000);
  auto store = OpenWithPutTier(f, TierId::kHbm);
  const BlockKey a = TestKey(1), b = TestKey(2);
  const auto a1 = TestBytes(1, 80), a2 = TestBytes(3, 80), bb = TestBytes(2, 80);
  REQUIRE(store->Put(a, a1).ok());
  REQUIRE(store->Put(b, bb).ok());  // a is demoted to host
  REQUIRE(f.at(TierId::kHost).Has(a));
  const Status s = store->Put(a, a2);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(f.at(TierId::kHbm).Has(a));
  CHECK(f.at(TierId::kHost).Has(b));
  CHECK_FALSE(f.at(TierId::kNvme).Has(a));  // the previous version, demoted on the way, is gone
  CheckReadsBack(*store, a, a2);
  CheckReadsBack(*store, b, bb);
}

TEST_CASE("A Put that fails after demoting its own key's previous version leaves that version readable") {
  FakeTiers f(100, 100, 1000);
  auto hbm = std::make_unique<FaultInjectingTier>(std::move(f.tiers[0]));
  FaultInjectingTier* faulty = hbm.get();
  f.tiers[0] = std::move(hbm);
  auto store = OpenWithPutTier(f, TierId::kHbm);
  const BlockKey a = TestKey(1), b = TestKey(2);
  const auto a1 = TestBytes(1, 80), a2 = TestBytes(3, 80), bb = TestBytes(2, 80);
  REQUIRE(store->Put(a, a1).ok());
  REQUIRE(store->Put(b, bb).ok());
  faulty->FailNextPuts(1, FaultInjectingTier::Eio(false));  // a2's write into hbm, after the room is made
  const Status s = store->Put(a, a2);
  INFO(s.ToString());
  REQUIRE(s.IsIoError());
  CHECK(f.at(TierId::kNvme).Has(a));  // where the room-making demoted the previous version
  CheckReadsBack(*store, a, a1);
  CheckReadsBack(*store, b, bb);
}

TEST_CASE("A Prefetch with a priority outside the enum is refused, not queued") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kNvme);
  const BlockKey k = TestKey(1);
  REQUIRE(store->Put(k, TestBytes(1, 100)).ok());
  PrefetchOptions o;
  o.priority = static_cast<Priority>(3);
  const std::vector<Status> st = store->Prefetch({&k, 1}, TierId::kHost, o).get();
  REQUIRE(st.size() == 1);
  INFO(st[0].ToString());
  CHECK(st[0].IsInvalidArgument());
  CHECK_THAT(st[0].message(), Catch::Contains("priority 3"));
  CHECK_FALSE(f.at(TierId::kHost).Has(k));
}

// Summed over the store's tiers.
std::uint64_t Misses(Store& store) {
  std::uint64_t n = 0;
  for (const TierStatsSnapshot& t : store.Stats().slots) n += t.misses;
  return n;
}

TEST_CASE("A lost key (every copy dropped as corrupt) is a miss in every tier for Get, GetBatch, GetRanges and Acquire") {
  FakeTiers f(0, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHost);
  const BlockKey k = TestKey(5);
  REQUIRE(store->Put(k, TestBytes(1, 100)).ok());
  REQUIRE(f.at(TierId::kHost).CorruptStored(k));
  REQUIRE(GetBytes(*store, k).status().IsCorruption());  // dropped: lost
  std::uint64_t before = Misses(*store);
  REQUIRE(GetBytes(*store, k).status().IsCorruption());
  CHECK(Misses(*store) - before == 2);
  std::vector<std::byte> buf(256);
  before = Misses(*store);
  std::vector<Store::GetRangeItem> range{{k, 0, 8, buf, {}, TierId::kHost}};
  REQUIRE(store->GetRanges(range)[0].IsCorruption());
  CHECK(Misses(*store) - before == 2);
  before = Misses(*store);
  std::vector<Store::GetItem> batch{{k, buf, {}}};
  REQUIRE(store->GetBatch(batch)[0].IsCorruption());
  CHECK(Misses(*store) - before == 2);
  before = Misses(*store);
  REQUIRE(store->Acquire(k, TierId::kHost).status().IsCorruption());
  CHECK(Misses(*store) - before == 2);
}

TEST_CASE("Per-tier hits and misses count Gets and Acquires, not prefetches") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHost);
  const BlockKey a = TestKey(1), b = TestKey(2), c = TestKey(3);
  PutOptions nvme;
  nvme.tier = TierId::kNvme;
  for (const BlockKey& k : {a, b, c}) REQUIRE(store->Put(k, TestBytes(1, 100), nvme).ok());
  REQUIRE(store->Prefetch({&a, 1}, TierId::kHost).get()[0].ok());
  REQUIRE(f.at(TierId::kHost).Has(a));
  StoreStats st = store->Stats();
  for (const auto& slot : st.slots) {
    INFO(slot.name);
    CHECK(slot.hits == 0);  // a prefetch is no read of the caller's
    CHECK(slot.misses == 0);
  }
  REQUIRE(store->Acquire(b, TierId::kHost).ok());  // a demand read, from nvme
  REQUIRE(GetBytes(*store, c).ok());                // and a Get, from nvme
  st = store->Stats();
  CHECK(st.slots[2].hits == 2);
  CHECK(st.slots[0].misses == 2);
  CHECK(st.slots[1].misses == 2);
}

TEST_CASE("The fake tier gives an empty block a non-null resident pointer, as the Tier contract says") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHost);
  const BlockKey k = TestKey(1);
  REQUIRE(store->Put(k, std::span<const std::byte>{}).ok());
  auto h = store->Acquire(k, TierId::kHost);
  INFO(h.status().ToString());
  REQUIRE(h.ok());
  CHECK(h->size() == 0);
  CHECK(f.at(TierId::kHost).Has(k));
}


TEST_CASE("Acquire counts a hit where it finds the block, and a miss in every tier for an unknown key") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHost);
  const BlockKey k = TestKey(1);
  REQUIRE(store->Put(k, TestBytes(1, 100)).ok());
  REQUIRE(store->Acquire(k, TierId::kHost).ok());  // already there: no read, still a hit
  StoreStats st = store->Stats();
  CHECK(st.slots[0].misses == 1);
  CHECK(st.slots[1].hits == 1);
  CHECK(store->Acquire(TestKey(2), TierId::kHost).status().IsNotFound());
  st = store->Stats();
  for (const auto& slot : st.slots) CHECK(slot.misses == (slot.name == "hbm" ? 2u : 1u));
}

TEST_CASE("A Get that joins an in-flight prefetch of its key counts its read") {
  FakeTiers f(4096, 4096, 1 << 16);
  auto store = OpenWithPutTier(f, TierId::kHost);
  const BlockKey k = TestKey(1);
  PutOptions nvme;
  nvme.tier = TierId::kNvme;
  REQUIRE(store->Put(k, TestBytes(1, 100), nvme).ok());
  f.at(TierId::kNvme).get_delay_ms = 1500;
  auto prefetch = store->Prefetch({&k, 1}, TierId::kHost);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(GetBytes(*store, k).ok());
  REQUIRE(prefetch.get()[0].ok());
  const StoreStats st = store->Stats();
  std::uint64_t reads = 0;
  for (const auto& slot : st.slots) reads += slot.hits;
  CHECK(reads == 1);  // the Get's: served by the prefetch's read from nvme
  CHECK(st.slots[2].hits == 1);
}

}  // namespace
}  // namespace terrace::testing
