// The store applies the placement rules (src/store/placement_rules.h) where the unit table cannot
// see: scenarios whose outcome depends on one rule, mirrored by the trace replay's tests
// (tests/plan/plan_replay_test.cpp), which must come to the same copies.
#include <catch2/catch.hpp>

#include "store_test_util.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kRuleBlock = 1024;

TEST_CASE("Exclusive write-through: a promotion keeps the lowest tier's copy, so no eviction writes back") {
  // hbm 1 block, host 2 blocks (the lowest), write-through, puts into hbm.
  // Put 1: host + hbm. Put 2: host + hbm, evicting hbm's 1 (host has it: dropped). Get 1 promotes it
  // from host into hbm, evicting 2 (host copy: dropped); host keeps 1 (DroppedByMove spares the
  // lowest slot under write-through). Get 2 likewise. No demotion ever writes; host holds both.
  FakeTiers f(kRuleBlock, 2 * kRuleBlock, 0);
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHbm;
  o.placement = Placement::kExclusive;
  o.write_policy = WritePolicy::kWriteThrough;
  auto store = OpenFakeStore(f, o);
  REQUIRE(store->Put(TestKey(1), TestBytes(1, kRuleBlock)).ok());
  REQUIRE(store->Put(TestKey(2), TestBytes(2, kRuleBlock)).ok());
  for (int k : {1, 2}) {
    auto got = GetBytes(*store, TestKey(k));
    REQUIRE(got.ok());
    CHECK(*got == TestBytes(k, kRuleBlock));
    CHECK(f.at(TierId::kHbm).Has(TestKey(k)));
  }
  CHECK(f.at(TierId::kHost).Has(TestKey(1)));
  CHECK(f.at(TierId::kHost).Has(TestKey(2)));
  const StoreStats st = store->Stats();
  CHECK(st.demotions == 0);
  CHECK(st.promotions == 2);
  CHECK(st.tiers[0].evictions == 3);
}

}  // namespace
}  // namespace terrace::testing
