// The token-start hook (ForwardOptions::on_embedding) and what lookahead does with it: the hook
// sees the embedding before layer 0 with a layer -1 AttnResView whose prediction is the router on
// the embedding; when the first layer is MoE and its mixer adds nothing, that prediction is the
// layer's routing; the lookahead predictor predicts the first MoE layer at token start, gated by
// its precision; ExpertOffload calls it once per pass, in the pass's step.
#include <algorithm>
#include <cstring>
#include <map>

#include "experts_test_util.h"
#include "src/model/config.h"
#include "src/model/names.h"

namespace terrace::experts {
namespace {

// Serves `inner` with one tensor replaced by zeros of the same dtype and shape.
class ZeroingSource final : public model::WeightSource {
 public:
  ZeroingSource(const model::WeightSource& inner, std::string zeroed) : inner_(inner), zeroed_(std::move(zeroed)) {
    auto v = inner_.Get(zeroed_);
    REQUIRE(v.ok());
    view_ = *v;
    zeros_.assign(view_.data.size(), std::byte{0});
    view_.data = zeros_;
  }
  Result<model::TensorView> Get(std::string_view name) const override {
    if (name == zeroed_) return view_;
    return inner_.Get(name);
  }
  bool Has(std::string_view name) const override { return inner_.Has(name); }
  std::vector<std::string> Names() const override { return inner_.Names(); }

 private:
  const model::WeightSource& inner_;
  std::string zeroed_;
  std::vector<std::byte> zeros_;
  model::TensorView view_;
};

void RunSession(const model::Model& m, const model::ForwardOptions& hooks, int decode) {
  model::Session s(m);
  s.set_hooks(hooks);
  REQUIRE(s.Prefill(testing::Prompt()).ok());
  for (int i = 0; i < decode; ++i) REQUIRE(s.Decode(model::Argmax(s.last_logits())).ok());
}

TEST_CASE("on_embedding runs once per pass before layer 0 with the embedding and a layer -1 view",
          "[experts][lookahead][embedding]") {
  const model::ModelDir& dir = testing::ToyDir();
  const model::ModelConfig& c = dir.config();
  REQUIRE(c.attn_res_block_size > 0);
  auto loaded = model::Model::Load(c, dir);
  REQUIRE(loaded.ok());
  const model::Model& m = **loaded;
  int passes = 0, compared = 0;
  bool before_layer0 = false;
  std::vector<float> embedding;
  model::ForwardOptions o;
  o.on_embedding = [&](std::span<const float> h, std::int64_t T) {
    ++passes;
    before_layer0 = true;
    REQUIRE(static_cast<std::int64_t>(h.size()) == T * c.hidden_size);
    embedding.assign(h.begin(), h.end());
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    REQUIRE(v != nullptr);
    CHECK(v->model == &m);
    CHECK(v->layer == -1);
    CHECK(v->tokens == T);
    REQUIRE(v->bank.size() == 1);
    CHECK(v->bank[0].data() == h.data());
    CHECK(v->partial.empty());
    // From the embedding the mix is over [embedding] alone: the router on the embedding itself.
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.IsDenseLayer(l)) {
        CHECK(m.PredictRoutingAttnRes(l, *v).status().IsInvalidArgument());
        continue;
      }
      auto a = m.PredictRoutingAttnRes(l, *v);
      auto b = m.PredictRouting(l, h, T);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      CHECK(testing::SameRouting(*a, *b));
      ++compared;
    }
    // A layer -1 view with a partial sum, or a second bank block, is not one the pass publishes.
    model::AttnResView bad = *v;
    bad.partial = h;
    CHECK(m.PredictRoutingAttnRes(c.first_k_dense_replace, bad).status().IsInvalidArgument());
  };
  o.on_layer_begin = [&](int l, std::int64_t) -> Status {
    if (l == 0) {
      CHECK(before_layer0);
      before_layer0 = false;
    }
    return Status::Ok();
  };
  o.on_ffn_input = [&](int l, std::span<const float>, std::int64_t) {
    if (l != 0) return;
    // Layer 0 pushed the embedding the hook saw into the bank.
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    REQUIRE(v != nullptr);
    REQUIRE_FALSE(v->bank.empty());
    REQUIRE(v->bank[0].size() == embedding.size());
    CHECK(std::memcmp(v->bank[0].data(), embedding.data(), embedding.size() * sizeof(float)) == 0);
  };
  RunSession(m, o, 3);
  CHECK(passes == 4);  // one prefill and three decode steps (Session::set_hooks copied the hook)
  CHECK(compared > 0);
  CHECK(model::Model::CurrentAttnResView() == nullptr);
}

// Routing of the first MoE layer (layer 0 here) per pass vs the prediction lookahead makes from
// the embedding at token start. Returns {passes where the ids matched, passes}.
std::pair<int, int> FirstLayerFromEmbedding(const model::Model& m, bool require_bitwise) {
  auto predictor = MakeLookaheadPredictor(m, LookaheadOptions{.depth = 1, .min_confidence = 0.0, .embedding_depth = 1});
  std::int64_t step = 0;
  std::vector<Prediction> predicted;
  model::Routing predicted_routing;
  int matched = 0, passes = 0;
  model::ForwardOptions o;
  o.on_embedding = [&](std::span<const float> h, std::int64_t T) {
    predicted.clear();
    predictor->OnTokenStart(step, h, T, &predicted);
    const model::AttnResView* v = model::Model::CurrentAttnResView();
    auto r = v ? m.PredictRoutingAttnRes(0, *v) : m.PredictRouting(0, h, T);
    REQUIRE(r.ok());
    predicted_routing = *r;
  };
  o.on_routing = [&](int l, const model::Routing& r) {
    if (l != 0) return;
    ++passes;
    REQUIRE(predicted.size() == 1);
    CHECK(predicted[0].layer == 0);
    CHECK(predicted[0].step == step);
    std::vector<int> ids = r.ids;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    if (predicted[0].experts == ids && predicted_routing.ids == r.ids) ++matched;
    if (require_bitwise) CHECK(testing::SameRouting(predicted_routing, r));
    ++step;
  };
  RunSession(m, o, 4);
  return {matched, passes};
}

TEST_CASE("with a first MoE layer whose mixer adds nothing, the prediction from the embedding is exact",
          "[experts][lookahead][embedding]") {
  for (const char* preset : {"moe-bench-plain", "moe-bench"}) {
    INFO(preset);
    auto base = model::Preset(preset);
    REQUIRE(base.ok());
    model::ModelConfig c = testing::SmallConfig(*base);
    c.first_k_dense_replace = 0;  // layer 0 is MoE
    terrace::testing::TempDir d(std::string("emb-") + preset);
    auto dir = testing::InitRandomCodesDir(c, d.path(), 5);
    const bool attn_res = c.attn_res_block_size > 0;
    // Layer 0's mixer output is zero: its router reads the embedding (plain: exactly; AttnRes: the
    // mix over [embedding, zero], a scaled embedding, which the RMSNorm makes the same direction).
    const ZeroingSource zeroed(*dir, model::AttnTensorName(0, "o_proj.weight"));
    auto m = model::Model::Load(c, zeroed);
    REQUIRE(m.ok());
    const auto [matched, passes] = FirstLayerFromEmbedding(**m, /*require_bitwise=*/!attn_res);
    CHECK(passes == 5);
    CHECK(matched == passes);
    // The control: with layer 0's mixer, the embedding does not give the routing in every pass.
    auto full = model::Model::Load(c, *dir);
    REQUIRE(full.ok());
    const auto [full_matched, full_passes] = FirstLayerFromEmbedding(**full, false);
    CHECK(full_passes == 5);
    CHECK(full_matched < full_passes);
  }
}

TEST_CASE("lookahead's embedding prediction is gated by its own precision", "[experts][lookahead][embedding]") {
  auto base = model::Preset("moe-bench-plain");
  REQUIRE(base.ok());
  const model::ModelConfig c = testing::SmallConfig(*base);
  terrace::testing::TempDir d("emb-gate");
  auto dir = testing::InitRandomCodesDir(c, d.path(), 5);
  auto m = model::Model::Load(c, *dir);
  REQUIRE(m.ok());
  const int first = c.first_k_dense_replace;
  std::vector<float> h(static_cast<std::size_t>(c.hidden_size));
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>((i * 37) % 11) - 5.0f;

  auto off = MakeLookaheadPredictor(**m, LookaheadOptions{.depth = 2, .min_confidence = 0.5, .embedding_depth = 0});
  std::vector<Prediction> out;
  off->OnTokenStart(0, h, 1, &out);
  CHECK(out.empty());

  auto two = MakeLookaheadPredictor(**m, LookaheadOptions{.depth = 2, .min_confidence = 0.5, .embedding_depth = 2});
  two->OnTokenStart(1, h, 1, &out);
  REQUIRE(out.size() == 2);
  CHECK(out[0].layer == first);
  CHECK(out[1].layer == first + 1);
  auto want = m.value()->PredictRouting(first, h, 1);
  REQUIRE(want.ok());
  std::vector<int> ids = want->ids;
  std::sort(ids.begin(), ids.end());
  CHECK(out[0].experts == ids);

  // Every step routes to experts the prediction missed: precision 0, so the running confidence
  // (0.8 c + 0.2 precision from 1) drops below 0.5 after 4 steps; then only every 8th step predicts.
  std::vector<int> wrong;
  for (int e = 0; e < c.num_experts && static_cast<int>(wrong.size()) < c.num_experts_per_token; ++e)
    if (!std::binary_search(ids.begin(), ids.end(), e)) wrong.push_back(e);
  auto gated = MakeLookaheadPredictor(**m, LookaheadOptions{.depth = 1, .min_confidence = 0.5, .embedding_depth = 1});
  std::vector<int> predicted_steps;
  for (std::int64_t step = 1; step <= 17; ++step) {
    out.clear();
    gated->OnTokenStart(step, h, 1, &out);
    if (!out.empty()) predicted_steps.push_back(static_cast<int>(step));
    std::vector<Prediction> ignored;
    gated->OnRouting(step, first, wrong, &ignored);
  }
  CHECK(predicted_steps == std::vector<int>{1, 2, 3, 4, 8, 16});
}

// Records what ExpertOffload hands the predictor.
class RecordingPredictor final : public Predictor {
 public:
  explicit RecordingPredictor(int first_moe) : first_(first_moe) {}
  std::string_view name() const override { return "recording"; }
  void OnTokenStart(std::int64_t step, std::span<const float> embedding, std::int64_t tokens,
                    std::vector<Prediction>* out) override {
    starts.push_back({step, tokens, static_cast<std::int64_t>(embedding.size())});
    out->push_back(Prediction{step, first_, {0, 1}, 1.0});
  }
  void OnRouting(std::int64_t step, int layer, std::span<const int>, std::vector<Prediction>*) override {
    if (layer == first_) routed_steps.push_back(step);
  }
  struct Start {
    std::int64_t step, tokens, values;
  };
  std::vector<Start> starts;
  std::vector<std::int64_t> routed_steps;

 private:
  int first_;
};

TEST_CASE("ExpertOffload calls the predictor at token start once per pass, in that pass's step",
          "[experts][lookahead][embedding]") {
  const auto& config = testing::ToyDir().config();
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("50%");
  testing::ToyOffload t = testing::OpenToyOffload(std::move(opt));
  auto m = model::Model::Load(config, testing::ToyDir(), t.offload);
  REQUIRE(m.ok());
  const int first = config.first_k_dense_replace;
  auto rec = std::make_unique<RecordingPredictor>(first);
  RecordingPredictor* r = rec.get();
  t.offload->SetPredictor(std::move(rec));
  model::ForwardOptions hooks;
  t.offload->AttachHooks(&hooks);
  const testing::RunOutput got = testing::Run(**m, &hooks);
  t.offload->Quiesce();
  CHECK(testing::SameBits(got.logits, testing::ResidentRun().logits));
  const std::int64_t passes = 1 + testing::kDecodeSteps;
  REQUIRE(static_cast<std::int64_t>(r->starts.size()) == passes);
  REQUIRE(r->routed_steps.size() == r->starts.size());
  for (std::size_t i = 0; i < r->starts.size(); ++i) {
    CHECK(r->starts[i].step == static_cast<std::int64_t>(i));
    CHECK(r->routed_steps[i] == r->starts[i].step);  // the same step as that pass's routing
    const std::int64_t T = i == 0 ? static_cast<std::int64_t>(testing::Prompt().size()) : 1;
    CHECK(r->starts[i].tokens == T);
    CHECK(r->starts[i].values == T * config.hidden_size);
  }
  // The token-start predictions were scored against the first MoE layer's routing.
  const ExpertMetrics x = t.offload->Metrics();
  REQUIRE_FALSE(x.layers.empty());
  REQUIRE(x.layers[0].layer == first);
  const PredictionCounts& p = x.layers[0].prediction;
  CHECK(p.true_positive + p.false_positive == 2 * static_cast<std::uint64_t>(passes));
}

}  // namespace
}  // namespace terrace::experts
