// Store::GetBatch and prefetch groups read blocks held only in NVMe with one tier GetBatch, and
// return exactly what single-key Gets return (bytes, statuses, promotion, corruption handling).
#include <catch2/catch.hpp>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kOddBlock = 3000;  // not a multiple of 4 KiB

// Puts n blocks (key i holds TestBytes(i, kOddBlock + i)) straight into the NVMe tier.
std::vector<BlockKey> PutInNvme(Store& store, int n) {
  std::vector<BlockKey> keys;
  for (int i = 0; i < n; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store.Put(keys.back(), TestBytes(i, kOddBlock + i), {Codec::kRaw, TierId::kNvme}).ok());
  }
  return keys;
}

TEST_CASE("GetBatch reads NVMe-only blocks in one tier batch and matches single Gets") {
  const bool promote = GENERATE(true, false);
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.promote_on_get = promote;
  auto store = OpenFakeStore(f, o);
  constexpr int kN = 20;
  auto keys = PutInNvme(*store, kN);
  // Items: every key, a missing key, a duplicate of key 3, and a buffer too small for key 4.
  std::vector<std::vector<std::byte>> bufs(kN + 3, std::vector<std::byte>(kOddBlock + kN));
  std::vector<Store::GetItem> items;
  for (int i = 0; i < kN; ++i) items.push_back({keys[i], bufs[i], {}});
  items.push_back({TestKey(999), bufs[kN], {}});
  items.push_back({keys[3], bufs[kN + 1], {}});
  items.push_back({keys[4], std::span<std::byte>(bufs[kN + 2]).first(10), {}});
  auto st = store->GetBatch(items);
  REQUIRE(st.size() == items.size());
  for (int i = 0; i < kN; ++i) {
    INFO(i << ": " << st[i].ToString());
    REQUIRE(st[i].ok());
    auto want = TestBytes(i, kOddBlock + i);
    CHECK(items[i].desc == DescribeBlock(want));
    CHECK(std::equal(want.begin(), want.end(), bufs[i].begin()));
  }
  CHECK(st[kN].IsNotFound());
  REQUIRE(st[kN + 1].ok());
  CHECK(std::equal(bufs[3].begin(), bufs[3].begin() + kOddBlock + 3, bufs[kN + 1].begin()));
  CHECK(st[kN + 2].IsInvalidArgument());
  CHECK(nvme.batch_calls() == 1);  // the 20 distinct NVMe reads went out together
  CHECK(nvme.batch_ops() == kN);
  for (int i = 0; i < kN; ++i) CHECK(TierOf(*store, keys[i]) == (promote ? TierId::kHost : TierId::kNvme));
  auto stats = store->Stats();
  CHECK(stats.lower_tier_reads >= kN);
  // Equivalence: a second batch (now served by host when promoted) returns the same bytes.
  std::vector<std::vector<std::byte>> again(kN, std::vector<std::byte>(kOddBlock + kN));
  std::vector<Store::GetItem> items2;
  for (int i = 0; i < kN; ++i) items2.push_back({keys[i], again[i], {}});
  for (const auto& s : store->GetBatch(items2)) CHECK(s.ok());
  for (int i = 0; i < kN; ++i) CHECK(again[i] == bufs[i]);
}

TEST_CASE("GetBatch never returns a corrupt NVMe copy: Corruption for it, the rest intact") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  auto store = OpenFakeStore(f);
  auto keys = PutInNvme(*store, 8);
  REQUIRE(nvme.CorruptStored(keys[5]));
  std::vector<std::vector<std::byte>> bufs(8, std::vector<std::byte>(kOddBlock + 8));
  std::vector<Store::GetItem> items;
  for (int i = 0; i < 8; ++i) items.push_back({keys[i], bufs[i], {}});
  auto st = store->GetBatch(items);
  for (int i = 0; i < 8; ++i) {
    INFO(i << ": " << st[i].ToString());
    if (i == 5) {
      CHECK(st[i].IsCorruption());
      CHECK_THAT(st[i].message(), Catch::Contains(keys[5].ToString()) && Catch::Contains("nvme"));
    } else {
      REQUIRE(st[i].ok());
      auto want = TestBytes(i, kOddBlock + i);
      CHECK(std::equal(want.begin(), want.end(), bufs[i].begin()));
    }
  }
  CHECK_FALSE(store->Contains(keys[5]));  // the bad copy was dropped, not kept
  CHECK(store->Stats().corruptions_dropped == 1);
}

TEST_CASE("GetBatch reads memory-resident blocks with one tier GetBatch per tier, beside NVMe reads and misses") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  FakeTier& hbm = f.at(TierId::kHbm);
  FakeTier& host = f.at(TierId::kHost);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.promote_on_get = false;  // every key stays where it was put
  auto store = OpenFakeStore(f, o);
  const TierId where[] = {TierId::kHost, TierId::kHbm, TierId::kNvme, TierId::kHost, TierId::kHbm,
                          TierId::kHost, TierId::kNvme, TierId::kHost, TierId::kHbm, TierId::kHost};
  constexpr int kN = 10;
  for (int i = 0; i < kN; ++i) REQUIRE(store->Put(TestKey(i), TestBytes(i, kOddBlock + i), {Codec::kRaw, where[i]}).ok());
  REQUIRE(host.CorruptStored(TestKey(5)));
  // Items: every key (interleaved across tiers), a missing key and a buffer too small for key 7.
  std::vector<std::vector<std::byte>> bufs(kN + 2, std::vector<std::byte>(kOddBlock + kN));
  std::vector<Store::GetItem> items;
  for (int i = 0; i < kN; ++i) items.push_back({TestKey(i), bufs[i], {}});
  items.push_back({TestKey(999), bufs[kN], {}});
  items.push_back({TestKey(7), std::span<std::byte>(bufs[kN + 1]).first(10), {}});
  const std::uint64_t host_calls = host.batch_calls(), hbm_calls = hbm.batch_calls();
  const std::uint64_t host_ops = host.batch_ops(), hbm_ops = hbm.batch_ops();
  auto st = store->GetBatch(items);
  REQUIRE(st.size() == items.size());
  for (int i = 0; i < kN; ++i) {
    INFO(i << ": " << st[i].ToString());
    if (i == 5) {  // the only copy failed its check: Corruption, and it is gone
      CHECK(st[i].IsCorruption());
      continue;
    }
    REQUIRE(st[i].ok());
    auto want = TestBytes(i, kOddBlock + i);
    CHECK(items[i].desc == DescribeBlock(want));
    CHECK(std::equal(want.begin(), want.end(), bufs[i].begin()));
  }
  CHECK(st[kN].IsNotFound());
  CHECK(st[kN + 1].IsInvalidArgument());
  CHECK(host.batch_calls() - host_calls == 1);  // keys 0, 3, 5, 7, 9 together (5's locked re-read is a Get)
  CHECK(host.batch_ops() - host_ops == 5);
  CHECK(hbm.batch_calls() - hbm_calls == 1);    // keys 1, 4, 8 together
  CHECK(hbm.batch_ops() - hbm_ops == 3);
  CHECK(nvme.batch_calls() == 1);               // keys 2, 6 together
  CHECK_FALSE(store->Contains(TestKey(5)));
  // Equivalence: single Gets give the same bytes.
  for (int i = 0; i < kN; ++i) {
    if (i == 5) continue;
    CHECK(*GetBytes(*store, TestKey(i)) == TestBytes(i, kOddBlock + i));
  }
}

TEST_CASE("Prefetch of many NVMe blocks goes out as batched tier reads") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  StoreOptions o = Quiet();
  o.background_threads = 1;  // one drainer: groups are deterministic
  auto store = OpenFakeStore(f, o);
  constexpr int kN = 100;
  auto keys = PutInNvme(*store, kN);
  for (const auto& s : store->Prefetch(keys, TierId::kHost, Priority::kDemand).get()) CHECK(s.ok());
  for (int i = 0; i < kN; ++i) {
    CHECK(TierOf(*store, keys[i]) == TierId::kHost);
    CHECK(*GetBytes(*store, keys[i]) == TestBytes(i, kOddBlock + i));
  }
  CHECK(nvme.batch_ops() == kN);
  CHECK(nvme.batch_calls() <= 4);  // groups of up to 64, not one call per key
  CHECK(store->Stats().prefetch_issued == kN);
}

}  // namespace
}  // namespace terrace::testing
