// The full forward pass on k3-toy random weights (written by InitWeights, read back via ModelDir):
// decode == prefill, split prefill == one prefill, greedy generation, state export/import, the
// joint-boundary rule, routing statistics and input errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "math_test_util.h"
#include "src/model/names.h"
#include "src/model/routing_stats.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "src/model/weights_init.h"
#include "test_util.h"

namespace terrace::model {
namespace {

using testing::RelErr;

// One k3-toy model directory shared by all test cases of this binary.
const ModelDir& ToyDir() {
  static terrace::testing::TempDir dir("k3toy");
  static std::unique_ptr<ModelDir> model = [] {
    auto config = Preset("k3-toy");
    REQUIRE(config.ok());
    InitOptions opt;
    opt.seed = 7;
    REQUIRE(InitWeights(*config, dir.path(), opt).ok());
    auto m = ModelDir::Open(dir.path());
    REQUIRE(m.ok());
    return std::move(m).value();
  }();
  return *model;
}

std::unique_ptr<Model> LoadToy(const ModelConfig& config) {
  auto m = Model::Load(config, ToyDir());
  REQUIRE(m.ok());
  return std::move(m).value();
}

std::vector<int> Prompt(int n, int salt = 0) {
  std::vector<int> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = (i * 37 + salt * 11 + 5) % 512;
  return p;
}

std::vector<float> Row(const Tensor& t, std::int64_t r) {
  const std::int64_t V = t.dim(1);
  return std::vector<float>(t.data.begin() + r * V, t.data.begin() + (r + 1) * V);
}

void CheckDecodeEqualsPrefill(const ModelConfig& config, int T) {
  const auto model = LoadToy(config);
  const auto prompt = Prompt(T);
  Session full(*model);
  auto logits = full.Prefill(prompt);
  REQUIRE(logits.ok());
  REQUIRE(logits->shape == std::vector<std::int64_t>{T, config.vocab_size});
  CHECK(testing::MaxAbs(logits->data) > 1e-2);

  Session step(*model);
  auto first = step.Prefill(std::span(prompt).first(1));
  REQUIRE(first.ok());
  CHECK(RelErr(first->data, Row(*logits, 0)) < 1e-4);
  for (int t = 1; t < T; ++t) {
    auto l = step.Decode(prompt[static_cast<std::size_t>(t)]);
    REQUIRE(l.ok());
    CAPTURE(t);
    CHECK(RelErr(*l, Row(*logits, t)) < 1e-4);
  }
  CHECK(step.state().num_tokens() == T);
  CHECK(ValidateJointBoundary(step.state()).ok());
}

TEST_CASE("k3-toy: token-by-token decode equals full prefill", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  CheckDecodeEqualsPrefill(*config, 20);
}

TEST_CASE("plain residual stream and unbounded gate: decode equals prefill", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  config->attn_res_block_size = 0;
  config->kda.gate_lower_bound.reset();
  CheckDecodeEqualsPrefill(*config, 12);
}

TEST_CASE("k3-toy: prefill A then B equals prefill of A+B (across a KDA chunk boundary)", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const auto model = LoadToy(*config);
  const auto prompt = Prompt(70, 1);
  Session full(*model);
  auto all = full.Prefill(prompt);
  REQUIRE(all.ok());
  Session split(*model);
  auto a = split.Prefill(std::span(prompt).first(30));
  auto b = split.Prefill(std::span(prompt).subspan(30));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::vector<float> joined = a->data;
  joined.insert(joined.end(), b->data.begin(), b->data.end());
  CHECK(RelErr(joined, all->data) < 1e-4);
}

TEST_CASE("Generate is greedy: each id is the argmax of a teacher-forced prefill", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const auto model = LoadToy(*config);
  const auto prompt = Prompt(6, 2);
  Session s(*model);
  auto ids = s.Generate(prompt, 5);
  REQUIRE(ids.ok());
  REQUIRE(ids->size() == 5);
  std::vector<int> forced = prompt;
  forced.insert(forced.end(), ids->begin(), ids->end() - 1);
  Session check(*model);
  auto logits = check.Prefill(forced);
  REQUIRE(logits.ok());
  for (std::size_t i = 0; i < ids->size(); ++i)
    CHECK((*ids)[i] == Argmax(Row(*logits, static_cast<std::int64_t>(prompt.size() + i) - 1)));
  CHECK(RelErr(s.last_logits(), Row(*logits, logits->dim(0) - 1)) < 1e-4);
  Session none(*model);
  auto zero = none.Generate(prompt, 0);
  REQUIRE(zero.ok());
  CHECK(zero->empty());
  CHECK(Argmax(std::vector<float>{1.0f, 3.0f, 3.0f}) == 1);
}

TEST_CASE("State export/import continues the sequence identically; joint boundary enforced", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const auto model = LoadToy(*config);
  const auto prompt = Prompt(9, 3);
  Session src(*model);
  REQUIRE(src.Prefill(prompt).ok());
  Session dst(*model);
  for (int l = 0; l < config->num_hidden_layers; ++l) {
    auto bytes = src.state().ExportLayer(l);
    REQUIRE(bytes.ok());
    if (config->IsMlaLayer(l)) {
      CHECK(bytes->size() == 9u * config->MlaCacheWidth() * sizeof(float));
      // Rebuild the cache from two token ranges.
      auto head = src.state().ExportMlaTokens(l, 0, 4);
      auto tail = src.state().ExportMlaTokens(l, 4, 9);
      REQUIRE(head.ok());
      REQUIRE(tail.ok());
      REQUIRE(dst.state().ImportMlaTokens(l, 0, *head).ok());
      REQUIRE(dst.state().ImportMlaTokens(l, 4, *tail).ok());
    } else {
      REQUIRE(dst.state().ImportLayer(l, *bytes, 9).ok());
    }
  }
  REQUIRE(ValidateJointBoundary(dst.state()).ok());
  auto a = src.Decode(17);
  auto b = dst.Decode(17);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(*a == *b);

  // MLA latents for fewer tokens than the KDA states cover: rejected, naming the layer.
  const int mla = config->kda.full_attn_layers.front() - 1;
  auto part = dst.state().ExportMlaTokens(mla, 0, 5);
  REQUIRE(part.ok());
  REQUIRE(dst.state().ImportMlaTokens(mla, 0, *part).ok());
  const Status st = ValidateJointBoundary(dst.state());
  REQUIRE(st.IsInvalidArgument());
  CHECK(st.message().find(fmt::format("MLA layer {} covers 5 tokens", mla)) != std::string::npos);
  CHECK_FALSE(dst.state().ImportLayer(0, std::vector<std::byte>(12), 1).ok());
  CHECK_FALSE(dst.state().ImportMlaTokens(mla, 7, *part).ok());  // a gap
}

TEST_CASE("Routing statistics count every routed slot", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const auto model = LoadToy(*config);
  const auto prompt = Prompt(32, 4);
  auto stats = MeasureRouting(*model, prompt);
  REQUIRE(stats.ok());
  CHECK(stats->layers.size() == static_cast<std::size_t>(config->num_hidden_layers - config->first_k_dense_replace));
  for (const auto& l : stats->layers) {
    CHECK(std::accumulate(l.counts.begin(), l.counts.end(), std::int64_t{0}) == 32 * config->num_experts_per_token);
    CHECK(l.entropy_bits > 0.0);
    CHECK(l.entropy_bits <= std::log2(config->num_experts) + 1e-9);
  }
  CHECK(stats->max_entropy_bits == Approx(4.0));
  const std::int64_t uniform[] = {3, 3, 3, 3}, single[] = {0, 5, 0, 0};
  CHECK(EntropyBits(uniform) == Approx(2.0));
  CHECK(EntropyBits(single) == 0.0);
}

TEST_CASE("Two sessions on one model run concurrently and match sequential runs", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const auto model = LoadToy(*config);
  const auto p1 = Prompt(10, 5), p2 = Prompt(7, 6);
  const auto run = [&](const std::vector<int>& p) {
    Session s(*model);
    auto ids = s.Generate(p, 3);
    return ids.ok() ? s.last_logits() : std::vector<float>{};
  };
  const auto want1 = run(p1), want2 = run(p2);
  std::vector<float> got1, got2;
  std::thread t1([&] { got1 = run(p1); });
  std::thread t2([&] { got2 = run(p2); });
  t1.join();
  t2.join();
  REQUIRE_FALSE(want1.empty());
  CHECK(RelErr(got1, want1) < 1e-6);
  CHECK(RelErr(got2, want2) < 1e-6);
}

class HidingSource : public WeightSource {
 public:
  HidingSource(const WeightSource& inner, std::string hidden) : inner_(inner), hidden_(std::move(hidden)) {}
  Result<TensorView> Get(std::string_view name) const override {
    if (name == hidden_) return Status::NotFound(fmt::format("tensor '{}' not found", name));
    return inner_.Get(name);
  }
  bool Has(std::string_view name) const override { return name != hidden_ && inner_.Has(name); }
  std::vector<std::string> Names() const override { return inner_.Names(); }

 private:
  const WeightSource& inner_;
  std::string hidden_;
};

TEST_CASE("Bad inputs give clear errors", "[model]") {
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  const std::string missing = AttnTensorName(3, "kv_b_proj.weight");
  auto bad = Model::Load(*config, HidingSource(ToyDir(), missing));
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find(missing) != std::string::npos);
  // A missing router correction bias is refused, not routed as zero.
  const std::string bias = MoeTensorName(1, "gate.e_score_correction_bias");
  auto no_bias = Model::Load(*config, HidingSource(ToyDir(), bias));
  REQUIRE_FALSE(no_bias.ok());
  CHECK(no_bias.status().message().find(bias) != std::string::npos);

  const auto model = LoadToy(*config);
  Session s(*model);
  const int oob[] = {1, 512};
  auto r = s.Prefill(oob);
  REQUIRE(r.status().IsInvalidArgument());
  CHECK(r.status().message().find("token id 512 at position 1") != std::string::npos);
  CHECK(s.Prefill({}).status().IsInvalidArgument());
  CHECK(s.state().num_tokens() == 0);
}

}  // namespace
}  // namespace terrace::model
