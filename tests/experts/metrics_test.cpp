// Expert utilization metrics on hand-made skewed routing: per-expert load, max/mean, coefficient
// of variation and the hot experts, per layer and overall, against values worked out by hand
// below; the same figures in the Prometheus text.
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "experts_test_util.h"

namespace terrace::experts {
namespace {

using testing::ToyDir;

// k3-toy: layer 0 dense, layers 1-7 MoE with 16 routed experts each (checked below).
constexpr int kMoeLayers = 7;
constexpr int kExperts = 16;

const LayerMetrics& LayerNamed(const ExpertMetrics& m, int layer) {
  for (const auto& l : m.layers)
    if (l.layer == layer) return l;
  FAIL("no metrics for layer " << layer);
  return m.layers.front();
}

std::vector<std::uint64_t> Loads(std::initializer_list<std::pair<int, std::uint64_t>> nonzero) {
  std::vector<std::uint64_t> v(kExperts, 0);
  for (const auto& [e, n] : nonzero) v[static_cast<std::size_t>(e)] = n;
  return v;
}

bool Has(const std::string& text, const std::string& line) { return text.find(line + "\n") != std::string::npos; }

TEST_CASE("expert load, max/mean, CV and hot experts on a hand-made skewed routing trace", "[experts][metrics]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  REQUIRE(ToyDir().config().num_experts == kExperts);
  model::ForwardOptions hooks;
  t.offload->AttachHooks(&hooks);
  // Layer 1: eight tokens, top-2. Expert 3 in every token, 7 in four, 5 in two, 0 and 1 in one.
  hooks.on_routing(1, model::Routing{2, {3, 7, 3, 7, 3, 7, 3, 7, 3, 0, 3, 1, 3, 5, 3, 5}, {}});
  // Layer 2: eight tokens, top-2, every expert exactly once.
  hooks.on_routing(2, model::Routing{2, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {}});
  const ExpertMetrics m = t.offload->Metrics();
  REQUIRE(m.layers.size() == static_cast<std::size_t>(kMoeLayers));
  CHECK(m.hot_factor == 2.0);

  // Layer 1: loads 3:8 7:4 5:2 0:1 1:1, sum 16 over 16 experts: mean 1, max 8, max/mean 8.
  // Sum of squares 64 + 16 + 4 + 1 + 1 = 86: variance 86/16 - 1 = 4.375, CV sqrt(4.375) / 1.
  // Hot: load > 2 x 1, so 3 and 7; expert 5, at exactly 2x the mean, is not.
  const LayerMetrics& l1 = LayerNamed(m, 1);
  CHECK(l1.expert_load == Loads({{3, 8}, {7, 4}, {5, 2}, {0, 1}, {1, 1}}));
  CHECK(l1.load_mean == 1.0);
  CHECK(l1.load_max == 8.0);
  CHECK(l1.load_cv == Approx(std::sqrt(4.375)).epsilon(1e-12));
  CHECK(l1.hot_experts == std::vector<int>{3, 7});

  // Layer 2: uniform, loads all 1: mean 1, max 1, CV 0, nothing hot.
  const LayerMetrics& l2 = LayerNamed(m, 2);
  CHECK(l2.expert_load == std::vector<std::uint64_t>(kExperts, 1));
  CHECK(l2.load_mean == 1.0);
  CHECK(l2.load_max == 1.0);
  CHECK(l2.load_cv == 0.0);
  CHECK(l2.hot_experts.empty());

  // Layers 3-7: nothing routed: all zero, CV 0 (not NaN), nothing hot.
  for (int l = 3; l <= kMoeLayers; ++l) {
    INFO("layer " << l);
    const LayerMetrics& x = LayerNamed(m, l);
    CHECK(x.expert_load == std::vector<std::uint64_t>(kExperts, 0));
    CHECK(x.load_mean == 0.0);
    CHECK(x.load_max == 0.0);
    CHECK(x.load_cv == 0.0);
    CHECK(x.hot_experts.empty());
  }

  // Overall, over the 7 x 16 = 112 experts: sum 32, mean 32/112 = 2/7, max 8; sum of squares
  // 86 + 16 = 102: variance 102/112 - (2/7)^2 = 102/112 - 4/49, CV its square root over 2/7.
  CHECK(m.load_mean == Approx(2.0 / 7.0).epsilon(1e-12));
  CHECK(m.load_max == 8.0);
  CHECK(m.load_cv == Approx(std::sqrt(102.0 / 112.0 - 4.0 / 49.0) / (2.0 / 7.0)).epsilon(1e-12));
  CHECK(m.hot_experts == 2);

  const std::string text = m.ToText();
  CHECK(text.find("layer   1:") != std::string::npos);
  CHECK(text.find(", hot 3,7\n") != std::string::npos);

  const std::string prom = m.PrometheusText();
  CHECK(Has(prom, "terrace_experts_hot_experts 2"));
  CHECK(Has(prom, "# TYPE terrace_experts_layer_hot_experts gauge"));
  CHECK(Has(prom, "terrace_experts_layer_hot_experts{layer=\"1\"} 2"));
  CHECK(Has(prom, "terrace_experts_layer_hot_experts{layer=\"2\"} 0"));
  CHECK(Has(prom, "terrace_experts_expert_load_max{layer=\"1\"} 8"));
  CHECK(Has(prom, "terrace_experts_expert_load_mean{layer=\"1\"} 1"));
  CHECK(Has(prom, "terrace_experts_expert_load_max_over_mean{layer=\"1\"} 8"));
  CHECK(Has(prom, "terrace_experts_expert_load_max{layer=\"2\"} 1"));
  CHECK(Has(prom, "terrace_experts_expert_load_cv{layer=\"2\"} 0"));
  CHECK(Has(prom, "terrace_experts_hot_expert_load{layer=\"1\",expert=\"3\"} 8"));
  CHECK(Has(prom, "terrace_experts_hot_expert_load{layer=\"1\",expert=\"7\"} 4"));
  CHECK(prom.find("terrace_experts_hot_expert_load{layer=\"1\",expert=\"5\"}") == std::string::npos);
  CHECK(prom.find("terrace_experts_hot_expert_load{layer=\"2\"") == std::string::npos);
  CHECK(Has(prom, "terrace_experts_layer_hot_experts{layer=\"7\"} 0"));

  // Reset forgets the loads.
  REQUIRE(t.offload->Reset().ok());
  const ExpertMetrics r = t.offload->Metrics();
  CHECK(r.hot_experts == 0);
  CHECK(LayerNamed(r, 1).expert_load == std::vector<std::uint64_t>(kExperts, 0));
}

TEST_CASE("without the routing hook, expert load counts each layer's distinct selections", "[experts][metrics]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  // Four selections of layer 1 (a selection counts each expert once, however often it is listed).
  t.offload->Prefetch(1, std::vector<int>{3, 7});
  t.offload->Prefetch(1, std::vector<int>{3, 3, 7});
  t.offload->Prefetch(1, std::vector<int>{3, 9});
  t.offload->Prefetch(1, std::vector<int>{3});
  t.offload->Quiesce();
  const ExpertMetrics m = t.offload->Metrics();
  // Loads 3:4 7:2 9:1, sum 7: mean 7/16, max 4, max/mean 64/7. Sum of squares 16 + 4 + 1 = 21:
  // variance 21/16 - 49/256 = 287/256, CV sqrt(287/256) / (7/16) = sqrt(287) / 7.
  // Hot: load > 2 x 7/16 = 0.875, so 3, 7 and 9.
  const LayerMetrics& l1 = LayerNamed(m, 1);
  CHECK(l1.expert_load == Loads({{3, 4}, {7, 2}, {9, 1}}));
  CHECK(l1.load_mean == 7.0 / 16.0);
  CHECK(l1.load_max == 4.0);
  CHECK(l1.load_cv == Approx(std::sqrt(287.0) / 7.0).epsilon(1e-12));
  CHECK(l1.hot_experts == std::vector<int>{3, 7, 9});
  CHECK(m.hot_experts == 3);
  const std::string prom = m.PrometheusText();
  CHECK(Has(prom, "terrace_experts_layer_hot_experts{layer=\"1\"} 3"));
  CHECK(Has(prom, "terrace_experts_expert_load_mean{layer=\"1\"} 0.4375"));
  CHECK(Has(prom, "terrace_experts_hot_expert_load{layer=\"1\",expert=\"9\"} 1"));
}

TEST_CASE("a layer's hit rate counts late hits and misses against it", "[experts][metrics]") {
  // Hits are acquires served without waiting: a late hit waited, so it is in the denominator only.
  LayerMetrics l;
  l.layer = 1;
  l.hits = 1;
  l.late_hits = 1;
  l.misses = 2;
  CHECK(l.hit_rate() == Approx(0.25));
  l.misses = 0;
  CHECK(l.hit_rate() == Approx(0.5));
  l.hits = 0;
  l.late_hits = 0;
  CHECK(l.hit_rate() == 0.0);  // no acquires: 0, not NaN
  ExpertMetrics m;
  m.layers.resize(1);
  m.layers[0].layer = 1;
  m.layers[0].hits = 1;
  m.layers[0].late_hits = 1;
  m.layers[0].misses = 2;
  const nlohmann::json j = nlohmann::json::parse(m.ToJson());
  CHECK(j["layers"][0]["hit_rate"] == Approx(0.25));
}

TEST_CASE("undefined precision and recall are null, n/a and no Prometheus sample, never 0", "[experts][metrics]") {
  ExpertMetrics m;
  m.layers.resize(3);
  m.layers[0].layer = 1;  // nothing predicted, 4 routed: precision 0/0, recall 0/4
  m.layers[0].prediction.false_negative = 4;
  m.layers[1].layer = 2;  // 1 of 2 predictions routed, 1 of 3 routed predicted
  m.layers[1].prediction = PredictionCounts{1, 1, 2};
  m.layers[2].layer = 3;  // nothing predicted, nothing routed: neither defined
  m.prediction.false_negative = 4;  // the run: nothing predicted

  const nlohmann::json j = nlohmann::json::parse(m.ToJson());
  CHECK(j["precision"].is_null());
  CHECK(j["recall"] == 0.0);
  CHECK(j["layers"][0]["precision"].is_null());
  CHECK(j["layers"][0]["recall"] == 0.0);
  CHECK(j["layers"][1]["precision"] == 0.5);
  CHECK(j["layers"][1]["recall"] == Approx(1.0 / 3.0));
  CHECK(j["layers"][2]["precision"].is_null());
  CHECK(j["layers"][2]["recall"].is_null());

  const std::string text = m.ToText();
  INFO(text);
  CHECK(text.find("prediction precision n/a recall 0.000\n") != std::string::npos);
  CHECK(text.find("layer   1: hit 0.000 (late 0, miss 0), precision n/a recall 0.000,") != std::string::npos);
  CHECK(text.find("layer   2: hit 0.000 (late 0, miss 0), precision 0.500 recall 0.333,") != std::string::npos);
  CHECK(text.find("layer   3: hit 0.000 (late 0, miss 0), precision n/a recall n/a,") != std::string::npos);

  const std::string prom = m.PrometheusText();
  INFO(prom);
  CHECK(prom.find("terrace_experts_prediction_precision{layer=\"1\"}") == std::string::npos);
  CHECK(Has(prom, "terrace_experts_prediction_recall{layer=\"1\"} 0"));
  CHECK(Has(prom, "terrace_experts_prediction_precision{layer=\"2\"} 0.5"));
  CHECK(prom.find("terrace_experts_prediction_precision{layer=\"3\"}") == std::string::npos);
  CHECK(prom.find("terrace_experts_prediction_recall{layer=\"3\"}") == std::string::npos);
  CHECK(prom.find("NaN") == std::string::npos);
}


TEST_CASE("Create refuses a config that fails ValidateConfig (a model_type the model does not implement)",
          "[experts]") {
  model::ModelConfig config = ToyDir().config();
  config.model_type = "kimi_k3\xff";  // not one the model implements (nor valid UTF-8)
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(ToyDir().config());
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, total, ""));
  REQUIRE(store.ok());
  auto off = ExpertOffload::Create(config, ToyDir(), store->get(), {});
  REQUIRE_FALSE(off.ok());
  INFO(off.status().ToString());
  CHECK(off.status().IsInvalidArgument());
  CHECK(off.status().message().find("model_type") != std::string::npos);
}

// ExpertMetrics::ToJson with an embedder's predictor name that is not UTF-8: replaced, not thrown.
TEST_CASE("metrics JSON keeps a predictor name that is not valid UTF-8 (replaced), never throws", "[experts][metrics]") {
  ExpertMetrics m;
  m.predictor = "my-predictor\xe9";
  const std::string json = m.ToJson();
  const auto parsed = nlohmann::json::parse(json);
  CHECK(parsed.at("predictor").get<std::string>().rfind("my-predictor", 0) == 0);
}

}  // namespace
}  // namespace terrace::experts
