// How expert loads reach the home tier: a layer's known selection goes to the store as one
// multi-key prefetch, so a non-addressable home tier (NVMe-like) receives its absent experts as
// ONE batched read instead of one single-block read per expert, with every predictor (on-demand
// too), and the run still equals the resident one bit for bit.
#include <set>

#include "experts_test_util.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"

namespace terrace::experts {
namespace {

using testing::ResidentRun;
using testing::SameBits;
using testing::ToyDir;

// A host tier presented as a non-addressable NVMe-kind tier (so the store batches reads from it,
// as from the NVMe tier), recording the size of every read call it receives: 1 per Get, n per
// GetBatch of n ops. Thread-safe.
class BatchRecordingTier final : public terrace::testing::ForwardingTier {
 public:
  explicit BatchRecordingTier(std::unique_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {
    caps_.id = TierId::kNvme;
    caps_.name = "nvme";
    caps_.memory = MemoryKind::kNone;
    caps_.reserves = false;
    caps_.device_buffers = false;
  }
  std::vector<std::size_t> read_calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  void clear() {
    std::lock_guard lock(mu_);
    calls_.clear();
  }

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    Record(1);
    return inner_->Get(key, out, desc);
  }
  std::vector<Status> GetBatch(std::span<GetOp> ops) override {
    Record(ops.size());
    return inner_->GetBatch(ops);
  }

 private:
  void Record(std::size_t n) {
    std::lock_guard lock(mu_);
    calls_.push_back(n);
  }
  mutable std::mutex mu_;
  std::vector<std::size_t> calls_;
};

struct Rig {
  BatchRecordingTier* home = nullptr;  // owned by the store
  std::unique_ptr<Store> store;
  std::shared_ptr<ExpertOffload> offload;
};

Rig MakeRig() {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  StoreOptions so = ExpertOffload::OpenStoreOptions(total, total, "");
  so.put_tier = TierId::kNvme;
  so.hbm.link.enabled = false;
  auto host = HostTier::Create(so.host);
  REQUIRE(host.ok());
  auto hbm = EmulatedHbmTier::Create(so.hbm);
  REQUIRE(hbm.ok());
  Rig rig;
  auto home = std::make_unique<BatchRecordingTier>(std::move(host).value());
  rig.home = home.get();
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<int>(TierId::kHbm)] = std::move(hbm).value();
  tiers[static_cast<int>(TierId::kNvme)] = std::move(home);
  auto store = Store::OpenWithTiers(so, std::move(tiers));
  if (!store.ok()) FAIL(store.status().ToString());
  rig.store = std::move(store).value();
  ExpertOffloadOptions opt;
  opt.home = TierId::kNvme;
  opt.budget = *CacheBudget::Parse("100%");
  auto off = ExpertOffload::Create(config, ToyDir(), rig.store.get(), std::move(opt));
  if (!off.ok()) FAIL(off.status().ToString());
  rig.offload = *off;
  return rig;
}

TEST_CASE("a layer's known selection reaches the home tier as one batched read", "[experts]") {
  Rig rig = MakeRig();  // predictor none: on-demand
  rig.home->clear();
  const int layer = testing::FirstMoeLayer();
  const std::vector<int> sel{1, 4, 5, 9, 12, 13};
  rig.offload->Prefetch(layer, sel);
  for (int e : sel) {
    auto lease = rig.offload->Lease(layer, e);
    REQUIRE(lease.ok());
  }
  const auto calls = rig.home->read_calls();
  std::size_t blocks = 0;
  for (std::size_t n : calls) blocks += n;
  INFO("read calls (blocks each):" << [&] {
    std::string s;
    for (std::size_t n : calls) s += " " + std::to_string(n);
    return s;
  }());
  CHECK(blocks == sel.size());  // each expert read once
  REQUIRE(calls.size() == 1);   // ... all in one call
  CHECK(calls[0] == sel.size());
  ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.misses == sel.size());  // loaded on demand (as one batch), not predicted
  CHECK(m.hits == 0);
  CHECK(m.prefetches_issued == 0);
  CHECK(m.demand_bytes == sel.size() * testing::BlockBytes());
  // Acquiring them again: resident, no read.
  for (int e : sel) REQUIRE(rig.offload->Lease(layer, e).ok());
  CHECK(rig.home->read_calls().size() == 1);
  CHECK(rig.offload->Metrics().hits == sel.size());
}

TEST_CASE("a whole run through a batching home tier equals the resident run, loading layers in batches",
          "[experts]") {
  Rig rig = MakeRig();
  auto m = model::Model::Load(ToyDir().config(), ToyDir(), rig.offload);
  REQUIRE(m.ok());
  model::ForwardOptions hooks;
  rig.offload->AttachHooks(&hooks);
  const auto out = testing::Run(**m, &hooks);
  CHECK(SameBits(out.logits, ResidentRun().logits));
  CHECK(out.ids == ResidentRun().ids);
  const auto calls = rig.home->read_calls();
  std::size_t blocks = 0, largest = 0;
  for (std::size_t n : calls) {
    blocks += n;
    largest = std::max(largest, n);
  }
  const ExpertMetrics x = rig.offload->Metrics();
  INFO(calls.size() << " read calls, " << blocks << " blocks, largest " << largest << "; misses " << x.misses);
  // Every miss read once; the prefill's first layer alone selects more than one expert, in one call.
  CHECK(blocks == x.misses);
  CHECK(largest > 1);
  CHECK(calls.size() < blocks);
}

}  // namespace
}  // namespace terrace::experts
