// Lead-time-aware residency (ExpertOffloadOptions::lead_protected_*): the first MoE layer's experts
// keep their reserved share of the budget under pressure from deeper layers, a load for the first
// layer beyond that share evicts among its own experts, the budget holds exactly, and runs with the
// partition (down to a share of the whole budget over three layers) equal the resident run.
#include <string>

#include "experts_test_util.h"

namespace terrace::experts {
namespace {

using testing::BlockBytes;
using testing::ResidentIn;
using testing::ResidentRun;
using testing::RunOutput;
using testing::SameBits;
using testing::ToyDir;

using LeadRig = testing::ToyOffload;

LeadRig MakeLeadRig(CachePolicyKind policy, std::uint64_t budget_bytes, int lead_layers, double share) {
  ExpertOffloadOptions opt;
  opt.policy = policy;
  opt.budget = CacheBudget{0, budget_bytes};
  opt.lead_protected_layers = lead_layers;
  opt.lead_protected_share = share;
  return testing::OpenToyOffload(std::move(opt));
}

LayerMetrics LayerOf(const ExpertMetrics& m, int layer) {
  for (const auto& l : m.layers)
    if (l.layer == layer) return l;
  FAIL("no metrics for layer " << layer);
  return {};
}

void LeaseAndRelease(LeadRig& r, int layer, int expert) {
  auto lease = r.offload->Lease(layer, expert);
  if (!lease.ok()) FAIL(lease.status().ToString());
  const ExpertMetrics m = r.offload->Metrics();
  CHECK(m.resident_bytes <= m.budget_bytes);
}

// Leases experts 0..3 of layer 1 (the first MoE layer of k3-toy), then 24 experts of layers 2..7,
// then experts 0..3 of layer 1 again: the layer-1 hits of that second pass.
std::uint64_t SecondPassHits(LeadRig& r) {
  for (int e = 0; e < 4; ++e) LeaseAndRelease(r, 1, e);
  for (int l = 2; l <= 7; ++l)
    for (int e = 0; e < 4; ++e) LeaseAndRelease(r, l, e);
  const std::uint64_t before = LayerOf(r.offload->Metrics(), 1).hits;
  for (int e = 0; e < 4; ++e) LeaseAndRelease(r, 1, e);
  return LayerOf(r.offload->Metrics(), 1).hits - before;
}

TEST_CASE("the first MoE layer's experts keep their reserved share under pressure; the budget holds",
          "[experts][lead]") {
  REQUIRE(ToyDir().config().first_k_dense_replace == 1);
  const std::uint64_t budget = 8 * BlockBytes();
  for (CachePolicyKind policy : {CachePolicyKind::kLru, CachePolicyKind::kLfu, CachePolicyKind::kUtility}) {
    INFO("policy " << CachePolicyName(policy));
    LeadRig on = MakeLeadRig(policy, budget, 1, 0.5);  // 4 of the 8 blocks reserved for layer 1
    CHECK(SecondPassHits(on) == 4);
    CHECK(ResidentIn(on, 1) == 4);
    // Beyond its share, a layer-1 load evicts a layer-1 expert: the other layers keep their 4.
    for (int e = 4; e < 10; ++e) LeaseAndRelease(on, 1, e);
    CHECK(ResidentIn(on, 1) == 4);
    int others = 0;
    for (int l = 2; l <= 7; ++l) others += ResidentIn(on, l);
    CHECK(others == 4);
    CHECK(on.offload->Metrics().resident_bytes == budget);
  }
  // Without the partition, LRU evicts the first layer's experts: every second-pass lease misses.
  LeadRig off = MakeLeadRig(CachePolicyKind::kLru, budget, 0, 0.5);
  CHECK(SecondPassHits(off) == 0);
}

TEST_CASE("runs with the lead-time partition equal the resident run and hold the budget", "[experts][lead]") {
  const RunOutput& want = ResidentRun();
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  // share 1 over three layers: the other layers' loads live only on the fallback.
  for (auto [layers, share] : {std::pair{1, 0.5}, std::pair{3, 1.0}}) {
    for (CachePolicyKind policy : {CachePolicyKind::kLru, CachePolicyKind::kUtility}) {
      INFO("lead layers " << layers << ", share " << share << ", policy " << CachePolicyName(policy));
      LeadRig r = MakeLeadRig(policy, total / 4, layers, share);
      auto m = model::Model::Load(config, ToyDir(), r.offload);
      REQUIRE(m.ok());
      r.offload->SetPredictor(MakeLookaheadPredictor(**m, {}));
      model::ForwardOptions hooks;
      r.offload->AttachHooks(&hooks);
      const testing::RunOutput got = testing::Run(**m, &hooks);
      r.offload->Quiesce();
      CHECK(got.ids == want.ids);
      CHECK(SameBits(got.logits, want.logits));
      const ExpertMetrics x = r.offload->Metrics();
      CHECK(x.resident_bytes <= x.budget_bytes);
    }
  }
}

TEST_CASE("a lead-protected share outside [0, 1] is refused", "[experts][lead]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, total, ""));
  REQUIRE(store.ok());
  for (double bad : {-0.1, 1.5}) {
    ExpertOffloadOptions opt;
    opt.lead_protected_share = bad;
    auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
    REQUIRE_FALSE(off.ok());
    CHECK(off.status().message().find("lead_protected_share") != std::string::npos);
  }
}

}  // namespace
}  // namespace terrace::experts
