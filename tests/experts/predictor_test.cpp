// Prediction scoring on hand-made routing traces: precision and recall counted by hand, the oracle
// replaying a trace, the statistical predictor learning a periodic one, and the utility policy's
// use probability.
#include "experts_test_util.h"
#include "src/experts/cache_policy.h"

namespace terrace::experts {
namespace {

TEST_CASE("precision and recall match counts made by hand", "[experts]") {
  PredictionScorer s(4);
  // step 0, layer 1: predicted {1,2,3} (in two predictions, overlapping), routed {2,3,4}.
  s.Predict(Prediction{0, 1, {1, 2}, 0.9});
  s.Predict(Prediction{0, 1, {2, 3}, 0.5});
  const int a01[] = {4, 3, 2, 2};  // duplicates count once
  s.Observe(0, 1, a01);
  // step 0, layer 2: nothing predicted, routed {0, 5}: two false negatives.
  const int a02[] = {0, 5};
  s.Observe(0, 2, a02);
  // step 1, layer 1: predicted {7}, routed {7}.
  s.Predict(Prediction{1, 1, {7}, 1.0});
  // A prediction for a step that never routes it is not scored.
  s.Predict(Prediction{1, 3, {1}, 1.0});
  const int a11[] = {7};
  s.Observe(1, 1, a11);
  const int a22[] = {6};
  s.Observe(2, 2, a22);  // step 1's pending layer-3 prediction is dropped unscored
  CHECK(s.layer(1).true_positive == 3);
  CHECK(s.layer(1).false_positive == 1);
  CHECK(s.layer(1).false_negative == 1);
  CHECK(s.layer(1).precision_if_defined().value() == Approx(3.0 / 4.0));
  CHECK(s.layer(1).recall_if_defined().value() == Approx(3.0 / 4.0));
  CHECK(s.layer(2).true_positive == 0);
  CHECK(s.layer(2).false_negative == 3);
  // Nothing predicted: precision is 0/0, undefined (not 0: no prediction was wrong); recall 0 of 3.
  CHECK_FALSE(s.layer(2).precision_if_defined().has_value());
  CHECK(s.layer(2).recall_if_defined() == 0.0);
  CHECK(s.layer(3).false_positive == 0);
  // Nothing scored at all (layer 3's prediction was dropped): neither is defined.
  CHECK_FALSE(s.layer(3).precision_if_defined().has_value());
  CHECK_FALSE(s.layer(3).recall_if_defined().has_value());
  const PredictionCounts t = s.total();
  CHECK(t.true_positive == 3);
  CHECK(t.false_positive == 1);
  CHECK(t.false_negative == 4);
  CHECK(t.recall_if_defined().value() == Approx(3.0 / 7.0));
}

// Feeds `trace` to an ExpertOffload (as MoeForward's Prefetch calls would; with `token_start`,
// each step begins with the on_embedding hook's OnTokenStart, as in a forward pass) and returns
// its metrics.
ExpertMetrics Replay(const RoutingTrace& trace, std::unique_ptr<Predictor> predictor, bool token_start = false) {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.predictor = std::move(predictor);
  const testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  const std::shared_ptr<ExpertOffload>& off = t.offload;
  const std::vector<float> embedding(static_cast<std::size_t>(testing::ToyDir().config().hidden_size), 0.5f);
  for (const auto& step : trace.steps) {
    if (token_start) off->OnTokenStart(embedding, 1);
    for (int l = 0; l < trace.num_layers; ++l) {
      const auto& sel = step[static_cast<std::size_t>(l)];
      if (sel.empty()) continue;
      off->Prefetch(l, sel);
      for (int e : sel) {
        auto lease = off->Lease(l, e);
        REQUIRE(lease.ok());
      }
    }
  }
  off->Quiesce();
  return off->Metrics();
}

RoutingTrace HandTrace(int steps, bool periodic) {
  const auto& config = testing::ToyDir().config();
  RoutingTrace t;
  t.num_layers = config.num_hidden_layers;
  for (int s = 0; s < steps; ++s) {
    t.steps.emplace_back(static_cast<std::size_t>(t.num_layers));
    for (int l = 1; l < t.num_layers; ++l) {
      // periodic: the same two experts per layer at every step; else a pattern that changes.
      const int base = periodic ? l : (l * 5 + s * 3);
      t.steps.back()[static_cast<std::size_t>(l)] = {base % 16, (base + 7) % 16};
      std::sort(t.steps.back()[static_cast<std::size_t>(l)].begin(), t.steps.back()[static_cast<std::size_t>(l)].end());
    }
  }
  return t;
}

TEST_CASE("the oracle replays a hand-made trace: precision 1, recall all but the first layer", "[experts]") {
  const RoutingTrace t = HandTrace(6, false);
  auto shared = std::make_shared<const RoutingTrace>(t);
  ExpertMetrics m = Replay(t, MakeOraclePredictor(shared, 2));
  // Every (step, layer) but step 0's first MoE layer is predicted exactly; 2 experts each.
  const std::uint64_t routed = 6 * 7 * 2;
  CHECK(m.prediction.true_positive == routed - 2);
  CHECK(m.prediction.false_positive == 0);
  CHECK(m.prediction.false_negative == 2);
  CHECK(m.prediction.precision_if_defined().value_or(-1) == 1.0);
  CHECK(m.prediction.recall_if_defined().value_or(-1) == Approx(static_cast<double>(routed - 2) / routed));
  // The replayed trace is what the offload recorded.
  CHECK(m.steps == 6);
}

TEST_CASE("the oracle's depth counts MoE layers: at depth 1 it reaches past the dense layer 0, and at token start "
          "it predicts the step's first MoE layer", "[experts]") {
  REQUIRE(testing::FirstMoeLayer() == 1);  // k3-toy: layer 0 is dense
  const RoutingTrace t = HandTrace(6, false);
  auto shared = std::make_shared<const RoutingTrace>(t);
  const std::uint64_t routed = 6 * 7 * 2;
  // Routing calls only: each step's first MoE layer is predicted from the last MoE layer of the
  // step before, so every (step, layer) but step 0's first MoE layer.
  ExpertMetrics m = Replay(t, MakeOraclePredictor(shared, 1));
  CHECK(m.prediction.true_positive == routed - 2);
  CHECK(m.prediction.false_negative == 2);
  CHECK(m.prediction.false_positive == 0);
  // With the forward pass's token start: step 0's first MoE layer too. Recall 1 in every layer.
  m = Replay(t, MakeOraclePredictor(shared, 1), /*token_start=*/true);
  CHECK(m.prediction.true_positive == routed);
  CHECK(m.prediction.false_positive == 0);
  for (const LayerMetrics& l : m.layers) {
    INFO("layer " << l.layer);
    CHECK(l.prediction.recall_if_defined().value_or(-1) == 1.0);
  }
  // Depth 0 predicts nothing, at token start included (the belady policy's demand-paged bound).
  m = Replay(t, MakeOraclePredictor(shared, 0), /*token_start=*/true);
  CHECK(m.prediction.true_positive == 0);
}

TEST_CASE("the oracle at token start predicts layer 0 of the step when layer 0 is a MoE layer", "[experts]") {
  // A trace whose every layer routes (a model without a dense first layer): the step's first MoE
  // layer is layer 0, which no routing call of the step precedes.
  RoutingTrace t;
  t.num_layers = 3;
  for (int s = 0; s < 2; ++s) t.steps.push_back({{s, 4 + s}, {1, 2}, {3, 6}});
  auto oracle = MakeOraclePredictor(std::make_shared<const RoutingTrace>(t), 1);
  std::vector<Prediction> out;
  oracle->OnTokenStart(1, {}, 1, &out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].step == 1);
  CHECK(out[0].layer == 0);
  CHECK(out[0].experts == std::vector<int>{1, 5});
  // After layer 2 of step 0 comes layer 0 of step 1, as at token start.
  out.clear();
  oracle->OnRouting(0, 2, std::vector<int>{3, 6}, &out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].step == 1);
  CHECK(out[0].layer == 0);
}

TEST_CASE("lookahead's depth counts MoE layers: after a dense layer, distance 1 is the next MoE layer",
          "[experts][lookahead]") {
  auto base = model::Preset("k3-toy");
  REQUIRE(base.ok());
  model::ModelConfig c = testing::SmallConfig(*base);
  c.first_k_dense_replace = 2;  // layers 0 and 1 dense
  terrace::testing::TempDir d("lookahead-dense2");
  auto dir = testing::InitRandomCodesDir(c, d.path(), 3);
  auto m = model::Model::Load(c, *dir);
  REQUIRE(m.ok());
  auto predictor = MakeLookaheadPredictor(**m, LookaheadOptions{.depth = 1, .min_confidence = 0.0, .min_rank_precision = 0});
  const std::vector<float> hidden(static_cast<std::size_t>(c.hidden_size), 0.5f);
  std::vector<Prediction> out;
  predictor->OnLayerEnd(1, 0, hidden, 1, &out);  // after dense layer 0: layer 2 is one MoE layer ahead
  REQUIRE(out.size() == 1);
  CHECK(out[0].layer == 2);
  out.clear();
  predictor->OnLayerEnd(1, 2, hidden, 1, &out);  // after MoE layer 2: layer 3
  REQUIRE(out.size() == 1);
  CHECK(out[0].layer == 3);
}

TEST_CASE("none predicts nothing: recall 0, every first use a miss", "[experts]") {
  const RoutingTrace t = HandTrace(3, false);
  ExpertMetrics m = Replay(t, MakeNonePredictor());
  CHECK(m.prediction.true_positive == 0);
  CHECK(m.prediction.false_negative == 3 * 7 * 2);
  CHECK(m.prediction.recall_if_defined() == 0.0);
  CHECK_FALSE(m.prediction.precision_if_defined().has_value());  // 0/0: nothing was predicted
  CHECK(m.prefetches_issued == 0);
}

TEST_CASE("the statistical predictor learns a periodic trace after one step", "[experts]") {
  const auto& config = testing::ToyDir().config();
  const RoutingTrace t = HandTrace(8, true);
  ExpertMetrics m = Replay(t, MakeStatisticalPredictor(config));
  // Steps 1..7 are predicted exactly (layer and token transitions repeat); step 0 only partly.
  CHECK(m.prediction.false_positive == 0);
  CHECK(m.prediction.true_positive >= 7 * 7 * 2);
  CHECK(m.prediction.recall_if_defined().value_or(-1) >= 7.0 / 8.0);
}

TEST_CASE("the utility policy's use probability protects the window", "[experts]") {
  CacheContext ctx;
  ctx.now = 2 * 8 + 3;  // step 2, layer 3
  ctx.num_layers = 8;
  ctx.window = 2;
  ctx.steps = 3;
  CacheEntryView predicted{4, 0, 1000, 0, 0, ctx.now + 1, 0.75};
  CHECK(UseProbability(predicted, ctx) == 0.75);
  CacheEntryView near{5, 1, 1000, 0, 3, -1, 0};   // used every step, its layer within the window
  CacheEntryView far{1, 1, 1000, 0, 3, -1, 0};    // same use rate, its layer 6 layers away
  CHECK(UseProbability(near, ctx) == Approx(4.0 / 5.0));
  CHECK(UseProbability(far, ctx) == Approx(0.5 * 4.0 / 5.0));
  auto policy = MakeCachePolicy(CachePolicyKind::kUtility);
  CHECK(policy->Score(far, ctx) < policy->Score(near, ctx));
  auto lru = MakeCachePolicy(CachePolicyKind::kLru);
  CacheEntryView old_e{1, 1, 1000, 5, 9, -1, 0}, new_e{1, 2, 1000, 6, 1, -1, 0};
  CHECK(lru->Score(old_e, ctx) < lru->Score(new_e, ctx));
  auto lfu = MakeCachePolicy(CachePolicyKind::kLfu);
  CHECK(lfu->Score(new_e, ctx) < lfu->Score(old_e, ctx));
}

TEST_CASE("lfu: of experts used equally often, the least recently used is evicted first, however many uses",
          "[experts]") {
  CacheContext ctx;
  ctx.num_layers = 8;
  auto lfu = MakeCachePolicy(CachePolicyKind::kLfu);
  for (const std::uint64_t uses : {1ULL, 2ULL, 3ULL, 8ULL, 100ULL, 1ULL << 20}) {
    for (const std::uint64_t last : {5ULL, 1000ULL, 1ULL << 40}) {
      CAPTURE(uses, last);
      CacheEntryView older{2, 1, 1000, last, uses, -1, 0}, newer{2, 2, 1000, last + 1, uses, -1, 0};
      const double so = lfu->Score(older, ctx), sn = lfu->Score(newer, ctx);
      CHECK(EvictsBefore(so, older, sn, newer));
      CHECK_FALSE(EvictsBefore(sn, newer, so, older));
      CacheEntryView more{2, 3, 1000, 0, uses + 1, -1, 0};  // one use more outweighs any recency
      CHECK(EvictsBefore(sn, newer, lfu->Score(more, ctx), more));
    }
  }
}

}  // namespace
}  // namespace terrace::experts
