// The lookahead predictor under Block AttnRes: the router path the predictor uses reproduces the real
// routing bit for bit from the real FFN input (plain and AttnRes), the forward pass's AttnResView is
// the bank it mixes, and the AttnRes-aware prediction (Model::PredictRoutingAttnRes, which the
// lookahead predictor uses on AttnRes models) recalls more at distance 1 than the router applied to
// the partial sum alone (Model::PredictRouting, the plain form).
#include <algorithm>
#include <cstring>
#include <map>

#include "experts_test_util.h"
#include "src/model/config.h"

namespace terrace::experts {
namespace {

// Prefill of Prompt() then kDecodeSteps greedy decode steps through `hooks`.
void RunWith(const model::Model& m, const model::ForwardOptions& hooks) {
  model::Session s(m);
  s.set_hooks(hooks);
  REQUIRE(s.Prefill(testing::Prompt()).ok());
  for (int i = 0; i < testing::kDecodeSteps; ++i) REQUIRE(s.Decode(model::Argmax(s.last_logits())).ok());
}

// Every MoE layer's routing, predicted from the exact FFN input, equals the routing the layer made
// (ids and weights, bitwise). Returns the layers compared.
int CheckExactInput(const model::Model& m) {
  const bool attn_res = m.config().attn_res_block_size > 0;
  std::map<int, model::Routing> plain, mixed;
  int compared = 0;
  model::ForwardOptions o;
  o.on_ffn_input = [&](int l, std::span<const float> h, std::int64_t T) {
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    CHECK((v != nullptr) == attn_res);
    if (m.config().IsDenseLayer(l)) return;
    auto p = m.PredictRouting(l, h, T);
    REQUIRE(p.ok());
    plain[l] = *p;
    if (v) {
      CHECK(v->layer == l);
      CHECK(v->tokens == T);
      CHECK(static_cast<int>(v->bank.size()) == l / m.config().attn_res_block_size + 1);
      auto q = m.PredictRoutingAttnRes(l, *v);
      REQUIRE(q.ok());
      mixed[l] = *q;
    }
  };
  o.on_routing = [&](int l, const model::Routing& r) {
    INFO("layer " << l);
    REQUIRE(plain.count(l) == 1);
    CHECK(testing::SameRouting(plain[l], r));
    if (attn_res) {
      REQUIRE(mixed.count(l) == 1);
      CHECK(testing::SameRouting(mixed[l], r));
    }
    plain.erase(l);
    mixed.erase(l);
    ++compared;
  };
  o.on_layer_end = [&](int l, std::span<const float> h, std::int64_t) {
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    REQUIRE((v != nullptr) == attn_res);
    if (v) {
      CHECK(v->layer == l);
      CHECK(v->partial.data() == h.data());
      CHECK(v->model == &m);
    }
  };
  RunWith(m, o);
  CHECK(model::Model::CurrentAttnResView() == nullptr);
  return compared;
}

TEST_CASE("a router call on the exact FFN input reproduces the routing bit for bit", "[experts][lookahead]") {
  const model::ModelDir& dir = testing::ToyDir();
  REQUIRE(dir.config().attn_res_block_size > 0);
  auto m = model::Model::Load(dir.config(), dir);
  REQUIRE(m.ok());
  CHECK(CheckExactInput(**m) > 0);

  model::ModelConfig plain = dir.config();
  plain.attn_res_block_size = 0;
  terrace::testing::TempDir pd("arl-plain");
  auto pdir = testing::InitRandomCodesDir(plain, pd.path(), 7);
  auto pm = model::Model::Load(pdir->config(), *pdir);
  REQUIRE(pm.ok());
  CHECK(CheckExactInput(**pm) > 0);
}

TEST_CASE("PredictRoutingAttnRes refuses a plain model, a foreign view and bad targets", "[experts][lookahead]") {
  const model::ModelDir& dir = testing::ToyDir();
  auto m = model::Model::Load(dir.config(), dir);
  REQUIRE(m.ok());
  const model::ModelConfig& c = dir.config();
  bool checked = false;
  model::ForwardOptions o;
  o.on_layer_end = [&](int l, std::span<const float>, std::int64_t) {
    if (l != 1 || checked) return;
    checked = true;
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    REQUIRE(v != nullptr);
    CHECK(m.value()->PredictRoutingAttnRes(c.num_hidden_layers, *v).status().IsInvalidArgument());
    CHECK(m.value()->PredictRoutingAttnRes(0, *v).status().IsInvalidArgument());  // before the view
    model::AttnResView other = *v;
    other.model = nullptr;
    CHECK(m.value()->PredictRoutingAttnRes(2, other).status().IsInvalidArgument());
    model::AttnResView short_partial = *v;
    short_partial.partial = v->partial.first(v->partial.size() - 1);
    CHECK(m.value()->PredictRoutingAttnRes(2, short_partial).status().IsInvalidArgument());
    CHECK(m.value()->PredictRoutingAttnRes(2, *v).ok());
  };
  RunWith(**m, o);
  CHECK(checked);
}

// Decode-step recall at distance 1 of (a) the lookahead predictor and (b) the plain form
// (PredictRouting of layer l+1 on the state leaving l), scored against the routing that followed.
struct Recalls {
  PredictionCounts predictor, plain;
};
Recalls DistanceOneRecall(const model::Model& m, const std::vector<int>& prompt, int decode) {
  const model::ModelConfig& c = m.config();
  auto predictor = MakeLookaheadPredictor(m, LookaheadOptions{.depth = 1, .min_confidence = 0.0});
  PredictionScorer by_predictor(c.num_hidden_layers), by_plain(c.num_hidden_layers);
  std::int64_t step = 0;
  bool measuring = false;
  model::ForwardOptions o;
  o.on_layer_end = [&](int l, std::span<const float> h, std::int64_t T) {
    if (!measuring) return;
    std::vector<Prediction> out;
    predictor->OnLayerEnd(step, l, h, T, &out);
    for (const Prediction& p : out) by_predictor.Predict(p);
    if (l + 1 < c.num_hidden_layers && !c.IsDenseLayer(l + 1)) {
      auto r = m.PredictRouting(l + 1, h, T);
      REQUIRE(r.ok());
      by_plain.Predict(Prediction{step, l + 1, r->ids, 1.0});
    }
  };
  o.on_routing = [&](int l, const model::Routing& r) {
    if (!measuring) return;
    std::vector<int> ids = r.ids;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    std::vector<Prediction> ignored;
    predictor->OnRouting(step, l, ids, &ignored);
    by_predictor.Observe(step, l, ids);
    by_plain.Observe(step, l, ids);
  };
  model::Session s(m);
  s.set_hooks(o);
  REQUIRE(s.Prefill(prompt).ok());
  measuring = true;
  for (int i = 0; i < decode; ++i, ++step) REQUIRE(s.Decode(model::Argmax(s.last_logits())).ok());
  // The first MoE layer has no earlier layer's prediction in either form: leave it out.
  Recalls out;
  const int first = c.first_k_dense_replace;
  for (int l = first + 1; l < c.num_hidden_layers; ++l) {
    if (c.IsDenseLayer(l)) continue;
    for (auto [dst, src] : {std::pair{&out.predictor, &by_predictor.layer(l)}, std::pair{&out.plain, &by_plain.layer(l)}}) {
      dst->true_positive += src->true_positive;
      dst->false_positive += src->false_positive;
      dst->false_negative += src->false_negative;
    }
  }
  return out;
}

TEST_CASE("AttnRes-aware lookahead recalls more at distance 1 than the router on the partial sum",
          "[experts][lookahead]") {
  // A small moe-bench-shaped AttnRes model: block size 2, a dense first layer, top-8 of 64.
  auto base = model::Preset("moe-bench");
  REQUIRE(base.ok());
  const model::ModelConfig c = testing::SmallConfig(*base);
  terrace::testing::TempDir d("arl-attnres");
  auto dir = testing::InitRandomCodesDir(c, d.path(), 7);
  auto m = model::Model::Load(dir->config(), *dir);
  REQUIRE(m.ok());
  const Recalls r = DistanceOneRecall(**m, testing::Prompt(), 12);
  INFO("predictor recall " << r.predictor.recall_if_defined().value_or(-1) << ", plain form " << r.plain.recall_if_defined().value_or(-1));
  REQUIRE(r.plain.true_positive + r.plain.false_negative > 0);
  CHECK(r.predictor.recall_if_defined().value_or(-1) > r.plain.recall_if_defined().value_or(-1) + 0.2);
}

TEST_CASE("on a plain residual model the lookahead predictor is the plain form", "[experts][lookahead]") {
  auto base = model::Preset("moe-bench-plain");
  REQUIRE(base.ok());
  const model::ModelConfig c = testing::SmallConfig(*base);
  terrace::testing::TempDir d("arl-plainrec");
  auto dir = testing::InitRandomCodesDir(c, d.path(), 7);
  auto m = model::Model::Load(dir->config(), *dir);
  REQUIRE(m.ok());
  const Recalls r = DistanceOneRecall(**m, testing::Prompt(), 6);
  CHECK(r.predictor.true_positive == r.plain.true_positive);
  CHECK(r.predictor.false_negative == r.plain.false_negative);
  CHECK(r.predictor.false_positive == r.plain.false_positive);
}

}  // namespace
}  // namespace terrace::experts

