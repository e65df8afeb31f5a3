// Background work never starves demand: speculative prefetch and demotion run in lanes of their
// own, so GetAsync and PutAsync queue behind neither a drain nor a demotion pass, and a prefetch
// waiting for demand wakes on cancel().
#include <catch2/catch.hpp>

#include <chrono>
#include <thread>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kLaneBlock = 4096;
constexpr int kDelayMs = 25;  // the slow tier's time per Get

TEST_CASE("GetAsync and PutAsync during a large speculative prefetch wait for one slow read, not the drain") {
  FakeTiers f(0, 8 << 20, 8 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.background_threads = 2;
  auto store = OpenFakeStore(f, o);
  constexpr int kPrefetched = 192;  // three batched groups: at least kPrefetched * kDelayMs of reads
  std::vector<BlockKey> keys;
  for (int i = 0; i < kPrefetched; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store->Put(keys.back(), TestBytes(i, kLaneBlock), {Codec::kRaw, TierId::kNvme}).ok());
  }
  const BlockKey wanted = TestKey(1000);  // on the slow tier too, not part of the prefetch
  REQUIRE(store->Put(wanted, TestBytes(1000, kLaneBlock), {Codec::kRaw, TierId::kNvme}).ok());
  nvme.get_delay_ms = kDelayMs;

  auto pre = store->Prefetch(keys, TierId::kHost, Priority::kLow);
  while (nvme.gets() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the drain is reading

  std::vector<std::byte> out(kLaneBlock);
  const auto t0 = Clock::now();
  auto get = store->GetAsync(wanted, out);
  const auto put_bytes = TestBytes(2000, kLaneBlock);  // PutAsync: the caller keeps the bytes alive
  auto put = store->PutAsync(TestKey(2000), put_bytes);
  auto r = get.get();
  const auto get_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  REQUIRE(put.get().ok());
  const auto both_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  REQUIRE(r.ok());
  CHECK(std::equal(out.begin(), out.end(), TestBytes(1000, kLaneBlock).begin()));
  INFO("GetAsync took " << get_ms << " ms, GetAsync + PutAsync " << both_ms << " ms; one slow read is "
                        << kDelayMs << " ms; the prefetch needs at least " << kPrefetched * kDelayMs << " ms");
  // Generous: one slow read plus scheduling, far below the drain still running behind it.
  CHECK(get_ms < 10 * kDelayMs);
  CHECK(both_ms < 10 * kDelayMs);
  CHECK_FALSE(pre.is_ready());  // it really was during the prefetch

  pre.cancel();
  auto statuses = pre.get();
  for (const Status& s : statuses) CHECK((s.ok() || s.code() == Code::kCancelled));
}

TEST_CASE("GetAsync and PutAsync do not wait for a background demotion pass") {
  // One pool thread: a demotion pass on it (blocks written one by one into a slow tier) held every
  // async get and put behind it for the whole pass.
  constexpr int kHostBlocks = 200;
  FakeTiers f(0, kHostBlocks * kLaneBlock, 8 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.background_threads = 1;
  o.high_watermark = 0.90;  // demotion on (Quiet turns it off)
  o.low_watermark = 0.75;
  auto store = OpenFakeStore(f, o);
  nvme.put_delay_ms = kDelayMs;
  // Past the 90% watermark: a pass evicts down to 75%, about 30 blocks x kDelayMs into the slow tier.
  const int filled = kHostBlocks * 92 / 100;
  for (int i = 0; i < filled; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kLaneBlock)).ok());
  // The pass is writing (bounded: a store that never demotes fails here instead of hanging).
  for (int i = 0; i < 5000 && nvme.puts() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(nvme.puts() > 0);
  std::vector<std::byte> out(kLaneBlock);
  const auto t0 = Clock::now();
  auto get = store->GetAsync(TestKey(filled - 1), out);  // host-resident, the newest: not a victim yet
  const auto put_bytes = TestBytes(5000, kLaneBlock);
  auto put = store->PutAsync(TestKey(5000), put_bytes);
  auto r = get.get();
  REQUIRE(put.get().ok());
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  REQUIRE(r.ok());
  CHECK(std::equal(out.begin(), out.end(), TestBytes(filled - 1, kLaneBlock).begin()));
  const std::uint64_t demoted_by_then = nvme.puts();
  INFO("GetAsync + PutAsync took " << ms << " ms; the pass writes " << kDelayMs << " ms per block and had written "
                                   << demoted_by_then << " blocks when they returned");
  CHECK(ms < 4 * kDelayMs);
  CHECK(demoted_by_then < 20);  // they returned while the pass was still running
}

TEST_CASE("A speculative prefetch waiting for demand completes on cancel() without waiting for the demand") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  BlockKey demand_key = TestKey(1), spec_key = TestKey(2);
  GetGate gate(f.at(TierId::kNvme), demand_key);
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(demand_key, TestBytes(1, kLaneBlock), {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(store->Put(spec_key, TestBytes(2, kLaneBlock), {Codec::kRaw, TierId::kNvme}).ok());
  std::thread demand([&] { CHECK(GetBytes(*store, demand_key).ok()); });
  gate.WaitHeld();
  auto fut = store->Prefetch({&spec_key, 1}, TierId::kHost, Priority::kLow);
  CHECK_FALSE(fut.wait_for(std::chrono::milliseconds(50)));  // waiting for the demand fetch
  fut.cancel();
  CHECK(fut.wait_for(std::chrono::seconds(5)));  // woken by the cancel, while the demand still runs
  CHECK(fut.get()[0].code() == Code::kCancelled);
  CHECK(gate.Started(spec_key) == 0);
  gate.Open();
  demand.join();
  CHECK(TierOf(*store, spec_key) == TierId::kNvme);
}

}  // namespace
}  // namespace terrace::testing
