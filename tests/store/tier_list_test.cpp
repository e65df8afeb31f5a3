// The open tier list: a store over more tiers than the standard three (two NVMe-like tiers), slot
// names and the standard TierId view of them, and shared tiers (TierCaps::shared) that other
// stores write behind this store's directory.
#include <catch2/catch.hpp>

#include <set>

#include "forwarding_tier.h"
#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kListBlock = 4096;

// Forwards to a tier other stores use too, reporting it as shared (or not, for the control).
class SharedView final : public terrace::testing::ForwardingTier {
 public:
  SharedView(std::shared_ptr<Tier> inner, bool shared) : ForwardingTier(std::move(inner)) { caps_.shared = shared; }
};

struct FourTiers {
  std::vector<FakeTier*> fake;  // hbm, host, nvme, nvme-2
  std::unique_ptr<Store> store;
  FourTiers(std::uint64_t host_blocks, std::uint64_t nvme_blocks, const StoreOptions& o = Quiet()) {
    std::vector<std::unique_ptr<Tier>> tiers;
    const std::pair<TierId, std::uint64_t> spec[] = {{TierId::kHbm, 1 << 20},
                                                     {TierId::kHost, host_blocks * kListBlock},
                                                     {TierId::kNvme, nvme_blocks * kListBlock},
                                                     {TierId::kNvme, 1 << 22}};
    for (const auto& [id, cap] : spec) {
      auto t = std::make_unique<FakeTier>(id, cap, id == TierId::kHbm);
      fake.push_back(t.get());
      tiers.push_back(std::move(t));
    }
    auto r = Store::OpenWithTiers(o, std::move(tiers));
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    store = std::move(*r);
  }
};

TEST_CASE("Four tiers: eviction demotes through both NVMe tiers and nothing is lost") {
  FourTiers f(/*host_blocks=*/2, /*nvme_blocks=*/3);
  constexpr int kKeys = 12;
  for (int i = 0; i < kKeys; ++i) REQUIRE(f.store->Put(TestKey(i), TestBytes(i, kListBlock)).ok());

  StoreStats st = f.store->Stats();
  REQUIRE(st.slots.size() == 4);
  CHECK(st.slots[0].name == "hbm");
  CHECK(st.slots[1].name == "host");
  CHECK(st.slots[2].name == "nvme");
  CHECK(st.slots[3].name == "nvme-2");
  CHECK(st.blocks == kKeys);
  CHECK(f.fake[1]->block_count() == 2);
  CHECK(f.fake[2]->block_count() == 3);
  CHECK(f.fake[3]->block_count() == kKeys - 5);  // the rest went one tier further down
  CHECK(st.demotions >= kKeys - 2);
  // The standard view: TierId::kNvme is the first NVMe slot.
  CHECK(st.present[static_cast<int>(TierId::kNvme)]);
  CHECK(st.tiers[static_cast<int>(TierId::kNvme)].name == "nvme");
  CHECK(st.tiers[static_cast<int>(TierId::kNvme)].blocks == 3);

  std::set<int> slots_seen;
  for (int i = 0; i < kKeys; ++i) {
    BlockKey k = TestKey(i);
    auto look = f.store->Lookup({&k, 1});
    REQUIRE(look[0].found);
    CHECK(f.fake[static_cast<std::size_t>(look[0].slot)]->Has(k));
    CHECK(look[0].tier == (look[0].slot >= 2 ? TierId::kNvme : TierId::kHost));
    slots_seen.insert(look[0].slot);
  }
  CHECK(slots_seen == std::set<int>{1, 2, 3});

  // Every block reads back; a read from the slowest tier promotes it to host (exclusive), and the
  // host victims it displaces cascade down again.
  int deepest_i = -1;
  for (int i = 0; i < kKeys; ++i) {
    if (f.fake[3]->Has(TestKey(i))) deepest_i = i;
  }
  REQUIRE(deepest_i >= 0);
  const BlockKey deepest = TestKey(deepest_i);
  REQUIRE(*GetBytes(*f.store, deepest) == TestBytes(deepest_i, kListBlock));
  CHECK(TierOf(*f.store, deepest) == TierId::kHost);
  CHECK_FALSE(f.fake[3]->Has(deepest));
  for (int i = 0; i < kKeys; ++i) {
    auto got = GetBytes(*f.store, TestKey(i));
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(i, kListBlock));
  }
  std::uint64_t copies = 0;
  for (FakeTier* t : f.fake) copies += t->block_count();
  CHECK(copies == kKeys);
  CHECK(f.store->Stats().slots[3].hits > 0);
  CHECK_THAT(f.store->PrometheusText(), Catch::Contains("terrace_tier_blocks{tier=\"nvme-2\"}"));
}

TEST_CASE("Four tiers: write-through reaches the last tier; recovery reads every tier") {
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
  tiers.push_back(std::make_unique<FakeTier>(TierId::kNvme, 1 << 20));
  auto last = std::make_unique<FakeTier>(TierId::kNvme, 1 << 20);
  FakeTier* last_raw = last.get();
  tiers.push_back(std::make_unique<FakeTier>(TierId::kNvme, 1 << 20));
  tiers.push_back(std::move(last));
  auto store = std::move(Store::OpenWithTiers(o, std::move(tiers)).value());
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kListBlock)).ok());
  CHECK(last_raw->Has(TestKey(1)));
  CHECK(store->Stats().slots.back().name == "nvme-3");

  // A store opened over tiers that already hold blocks finds them in any slot.
  std::vector<std::unique_ptr<Tier>> again;
  auto a = std::make_unique<FakeTier>(TierId::kNvme, 1 << 20);
  auto b = std::make_unique<FakeTier>(TierId::kNvme, 1 << 20);
  REQUIRE(b->Put(TestKey(7), DescribeBlock(TestBytes(7, 100)), TestBytes(7, 100)).ok());
  again.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
  again.push_back(std::move(a));
  again.push_back(std::move(b));
  auto reopened = std::move(Store::OpenWithTiers(Quiet(), std::move(again)).value());
  BlockKey k = TestKey(7);
  CHECK(reopened->Lookup({&k, 1})[0].slot == 2);
  CHECK(*GetBytes(*reopened, k) == TestBytes(7, 100));
}

TEST_CASE("OpenWithTiers over a list validates it") {
  std::vector<std::unique_ptr<Tier>> none;
  CHECK(Store::OpenWithTiers(Quiet(), std::move(none)).status().IsInvalidArgument());
  std::vector<std::unique_ptr<Tier>> with_null;
  with_null.push_back(std::make_unique<FakeTier>(TierId::kHost, 100));
  with_null.push_back(nullptr);
  CHECK(Store::OpenWithTiers(Quiet(), std::move(with_null)).status().IsInvalidArgument());
  std::vector<std::unique_ptr<Tier>> too_many;
  for (int i = 0; i <= kMaxTierSlots; ++i) too_many.push_back(std::make_unique<FakeTier>(TierId::kNvme, 100));
  auto r = Store::OpenWithTiers(Quiet(), std::move(too_many));
  CHECK(r.status().IsInvalidArgument());
  CHECK_THAT(r.status().message(), Catch::Contains(std::to_string(kMaxTierSlots)));
}

TEST_CASE("A buffer kind BufferKind does not name is refused, not taken for host memory") {
  FakeTiers f(0, 1 << 20, 0);
  auto store = OpenFakeStore(f);
  const auto bytes = TestBytes(1, 100);
  const auto bad = static_cast<BufferKind>(9);
  const Status put = store->Put(TestKey(1), ConstBufferRef{bytes, bad});
  CHECK(put.IsInvalidArgument());
  CHECK_THAT(put.message(), Catch::Contains("BufferKind"));
  CHECK_FALSE(store->Contains(TestKey(1)));
  REQUIRE(store->Put(TestKey(1), bytes).ok());
  std::vector<std::byte> out(100);
  CHECK(store->Get(TestKey(1), BufferRef{out, bad}).status().IsInvalidArgument());
  std::vector<Store::GetRefItem> items(2);
  items[0].key = TestKey(1);
  items[0].out = BufferRef{out, bad};
  std::vector<std::byte> out2(100);
  items[1].key = TestKey(1);
  items[1].out = BufferRef{out2, BufferKind::kHost};
  const std::vector<Status> st = store->GetBatch(items);
  CHECK(st[0].IsInvalidArgument());
  CHECK(st[1].ok());
  CHECK(out2 == bytes);
}

TEST_CASE("lowest_tier_evicts never drops a block from a shared lowest tier") {
  auto common = std::make_shared<FakeTier>(TierId::kNvme, 4 * 1024);
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 2 * 1024));
  tiers.push_back(std::make_unique<SharedView>(common, /*shared=*/true));
  StoreOptions o = Quiet();
  o.lowest_tier_evicts = true;
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = std::move(Store::OpenWithTiers(o, std::move(tiers)).value());
  int stored = 0;
  for (int i = 0; i < 12; ++i) stored += store->Put(TestKey(i), TestBytes(i, 1024)).ok() ? 1 : 0;
  CHECK(stored == 4);  // the shared tier's room, and no more: nothing of it was dropped
  CHECK(store->Stats().dropped_blocks == 0);
  for (int i = 0; i < 4; ++i) CHECK(common->Has(TestKey(i)));
}

// A store of its own host tier over `common`, which other stores of the test use too.
std::unique_ptr<Store> OpenOverShared(const std::shared_ptr<FakeTier>& common, bool shared) {
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
  tiers.push_back(std::make_unique<SharedView>(common, shared));
  return std::move(Store::OpenWithTiers(Quiet(), std::move(tiers)).value());
}

TEST_CASE("A directory miss asks a shared tier; a tier not marked shared is not asked") {
  for (bool shared : {true, false}) {
    INFO("shared: " << shared);
    auto common = std::make_shared<FakeTier>(TierId::kNvme, 1 << 20);
    auto open = [&] { return OpenOverShared(common, shared); };
    auto writer = open();
    auto reader = open();  // opened before the block exists: its directory cannot know it
    BlockKey k = TestKey(42);
    auto bytes = TestBytes(42, 3 * kListBlock + 5);
    REQUIRE(writer->Put(k, bytes, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    REQUIRE(common->Has(k));

    auto look = reader->Lookup({&k, 1});
    CHECK(look[0].found == shared);
    CHECK(reader->Contains(k) == shared);
    auto got = GetBytes(*reader, k);
    if (!shared) {
      CHECK(got.status().IsNotFound());
      CHECK(reader->Erase(k).IsNotFound());
      continue;
    }
    CHECK(look[0].slot == 1);
    CHECK(look[0].desc == DescribeBlock(bytes));
    REQUIRE(got.ok());
    CHECK(*got == bytes);
    CHECK(TierOf(*reader, k) == TierId::kHost);  // adopted, then promoted like any lower-tier read
    CHECK(reader->Stats().blocks == 1);
    // Other reads adopt too: a prefetch and an acquire of a second block the reader never saw.
    BlockKey k2 = TestKey(43);
    REQUIRE(writer->Put(k2, TestBytes(43, 100), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    auto pf = reader->Prefetch({&k2, 1}, TierId::kHost).get();
    REQUIRE(pf[0].ok());
    CHECK(TierOf(*reader, k2) == TierId::kHost);
    BlockKey k3 = TestKey(44);
    REQUIRE(writer->Put(k3, TestBytes(44, 100), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    auto h = reader->Acquire(k3, TierId::kHost);
    REQUIRE(h.ok());
    CHECK(std::memcmp(h->data(), TestBytes(44, 100).data(), 100) == 0);
    h->Release();
    // Erase through a store that never saw the key removes the shared copy.
    BlockKey k4 = TestKey(45);
    REQUIRE(writer->Put(k4, TestBytes(45, 100), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    CHECK(reader->Erase(k4).ok());
    CHECK_FALSE(common->Has(k4));
    // A ranged read of a block the reader never saw adopts it too, and moves nothing.
    BlockKey k5 = TestKey(46);
    const auto bytes5 = TestBytes(46, 2 * kListBlock);
    REQUIRE(writer->Put(k5, bytes5, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    std::vector<std::byte> part(100);
    std::vector<Store::GetRangeItem> ranges = {{k5, kListBlock + 3, part.size(), part}, {TestKey(98), 0, 1, part}};
    auto rs = reader->GetRanges(ranges);
    REQUIRE(rs[0].ok());
    CHECK(std::memcmp(part.data(), bytes5.data() + kListBlock + 3, part.size()) == 0);
    CHECK(ranges[0].tier == TierId::kNvme);
    CHECK(TierOf(*reader, k5) == TierId::kNvme);
    CHECK(rs[1].IsNotFound());
    // A key in no tier is still NotFound.
    CHECK(GetBytes(*reader, TestKey(99)).status().IsNotFound());
  }
}

TEST_CASE("Another store's reads never remove a shared tier's block; a replaced or erased one is asked for again") {
  auto common = std::make_shared<FakeTier>(TierId::kNvme, 1 << 20);
  auto open = [&] { return OpenOverShared(common, true); };
  auto writer = open();
  auto reader = open();
  // A promoting read (exclusive placement) copies the block up and leaves the shared copy.
  const BlockKey k = TestKey(50);
  const auto v1 = TestBytes(50, 4096);
  REQUIRE(writer->Put(k, v1, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  auto got = GetBytes(*reader, k);
  REQUIRE(got.ok());
  CHECK(*got == v1);
  CHECK(TierOf(*reader, k) == TierId::kHost);
  CHECK(common->Has(k));
  auto mine = GetBytes(*writer, k);
  INFO(mine.status().ToString());
  REQUIRE(mine.ok());
  CHECK(*mine == v1);
  // The writer replaces a block the reader adopted: the reader reads the new version; nothing is
  // dropped as corrupt.
  const BlockKey k2 = TestKey(51);
  REQUIRE(writer->Put(k2, TestBytes(51, 4096), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(reader->Contains(k2));  // adopted
  const auto v2 = TestBytes(151, 4096);
  REQUIRE(writer->Put(k2, v2, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  std::vector<std::byte> out(4096);
  GetOptions no_promote;
  no_promote.promote = false;
  auto r = reader->Get(k2, out, no_promote);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  CHECK(out == v2);
  CHECK(common->Has(k2));
  mine = GetBytes(*writer, k2);
  REQUIRE(mine.ok());
  CHECK(*mine == v2);
  CHECK(reader->Stats().corruptions_dropped == 0);
  // The writer erases a block the reader adopted: the reader misses (NotFound), not Corruption.
  const BlockKey k3 = TestKey(52);
  REQUIRE(writer->Put(k3, TestBytes(52, 100), PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(reader->Contains(k3));
  REQUIRE(writer->Erase(k3).ok());
  auto gone = reader->Get(k3, out, no_promote);
  INFO(gone.status().ToString());
  CHECK(gone.status().IsNotFound());
}

}  // namespace
}  // namespace terrace::testing
