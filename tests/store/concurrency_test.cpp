// 8 threads doing mixed put/get/prefetch/acquire/pin/erase on small tiers, so blocks keep moving.
// Every successful read must be exactly some version that was put under that key.
#include <cstdio>
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr int kKeys = 48;
constexpr int kThreads = 8;
constexpr int kOpsPerThread = 800;

// Block content for (key index, version): 16-byte header (index, version), then derived bytes.
std::vector<std::byte> Content(std::uint64_t k, std::uint64_t v) {
  std::size_t size = 512 + (k * 131 + v * 71) % 2048;
  auto bytes = TestBytes(k * 1000003 + v, size, 7);
  std::memcpy(bytes.data(), &k, 8);
  std::memcpy(bytes.data() + 8, &v, 8);
  return bytes;
}

// True if `bytes` is exactly Content(k, v) for the v in its header, with 1 <= v <= max_version.
bool ValidContent(std::uint64_t k, std::span<const std::byte> bytes, std::uint64_t max_version) {
  if (bytes.size() < 16) return false;
  std::uint64_t hk = 0, hv = 0;
  std::memcpy(&hk, bytes.data(), 8);
  std::memcpy(&hv, bytes.data() + 8, 8);
  if (hk != k || hv == 0 || hv > max_version) return false;
  auto want = Content(k, hv);
  return want.size() == bytes.size() && std::equal(want.begin(), want.end(), bytes.begin());
}

// `dropped`: when not null, the store's StoreStats::dropped_blocks once the threads are done.
void RunMixed(std::unique_ptr<Store> store, std::uint64_t* dropped = nullptr) {
  std::array<std::atomic<std::uint64_t>, kKeys> versions{};
  std::atomic<int> bad{0}, good_reads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<std::byte> buf(4096);
      for (int op = 0; op < kOpsPerThread; ++op) {
        std::uint64_t k = rng() % kKeys;
        BlockKey key = TestKey(k);
        switch (rng() % 10) {
          case 0: case 1: case 2: {  // put a new version
            std::uint64_t v = versions[k].fetch_add(1) + 1;
            Status s = store->Put(key, Content(k, v), {Codec::kRaw, static_cast<TierId>(rng() % 3)});
            if (!s.ok() && !s.IsOutOfCapacity() && !s.IsInvalidArgument()) bad.fetch_add(1);
            break;
          }
          case 3: case 4: case 5: {  // get
            auto r = store->Get(key, buf);
            if (r.ok()) {
              good_reads.fetch_add(1);
              if (!ValidContent(k, std::span<const std::byte>(buf).first(r->size), versions[k].load())) bad.fetch_add(1);
              if (Checksum(std::span<const std::byte>(buf).first(r->size)) != r->checksum) bad.fetch_add(1);
            } else if (!r.status().IsNotFound()) {
              bad.fetch_add(1);
              std::fprintf(stderr, "get: %s\n", r.status().ToString().c_str());
            }
            break;
          }
          case 6: {  // prefetch a few keys
            std::vector<BlockKey> keys = {key, TestKey((k + 1) % kKeys), TestKey((k + 2) % kKeys)};
            auto st = store->Prefetch(keys, static_cast<TierId>(rng() % 2), static_cast<Priority>(rng() % 3)).get();
            for (const auto& s : st) {
              if (!s.ok() && !s.IsNotFound() && !s.IsOutOfCapacity()) {
                bad.fetch_add(1);
                std::fprintf(stderr, "prefetch: %s\n", s.ToString().c_str());
              }
            }
            break;
          }
          case 7: {  // acquire and read in place
            auto h = store->Acquire(key, static_cast<TierId>(rng() % 2));
            if (h.ok()) {
              if (!ValidContent(k, {h->data(), h->size()}, versions[k].load())) bad.fetch_add(1);
            } else if (!h.status().IsNotFound() && !h.status().IsOutOfCapacity()) {
              bad.fetch_add(1);
            }
            break;
          }
          case 8: {  // pin, read, unpin
            if (store->Pin(key).ok()) {
              auto r = store->Get(key, buf);
              if (!r.ok() || !ValidContent(k, std::span<const std::byte>(buf).first(r->size), versions[k].load())) {
                bad.fetch_add(1);  // a pinned block cannot disappear
              }
              if (!store->Unpin(key).ok()) bad.fetch_add(1);
            }
            break;
          }
          case 9: {  // erase
            Status s = store->Erase(key);
            if (!s.ok() && !s.IsNotFound() && !s.IsInvalidArgument()) bad.fetch_add(1);
            break;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  if (dropped != nullptr) *dropped = store->Stats().dropped_blocks;
  CHECK(bad.load() == 0);
  CHECK(good_reads.load() > 0);
  // Quiescent: every stored block reads back valid; nothing stays pinned.
  for (int k = 0; k < kKeys; ++k) {
    std::vector<std::byte> buf(4096);
    auto r = store->Get(TestKey(k), buf);
    if (!r.ok()) {
      CHECK(r.status().IsNotFound());
      continue;
    }
    CHECK(ValidContent(k, std::span<const std::byte>(buf).first(r->size), versions[k].load()));
    CHECK(store->Erase(TestKey(k)).ok());
  }
  std::uint64_t left = 0;
  for (const auto& t : store->Stats().tiers) left += t.blocks;
  CHECK(left == 0);  // no orphaned copies in any tier
}

void RunMixedOnFakes(const StoreOptions& o) {
  FakeTiers f(8 * 1024, 24 * 1024, 1 << 20);
  RunMixed(OpenFakeStore(f, o));
}

TEST_CASE("Mixed concurrent operations never expose a torn or foreign block") {
  SECTION("exclusive, write-back, S3-FIFO") {
    StoreOptions o;
    RunMixedOnFakes(o);
  }
  SECTION("inclusive, write-through, LRU, hbm put tier") {
    StoreOptions o;
    o.placement = Placement::kInclusive;
    o.write_policy = WritePolicy::kWriteThrough;
    o.eviction = EvictionPolicy::kLru;
    o.put_tier = TierId::kHbm;
    RunMixedOnFakes(o);
  }
  SECTION("a cache (lowest_tier_evicts) whose lowest tier keeps filling: blocks are dropped, never torn") {
    StoreOptions o;
    o.lowest_tier_evicts = true;
    FakeTiers f(8 * 1024, 8 * 1024, 16 * 1024);  // far less room than the 48 keys take
    std::uint64_t dropped = 0;
    RunMixed(OpenFakeStore(f, o), &dropped);
    CHECK(dropped > 0);
  }
  SECTION("real tiers: emulated hbm, host arena, nvme") {
    TempDir dir("store-mixed");
    auto store = Store::Open(RealTierOptions(dir.path(), 32 * kKiB, 96 * kKiB, 32 * kKiB));
    INFO(store.status().ToString());
    REQUIRE(store.ok());
    RunMixed(std::move(*store));
  }
}


// Puts that must evict from a small host tier over a slow lower tier: while the other threads
// demote the few victims there are, every victim is busy for a while. A put waits for them
// instead of failing OutOfCapacity: nothing is pinned and the lower tier has room for all.
TEST_CASE("Concurrent puts into a full tier wait for busy victims instead of failing") {
  constexpr int kPutThreads = 8, kPutsPerThread = 24;
  constexpr std::size_t kBlock = 1024;
  FakeTiers f(0, 4 * kBlock, 1 << 20);  // room for 4 blocks above, all of them below
  f.at(TierId::kNvme).put_delay_ms = 3;  // demotions hold their victims' locks for a while
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHost;
  auto store = OpenFakeStore(f, o);
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kPutThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPutsPerThread; ++i) {
        const std::uint64_t k = static_cast<std::uint64_t>(t) * 1000 + static_cast<std::uint64_t>(i);
        Status s = store->Put(TestKey(k), TestBytes(k, kBlock, 3));
        if (!s.ok()) {
          failed.fetch_add(1);
          std::fprintf(stderr, "put %llu: %s\n", static_cast<unsigned long long>(k), s.ToString().c_str());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failed.load() == 0);
  std::vector<std::byte> buf(kBlock);
  for (int t = 0; t < kPutThreads; ++t) {
    for (int i = 0; i < kPutsPerThread; ++i) {
      const std::uint64_t k = static_cast<std::uint64_t>(t) * 1000 + static_cast<std::uint64_t>(i);
      auto r = store->Get(TestKey(k), buf);
      REQUIRE(r.ok());
      CHECK(std::equal(buf.begin(), buf.end(), TestBytes(k, kBlock, 3).begin()));
    }
  }
}

}  // namespace
}  // namespace terrace::testing
