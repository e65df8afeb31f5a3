// MXFP4 experts through the whole model (k3-toy random weights, MXFP4 routed experts): the resident
// provider keeps them as MXFP4 expert blocks; a provider serving the same blocks from its own buffer
// (as a store-backed one does) gives bit-identical logits; the lookahead hook (on_layer_end) and
// Model::PredictRouting.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "math_test_util.h"
#include "src/model/expert_provider.h"
#include "src/model/model.h"
#include "src/model/names.h"
#include "src/model/ops.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "src/model/weights_init.h"
#include "test_util.h"

namespace terrace::model {
namespace {

const ModelDir& ExpertsToyDir() {
  static terrace::testing::TempDir dir("k3toy_experts");
  static std::unique_ptr<ModelDir> model = [] {
    auto config = Preset("k3-toy");
    REQUIRE(config.ok());
    InitOptions opt;
    opt.seed = 11;
    REQUIRE(InitWeights(*config, dir.path(), opt).ok());
    auto m = ModelDir::Open(dir.path());
    REQUIRE(m.ok());
    return std::move(m).value();
  }();
  return *model;
}

ModelConfig ToyConfig() {
  auto c = Preset("k3-toy");
  REQUIRE(c.ok());
  return *c;
}

// Serves every expert as an expert block kept in one shared buffer at odd offsets; each Acquire
// copies the block out (as a store read would) and parses it. Counts calls.
class BlockBufferProvider : public ExpertProvider {
 public:
  BlockBufferProvider(const WeightSource& source, const ModelConfig& c)
      : L_(c.routed_expert_hidden_size), I_(c.moe_intermediate_size), E_(c.num_experts) {
    buffer_.push_back(std::byte{0x5A});  // odd start: no alignment may be assumed
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.IsDenseLayer(l)) continue;
      for (int e = 0; e < c.num_experts; ++e) {
        std::string prefix = ExpertTensorName(l, e, "w1", "weight_packed");
        prefix.resize(prefix.size() - std::string_view("w1.weight_packed").size());
        auto w = LoadExpert(source, prefix, L_, I_);
        REQUIRE(w.ok());
        REQUIRE(w->format == ExpertFormat::kMxfp4);
        const auto block = SerializeExpertBlock(*w);
        REQUIRE(!block.empty());
        where_[{l, e}] = {buffer_.size(), block.size()};
        buffer_.insert(buffer_.end(), block.begin(), block.end());
        buffer_.push_back(std::byte{0xA5});
      }
    }
  }
  Result<const ExpertWeights*> Acquire(int layer, int expert) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = where_.find({layer, expert});
    if (it == where_.end()) return Status::NotFound("no such expert");
    Lease& lease = leases_[{layer, expert}];
    REQUIRE(lease.bytes.empty());  // MoeForward releases before it acquires the same expert again
    lease.bytes.assign(buffer_.begin() + static_cast<std::ptrdiff_t>(it->second.first),
                       buffer_.begin() + static_cast<std::ptrdiff_t>(it->second.first + it->second.second));
    TERRACE_ASSIGN_OR_RETURN(lease.weights, ParseExpertBlock(lease.bytes, L_, I_));
    ++acquires_;
    return &lease.weights;
  }
  void Release(int layer, int expert) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find({layer, expert});
    REQUIRE(it != leases_.end());
    leases_.erase(it);
    ++releases_;
  }
  int acquires() const { return acquires_; }
  int releases() const { return releases_; }
  std::size_t outstanding() const { return leases_.size(); }

 private:
  struct Lease {
    std::vector<std::byte> bytes;
    ExpertWeights weights;
  };
  std::int64_t L_, I_;
  int E_;
  std::vector<std::byte> buffer_;
  std::map<std::pair<int, int>, std::pair<std::size_t, std::size_t>> where_;
  std::mutex mu_;
  std::map<std::pair<int, int>, Lease> leases_;
  int acquires_ = 0, releases_ = 0;
};

std::vector<int> ExpertsPrompt(int n) {
  std::vector<int> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = (i * 53 + 9) % 512;
  return p;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("Resident provider keeps MXFP4 experts as MXFP4 expert blocks", "[model][experts]") {
  const ModelConfig c = ToyConfig();
  auto p = ResidentExpertProvider::Create(ExpertsToyDir(), c);
  REQUIRE(p.ok());
  int moe_layers = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.IsDenseLayer(l) ? 0 : 1;
  const std::size_t block = ExpertBlockBytes(c.routed_expert_hidden_size, c.moe_intermediate_size);
  // No fp32 copy: exactly one expert block per routed expert.
  CHECK((*p)->bytes() == static_cast<std::size_t>(moe_layers) * c.num_experts * block);
  auto e = (*p)->Acquire(1, 3);
  REQUIRE(e.ok());
  CHECK((*e)->format == ExpertFormat::kMxfp4);
  CHECK((*e)->w1.data.empty());
  CHECK((*e)->q1.rows == c.moe_intermediate_size);
  (*p)->Release(1, 3);
}

TEST_CASE("Experts served as expert blocks from another buffer == resident, bitwise", "[model][experts]") {
  const ModelConfig c = ToyConfig();
  auto resident = Model::Load(c, ExpertsToyDir());
  REQUIRE(resident.ok());
  auto provider = std::make_shared<BlockBufferProvider>(ExpertsToyDir(), c);
  auto offloaded = Model::Load(c, ExpertsToyDir(), provider);
  REQUIRE(offloaded.ok());
  const auto prompt = ExpertsPrompt(37);
  Session a(**resident), b(**offloaded);
  auto la = a.Prefill(prompt);
  auto lb = b.Prefill(prompt);
  REQUIRE(la.ok());
  REQUIRE(lb.ok());
  CHECK(testing::MaxAbs(la->data) > 1e-2);
  CHECK(BitEqual(la->data, lb->data));
  for (int t = 0; t < 6; ++t) {
    const int tok = (t * 71 + 3) % c.vocab_size;
    auto da = a.Decode(tok);
    auto db = b.Decode(tok);
    REQUIRE(da.ok());
    REQUIRE(db.ok());
    CAPTURE(t);
    CHECK(BitEqual(*da, *db));
  }
  CHECK(provider->acquires() > 0);
  CHECK(provider->acquires() == provider->releases());
  CHECK(provider->outstanding() == 0);
}

TEST_CASE("BF16 dense weights keep their bf16 bits for decode; they widen to the fp32 values", "[model][bf16]") {
  const ModelConfig c = ToyConfig();
  auto model = Model::Load(c, ExpertsToyDir());
  REQUIRE(model.ok());
  const LayerWeights& l1 = (*model)->layer(1);
  for (const Weight* w : {&l1.moe.router, &l1.moe.shared_down, &l1.kda.q_proj, &l1.kda.o_proj}) {
    REQUIRE(w->bf16.size() == w->data.size());
    bool same = true;
    for (std::size_t i = 0; i < w->data.size(); ++i) same = same && Bf16ToFloat(w->bf16[i]) == w->data[i];
    CHECK(same);
  }
}

TEST_CASE("on_layer_end sees every layer's hidden state; decode rows == prefill rows", "[model][hooks]") {
  const ModelConfig c = ToyConfig();
  auto model = Model::Load(c, ExpertsToyDir());
  REQUIRE(model.ok());
  const std::int64_t d = c.hidden_size;
  const int T = 9;
  const auto prompt = ExpertsPrompt(T);
  // Prefill: one call per layer, in order, [T, d].
  std::vector<std::vector<float>> full(static_cast<std::size_t>(c.num_hidden_layers));
  std::vector<int> order;
  ForwardOptions o;
  o.on_layer_end = [&](int l, std::span<const float> h, std::int64_t tokens) {
    order.push_back(l);
    CHECK(tokens == T);
    CHECK(static_cast<std::int64_t>(h.size()) == tokens * d);
    full[static_cast<std::size_t>(l)].assign(h.begin(), h.end());
  };
  auto state = SequenceState::ForConfig(c);
  REQUIRE((*model)->Forward(prompt, &state, o).ok());
  std::vector<int> want(static_cast<std::size_t>(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) want[static_cast<std::size_t>(l)] = l;
  CHECK(order == want);
  // Token by token: each call's row equals the prefill's row t of the same layer.
  auto step = SequenceState::ForConfig(c);
  for (int t = 0; t < T; ++t) {
    ForwardOptions so;
    so.chunked_kda = false;
    so.absorbed_mla = true;
    int calls = 0;
    so.on_layer_end = [&](int l, std::span<const float> h, std::int64_t tokens) {
      ++calls;
      REQUIRE(tokens == 1);
      const auto& f = full[static_cast<std::size_t>(l)];
      const std::vector<float> row(f.begin() + t * d, f.begin() + (t + 1) * d);
      CAPTURE(t, l);
      CHECK(testing::RelErr(std::vector<float>(h.begin(), h.end()), row) < 1e-4);
    };
    REQUIRE((*model)->Forward(std::span(prompt).subspan(static_cast<std::size_t>(t), 1), &step, so).ok());
    CHECK(calls == c.num_hidden_layers);
  }
}

TEST_CASE("PredictRouting applies the layer's FFN norm and router", "[model][hooks]") {
  const ModelConfig c = ToyConfig();
  auto loaded = Model::Load(c, ExpertsToyDir());
  REQUIRE(loaded.ok());
  const Model& model = **loaded;
  const std::int64_t d = c.hidden_size, T = 5;
  const auto hidden = testing::RandomVec(static_cast<std::size_t>(T * d), 3, -2.0f, 2.0f);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    CAPTURE(l);
    auto r = model.PredictRouting(l, hidden, T);
    if (c.IsDenseLayer(l)) {
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().IsInvalidArgument());
      CHECK(r.status().message().find("dense") != std::string::npos);
      continue;
    }
    REQUIRE(r.ok());
    // Oracle: RMSNorm with post_attention_layernorm, then the router (MoeForward's Route).
    std::vector<float> normed(hidden.size());
    ops::RmsNorm(hidden.data(), T, d, model.layer(l).post_norm.ptr(), c.rms_norm_eps, normed.data());
    Routing want;
    Route(model.layer(l).moe, model.moe_dims(), normed.data(), T, &want);
    CHECK(r->top_k == c.num_experts_per_token);
    CHECK(r->ids == want.ids);
    CHECK(r->weights == want.weights);
    // A different norm (the layer's input norm) would choose differently somewhere.
    ops::RmsNorm(hidden.data(), T, d, model.layer(l).input_norm.ptr(), c.rms_norm_eps, normed.data());
    Routing other;
    Route(model.layer(l).moe, model.moe_dims(), normed.data(), T, &other);
    CHECK(other.weights != want.weights);
  }
  CHECK_FALSE(model.PredictRouting(-1, hidden, T).ok());
  CHECK_FALSE(model.PredictRouting(c.num_hidden_layers, hidden, T).ok());
  CHECK_FALSE(model.PredictRouting(1, std::span(hidden).first(static_cast<std::size_t>(d) + 1), T).ok());
  CHECK_FALSE(model.PredictRouting(1, hidden, 0).ok());
}

}  // namespace
}  // namespace terrace::model
