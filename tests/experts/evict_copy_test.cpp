// Store::EvictCopy: drops a copy only when a lower tier holds the block too, never while pinned,
// never the last copy.
#include <catch2/catch.hpp>

#include "terrace/store.h"
#include "test_util.h"

namespace terrace {
namespace {

TEST_CASE("EvictCopy drops an upper copy cleanly and refuses the last or a pinned one", "[experts][store]") {
  StoreOptions o;
  o.hbm.mode = HbmMode::kEmulated;
  o.hbm.capacity_bytes = 4 * kMiB;
  o.host.capacity_bytes = 8 * kMiB;
  o.host.pin = false;
  o.placement = Placement::kInclusive;
  o.logger = NullLogger();
  auto store = Store::Open(o);
  REQUIRE(store.ok());
  Store& s = **store;
  const BlockKey key = testing::TestKey(1, BlockKind::kExpert);
  const auto bytes = testing::TestBytes(1, 10000);
  PutOptions po;
  po.tier = TierId::kHost;
  REQUIRE(s.Put(key, bytes, po).ok());

  CHECK(s.EvictCopy(key, TierId::kHbm).IsNotFound());           // no copy there yet
  CHECK(s.EvictCopy(key, TierId::kHost).IsInvalidArgument());   // the last copy
  {
    auto h = s.Acquire(key, TierId::kHbm);
    REQUIRE(h.ok());
    CHECK(s.EvictCopy(key, TierId::kHbm).IsInvalidArgument());  // pinned by the handle
  }
  const auto before = s.Stats();
  REQUIRE(s.EvictCopy(key, TierId::kHbm).ok());
  const auto after = s.Stats();
  CHECK(after.demotions == before.demotions);  // nothing written back
  CHECK(after.tiers[static_cast<int>(TierId::kHbm)].blocks == 0);
  CHECK(after.tiers[static_cast<int>(TierId::kHost)].blocks == 1);
  auto where = s.Lookup(std::span<const BlockKey>(&key, 1));
  REQUIRE(where[0].found);
  CHECK(where[0].tier == TierId::kHost);
  std::vector<std::byte> out(bytes.size());
  REQUIRE(s.Get(key, out).ok());
  CHECK(out == bytes);
  CHECK(s.EvictCopy(key, TierId::kHost).IsInvalidArgument());  // still the last copy
}

}  // namespace
}  // namespace terrace
