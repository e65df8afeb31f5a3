// An ExpertOffload over a store it does not have to itself: a second ExpertOffload of the same
// model (same keys) that holds pinned copies of the first one's victims, and a store whose put
// tier is the fast tier (as a PrefixCache uses), which evicts unpinned expert copies on its own.
// Every acquire succeeds with the right bytes, each cache's books stay within its budget, and a
// copy the store dropped is loaded (and counted) again.
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "experts_test_util.h"
#include "src/model/names.h"

namespace terrace::experts {
namespace {

using testing::BlockBytes;
using testing::FirstMoeLayer;
using testing::ToyDir;

// The expert's MXFP4 bytes are ToyDir's tensors, byte for byte.
bool SameExpert(int layer, int expert, const model::ExpertWeights& w, std::string* why) {
  const model::Mxfp4Matrix* ms[3] = {&w.q1, &w.q2, &w.q3};
  const char* projs[3] = {"w1", "w2", "w3"};
  for (int i = 0; i < 3; ++i) {
    auto packed = ToyDir().Get(model::ExpertTensorName(layer, expert, projs[i], "weight_packed"));
    auto scales = ToyDir().Get(model::ExpertTensorName(layer, expert, projs[i], "weight_scale"));
    if (!packed.ok() || !scales.ok()) {
      *why = "tensor missing";
      return false;
    }
    if (static_cast<std::size_t>(ms[i]->packed_bytes()) != packed->data.size() ||
        static_cast<std::size_t>(ms[i]->scale_bytes()) != scales->data.size() ||
        std::memcmp(ms[i]->packed, packed->data.data(), packed->data.size()) != 0 ||
        std::memcmp(ms[i]->scales, scales->data.data(), scales->data.size()) != 0) {
      *why = fmt::format("expert {} of layer {}: bytes of {} differ", expert, layer, projs[i]);
      return false;
    }
  }
  return true;
}

std::vector<int> MoeLayers() {
  std::vector<int> out;
  const auto& c = ToyDir().config();
  for (int l = 0; l < c.num_hidden_layers; ++l)
    if (!c.IsDenseLayer(l)) out.push_back(l);
  return out;
}

std::shared_ptr<ExpertOffload> MakeOffload(Store* store, std::uint64_t budget) {
  ExpertOffloadOptions eo;
  eo.budget.bytes = budget;
  auto off = ExpertOffload::Create(ToyDir().config(), ToyDir(), store, std::move(eo));
  if (!off.ok()) FAIL(off.status().ToString());
  return *off;
}

bool InHbm(const Store& store, const BlockKey& key) {
  auto where = store.Lookup(std::span<const BlockKey>(&key, 1));
  return !where.empty() && where[0].found && where[0].tier == TierId::kHbm;
}

// Acquires (layer, expert) from `o`, checks its bytes, releases it, and checks that `o` keeps no
// more than its budget.
void AcquireAndCheck(ExpertOffload& o, int layer, int expert) {
  auto w = o.Acquire(layer, expert);
  INFO("expert " << expert << " of layer " << layer);
  if (!w.ok()) FAIL("acquire failed: " << w.status().ToString());
  std::string why;
  const bool same = SameExpert(layer, expert, **w, &why);
  INFO(why);
  CHECK(same);
  o.Release(layer, expert);
  const ExpertMetrics m = o.Metrics();
  CHECK(m.resident_bytes <= m.budget_bytes);
}

TEST_CASE("two ExpertOffloads over one store: a victim the other one holds is dropped from the books, not an error",
          "[experts][shared_store]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  const std::uint64_t blk = BlockBytes();
  const std::uint64_t budget = 4 * blk;
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, 2 * budget, ""));
  REQUIRE(store.ok());
  auto a = MakeOffload(store->get(), budget);
  auto b = MakeOffload(store->get(), budget);
  const int l = FirstMoeLayer();
  for (int e = 0; e < 4; ++e) AcquireAndCheck(*a, l, e);
  for (int e = 0; e < 4; ++e) AcquireAndCheck(*b, l, e);  // b now holds pinned copies of a's four
  // a needs room: its least recently used expert (0) is pinned by b. a no longer counts it, and
  // the copy stays where b holds it.
  AcquireAndCheck(*a, l, 4);
  ExpertMetrics ma = a->Metrics();
  CHECK(ma.resident_bytes == 4 * blk);
  CHECK(ma.evictions == 0);
  CHECK(ma.shared_drops == 1);
  const auto k0 = a->key(l, 0);
  REQUIRE(k0.ok());
  CHECK(InHbm(**store, *k0));
  // a acquires expert 0 again: a load like any other, read from the fast tier where b holds it.
  const std::uint64_t hbm_loads = ma.loads_from[static_cast<std::size_t>(TierId::kHbm)];
  AcquireAndCheck(*a, l, 0);
  ma = a->Metrics();
  CHECK(ma.loads_from[static_cast<std::size_t>(TierId::kHbm)] == hbm_loads + 1);
  CHECK(ma.resident_bytes == 4 * blk);

  SECTION("a lease b holds is not a's to evict either") {
    auto lease = b->Lease(l, 1);
    REQUIRE(lease.ok());
    for (int e = 5; e < 12; ++e) AcquireAndCheck(*a, l, e);
    CHECK(a->Metrics().resident_bytes <= budget);
  }
  SECTION("a third ExpertOffload created while the others hold experts starts cold without an error") {
    auto c = MakeOffload(store->get(), budget);
    CHECK(c->Metrics().resident_bytes == 0);
    for (int e = 0; e < 8; ++e) AcquireAndCheck(*c, l, e);
    CHECK(c->Metrics().resident_bytes == 4 * blk);
  }
  SECTION("Reset leaves the copies the other one holds where they are") {
    REQUIRE(a->Reset().ok());
    CHECK(a->Metrics().resident_bytes == 0);
    for (int e = 0; e < 4; ++e) {
      const auto k = b->key(l, e);
      REQUIRE(k.ok());
      CHECK(InHbm(**store, *k));
    }
  }
}

TEST_CASE("two ExpertOffloads over one store, interleaved at random: every acquire succeeds with the right bytes",
          "[experts][shared_store]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  const std::uint64_t budget = total / 14;
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, 2 * budget, ""));
  REQUIRE(store.ok());
  std::shared_ptr<ExpertOffload> off[2] = {MakeOffload(store->get(), budget), MakeOffload(store->get(), budget)};
  const std::vector<int> layers = MoeLayers();
  const int E = config.num_experts;

  SECTION("one thread, leases held across the other's acquires") {
    std::mt19937 rng(5);
    std::vector<ExpertLease> held;
    for (int it = 0; it < 600; ++it) {
      const int i = static_cast<int>(rng() % 2);
      const int l = layers[rng() % layers.size()];
      const int e = static_cast<int>(rng() % static_cast<unsigned>(E));
      if (i == 1 && rng() % 4 == 0) {
        auto lease = off[1]->Lease(l, e);
        if (!lease.ok()) FAIL(lease.status().ToString());
        held.push_back(std::move(*lease));
        if (held.size() > 3) held.erase(held.begin());
        continue;
      }
      AcquireAndCheck(*off[i], l, e);
    }
    held.clear();
    for (auto& o : off) {
      const ExpertMetrics m = o->Metrics();
      CHECK(m.resident_bytes <= m.budget_bytes);
      CHECK(m.resident_bytes > 0);
    }
  }
  SECTION("two threads") {
    std::atomic<int> failed{0}, wrong{0};
    std::vector<std::thread> th;
    for (int i = 0; i < 2; ++i) {
      th.emplace_back([&, i] {
        std::mt19937 rng(static_cast<unsigned>(i));
        for (int it = 0; it < 400; ++it) {
          const int l = layers[rng() % layers.size()];
          const int e = static_cast<int>(rng() % static_cast<unsigned>(E));
          auto w = off[i]->Acquire(l, e);
          if (!w.ok()) {
            ++failed;
            continue;
          }
          std::string why;
          if (!SameExpert(l, e, **w, &why)) ++wrong;
          off[i]->Release(l, e);
          if (off[i]->Metrics().resident_bytes > budget) ++wrong;
        }
      });
    }
    for (auto& t : th) t.join();
    CHECK(failed.load() == 0);
    CHECK(wrong.load() == 0);
  }
}

// A store shared with a prefix cache: 1 MiB of emulated HBM that its blocks are put into, over a
// 16 MiB host tier (inclusive: the host copy stays), no promotion on Get.
StoreOptions FastTierSharedWithKv() {
  StoreOptions so;
  so.hbm.mode = HbmMode::kEmulated;
  so.hbm.capacity_bytes = 1 * kMiB;
  so.host.capacity_bytes = 16 * kMiB;
  so.host.pin = false;
  so.host.chunk_bytes = 1 * kMiB;
  so.placement = Placement::kInclusive;
  so.promote_on_get = false;
  so.put_tier = TierId::kHbm;  // a prefix cache's blocks land in the fast tier
  so.logger = NullLogger();
  return so;
}

TEST_CASE("a shared store that evicts a landed expert copy: the next acquire loads it again and counts the load",
          "[experts][shared_store]") {
  const std::uint64_t blk = BlockBytes();
  const StoreOptions so = FastTierSharedWithKv();
  auto store = Store::Open(so);
  REQUIRE(store.ok());
  const std::uint64_t budget = 16 * blk;
  REQUIRE(budget <= so.hbm.capacity_bytes);
  auto off = MakeOffload(store->get(), budget);
  const int l = MoeLayers().at(1);
  const std::vector<int> sel{0, 1, 2, 3};
  auto in_hbm = [&] {
    int n = 0;
    for (int e : sel) {
      auto k = off->key(l, e);
      REQUIRE(k.ok());
      n += InHbm(**store, *k) ? 1 : 0;
    }
    return n;
  };
  off->Prefetch(l, sel);  // the layer's selection: one batch, landed, not acquired (not pinned)
  off->Quiesce();
  const ExpertMetrics m0 = off->Metrics();
  REQUIRE(in_hbm() == 4);
  CHECK(m0.resident_bytes == 4 * blk);
  const auto host = static_cast<std::size_t>(TierId::kHost);
  CHECK(m0.loads_from[host] == 4);
  CHECK(m0.demand_bytes == 4 * blk);

  // Other blocks (what a PrefixCache over this store writes) fill the fast tier: 2 MiB of 64 KiB.
  for (int i = 0; i < 32; ++i) REQUIRE((*store)->Put(terrace::testing::TestKey(1000 + static_cast<std::uint64_t>(i)),
                                                     terrace::testing::TestBytes(static_cast<std::uint64_t>(i), 64 * 1024))
                                           .ok());
  REQUIRE(in_hbm() == 0);
  // The books follow the store: nothing of ours is in the fast tier any more.
  CHECK(off->Metrics().resident_bytes == 0);

  for (int e : sel) AcquireAndCheck(*off, l, e);
  const ExpertMetrics m1 = off->Metrics();
  CHECK(in_hbm() == 4);
  CHECK(m1.resident_bytes == static_cast<std::uint64_t>(in_hbm()) * blk);
  CHECK(m1.loads_from[host] == 8);  // read from the host tier twice
  CHECK(m1.loaded_bytes_from[host] == 8 * blk);
  CHECK(m1.demand_bytes == 8 * blk);
  CHECK(m1.misses == 4);
  CHECK(m1.hits == 0);
  CHECK(m1.stall_ns > m0.stall_ns);  // the forward thread waited for the reads
  CHECK(m1.shared_drops == 4);
  CHECK(m1.evictions == 0);
}

TEST_CASE("a shared store that evicts a landed copy: an acquire that finds it gone without a Metrics call in between",
          "[experts][shared_store]") {
  const std::uint64_t blk = BlockBytes();
  auto store = Store::Open(FastTierSharedWithKv());
  REQUIRE(store.ok());
  auto off = MakeOffload(store->get(), 16 * blk);
  const int l = FirstMoeLayer();
  const std::vector<int> sel{5, 6};
  off->Prefetch(l, sel);
  off->Quiesce();
  for (int i = 0; i < 32; ++i) REQUIRE((*store)->Put(terrace::testing::TestKey(2000 + static_cast<std::uint64_t>(i)),
                                                     terrace::testing::TestBytes(static_cast<std::uint64_t>(i), 64 * 1024))
                                           .ok());
  for (int e : sel) {  // no Metrics call between them: each acquire finds its own copy gone
    auto w = off->Acquire(l, e);
    if (!w.ok()) FAIL(w.status().ToString());
    std::string why;
    const bool same = SameExpert(l, e, **w, &why);
    INFO(why);
    CHECK(same);
  }
  const ExpertMetrics m = off->Metrics();
  CHECK(m.loads_from[static_cast<std::size_t>(TierId::kHost)] == 4);
  CHECK(m.demand_bytes == 4 * blk);
  CHECK(m.resident_bytes == 2 * blk);
  for (int e : sel) off->Release(l, e);
}

}  // namespace
}  // namespace terrace::experts
