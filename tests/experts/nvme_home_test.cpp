// Expert home copies on the real NVMe tier (a temp dir, O_DIRECT data file, batched io_uring
// reads) behind a deliberately slow single-channel wrapper, with read faults injected under the
// tier: a layer's selection still reaches the drive as one batched read, and whole runs equal the
// resident run bit for bit. (Demand-before-speculation, cancellation, the speculative cap and the
// corrupt-copy cases run over this home too: prefetch_control_test.cpp.)
#include <set>
#include <string>
#include <vector>

#include "slow_rig.h"

namespace terrace::experts {
namespace {

using testing::Home;
using testing::MakeSlowRig;
using testing::SlowRig;
using testing::ToyDir;

TEST_CASE("a slow NVMe home serves a layer's selection as one batched read", "[experts][nvme]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  SlowRig rig = MakeSlowRig(std::move(opt), 3, Home::kNvme, /*wrap_hbm=*/false);
  rig.slow->set_delay(std::chrono::milliseconds(20));
  const int layer = testing::FirstMoeLayer();
  const std::vector<int> sel{2, 3, 7, 11, 12, 14};
  rig.offload->Prefetch(layer, sel);  // the layer's routing: one demand batch
  for (int e : sel) {
    auto lease = rig.offload->Lease(layer, e);
    if (!lease.ok()) FAIL(lease.status().ToString());
  }
  const auto calls = rig.slow->read_calls();
  const auto reads = rig.slow->reads();
  INFO(calls.size() << " read calls for " << reads.size() << " blocks");
  REQUIRE(calls.size() == 1);  // one call past the wrapper, one batched read in the NVMe tier
  CHECK(calls[0] == sel.size());
  std::set<int> read;
  for (const BlockKey& k : reads) read.insert(testing::ExpertOf(*rig.offload, k));
  CHECK(read == std::set<int>(sel.begin(), sel.end()));
  const ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.misses == sel.size());
  CHECK(m.demand_bytes == sel.size() * testing::BlockBytes());
  // Landed in the fast tier: leasing them again reads nothing.
  for (int e : sel) REQUIRE(rig.offload->Lease(layer, e).ok());
  CHECK(rig.slow->read_calls().size() == 1);
  CHECK(rig.store->Stats().tiers[static_cast<int>(TierId::kNvme)].blocks ==
        m.total_expert_bytes / testing::BlockBytes());
}

TEST_CASE("offloaded runs over a slow NVMe home with a transient read fault equal the resident run",
          "[experts][nvme]") {
  const auto& config = ToyDir().config();
  const std::uint64_t one_layer_topk = static_cast<std::uint64_t>(config.num_experts_per_token) * testing::BlockBytes();
  std::vector<std::pair<std::string, CacheBudget>> budgets = {
      {"one layer's top-k", CacheBudget{0, one_layer_topk}}, {"25%", *CacheBudget::Parse("25%")}};
  std::vector<PredictorKind> predictors = {PredictorKind::kNone, PredictorKind::kLookahead, PredictorKind::kStatistical};
  if (terrace::testing::kThreadSanitizedBuild) budgets.pop_back();  // TSan: the budget that evicts most only
  for (PredictorKind predictor : predictors) {
    for (const auto& [bname, budget] : budgets) {
      INFO("predictor " << PredictorName(predictor) << ", budget " << bname);
      ExpertOffloadOptions opt;
      opt.policy = CachePolicyKind::kUtility;
      opt.budget = budget;
      // The fast tier unwrapped: the NVMe tier reads straight into its reservations.
      SlowRig rig = MakeSlowRig(std::move(opt), 3, Home::kNvme, /*wrap_hbm=*/false);
      auto model = model::Model::Load(config, ToyDir(), rig.offload);
      REQUIRE(model.ok());
      if (predictor == PredictorKind::kLookahead) rig.offload->SetPredictor(MakeLookaheadPredictor(**model, {}));
      if (predictor == PredictorKind::kStatistical) rig.offload->SetPredictor(MakeStatisticalPredictor(config));
      rig.slow->set_delay(std::chrono::milliseconds(1));
      // The next read request returns with one bit flipped: the NVMe tier's checksum catches it
      // and its re-read is clean, so nothing is dropped and the run goes on.
      rig.nvme_engine->Arm(nvme::IoOp::kRead, nvme::FaultKind::kBitFlip, 1);
      model::ForwardOptions hooks;
      rig.offload->AttachHooks(&hooks);
      const testing::RunOutput got = testing::Run(**model, &hooks);
      rig.offload->Quiesce();
      CHECK(got.ids == testing::ResidentRun().ids);
      CHECK(testing::SameBits(got.logits, testing::ResidentRun().logits));
      CHECK(rig.nvme_engine->injected(nvme::FaultKind::kBitFlip) == 1);
      const ExpertMetrics m = rig.offload->Metrics();
      CHECK(m.resident_bytes <= m.budget_bytes);
      CHECK(m.corrupt_copies_reread == 0);
      // Every miss and every speculative load read its block from the NVMe home, through the wrapper.
      CHECK(rig.slow->reads().size() >= m.misses);
      const StoreStats st = rig.store->Stats();
      CHECK(st.tiers[static_cast<int>(TierId::kNvme)].blocks == m.total_expert_bytes / testing::BlockBytes());
      CHECK(st.tiers[static_cast<int>(TierId::kHost)].blocks == 0);
      if (predictor == PredictorKind::kNone) CHECK(m.speculative_bytes == 0);
    }
  }
}

}  // namespace
}  // namespace terrace::experts
