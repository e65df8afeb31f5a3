// Store::GetRanges: parts of blocks from the fastest copy, nothing moved, one status per item, and
// a copy that moves away during the read looked up again.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <thread>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kBlock = 10000;

std::vector<std::byte> Slice(const std::vector<std::byte>& v, std::uint64_t offset, std::uint64_t length) {
  return {v.begin() + static_cast<std::ptrdiff_t>(offset), v.begin() + static_cast<std::ptrdiff_t>(offset + length)};
}

TEST_CASE("GetRanges reads ranges from the fastest copy and moves nothing") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  auto store = OpenFakeStore(f);  // promote_on_get: a Get would move NVMe blocks up; GetRanges must not
  const BlockKey in_host = TestKey(1), in_nvme = TestKey(2);
  const auto host_bytes = TestBytes(1, kBlock), nvme_bytes = TestBytes(2, kBlock + 1);
  REQUIRE(store->Put(in_host, host_bytes).ok());
  REQUIRE(store->Put(in_nvme, nvme_bytes, {Codec::kRaw, TierId::kNvme}).ok());
  struct Want {
    BlockKey key;
    std::uint64_t offset, length;
  };
  const std::vector<Want> wants = {{in_host, 0, kBlock},  {in_host, 4096, 100}, {in_host, kBlock - 1, 1},
                                   {in_nvme, 0, 0},       {in_nvme, 7, 5000},   {in_nvme, kBlock, 1}};
  std::vector<std::vector<std::byte>> outs(wants.size(), std::vector<std::byte>(kBlock + 1));
  std::vector<Store::GetRangeItem> items;
  for (std::size_t i = 0; i < wants.size(); ++i) items.push_back({wants[i].key, wants[i].offset, wants[i].length, outs[i]});
  const auto before = store->Stats();
  auto st = store->GetRanges(items);
  REQUIRE(st.size() == items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    INFO("item " << i << ": " << st[i].ToString());
    REQUIRE(st[i].ok());
    const auto& whole = wants[i].key == in_host ? host_bytes : nvme_bytes;
    CHECK(items[i].desc == DescribeBlock(whole));
    CHECK(items[i].tier == (wants[i].key == in_host ? TierId::kHost : TierId::kNvme));
    CHECK(Slice(outs[i], 0, wants[i].length) == Slice(whole, wants[i].offset, wants[i].length));
  }
  CHECK(TierOf(*store, in_nvme) == TierId::kNvme);  // not promoted
  const auto after = store->Stats();
  CHECK(after.promotions == before.promotions);
  CHECK(after.range_reads == before.range_reads + items.size());
  std::uint64_t bytes = 0;
  for (const auto& w : wants) bytes += w.length;
  CHECK(after.range_read_bytes == before.range_read_bytes + bytes);
  CHECK(after.tiers[static_cast<int>(TierId::kNvme)].hits >= 3);
}

TEST_CASE("GetRanges answers every item: missing, lost, out of bounds, short buffer") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& nvme = f.at(TierId::kNvme);
  auto store = OpenFakeStore(f);
  const auto good = TestBytes(3, kBlock);
  REQUIRE(store->Put(TestKey(3), good, {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(store->Put(TestKey(4), TestBytes(4, kBlock), {Codec::kRaw, TierId::kNvme}).ok());
  REQUIRE(nvme.CorruptStored(TestKey(4)));
  REQUIRE(GetBytes(*store, TestKey(4)).status().IsCorruption());  // the last copy is dropped: lost
  std::vector<std::byte> a(kBlock), b(kBlock), c(kBlock), d(10), e(kBlock);
  std::vector<Store::GetRangeItem> items = {{TestKey(99), 0, 10, a},      {TestKey(4), 0, 10, b},
                                            {TestKey(3), kBlock - 5, 6, c}, {TestKey(3), 0, 11, d},
                                            {TestKey(3), 100, 200, e}};
  auto st = store->GetRanges(items);
  REQUIRE(st.size() == items.size());
  CHECK(st[0].IsNotFound());
  CHECK(st[1].IsCorruption());
  CHECK(st[2].IsInvalidArgument());
  CHECK_THAT(st[2].message(), Catch::Contains(TestKey(3).ToString()) && Catch::Contains("end"));
  CHECK(st[3].IsInvalidArgument());
  REQUIRE(st[4].ok());
  CHECK(Slice(e, 0, 200) == Slice(good, 100, 200));
}

TEST_CASE("GetRanges looks a copy up again when it leaves its tier during the read") {
  FakeTiers f(0, 1 << 20, 1 << 20);
  FakeTier& host = f.at(TierId::kHost);
  StoreOptions o = Quiet();
  o.write_policy = WritePolicy::kWriteThrough;  // host and NVMe copies
  const BlockKey key = TestKey(5);
  GetGate gate(host, key);  // holds the range read inside the host tier
  auto store = OpenFakeStore(f, o);
  const auto bytes = TestBytes(5, kBlock);
  REQUIRE(store->Put(key, bytes).ok());
  REQUIRE(TierOf(*store, key) == TierId::kHost);
  std::vector<std::byte> out(kBlock);
  std::vector<Store::GetRangeItem> items = {{key, 1000, 3000, out}};
  std::vector<Status> st;
  std::thread reader([&] { st = store->GetRanges(items); });
  gate.WaitHeld();
  REQUIRE(store->EvictCopy(key, TierId::kHost).ok());  // the copy the directory named is gone
  gate.Open();
  reader.join();
  REQUIRE(st.size() == 1);
  INFO(st[0].ToString());
  REQUIRE(st[0].ok());
  CHECK(items[0].tier == TierId::kNvme);
  CHECK(Slice(out, 0, 3000) == Slice(bytes, 1000, 3000));
}

TEST_CASE("GetRanges finds a key present throughout although its copy moves before every read") {
  // Host holds one block. Before each of the reader's first three tier reads of the key, its copy
  // is to move: a filler put evicts it to NVMe, a new version is put into host, another filler
  // would evict that. The first two moves run on the reader's thread, inside the tier's read of an
  // unlocked round. The third read is GetRanges' locked round: this thread holds the key's lock
  // stripe, and may take no other (KeyLocks::Lock), so that filler is put from another thread,
  // given 200 ms inside the read; the key's lock keeps it from moving the copy until the read ends.
  FakeTiers f(0, kBlock, 1 << 20);
  const BlockKey key = TestKey(7);
  const auto v1 = TestBytes(7, kBlock), v2 = TestBytes(8, kBlock);
  const std::thread::id reader = std::this_thread::get_id();
  Store* store_ptr = nullptr;
  int moves = 0;
  bool moving = false;  // the mover's own reads (a demotion's) are not the reader's
  std::future<Status> late_filler;
  auto mover = [&](const BlockKey& k) {
    if (std::this_thread::get_id() != reader || !(k == key) || store_ptr == nullptr || moving) return;
    moving = true;
    const int n = ++moves;
    if (n == 1) (void)store_ptr->Put(TestKey(101), TestBytes(101, kBlock));
    if (n == 2) (void)store_ptr->Put(key, v2);
    if (n == 3) {
      late_filler = std::async(std::launch::async, [s = store_ptr] { return s->Put(TestKey(103), TestBytes(103, kBlock)); });
      (void)late_filler.wait_for(std::chrono::milliseconds(200));
    }
    moving = false;
  };
  f.at(TierId::kHost).on_get = mover;
  f.at(TierId::kNvme).on_get = mover;
  auto store = OpenFakeStore(f);
  REQUIRE(store->Put(key, v1).ok());
  std::vector<std::byte> out(kBlock);
  std::vector<Store::GetRangeItem> items = {{key, 500, 4000, out}};
  store_ptr = store.get();
  auto st = store->GetRanges(items);
  store_ptr = nullptr;
  REQUIRE(late_filler.valid());
  (void)late_filler.get();  // may have waited for the key's lock: it ends once the read has
  REQUIRE(st.size() == 1);
  INFO(st[0].ToString());
  CHECK(moves == 3);
  REQUIRE(st[0].ok());
  CHECK(items[0].tier == TierId::kHost);
  CHECK(items[0].desc == DescribeBlock(v2));
  CHECK(Slice(out, 0, 4000) == Slice(v2, 500, 4000));
}


TEST_CASE("GetRanges counts a hit where it read and a miss in every tier for an unknown key, as Get does") {
  FakeTiers f(1 << 16, 1 << 16, 1 << 16);
  auto store = OpenFakeStore(f);
  const BlockKey known = TestKey(1), unknown = TestKey(2);
  REQUIRE(store->Put(known, TestBytes(1, 100), {Codec::kRaw, TierId::kNvme}).ok());
  std::vector<std::byte> a(10), b(10);
  std::vector<Store::GetRangeItem> items{{known, 0, 10, a, {}, TierId::kHost}, {unknown, 0, 10, b, {}, TierId::kHost}};
  const std::vector<Status> st = store->GetRanges(items);
  REQUIRE(st.size() == 2);
  CHECK(st[0].ok());
  CHECK(st[1].IsNotFound());
  const StoreStats s = store->Stats();
  CHECK(s.slots[0].misses == 2);  // hbm: neither key
  CHECK(s.slots[1].misses == 2);
  CHECK(s.slots[2].misses == 1);  // nvme held the known key
  CHECK(s.slots[2].hits == 1);
}

}  // namespace
}  // namespace terrace::testing
