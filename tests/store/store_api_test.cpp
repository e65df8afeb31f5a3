// Store API round trips over fake tiers: put/get/lookup/erase/pin/acquire/batches/errors.
#include <catch2/catch.hpp>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

TEST_CASE("Put/Get/Lookup/Erase round trip through each tier") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  for (int t = 0; t < kNumTiers; ++t) {
    auto tier = static_cast<TierId>(t);
    BlockKey key = TestKey(100 + t);
    auto bytes = TestBytes(t, 3000 + t);
    REQUIRE(store->Put(key, bytes, PutOptions{Codec::kBf16, tier}).ok());
    CHECK(f.at(tier).Has(key));
    CHECK(store->Contains(key));
    auto look = store->Lookup({&key, 1});
    REQUIRE(look[0].found);
    CHECK(look[0].desc == DescribeBlock(bytes, Codec::kBf16));
    auto got = GetBytes(*store, key);
    REQUIRE(got.ok());
    CHECK(*got == bytes);
    REQUIRE(store->Erase(key).ok());
    CHECK_FALSE(store->Contains(key));
    for (int u = 0; u < kNumTiers; ++u) CHECK_FALSE(f.fake[u]->Has(key));
    CHECK(store->Erase(key).IsNotFound());
    CHECK(GetBytes(*store, key).status().IsNotFound());
  }
}

TEST_CASE("Get into a too-small buffer names the size needed") {
  FakeTiers f(0, 1 << 20, 0);
  auto store = OpenFakeStore(f);
  auto bytes = TestBytes(1, 5000);
  REQUIRE(store->Put(TestKey(1), bytes).ok());
  std::vector<std::byte> small(100);
  auto r = store->Get(TestKey(1), small);
  REQUIRE(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains("5000"));
  CHECK_THAT(r.status().message(), Catch::Contains(TestKey(1).ToString()));
}

TEST_CASE("Overwrite replaces the block and removes stale copies in other tiers") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  BlockKey key = TestKey(5);
  REQUIRE(store->Put(key, TestBytes(1, 1000), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(store->Put(key, TestBytes(2, 2000)).ok());  // host
  CHECK(f.at(TierId::kHost).Has(key));
  CHECK_FALSE(f.at(TierId::kNvme).Has(key));
  CHECK(*GetBytes(*store, key) == TestBytes(2, 2000));
}

TEST_CASE("Putting identical bytes again is a dedup hit") {
  FakeTiers f(0, 1 << 20, 0);
  auto store = OpenFakeStore(f);
  auto bytes = TestBytes(3, 1000);
  REQUIRE(store->Put(TestKey(3), bytes).ok());
  REQUIRE(store->Put(TestKey(3), bytes).ok());
  CHECK(store->Stats().put_dedup_hits == 1);
  CHECK(f.at(TierId::kHost).Stats().puts == 1);
}

TEST_CASE("Pin blocks erase and replacement until unpinned") {
  FakeTiers f(0, 1 << 20, 0);
  auto store = OpenFakeStore(f);
  BlockKey key = TestKey(9);
  REQUIRE(store->Put(key, TestBytes(9, 100)).ok());
  REQUIRE(store->Pin(key).ok());
  REQUIRE(store->Pin(key).ok());
  CHECK(store->Erase(key).IsInvalidArgument());
  CHECK(store->Put(key, TestBytes(10, 100)).IsInvalidArgument());
  REQUIRE(store->Unpin(key).ok());
  CHECK(store->Erase(key).IsInvalidArgument());  // pins nest
  REQUIRE(store->Unpin(key).ok());
  CHECK(store->Unpin(key).IsInvalidArgument());
  CHECK(store->Erase(key).ok());
  CHECK(store->Pin(key).IsNotFound());
}

TEST_CASE("Acquire promotes to the requested tier and pins while the handle lives") {
  FakeTiers f(1 << 20, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  BlockKey key = TestKey(11);
  auto bytes = TestBytes(11, 4096);
  REQUIRE(store->Put(key, bytes, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  {
    auto h = store->Acquire(key, TierId::kHbm);
    REQUIRE(h.ok());
    CHECK(h->tier() == TierId::kHbm);
    CHECK(h->memory_kind() == MemoryKind::kHost);  // the fake hbm is emulated in host memory
    REQUIRE(h->size() == bytes.size());
    CHECK(std::equal(bytes.begin(), bytes.end(), h->data()));
    CHECK(TierOf(*store, key) == TierId::kHbm);
    CHECK(store->Erase(key).IsInvalidArgument());
    BlockHandle moved = std::move(*h);
    CHECK(moved.valid());
    CHECK_FALSE(h->valid());
  }
  CHECK(store->Erase(key).ok());
  CHECK(store->Acquire(key).status().IsNotFound());
  REQUIRE(store->Put(key, bytes).ok());
  CHECK(store->Acquire(key, TierId::kNvme).status().IsInvalidArgument());  // not addressable
}

TEST_CASE("Batch variants return one status per item") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);
  std::vector<std::vector<std::byte>> data;
  std::vector<Store::PutItem> puts;
  for (int i = 0; i < 5; ++i) data.push_back(TestBytes(i, 500 + i));
  for (int i = 0; i < 5; ++i) puts.push_back({TestKey(i), data[i], {}});
  for (auto s : store->PutBatch(puts)) CHECK(s.ok());
  std::vector<std::vector<std::byte>> bufs(6, std::vector<std::byte>(1000));
  std::vector<Store::GetItem> gets;
  for (int i = 0; i < 6; ++i) gets.push_back({TestKey(i), bufs[i], {}});
  auto st = store->GetBatch(gets);
  for (int i = 0; i < 5; ++i) {
    REQUIRE(st[i].ok());
    CHECK(gets[i].desc.size == data[i].size());
    CHECK(std::equal(data[i].begin(), data[i].end(), bufs[i].begin()));
  }
  CHECK(st[5].IsNotFound());
  std::vector<BlockKey> keys = {TestKey(0), TestKey(7)};
  auto es = store->EraseBatch(keys);
  CHECK(es[0].ok());
  CHECK(es[1].IsNotFound());
  auto look = store->Lookup(keys);
  CHECK_FALSE(look[0].found);
}

TEST_CASE("A block larger than its tier is rejected with OutOfCapacity and nothing is stored") {
  FakeTiers f(0, 4096, 0);
  auto store = OpenFakeStore(f);
  auto s = store->Put(TestKey(1), TestBytes(1, 8192));
  REQUIRE(s.IsOutOfCapacity());
  CHECK_THAT(s.message(), Catch::Contains("host"));
  CHECK_FALSE(store->Contains(TestKey(1)));
}

TEST_CASE("OpenWithTiers validates its input") {
  FakeTiers none(0, 0, 0);
  CHECK(Store::OpenWithTiers({}, std::move(none.tiers)).status().IsInvalidArgument());
  std::array<std::unique_ptr<Tier>, kNumTiers> wrong;
  wrong[0] = std::make_unique<FakeTier>(TierId::kHost, 100);
  CHECK(Store::OpenWithTiers({}, std::move(wrong)).status().IsInvalidArgument());
  FakeTiers f(0, 100, 0);
  StoreOptions o;
  o.low_watermark = 0.95;
  o.high_watermark = 0.9;
  CHECK(Store::OpenWithTiers(o, std::move(f.tiers)).status().IsInvalidArgument());
}

TEST_CASE("Opening over tiers that already hold blocks recovers them") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto bytes = TestBytes(1, 100);
  REQUIRE(f.at(TierId::kNvme).Put(TestKey(1), DescribeBlock(bytes), bytes).ok());
  auto stale = TestBytes(2, 100);
  REQUIRE(f.at(TierId::kHost).Put(TestKey(1), DescribeBlock(stale), stale).ok());
  auto* host = f.fake[1];
  auto store = OpenFakeStore(f);
  CHECK(*GetBytes(*store, TestKey(1)) == bytes);  // the persistent tier's version wins
  bool stale_left = host->Has(TestKey(1)) && host->Lookup(TestKey(1))->checksum == DescribeBlock(stale).checksum;
  CHECK_FALSE(stale_left);
}

}  // namespace
}  // namespace terrace::testing
