// Store contracts a review found broken, each pinned by the case that broke it: a batch that does
// not promote never promotes (also for keys that take the single-key path), a device-memory Put
// whose write-through fails keeps the previous version, an empty block can be acquired, and a
// prefetch's on_item callback may read a key of its own group that is still to load.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <vector>

#include "fake_tier.h"
#include "terrace/store.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"

namespace terrace::testing {
namespace {

BlockKey Key(int i) { return BlockKey{1, BlockKind::kKv, static_cast<std::uint32_t>(i), ContentId{1000ull + i, 7ull}}; }

StoreOptions NoEviction() {
  StoreOptions o;
  o.high_watermark = 1.0;
  o.low_watermark = 1.0;
  return o;
}

TEST_CASE("GetBatch without promotion leaves every item where it is, duplicates included") {
  StoreOptions o = NoEviction();  // promote_on_get = true, exclusive placement: a promotion moves
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
  auto nvme = std::make_unique<FakeTier>(TierId::kNvme, 1 << 20);
  FakeTier* nv = nvme.get();
  tiers.push_back(std::move(nvme));
  auto store = Store::OpenWithTiers(o, std::move(tiers));
  REQUIRE(store.ok());
  const BlockKey k = Key(1);
  const std::vector<std::byte> data(4096, std::byte{7});
  REQUIRE((*store)->Put(k, data, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  std::vector<std::byte> a(4096), b(4096);
  std::vector<Store::GetItem> items = {{k, a, {}}, {k, b, {}}};  // the second takes the single-key path
  GetOptions g;
  g.promote = false;
  const auto st = (*store)->GetBatch(items, g);
  REQUIRE(st[0].ok());
  REQUIRE(st[1].ok());
  CHECK(a == data);
  CHECK(b == data);
  CHECK((*store)->Lookup({&k, 1})[0].tier == TierId::kNvme);
  CHECK(nv->Lookup(k).ok());
}

TEST_CASE("a device-memory Put whose write-through fails keeps the previous version, as a host Put does") {
  for (bool device : {false, true}) {
    INFO((device ? "device" : "host") << " buffer");
    StoreOptions o = NoEviction();
    o.put_tier = TierId::kHbm;
    o.write_policy = WritePolicy::kWriteThrough;
    HbmTierOptions h;
    h.capacity_bytes = 1 << 20;
    h.link.enabled = false;
    std::vector<std::unique_ptr<Tier>> tiers;
    auto hbm = EmulatedHbmTier::Create(h);
    REQUIRE(hbm.ok());
    tiers.push_back(std::move(hbm).value());
    tiers.push_back(std::make_unique<FakeTier>(TierId::kNvme, 8192));  // room for v1 (4 KiB), not v2 (16 KiB)
    auto store = Store::OpenWithTiers(o, std::move(tiers));
    REQUIRE(store.ok());
    const BlockKey k = Key(2);
    const std::vector<std::byte> v1(4096, std::byte{1}), v2(16384, std::byte{2});
    REQUIRE((*store)->Put(k, v1).ok());
    const Status s = device ? (*store)->Put(k, ConstBufferRef{v2, BufferKind::kDevice}) : (*store)->Put(k, v2);
    REQUIRE_FALSE(s.ok());
    std::vector<std::byte> out(16384);
    auto r = (*store)->Get(k, out);
    INFO(s.ToString() << " / " << r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->size == v1.size());
    CHECK(std::vector<std::byte>(out.begin(), out.begin() + 4096) == v1);
  }
}

TEST_CASE("an empty block can be acquired from a host tier that has not grown a chunk yet") {
  HostTierOptions h;
  h.capacity_bytes = 1 << 20;
  h.chunk_bytes = 1 << 20;
  h.pin = false;
  std::vector<std::unique_ptr<Tier>> tiers;
  auto host = HostTier::Create(h);
  REQUIRE(host.ok());
  tiers.push_back(std::move(host).value());
  auto store = Store::OpenWithTiers(NoEviction(), std::move(tiers));
  REQUIRE(store.ok());
  const BlockKey k = Key(3);
  REQUIRE((*store)->Put(k, std::span<const std::byte>{}).ok());
  {
    auto handle = (*store)->Acquire(k, TierId::kHost);
    INFO(handle.status().ToString());
    REQUIRE(handle.ok());
  }
  std::vector<std::byte> out(16);
  auto r = (*store)->Get(k, out);
  REQUIRE(r.ok());
  CHECK(r->size == 0);
}

TEST_CASE("a prefetch's on_item callback may read a key of its own group that is still to load") {
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 20));
  tiers.push_back(std::make_unique<FakeTier>(TierId::kNvme, 1 << 20));
  auto store = Store::OpenWithTiers(NoEviction(), std::move(tiers));
  REQUIRE(store.ok());
  const std::vector<std::byte> data(4096, std::byte{7});
  const std::vector<BlockKey> keys = {Key(10), Key(11), Key(12)};
  for (const auto& k : keys) REQUIRE((*store)->Put(k, data, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  PrefetchOptions po;
  po.priority = Priority::kDemand;
  Store* s = store->get();
  Status inner = Status::Internal("on_item(0) did not run");
  std::vector<std::byte> got(4096);
  po.on_item = [&](std::size_t i, const Status&) {
    if (i != 0) return;
    auto r = s->Get(keys[2], got);  // its own thread leads this key's fetch, not yet read
    inner = r.status();
  };
  auto f = (*store)->Prefetch(keys, TierId::kHost, po);
  if (!f.wait_for(std::chrono::seconds(20))) {
    FAIL_CHECK("the prefetch did not finish in 20 s: its on_item waits on a fetch its own thread leads");
    std::_Exit(1);  // the lane thread is stuck for good: do not hang the suite in the destructor
  }
  const auto st = f.get();
  for (const Status& x : st) CHECK(x.ok());
  CHECK(inner.ok());
  CHECK(got == data);
  std::vector<std::byte> out(4096);
  for (const auto& k : keys) {
    auto r = (*store)->Get(k, out);
    REQUIRE(r.ok());
    CHECK(out == data);
  }
}

}  // namespace
}  // namespace terrace::testing
