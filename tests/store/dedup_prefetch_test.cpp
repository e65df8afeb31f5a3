// In-flight deduplication and prefetch (targets, deadlines, cancel, yielding to demand).
#include <catch2/catch.hpp>

#include <latch>
#include <thread>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kDedupBlock = 4096;

TEST_CASE("Concurrent Gets of one key read the lower tier once") {
  bool promote = GENERATE(true, false);
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.promote_on_get = promote;
  auto store = OpenFakeStore(f, o);
  BlockKey key = TestKey(1);
  auto bytes = TestBytes(1, kDedupBlock);
  REQUIRE(store->Put(key, bytes, {Codec::kRaw, TierId::kNvme}).ok());
  nvme.get_delay_ms = 300;  // long enough that every caller arrives while the first read runs
  constexpr int kThreads = 6;
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  std::vector<int> good(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      auto r = GetBytes(*store, key);
      good[t] = r.ok() && *r == bytes;
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) CHECK(good[t] == 1);
  CHECK(nvme.gets() == 1);
  auto st = store->Stats();
  CHECK(st.dedup_hits == kThreads - 1);
  CHECK(st.lower_tier_reads == 1);
}

TEST_CASE("A Get that joins a move-only fetch (a prefetch) still gets the block's bytes") {
  // put_tier hbm: a block in the host tier is below the promotion tier, so a Get of it takes the
  // deduplicated path and joins a prefetch already moving it (whose leader has no buffer of its own).
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  const BlockKey key = TestKey(7);
  const auto bytes = TestBytes(7, kDedupBlock + 123);
  GetGate gate(f.at(TierId::kHost), key);
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHbm;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(key, bytes, {Codec::kRaw, TierId::kHost}).ok());
  auto moved = store->Prefetch({&key, 1}, TierId::kHbm, Priority::kDemand);
  gate.WaitHeld();  // the prefetch's read of the host copy is in flight
  Result<std::vector<std::byte>> got = Status::NotFound("unset");
  std::thread get([&] { got = GetBytes(*store, key); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // long enough to join the fetch
  gate.Open();
  get.join();
  REQUIRE(moved.get()[0].ok());
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(*got == bytes);
  CHECK(gate.Started(key) == 1);  // the Get did not read the host copy itself
  const StoreStats st = store->Stats();
  CHECK(st.dedup_hits == 1);
  CHECK(st.prefetch_late == 1);
  CHECK(TierOf(*store, key) == TierId::kHbm);
}

TEST_CASE("Prefetch moves blocks up to the target and counts useful prefetches") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  std::vector<BlockKey> keys;
  for (int i = 0; i < 10; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store->Put(keys.back(), TestBytes(i, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  }
  auto fut = store->Prefetch(keys, TierId::kHost, Priority::kHigh);
  auto statuses = fut.get();
  REQUIRE(statuses.size() == keys.size());
  for (const auto& s : statuses) CHECK(s.ok());
  for (const auto& k : keys) CHECK(TierOf(*store, k) == TierId::kHost);
  CHECK(store->Stats().prefetch_issued == 10);
  // A second prefetch to a lower target is a no-op; to hbm it moves further up.
  for (const auto& s : store->Prefetch(keys, TierId::kNvme).get()) CHECK(s.ok());
  CHECK(TierOf(*store, keys[0]) == TierId::kHost);
  for (const auto& s : store->Prefetch({keys.data(), 2}, TierId::kHbm, Priority::kDemand).get()) CHECK(s.ok());
  CHECK(TierOf(*store, keys[0]) == TierId::kHbm);
  REQUIRE(*GetBytes(*store, keys[5]) == TestBytes(5, kDedupBlock));
  CHECK(store->Stats().prefetch_useful >= 1);
  // Missing keys and absent tiers are reported per item.
  BlockKey missing = TestKey(999);
  CHECK(store->Prefetch({&missing, 1}, TierId::kHost).get()[0].IsNotFound());
}

TEST_CASE("Queued prefetches of one priority to different targets each move their blocks to their own target") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  const BlockKey first = TestKey(1), up = TestKey(2), mid = TestKey(3);
  GetGate gate(f.at(TierId::kNvme), first);
  auto store = OpenFakeStore(f);
  for (int i = 1; i <= 3; ++i)
    REQUIRE(store->Put(TestKey(i), TestBytes(i, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  // The first prefetch holds the speculative lane, so the next two wait in one queue, side by side.
  auto f1 = store->Prefetch({&first, 1}, TierId::kHost, Priority::kHigh);
  gate.WaitHeld();
  auto f2 = store->Prefetch({&up, 1}, TierId::kHbm, Priority::kHigh);
  auto f3 = store->Prefetch({&mid, 1}, TierId::kHost, Priority::kHigh);
  gate.Open();
  CHECK(f1.get()[0].ok());
  CHECK(f2.get()[0].ok());
  CHECK(f3.get()[0].ok());
  CHECK(TierOf(*store, first) == TierId::kHost);
  CHECK(TierOf(*store, up) == TierId::kHbm);
  CHECK(TierOf(*store, mid) == TierId::kHost);
}

TEST_CASE("Prefetch to an absent tier is InvalidArgument") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  BlockKey key = TestKey(1);
  REQUIRE(store->Put(key, TestBytes(1, kDedupBlock)).ok());
  CHECK(store->Prefetch({&key, 1}, TierId::kHbm).get()[0].IsInvalidArgument());
}

TEST_CASE("A passed deadline times out every item and moves nothing") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  std::vector<BlockKey> keys;
  for (int i = 0; i < 5; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store->Put(keys.back(), TestBytes(i, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  }
  auto statuses = store->Prefetch(keys, TierId::kHost, Priority::kLow, Clock::now() - std::chrono::seconds(1)).get();
  for (const auto& s : statuses) CHECK(s.code() == Code::kTimedOut);
  for (const auto& k : keys) CHECK(TierOf(*store, k) == TierId::kNvme);
}

TEST_CASE("cancel() stops the items that have not started") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.background_threads = 1;
  auto store = OpenFakeStore(f, o);
  std::vector<BlockKey> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store->Put(keys.back(), TestBytes(i, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  }
  nvme.get_delay_ms = 50;
  auto fut = store->Prefetch(keys, TierId::kHost, Priority::kLow);
  fut.cancel();
  auto statuses = fut.get();
  int cancelled = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (statuses[i].code() == Code::kCancelled) {
      ++cancelled;
      CHECK(TierOf(*store, keys[i]) == TierId::kNvme);
    } else {
      CHECK(statuses[i].ok());
    }
  }
  CHECK(cancelled >= 18);  // at most the item(s) already running complete
}

TEST_CASE("Speculative prefetch does not start while a demand fetch is in flight") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  BlockKey demand_key = TestKey(1), spec_key = TestKey(2);
  GetGate gate(f.at(TierId::kNvme), demand_key);
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(demand_key, TestBytes(1, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(store->Put(spec_key, TestBytes(2, kDedupBlock), {Codec::kRaw, TierId::kNvme}).ok());
  std::thread demand([&] { CHECK(GetBytes(*store, demand_key).ok()); });
  gate.WaitHeld();
  auto fut = store->Prefetch({&spec_key, 1}, TierId::kHost, Priority::kLow);
  CHECK_FALSE(fut.wait_for(std::chrono::milliseconds(200)));  // it must wait for the demand fetch
  CHECK(gate.Started(spec_key) == 0);
  gate.Open();
  demand.join();
  CHECK(fut.get()[0].ok());
  CHECK(TierOf(*store, spec_key) == TierId::kHost);
}

}  // namespace
}  // namespace terrace::testing
