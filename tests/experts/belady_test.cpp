// The belady cache policy and the offline Belady simulation (SimulateBelady): on hand-made traces
// their misses equal the optimum an exhaustive search over every cache state finds (computed here,
// independently of Belady's rule), and are never more than lru's or utility's; belady respects
// leases, the budget and the lead-time partition; it runs only with the oracle predictor.
#include <bit>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "experts_test_util.h"
#include "src/experts/belady.h"

namespace terrace::experts {
namespace {

using testing::BlockBytes;
using testing::ResidentIn;
using testing::ToyDir;

constexpr int kLayers[] = {1, 2, 3};  // k3-toy MoE layers the hand-made traces route through
constexpr int kExpertsUsed = 6;       // experts 0..5 of each

int NumLayers() { return ToyDir().config().num_hidden_layers; }

// Bit of (layer, expert) in the search's cache masks.
int Bit(int layer, int expert) { return (layer - kLayers[0]) * kExpertsUsed + expert; }

// A trace of `steps` steps, each routing every layer of kLayers to 1 or 2 distinct experts
// (ascending) of 0..kExpertsUsed-1, from a fixed linear congruential sequence.
RoutingTrace MakeTrace(std::uint32_t seed, int steps) {
  RoutingTrace t;
  t.num_layers = NumLayers();
  std::uint32_t x = seed;
  auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<int>((x >> 16) % kExpertsUsed);
  };
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<int>> layers(static_cast<std::size_t>(t.num_layers));
    for (int l : kLayers) {
      std::vector<int>& sel = layers[static_cast<std::size_t>(l)];
      sel.push_back(next());
      if (next() % 2 == 0) {
        const int b = next();
        if (b != sel[0]) sel.push_back(b);
      }
      std::sort(sel.begin(), sel.end());
    }
    t.steps.push_back(std::move(layers));
  }
  return t;
}

// The fewest misses of any cache of `capacity` experts on `trace`, by exhaustive search over
// cache states (masks of Bit). `whole_layer`: a layer's selection must be cached all at once (as
// ExpertOffload loads it: one batch, its experts kept while the layer runs); otherwise the
// experts are acquired one at a time, ascending (the forward pass's order).
std::uint64_t OptimalMisses(const RoutingTrace& trace, int capacity, bool whole_layer) {
  std::map<std::uint32_t, std::uint64_t> best{{0u, 0}};
  auto request = [&](std::uint32_t need) {
    std::map<std::uint32_t, std::uint64_t> next;
    for (const auto& [mask, misses] : best) {
      const std::uint64_t m = misses + static_cast<std::uint64_t>(std::popcount(need & ~mask));
      // Keep any subset of the other cached experts that fits beside `need`.
      const std::uint32_t others = mask & ~need;
      for (std::uint32_t keep = others;; keep = (keep - 1) & others) {
        const std::uint32_t state = need | keep;
        if (std::popcount(state) <= capacity) {
          auto [it, inserted] = next.try_emplace(state, m);
          if (!inserted) it->second = std::min(it->second, m);
        }
        if (keep == 0) break;
      }
    }
    best = std::move(next);
  };
  for (const auto& step : trace.steps) {
    for (int l : kLayers) {
      std::uint32_t sel = 0;
      for (int e : step[static_cast<std::size_t>(l)]) {
        if (!whole_layer) request(1u << Bit(l, e));
        sel |= 1u << Bit(l, e);
      }
      if (whole_layer) request(sel);
    }
  }
  std::uint64_t fewest = UINT64_MAX;
  for (const auto& [mask, misses] : best) fewest = std::min(fewest, misses);
  return fewest;
}

// Replays `trace` through an ExpertOffload as the forward pass drives it (each layer: its
// selection, then one lease at a time, ascending) with `capacity` experts of budget; the misses.
// `future`: the oracle predictor over `trace` at depth 0 (its known future, no prefetches).
std::uint64_t LiveMisses(CachePolicyKind policy, const RoutingTrace& trace, int capacity, bool future,
                         int lead_layers = 0) {
  ExpertOffloadOptions opt;
  opt.policy = policy;
  opt.budget = CacheBudget{0, static_cast<std::uint64_t>(capacity) * BlockBytes()};
  opt.lead_protected_layers = lead_layers;
  if (future) opt.predictor = MakeOraclePredictor(std::make_shared<const RoutingTrace>(trace), 0);
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  for (const auto& step : trace.steps) {
    for (int l = 0; l < NumLayers(); ++l) {
      const std::vector<int>& sel = step[static_cast<std::size_t>(l)];
      if (sel.empty()) continue;
      t.offload->Prefetch(l, sel);
      for (int e : sel) {
        auto lease = t.offload->Lease(l, e);
        if (!lease.ok()) FAIL(lease.status().ToString());
        const ExpertMetrics m = t.offload->Metrics();
        CHECK(m.resident_bytes <= m.budget_bytes);
      }
    }
  }
  const ExpertMetrics m = t.offload->Metrics();
  CHECK(m.prefetches_issued == 0);
  return m.misses + m.late_hits;
}

TEST_CASE("SimulateBelady counts a hand-checked case and matches the exhaustive optimum", "[experts][belady]") {
  // Room for 2; one expert per step: 1 2 3 1 2. Belady loads 1, 2, then 3 evicting 2 (next used
  // after 1), hits 1, loads 2: 4 misses (lru: 5, it evicts 1 for 3).
  RoutingTrace tiny;
  tiny.num_layers = 2;
  for (int e : {1, 2, 3, 1, 2}) tiny.steps.push_back({{}, {e}});
  const BeladyMisses b = SimulateBelady(tiny, 2);
  CHECK(b.step_misses == std::vector<std::uint64_t>{1, 1, 1, 0, 1});
  CHECK(b.From(0) == 4);
  CHECK(b.From(3) == 1);
  CHECK(SimulateBelady(tiny, 0).From(0) == 5);
  CHECK(SimulateBelady(tiny, 3).From(0) == 3);  // room for all: the distinct experts

  for (std::uint32_t seed : {1u, 7u, 42u, 99u}) {
    const RoutingTrace t = MakeTrace(seed, 9);
    for (int capacity : {2, 3, 5}) {
      INFO("seed " << seed << ", capacity " << capacity);
      const std::uint64_t sequential = OptimalMisses(t, capacity, false);
      CHECK(SimulateBelady(t, static_cast<std::uint64_t>(capacity)).From(0) == sequential);
      CHECK(sequential <= OptimalMisses(t, capacity, true));
    }
  }
}

TEST_CASE("the belady policy misses exactly the optimum, never more than lru or utility", "[experts][belady]") {
  std::uint64_t lru_total = 0, belady_total = 0;
  for (std::uint32_t seed : {1u, 7u, 42u, 99u}) {
    const RoutingTrace t = MakeTrace(seed, 9);
    for (int capacity : {2, 3, 5}) {
      INFO("seed " << seed << ", capacity " << capacity);
      const std::uint64_t optimum = OptimalMisses(t, capacity, true);
      const std::uint64_t belady = LiveMisses(CachePolicyKind::kBelady, t, capacity, true);
      const std::uint64_t lru = LiveMisses(CachePolicyKind::kLru, t, capacity, false);
      const std::uint64_t utility = LiveMisses(CachePolicyKind::kUtility, t, capacity, false);
      CHECK(belady == optimum);
      CHECK(belady <= lru);
      CHECK(belady <= utility);
      // The offline simulation (one acquire at a time) is a lower bound of the batched cache.
      CHECK(SimulateBelady(t, static_cast<std::uint64_t>(capacity)).From(0) <= belady);
      lru_total += lru;
      belady_total += belady;
    }
  }
  CHECK(belady_total < lru_total);  // the traces are hard enough to tell them apart
}

TEST_CASE("belady keeps the lead-time partition, leases and the budget", "[experts][belady]") {
  // Step 0 routes layer 1 and layers 2..7 to experts 0..3; in the future only layers 2..7 come
  // back, so Belady alone evicts layer 1's experts first. With 4 of 8 blocks reserved for layer 1
  // (the partition), the deeper layers' loads evict among themselves instead.
  RoutingTrace t;
  t.num_layers = NumLayers();
  t.steps.assign(2, std::vector<std::vector<int>>(static_cast<std::size_t>(t.num_layers)));
  for (int l = 1; l < t.num_layers; ++l) t.steps[0][static_cast<std::size_t>(l)] = {0, 1, 2, 3};
  for (int l = 2; l < t.num_layers; ++l) t.steps[1][static_cast<std::size_t>(l)] = {0, 1, 2, 3};
  for (int lead_layers : {0, 1}) {
    INFO("lead layers " << lead_layers);
    ExpertOffloadOptions opt;
    opt.policy = CachePolicyKind::kBelady;
    opt.budget = CacheBudget{0, 8 * BlockBytes()};
    opt.lead_protected_layers = lead_layers;
    opt.lead_protected_share = 0.5;
    opt.predictor = MakeOraclePredictor(std::make_shared<const RoutingTrace>(t), 0);
    testing::ToyOffload r = testing::OpenToyOffload(std::move(opt));
    for (int l = 1; l < t.num_layers; ++l) {
      r.offload->Prefetch(l, t.steps[0][static_cast<std::size_t>(l)]);
      for (int e = 0; e < 4; ++e) {
        auto lease = r.offload->Lease(l, e);
        REQUIRE(lease.ok());
        CHECK(r.offload->Metrics().resident_bytes <= r.offload->Metrics().budget_bytes);
      }
    }
    CHECK(ResidentIn(r, 1) == (lead_layers == 1 ? 4 : 0));
    CHECK(r.offload->Metrics().resident_bytes == 8 * BlockBytes());
  }
  // A leased expert is never the victim, even the one used farthest ahead (never again).
  ExpertOffloadOptions opt;
  opt.policy = CachePolicyKind::kBelady;
  opt.budget = CacheBudget{0, BlockBytes()};
  opt.predictor = MakeOraclePredictor(std::make_shared<const RoutingTrace>(t), 0);
  testing::ToyOffload one = testing::OpenToyOffload(std::move(opt));
  auto held = one.offload->Lease(1, 9);  // not in the trace: never used again
  REQUIRE(held.ok());
  auto other = one.offload->Lease(2, 0);
  REQUIRE_FALSE(other.ok());
  CHECK(other.status().IsOutOfCapacity());
}

TEST_CASE("belady runs only with the oracle predictor", "[experts][belady]") {
  CHECK(*ParseCachePolicy("belady") == CachePolicyKind::kBelady);
  CHECK(CachePolicyName(CachePolicyKind::kBelady) == "belady");
  for (PredictorKind p : {PredictorKind::kNone, PredictorKind::kLookahead, PredictorKind::kStatistical, PredictorKind::kOracle}) {
    INFO(PredictorName(p));
    const Status s = CheckPolicyPredictor(CachePolicyKind::kBelady, p);
    CHECK(s.ok() == (p == PredictorKind::kOracle));
    if (!s.ok()) {
      CHECK(s.IsInvalidArgument());
      CHECK(s.message().find("oracle") != std::string::npos);
      CHECK(s.message().find(std::string(PredictorName(p))) != std::string::npos);
    }
    for (CachePolicyKind other : {CachePolicyKind::kLru, CachePolicyKind::kLfu, CachePolicyKind::kUtility})
      CHECK(CheckPolicyPredictor(other, p).ok());
  }

  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, total, ""));
  REQUIRE(store.ok());
  // Create refuses a predictor without a known future, and a trace of another model's layers.
  {
    ExpertOffloadOptions opt;
    opt.policy = CachePolicyKind::kBelady;
    opt.predictor = MakeStatisticalPredictor(config);
    auto off = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt));
    REQUIRE_FALSE(off.ok());
    CHECK(off.status().IsInvalidArgument());
    CHECK(off.status().message().find("belady") != std::string::npos);
    CHECK(off.status().message().find("statistical") != std::string::npos);
    auto wrong = std::make_shared<RoutingTrace>();
    wrong->num_layers = 3;
    ExpertOffloadOptions opt2;
    opt2.policy = CachePolicyKind::kBelady;
    opt2.predictor = MakeOraclePredictor(wrong);
    auto off2 = ExpertOffload::Create(config, ToyDir(), store->get(), std::move(opt2));
    REQUIRE_FALSE(off2.ok());
    CHECK(off2.status().message().find("3 layers") != std::string::npos);
  }
  // Without a predictor (the pass that records the trace) it runs; a predictor without a future
  // set later fails every acquire, naming it, until the oracle is set.
  ExpertOffloadOptions opt;
  opt.policy = CachePolicyKind::kBelady;
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  REQUIRE(t.offload->Lease(1, 0).ok());
  t.offload->SetPredictor(MakeNonePredictor());
  auto refused = t.offload->Lease(1, 0);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().IsInvalidArgument());
  CHECK(refused.status().message().find("the none predictor") != std::string::npos);
  t.offload->SetPredictor(MakeOraclePredictor(t.offload->trace()));
  CHECK(t.offload->Lease(1, 0).ok());
}

}  // namespace
}  // namespace terrace::experts
