// Lookahead's per-rank gate (LookaheadOptions::min_rank_precision): a top-k rank whose running
// precision falls below the threshold is left out of the prediction (kept every 8th step), the
// other ranks stay, every candidate keeps being scored so a rank comes back once it is right
// again, and with the gate off every candidate is predicted.
#include <random>

#include "experts_test_util.h"

namespace terrace::experts {
namespace {

using testing::ToyDir;

struct Probe {
  std::unique_ptr<model::Model> model;
  std::vector<float> hidden;
  int target = 2;  // predicted from the end of layer 1 (distance 1)
  int rank0 = -1, rank1 = -1;
};

Probe MakeProbe() {
  Probe p;
  auto m = model::Model::Load(ToyDir().config(), ToyDir());
  REQUIRE(m.ok());
  p.model = std::move(m).value();
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  p.hidden.resize(static_cast<std::size_t>(ToyDir().config().hidden_size));
  for (float& x : p.hidden) x = n(rng);
  auto r = p.model->PredictRouting(p.target, p.hidden, 1);
  REQUIRE(r.ok());
  REQUIRE(r->ids.size() == 2);  // k3-toy: top-2
  p.rank0 = r->ids[0];
  p.rank1 = r->ids[1];
  return p;
}

// One step: the prediction made after layer 1 for layer 2 (sorted experts; empty: none), then
// layer 2's routing `actual`.
std::vector<int> Step(Predictor& pred, const Probe& p, std::int64_t step, std::vector<int> actual) {
  std::vector<Prediction> out;
  pred.OnLayerEnd(step, p.target - 1, p.hidden, 1, &out);
  std::vector<int> got;
  for (const Prediction& x : out)
    if (x.step == step && x.layer == p.target) got = x.experts;
  std::sort(actual.begin(), actual.end());
  std::vector<Prediction> ignored;
  pred.OnRouting(step, p.target, actual, &ignored);
  return got;
}

TEST_CASE("lookahead's rank gate drops a usually wrong rank, keeps the others, and lets it back", "[experts][lookahead]") {
  const Probe p = MakeProbe();
  std::vector<int> both{p.rank0, p.rank1};
  std::sort(both.begin(), both.end());
  LookaheadOptions o;
  o.depth = 1;
  o.embedding_depth = 0;
  o.min_rank_precision = 0.7;
  auto gated = MakeLookaheadPredictor(*p.model, o);
  o.min_rank_precision = 0;
  auto plain = MakeLookaheadPredictor(*p.model, o);
  // Steps 1..4: the router chooses the rank-0 expert and another one, never the rank-1 expert:
  // rank 1's precision falls 1 -> 0.9 -> 0.81 -> 0.73 -> 0.66.
  int other = 0;
  while (other == p.rank0 || other == p.rank1) ++other;
  for (std::int64_t s = 1; s <= 4; ++s) {
    CHECK(Step(*gated, p, s, {p.rank0, other}) == both);
    CHECK(Step(*plain, p, s, {p.rank0, other}) == both);
  }
  CHECK(Step(*gated, p, 5, {p.rank0, other}) == std::vector<int>{p.rank0});
  CHECK(Step(*plain, p, 5, {p.rank0, other}) == both);
  CHECK(Step(*gated, p, 8, {p.rank0, p.rank1}) == both);  // every 8th step: all candidates
  // Left out, rank 1 is still scored: right again from step 8 on (0.59 -> 0.63 -> 0.67 -> 0.70), it returns.
  CHECK(Step(*gated, p, 9, {p.rank0, p.rank1}) == std::vector<int>{p.rank0});
  CHECK(Step(*gated, p, 10, {p.rank0, p.rank1}) == std::vector<int>{p.rank0});
  CHECK(Step(*gated, p, 11, {p.rank0, p.rank1}) == both);
}

TEST_CASE("the rank gate's threshold follows the drive's busy share when busy_rank_precision is set", "[experts][lookahead]") {
  LookaheadOptions o;
  o.min_rank_precision = 0.7;
  CHECK(o.RankThreshold(1.0) == 0.7);  // off by default
  o.busy_rank_precision = 0.9;
  CHECK(o.RankThreshold(0.0) == 0.7);
  CHECK(o.RankThreshold(LookaheadOptions::kBusyGateFrom) == 0.7);
  CHECK(o.RankThreshold(0.75) == Approx(0.8));
  CHECK(o.RankThreshold(1.0) == Approx(0.9));
  CHECK(o.RankThreshold(2.0) == Approx(0.9));  // clamped
  o.busy_rank_precision = 0.5;                 // below the base threshold: never lowers it
  CHECK(o.RankThreshold(1.0) == 0.7);
}

TEST_CASE("a busy drive raises lookahead's rank gate; an idle one lowers it back", "[experts][lookahead]") {
  const Probe p = MakeProbe();
  std::vector<int> both{p.rank0, p.rank1};
  std::sort(both.begin(), both.end());
  int other = 0;
  while (other == p.rank0 || other == p.rank1) ++other;
  LookaheadOptions o;
  o.depth = 1;
  o.embedding_depth = 0;
  o.min_rank_precision = 0.7;
  auto fixed = MakeLookaheadPredictor(*p.model, o);
  o.busy_rank_precision = 0.95;
  auto following = MakeLookaheadPredictor(*p.model, o);
  // Steps 1, 2: rank 1 is wrong, its precision falls 1 -> 0.9 -> 0.81.
  for (std::int64_t s = 1; s <= 2; ++s) {
    CHECK(Step(*fixed, p, s, {p.rank0, other}) == both);
    CHECK(Step(*following, p, s, {p.rank0, other}) == both);
  }
  // Step 3 after a step whose loads kept the drive busy throughout: 0.81 < 0.95 leaves rank 1 out
  // of the following gate only (it is still scored: 0.73).
  fixed->OnLoadBusyShare(1.0);
  following->OnLoadBusyShare(1.0);
  CHECK(Step(*fixed, p, 3, {p.rank0, other}) == both);
  CHECK(Step(*following, p, 3, {p.rank0, other}) == std::vector<int>{p.rank0});
  // Step 4 after an idle step: the threshold is 0.7 again and 0.73 passes it.
  following->OnLoadBusyShare(0.1);
  CHECK(Step(*following, p, 4, {p.rank0, other}) == both);
}

}  // namespace
}  // namespace terrace::experts
