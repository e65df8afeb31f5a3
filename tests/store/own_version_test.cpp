// A write-back Put whose room below is held only by its own key's previous version demotes that
// version (StoreImpl::OwnCopiesEvictable) - never into a shared tier - and every key still reads its
// last acknowledged version, over random operations on small tiers.
#include <catch2/catch.hpp>

#include <map>
#include <random>

#include "forwarding_tier.h"
#include "store_test_util.h"

namespace terrace::testing {
namespace {

// A tier other processes' stores also use (TierCaps::shared), over a FakeTier both stores share.
class SharedTier final : public ForwardingTier {
 public:
  explicit SharedTier(std::shared_ptr<Tier> inner) : ForwardingTier(std::move(inner)) { caps_.shared = true; }
};

TEST_CASE("A Put never demotes its own previous version into a shared tier, over another store's version") {
  auto nvme = std::make_shared<FakeTier>(TierId::kNvme, 1 << 16);
  std::vector<std::unique_ptr<Tier>> ta, tb;
  ta.push_back(std::make_unique<FakeTier>(TierId::kHbm, 100, true));
  ta.push_back(std::make_unique<FakeTier>(TierId::kHost, 100));
  ta.push_back(std::make_unique<SharedTier>(nvme));
  tb.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 16));
  tb.push_back(std::make_unique<SharedTier>(nvme));
  StoreOptions oa = Quiet();
  oa.put_tier = TierId::kHbm;
  auto ra = Store::OpenWithTiers(oa, std::move(ta));
  REQUIRE(ra.ok());
  auto rb = Store::OpenWithTiers(Quiet(), std::move(tb));
  REQUIRE(rb.ok());
  Store& a = **ra;
  Store& b = **rb;
  const BlockKey k = TestKey(1), v = TestKey(2);
  REQUIRE(a.Put(k, TestBytes(1, 80)).ok());
  REQUIRE(a.Put(v, TestBytes(2, 80)).ok());  // k demoted to host: a's own copy
  const auto theirs = TestBytes(9, 60);
  REQUIRE(b.Put(k, theirs, {Codec::kRaw, TierId::kNvme}).ok());  // b's acknowledged version, shared
  const Status s = a.Put(k, TestBytes(3, 80));  // its only room below is k's old copy, above the shared tier
  INFO(s.ToString());
  CHECK(s.IsOutOfCapacity());  // as before OwnCopiesEvictable: no write into the shared tier
  REQUIRE(nvme->Has(k));
  auto got = GetBytes(b, k);
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(*got == theirs);
}

// Random puts (to random tiers), erases, pins, handles and gets on 7 keys over tiers of a few
// blocks; after every operation each key reads its last acknowledged version, and an erased key is
// in no tier.
void RandomOwnVersionRun(std::vector<std::uint64_t> caps, Placement placement, WritePolicy policy,
                         std::uint64_t seed) {
  std::vector<std::unique_ptr<Tier>> tiers;
  std::vector<FakeTier*> fake;
  // Two tiers: host, nvme; three: hbm, host, nvme; four: hbm, host and two nvme.
  const std::vector<TierId> kinds = caps.size() == 2 ? std::vector<TierId>{TierId::kHost, TierId::kNvme}
                                    : std::vector<TierId>{TierId::kHbm, TierId::kHost, TierId::kNvme, TierId::kNvme};
  for (std::size_t i = 0; i < caps.size(); ++i) {
    const TierId id = kinds[i];
    auto t = std::make_unique<FakeTier>(id, caps[i], id == TierId::kHbm);
    fake.push_back(t.get());
    tiers.push_back(std::move(t));
  }
  StoreOptions o = Quiet();
  o.placement = placement;
  o.write_policy = policy;
  o.put_tier = caps.size() > 2 ? TierId::kHbm : TierId::kHost;
  auto opened = Store::OpenWithTiers(o, std::move(tiers));
  REQUIRE(opened.ok());
  Store& store = **opened;
  std::mt19937_64 rng(seed);
  std::map<int, std::vector<std::byte>> model;
  std::map<int, int> pins;
  std::vector<BlockHandle> handles;
  constexpr int kKeys = 7;
  int puts = 0;
  for (int op = 0; op < 200; ++op) {
    const int k = static_cast<int>(rng() % kKeys);
    const BlockKey key = TestKey(static_cast<std::uint64_t>(k) + 1);
    const int what = static_cast<int>(rng() % 100);
    if (what < 55) {
      const auto bytes = TestBytes(rng(), 20 + rng() % 90);
      const TierId to[] = {TierId::kHbm, TierId::kHost, TierId::kNvme};
      const Status s = store.Put(key, bytes, {Codec::kRaw, to[rng() % 3]});
      INFO("op " << op << " put " << k << ": " << s.ToString());
      if (s.ok()) {
        model[k] = bytes;
        ++puts;
      } else {
        REQUIRE((s.IsOutOfCapacity() || s.IsInvalidArgument()));  // no room, or pinned
      }
    } else if (what < 65) {
      if (store.Erase(key).ok()) model.erase(k);
    } else if (what < 72) {
      if (store.Pin(key).ok()) ++pins[k];
    } else if (what < 80) {
      if (pins[k] > 0 && store.Unpin(key).ok()) --pins[k];
    } else if (what < 86) {
      auto h = store.Acquire(key, rng() % 2 ? TierId::kHost : TierId::kHbm);
      if (h.ok()) handles.push_back(std::move(*h));
    } else if (what < 92) {
      if (!handles.empty()) handles.erase(handles.begin() + static_cast<long>(rng() % handles.size()));
    } else {
      (void)GetBytes(store, key);
    }
    for (int i = 0; i < kKeys; ++i) {
      const BlockKey ki = TestKey(static_cast<std::uint64_t>(i) + 1);
      auto got = GetBytes(store, ki);
      INFO("op " << op << " key " << i << ": " << got.status().ToString());
      if (model.count(i)) {
        REQUIRE(got.ok());
        REQUIRE(*got == model[i]);
      } else {
        REQUIRE(got.status().IsNotFound());
        for (FakeTier* f : fake) REQUIRE_FALSE(f->Has(ki));
      }
    }
  }
  CHECK(puts > 0);
}

TEST_CASE("Every key reads its last acknowledged version under random puts, erases, pins and handles on small tiers") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    for (Placement p : {Placement::kExclusive, Placement::kInclusive}) {
      for (WritePolicy w : {WritePolicy::kWriteBack, WritePolicy::kWriteThrough}) {
        INFO("seed " << seed << " placement " << static_cast<int>(p) << " policy " << static_cast<int>(w));
        RandomOwnVersionRun({200, 200, 600}, p, w, seed);
        RandomOwnVersionRun({150, 150, 200, 500}, p, w, seed);
        RandomOwnVersionRun({150, 500}, p, w, seed);
      }
    }
  }
}


TEST_CASE("With a shared tier, a key in no tier is a miss in every tier for Get, GetRanges and Acquire alike") {
  auto nvme = std::make_shared<FakeTier>(TierId::kNvme, 1 << 16);
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::make_unique<FakeTier>(TierId::kHost, 1 << 16));
  tiers.push_back(std::make_unique<SharedTier>(nvme));
  auto opened = Store::OpenWithTiers(Quiet(), std::move(tiers));
  REQUIRE(opened.ok());
  Store& store = **opened;
  const BlockKey k = TestKey(5);
  auto misses = [&] {
    std::uint64_t n = 0;
    for (const TierStatsSnapshot& t : store.Stats().slots) n += t.misses;
    return n;
  };
  REQUIRE(GetBytes(store, k).status().IsNotFound());  // the directory misses; the shared tier is asked
  CHECK(misses() == 2);
  std::vector<std::byte> buf(8);
  std::vector<Store::GetRangeItem> range{{k, 0, 8, buf, {}, TierId::kHost}};
  REQUIRE(store.GetRanges(range)[0].IsNotFound());
  CHECK(misses() == 4);
  REQUIRE(store.Acquire(k, TierId::kHost).status().IsNotFound());
  CHECK(misses() == 6);
}

}  // namespace
}  // namespace terrace::testing
