// A Put replaces every copy of the previous version, or it is not acknowledged: when a tier cannot
// erase a copy a Put replaces (or a failed Put cannot take back its own), the store keeps tracking
// what that tier still holds, so what a reopen finds is what the session read, and an overwritten
// version never comes back from the persistent tier.
#include <catch2/catch.hpp>

#include <optional>
#include <vector>

#include "fake_tier.h"
#include "store_test_util.h"
#include "terrace/store.h"
#include "test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::testing {
namespace {

constexpr std::size_t kStaleBlock = 4096;

struct StaleRig {
  std::unique_ptr<Store> store;
  FaultInjectingTier* host = nullptr;
  FaultInjectingTier* nvme = nullptr;
};

StoreOptions StaleOptions(const std::filesystem::path& dir, WritePolicy policy) {
  StoreOptions o = Quiet();
  o.put_tier = TierId::kHost;
  o.write_policy = policy;
  o.nvme.path = dir;
  o.nvme.capacity_bytes = 4 * kMiB;
  return o;
}

// A fake host tier over a real NVMe tier in `dir`, both wrapped for fault injection.
StaleRig OpenStale(const StoreOptions& o) {
  auto nvme = NvmeTier::Open(o.nvme);
  INFO(nvme.status().ToString());
  REQUIRE(nvme.ok());
  auto host = std::make_unique<FaultInjectingTier>(std::make_unique<FakeTier>(TierId::kHost, 1 * kMiB));
  auto nv = std::make_unique<FaultInjectingTier>(std::unique_ptr<Tier>(std::move(*nvme)));
  StaleRig rig;
  rig.host = host.get();
  rig.nvme = nv.get();
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::move(host));
  tiers.push_back(std::move(nv));
  auto store = Store::OpenWithTiers(o, std::move(tiers));
  INFO(store.status().ToString());
  REQUIRE(store.ok());
  rig.store = std::move(*store);
  return rig;
}

// What a Get returns: the bytes, or nothing for NotFound; any other error fails the test. It does
// not promote: a promotion would move the block out of the NVMe tier (exclusive placement).
std::optional<std::vector<std::byte>> ReadOrNone(Store& store, const BlockKey& key) {
  std::vector<std::byte> buf(4 * kStaleBlock);
  GetOptions stay;
  stay.promote = false;
  auto got = store.Get(key, buf, stay);
  if (got.status().IsNotFound()) return std::nullopt;
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  buf.resize(got->size);
  return buf;
}

TEST_CASE("a Put whose previous copy cannot be erased is not acknowledged, so a reopen never returns that version") {
  TempDir dir("stale-copy-publish");
  const StoreOptions o = StaleOptions(dir.path(), WritePolicy::kWriteBack);
  const BlockKey k = TestKey(1);
  const auto v1 = TestBytes(1, kStaleBlock), v2 = TestBytes(2, kStaleBlock);
  Status put;
  {
    StaleRig rig = OpenStale(o);
    REQUIRE(rig.store->Put(k, v1, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
    rig.nvme->FailNextErases(1, FaultInjectingTier::Eio(false));
    put = rig.store->Put(k, v2);  // to the host tier: the NVMe copy of v1 is now stale
    INFO(put.ToString());
    CHECK(rig.nvme->injected().erase_errors == 1);
    // Acknowledged, the session reads v2; refused, nothing changed: it reads v1.
    CHECK(ReadOrNone(*rig.store, k) == (put.ok() ? v2 : v1));
  }
  StaleRig again = OpenStale(o);
  const auto after = ReadOrNone(*again.store, k);
  INFO(put.ToString());
  if (put.ok()) {
    CHECK(after != v1);  // the write-back copy of v2 may be gone with the host tier; v1 must be
  } else {
    CHECK(after == v1);
    CHECK(put.ToString().find("could not be removed") != std::string::npos);
  }
  CHECK_FALSE(put.ok());  // the only outcome that keeps both promises above when the erase failed
}

TEST_CASE("an erase a tier applied but could not make durable undoes the Put, and says a reopen may differ") {
  TempDir dir("stale-copy-applied");
  const StoreOptions o = StaleOptions(dir.path(), WritePolicy::kWriteBack);
  const BlockKey k = TestKey(3);
  const auto v1 = TestBytes(5, kStaleBlock), v2 = TestBytes(6, kStaleBlock);
  StaleRig rig = OpenStale(o);
  REQUIRE(rig.store->Put(k, v1, PutOptions{Codec::kRaw, TierId::kNvme}).ok());
  rig.nvme->FailNextErasesAfterApplying(1, FaultInjectingTier::Eio(false));
  const Status put = rig.store->Put(k, v2);
  INFO(put.ToString());
  CHECK_FALSE(put.ok());  // the tier may still hold v1 after a reopen: v2 is not acknowledged
  CHECK(put.ToString().find("after a reopen tier nvme may return the previous version") != std::string::npos);
  CHECK(rig.nvme->injected().erase_errors == 1);
  CHECK(ReadOrNone(*rig.store, k) == std::nullopt);  // NotFound, not "lost" (Corruption) and not v2
  REQUIRE(rig.store->Put(k, v2).ok());                // a retry once the tier is healthy
  CHECK(ReadOrNone(*rig.store, k) == v2);
}

TEST_CASE("a failed write-through Put whose copies cannot all be removed says what is left, and a reopen agrees") {
  TempDir dir("stale-copy-remove");
  const StoreOptions o = StaleOptions(dir.path(), WritePolicy::kWriteThrough);
  const BlockKey k = TestKey(2);
  const auto v1 = TestBytes(3, kStaleBlock), v2 = TestBytes(4, kStaleBlock);
  std::optional<std::vector<std::byte>> in_session;
  {
    StaleRig rig = OpenStale(o);
    REQUIRE(rig.store->Put(k, v1).ok());  // host and NVMe
    rig.host->FailNextPuts(1, FaultInjectingTier::Eio(false));  // the target's write fails...
    rig.nvme->FailNextErases(1, FaultInjectingTier::Eio(false));  // ...and v2 cannot be taken back from NVMe
    const Status put = rig.store->Put(k, v2);
    INFO(put.ToString());
    REQUIRE_FALSE(put.ok());
    CHECK(rig.nvme->injected().erase_errors == 1);
    in_session = ReadOrNone(*rig.store, k);
    CHECK(in_session == v2);  // NVMe holds v2 (written through before the host write failed)
    CHECK(put.ToString().find("could not be removed") != std::string::npos);
  }
  StaleRig again = OpenStale(o);
  CHECK(ReadOrNone(*again.store, k) == in_session);
}

TEST_CASE("a write-through Put of the bytes a key holds only above the write-through tier still writes them through") {
  TempDir dir("stale-copy-dedup");
  const StoreOptions o = StaleOptions(dir.path(), WritePolicy::kWriteThrough);
  const BlockKey k = TestKey(4);
  const auto v1 = TestBytes(7, kStaleBlock), v2 = TestBytes(8, kStaleBlock);
  {
    StaleRig rig = OpenStale(o);
    REQUIRE(rig.store->Put(k, v1).ok());  // host and NVMe
    rig.host->FailNextPuts(1, FaultInjectingTier::Eio(false));
    rig.host->FailNextErases(1, FaultInjectingTier::Eio(false));
    const Status failed = rig.store->Put(k, v2);
    INFO(failed.ToString());
    REQUIRE_FALSE(failed.ok());
    REQUIRE(ReadOrNone(*rig.store, k) == v1);  // v1, in the host tier only
    REQUIRE(rig.store->Put(k, v1).ok());        // an acknowledged write-through put of v1
  }
  StaleRig again = OpenStale(o);
  CHECK(ReadOrNone(*again.store, k) == v1);
}

}  // namespace
}  // namespace terrace::testing
