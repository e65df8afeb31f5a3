// Offloaded runs equal the all-resident run bit for bit, for every cache policy (belady with the
// oracle only), predictor and budget (down to one that holds only one layer's top-k experts), and the cache keeps its budget.
#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "experts_test_util.h"
#include "forwarding_tier.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"

namespace terrace::experts {
namespace {

using testing::BlockBytes;
using testing::ResidentRun;
using testing::RunOutput;
using testing::SameBits;
using testing::ToyDir;

struct Offloaded {
  std::unique_ptr<Store> store;
  std::shared_ptr<ExpertOffload> offload;
  std::unique_ptr<model::Model> model;
};

// An hbm tier whose caps say GPU device memory, as the CUDA tier's do: the host must not read it.
class DeviceMemoryTier final : public terrace::testing::ForwardingTier {
 public:
  explicit DeviceMemoryTier(std::shared_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {
    caps_.memory = MemoryKind::kDevice;
    caps_.emulated = false;
  }
};

Offloaded Make(CachePolicyKind policy, CacheBudget budget, const std::string& nvme_dir = {}) {
  ExpertOffloadOptions opt;
  opt.policy = policy;
  opt.budget = budget;
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt), nvme_dir);
  Offloaded o;
  o.store = std::move(t.store);
  o.offload = std::move(t.offload);
  auto m = model::Model::Load(ToyDir().config(), ToyDir(), o.offload);
  REQUIRE(m.ok());
  o.model = std::move(m).value();
  return o;
}

// Runs the prompt with `predictor`; for the oracle, first records the trace with predictor none.
RunOutput RunWith(Offloaded& o, PredictorKind predictor) {
  const auto& config = ToyDir().config();
  switch (predictor) {
    case PredictorKind::kNone: o.offload->SetPredictor(MakeNonePredictor()); break;
    case PredictorKind::kLookahead: o.offload->SetPredictor(MakeLookaheadPredictor(*o.model, {})); break;
    case PredictorKind::kStatistical: o.offload->SetPredictor(MakeStatisticalPredictor(config)); break;
    case PredictorKind::kOracle: {
      model::ForwardOptions hooks;
      o.offload->AttachHooks(&hooks);
      (void)testing::Run(*o.model, &hooks);
      auto trace = o.offload->trace();
      REQUIRE(o.offload->Reset().ok());
      o.offload->SetPredictor(MakeOraclePredictor(trace));
      break;
    }
  }
  model::ForwardOptions hooks;
  o.offload->AttachHooks(&hooks);
  RunOutput out = testing::Run(*o.model, &hooks);
  o.offload->Quiesce();
  return out;
}

TEST_CASE("offloaded runs equal the resident run for every policy, predictor and budget", "[experts]") {
  const RunOutput& want = ResidentRun();
  REQUIRE_FALSE(want.logits.empty());
  const auto& config = ToyDir().config();
  const std::uint64_t one_layer_topk = static_cast<std::uint64_t>(config.num_experts_per_token) * BlockBytes();
  std::vector<std::pair<std::string, CacheBudget>> budgets = {
      {"one layer's top-k", CacheBudget{0, one_layer_topk}},
      {"25%", *CacheBudget::Parse("25%")},
      {"100%", *CacheBudget::Parse("100%")}};
  // TSan runs every predictor (the prefetch threads) against two policies at the two budgets that
  // evict; the normal and ASan builds run the whole matrix.
  // belady runs only with the oracle (CheckPolicyPredictor): its other predictors are skipped.
  std::vector<CachePolicyKind> policies = {CachePolicyKind::kLru, CachePolicyKind::kLfu, CachePolicyKind::kUtility,
                                           CachePolicyKind::kBelady};
  if (terrace::testing::kThreadSanitizedBuild) {
    policies = {CachePolicyKind::kLru, CachePolicyKind::kUtility};
    budgets.pop_back();
  }
  for (CachePolicyKind policy : policies) {
    for (PredictorKind predictor :
         {PredictorKind::kNone, PredictorKind::kLookahead, PredictorKind::kStatistical, PredictorKind::kOracle}) {
      if (!CheckPolicyPredictor(policy, predictor).ok()) continue;
      for (const auto& [bname, budget] : budgets) {
        INFO("policy " << CachePolicyName(policy) << ", predictor " << PredictorName(predictor) << ", budget " << bname);
        Offloaded o = Make(policy, budget);
        RunOutput got = RunWith(o, predictor);
        CHECK(got.ids == want.ids);
        CHECK(SameBits(got.logits, want.logits));
        ExpertMetrics m = o.offload->Metrics();
        CHECK(m.resident_bytes <= m.budget_bytes);
        CHECK(m.budget_bytes == budget.Resolve(m.total_expert_bytes));
        CHECK(m.hits + m.late_hits + m.misses > 0);
        CHECK(m.steps == static_cast<std::uint64_t>(1 + testing::kDecodeSteps));
        CHECK(m.tokens == testing::Prompt().size() + testing::kDecodeSteps);
        // Every landed load was read from the experts' home (host): none from HBM or NVMe.
        const auto host = static_cast<std::size_t>(TierId::kHost);
        CHECK(m.loaded_bytes_from[host] == m.demand_bytes + m.speculative_bytes);
        CHECK(m.loaded_bytes_from[host] == m.loads_from[host] * BlockBytes());
        CHECK(m.loads_from[static_cast<std::size_t>(TierId::kHbm)] == 0);
        CHECK(m.loads_from[static_cast<std::size_t>(TierId::kNvme)] == 0);
        if (predictor == PredictorKind::kNone) {
          CHECK(m.speculative_bytes == 0);
          CHECK(m.prefetches_issued == 0);
        }
        if (bname == "100%" && predictor == PredictorKind::kNone) {
          // Nothing is ever evicted: each distinct expert misses exactly once.
          auto trace = o.offload->trace();
          std::set<std::pair<int, int>> distinct;
          for (const auto& step : trace->steps)
            for (int l = 0; l < static_cast<int>(step.size()); ++l)
              for (int e : step[static_cast<std::size_t>(l)]) distinct.emplace(l, e);
          CHECK(m.misses == distinct.size());
          CHECK(m.evictions == 0);
        }
        if (predictor == PredictorKind::kOracle) {
          CHECK(m.prediction.precision_if_defined().value_or(-1) == 1.0);
          CHECK(m.prediction.recall_if_defined().value_or(-1) > 0.8);
        }
      }
    }
  }
}

TEST_CASE("experts homed on the NVMe tier give the resident run's outputs", "[experts]") {
  terrace::testing::TempDir dir("experts-nvme");
  Offloaded o = Make(CachePolicyKind::kUtility, *CacheBudget::Parse("25%"), (dir.path() / "store").string());
  RunOutput got = RunWith(o, PredictorKind::kLookahead);
  CHECK(got.ids == ResidentRun().ids);
  CHECK(SameBits(got.logits, ResidentRun().logits));
  StoreStats st = o.store->Stats();
  CHECK(st.tiers[static_cast<int>(TierId::kNvme)].blocks ==
        o.offload->Metrics().total_expert_bytes / BlockBytes());
  CHECK(st.tiers[static_cast<int>(TierId::kHost)].blocks == 0);
  // The loads come from NVMe, where the experts live; the metrics say so (the store's own per-tier
  // hit counters leave prefetch reads out, so they cannot).
  const ExpertMetrics m = o.offload->Metrics();
  const auto nvme = static_cast<std::size_t>(TierId::kNvme);
  CHECK(m.loads_from[nvme] > 0);
  CHECK(m.loaded_bytes_from[nvme] == m.demand_bytes + m.speculative_bytes);
  CHECK(m.loads_from[static_cast<std::size_t>(TierId::kHost)] == 0);
  CHECK(m.loads_from[static_cast<std::size_t>(TierId::kHbm)] == 0);
}

TEST_CASE("a lease pins its expert in the fast tier; eviction never drops the home copy", "[experts]") {
  const auto& config = ToyDir().config();
  // Room for exactly one expert: each new lease must evict the previous, unleased one.
  Offloaded o = Make(CachePolicyKind::kLru, CacheBudget{0, BlockBytes()});
  auto a = o.offload->Lease(1, 0);
  REQUIRE(a.ok());
  CHECK(a->weights().format == model::ExpertFormat::kMxfp4);
  CHECK(a->weights().q1.rows == config.moe_intermediate_size);
  // While leased, a second expert cannot get room.
  auto b = o.offload->Lease(1, 1);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().IsOutOfCapacity());
  CHECK(b.status().message().find("expert 1 of layer 1") != std::string::npos);
  a->Release();
  auto c = o.offload->Lease(1, 1);
  REQUIRE(c.ok());
  ExpertMetrics m = o.offload->Metrics();
  CHECK(m.evictions == 1);
  CHECK(m.resident_bytes == BlockBytes());
  // The evicted expert's home copy is still there and still serves a lease.
  c->Release();
  auto d = o.offload->Lease(1, 0);
  REQUIRE(d.ok());
  CHECK(o.store->Stats().tiers[static_cast<int>(TierId::kHost)].blocks ==
        o.offload->Metrics().total_expert_bytes / BlockBytes());
}

TEST_CASE("budgets, policies and predictors parse; bad text is an error naming the forms", "[experts]") {
  CHECK(CacheBudget::Parse("25%")->fraction == 0.25);
  CHECK(CacheBudget::Parse("64MiB")->bytes == 64ull << 20);
  CHECK(CacheBudget::Parse("2G")->bytes == 2ull << 30);
  CHECK(CacheBudget::Parse("4096")->bytes == 4096);
  for (const char* bad : {"", "0%", "101%", "abc", "12XB", "0", "-5%"}) {
    auto r = CacheBudget::Parse(bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find("25%") != std::string::npos);
  }
  // ParsePercent: percentages only, and its errors offer only them (no sizes).
  CHECK(CacheBudget::ParsePercent("25%")->fraction == 0.25);
  for (const char* bad : {"", "0%", "101%", "64MiB", "1048576", "abc", "x%"}) {
    auto r = CacheBudget::ParsePercent(bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find("such as 25% (0-100]") != std::string::npos);
    CHECK(r.status().message().find("size such as") == std::string::npos);
  }
  CHECK(*ParsePredictor("lookahead") == PredictorKind::kLookahead);
  CHECK_FALSE(ParsePredictor("magic").ok());
  CHECK(*ParseCachePolicy("utility") == CachePolicyKind::kUtility);
  CHECK_FALSE(ParseCachePolicy("fifo").ok());
}

TEST_CASE("a budget below one expert block is refused with the sizes", "[experts]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, total, ""));
  REQUIRE(store.ok());
  ExpertOffloadOptions opt;
  opt.budget = CacheBudget{0, BlockBytes() - 1};
  auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
  REQUIRE_FALSE(off.ok());
  CHECK(off.status().IsInvalidArgument());
  // The library names its own option (the CLI adds its flag); the sizes say what is missing.
  CHECK(off.status().message().find("expert cache budget") != std::string::npos);
  CHECK(off.status().message().find(std::to_string(BlockBytes())) != std::string::npos);
}

TEST_CASE("a hand-filled budget fraction outside (0, 1] is refused; Resolve never exceeds the total", "[experts]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, total, ""));
  REQUIRE(store.ok());
  for (double f : {-0.5, 0.0, std::nan(""), 2.0, std::numeric_limits<double>::infinity()}) {
    CAPTURE(f);
    const CacheBudget b{f, 0};
    CHECK(b.Check().IsInvalidArgument());
    CHECK(b.Resolve(total) <= total);
    ExpertOffloadOptions opt;
    opt.budget = b;
    auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
    REQUIRE_FALSE(off.ok());
    CHECK(off.status().IsInvalidArgument());
    CHECK(off.status().message().find("fraction") != std::string::npos);
  }
  CHECK(CacheBudget{1.0, 0}.Resolve(total) == total);
  // A total whose double rounds up to 2^64 (no uint64 value): the whole of it, not 0.
  const std::uint64_t huge = std::numeric_limits<std::uint64_t>::max();
  CHECK(CacheBudget{1.0, 0}.Resolve(huge) == huge);
  CHECK(CacheBudget{0.5, 0}.Resolve(huge) == huge / 2 + 1);  // 2^63: the double of huge / 2
  CHECK(CacheBudget{0.5, 0}.Check().ok());
  CHECK(CacheBudget{-1.0, 3 * BlockBytes()}.Check().ok());  // an absolute budget ignores the fraction
}

TEST_CASE("an hbm tier smaller than the budget is refused with both sizes", "[experts]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  StoreOptions so = ExpertOffload::OpenStoreOptions(total, total, "");
  so.hbm.capacity_bytes = 4 * BlockBytes();
  auto store = Store::Open(so);
  REQUIRE(store.ok());
  const std::uint64_t hbm = (*store)->Stats().tiers[static_cast<std::size_t>(TierId::kHbm)].capacity_bytes;
  REQUIRE(hbm < 8 * BlockBytes());
  ExpertOffloadOptions opt;
  opt.budget = CacheBudget{0, 8 * BlockBytes()};
  auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
  REQUIRE_FALSE(off.ok());
  CHECK(off.status().IsInvalidArgument());
  CHECK(off.status().message().find(std::to_string(8 * BlockBytes())) != std::string::npos);
  CHECK(off.status().message().find(std::to_string(hbm)) != std::string::npos);
  // A budget the tier holds is accepted over the same store.
  ExpertOffloadOptions fits;
  fits.budget = CacheBudget{0, hbm / BlockBytes() * BlockBytes()};
  CHECK(ExpertOffload::Create(config, ToyDir(), store->get(), std::move(fits)).ok());
}

TEST_CASE("an hbm tier in device memory is refused: the experts are read on the host", "[experts]") {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  StoreOptions so = ExpertOffload::OpenStoreOptions(total, total, "");
  auto host = HostTier::Create(so.host);
  REQUIRE(host.ok());
  auto hbm = EmulatedHbmTier::Create(so.hbm);
  REQUIRE(hbm.ok());
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<int>(TierId::kHost)] = std::move(host).value();
  tiers[static_cast<int>(TierId::kHbm)] = std::make_unique<DeviceMemoryTier>(std::move(hbm).value());
  auto store = Store::OpenWithTiers(so, std::move(tiers));
  REQUIRE(store.ok());
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
  REQUIRE_FALSE(off.ok());
  CHECK(off.status().IsInvalidArgument());
  CHECK(off.status().message().find("host-addressable") != std::string::npos);
}

}  // namespace
}  // namespace terrace::experts
