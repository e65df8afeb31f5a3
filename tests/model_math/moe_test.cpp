// Stable LatentMoE: routing rules, identity-projection equivalence with a plain MoE computed here,
// latent projection/norm wiring, and MXFP4 expert loading.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "math_test_util.h"
#include "src/model/moe.h"
#include "src/model/mxfp4.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

using testing::RandomTensor;
using testing::RandomVec;
using testing::RelErr;

// Experts held in memory; records the Prefetch / Acquire / Release protocol.
class TestExperts : public ExpertProvider {
 public:
  std::vector<ExpertWeights> experts;
  std::vector<int> prefetched;
  int acquired = 0, released = 0;
  bool prefetch_before_acquire = true;
  Result<const ExpertWeights*> Acquire(int, int e) override {
    if (std::find(prefetched.begin(), prefetched.end(), e) == prefetched.end()) prefetch_before_acquire = false;
    ++acquired;
    return &experts[static_cast<std::size_t>(e)];
  }
  void Release(int, int) override { ++released; }
  void Prefetch(int, std::span<const int> ids) override { prefetched.insert(prefetched.end(), ids.begin(), ids.end()); }
};

TestExperts MakeExperts(std::int64_t E, std::int64_t I, std::int64_t L, std::uint64_t seed) {
  TestExperts t;
  for (std::int64_t e = 0; e < E; ++e) {
    ExpertWeights w;
    w.w1 = RandomTensor({I, L}, seed++, 0.3f);
    w.w2 = RandomTensor({L, I}, seed++, 0.3f);
    w.w3 = RandomTensor({I, L}, seed++, 0.3f);
    t.experts.push_back(std::move(w));
  }
  return t;
}

Tensor Identity(std::int64_t n) {
  Tensor t({n, n});
  for (std::int64_t i = 0; i < n; ++i) t.data[i * n + i] = 1.0f;
  return t;
}

// A plain (non-latent) MoE written from the equations with double accumulation.
std::vector<float> PlainMoe(const MoeWeights& w, const MoeDims& m, const TestExperts& ex, const std::vector<float>& x,
                            std::int64_t T) {
  const std::int64_t d = m.hidden, E = m.experts;
  std::vector<float> out(T * d, 0.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    const float* xt = &x[t * d];
    std::vector<double> s(E), biased(E);
    for (std::int64_t e = 0; e < E; ++e) {
      double z = 0.0;
      for (std::int64_t i = 0; i < d; ++i) z += static_cast<double>(w.router.data[e * d + i]) * xt[i];
      s[e] = 1.0 / (1.0 + std::exp(-z));
      biased[e] = s[e] + (w.bias.data.empty() ? 0.0 : w.bias.data[e]);
    }
    std::vector<int> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return biased[a] > biased[b]; });
    double sum = 0.0;
    for (std::int64_t j = 0; j < m.top_k; ++j) sum += s[idx[j]];
    for (std::int64_t j = 0; j < m.top_k; ++j) {
      const auto& ew = ex.experts[idx[j]];
      const double wt = s[idx[j]] / sum * m.scaling;
      const std::int64_t I = ew.w1.dim(0);
      std::vector<double> act(I);
      for (std::int64_t r = 0; r < I; ++r) {
        double g = 0.0, u = 0.0;
        for (std::int64_t i = 0; i < d; ++i) {
          g += static_cast<double>(ew.w1.data[r * d + i]) * xt[i];
          u += static_cast<double>(ew.w3.data[r * d + i]) * xt[i];
        }
        act[r] = (4.0 * std::tanh(g / 4.0) / (1.0 + std::exp(-g))) * (25.0 * std::tanh(u / 25.0));
      }
      for (std::int64_t o = 0; o < d; ++o) {
        double y = 0.0;
        for (std::int64_t r = 0; r < I; ++r) y += static_cast<double>(ew.w2.data[o * I + r]) * act[r];
        out[t * d + o] += static_cast<float>(wt * y);
      }
    }
  }
  return out;
}

TEST_CASE("LatentMoE with identity projections and no norm equals a plain MoE", "[moe]") {
  const std::int64_t d = 32, E = 8, I = 24, T = 9;
  MoeDims m{d, d, E, 3, I, false, 2.5f, 4.0f, 25.0f, 1e-5f};
  MoeWeights w;
  w.router = RandomTensor({E, d}, 1, 0.4f);
  w.bias = RandomTensor({E}, 2, 0.3f);
  auto ex = MakeExperts(E, I, d, 100);
  const auto x = RandomVec(T * d, 3);
  const auto want = PlainMoe(w, m, ex, x, T);

  std::vector<float> got(T * d);
  Routing r;
  REQUIRE(MoeForward(w, m, 1, &ex, x.data(), T, got.data(), &r).ok());
  CHECK(RelErr(got, want) < 1e-5);
  CHECK(testing::MaxAbs(want) > 1e-3);
  CHECK(ex.acquired == ex.released);
  CHECK(ex.prefetch_before_acquire);

  // The same with explicit identity latent projections (latent == hidden is then forced off by
  // dims, so use a latent-projection config of the same width through HasLatentProjection = false).
  MoeWeights w2 = w;
  w2.down = Identity(d);
  w2.up = Identity(d);
  std::vector<float> got2(T * d);
  REQUIRE(MoeForward(w2, m, 1, &ex, x.data(), T, got2.data()).ok());
  CHECK(RelErr(got2, want) < 1e-5);
}

TEST_CASE("Router: bias changes selection only; weights renormalised and scaled; ties to lower id", "[moe]") {
  const std::int64_t d = 4, E = 4;
  MoeDims m{d, d, E, 2, 8, false, 2.0f, 4.0f, 25.0f, 1e-5f};
  MoeWeights w;
  w.router = Tensor({E, d});  // all scores sigmoid(0) = 0.5: a four-way tie
  const std::vector<float> x(d, 1.0f);
  Routing r;
  Route(w, m, x.data(), 1, &r);
  CHECK(r.ids == std::vector<int>{0, 1});
  CHECK(r.weights[0] == Approx(1.0f));  // 0.5 / 1.0 * 2.0
  w.bias = Tensor({E});
  w.bias.data = {0.0f, 0.0f, 0.2f, 0.1f};
  Route(w, m, x.data(), 1, &r);
  CHECK(r.ids == std::vector<int>{2, 3});
  CHECK(r.weights[0] == Approx(1.0f));  // bias does not enter the weights
  CHECK(r.weights[1] == Approx(1.0f));
}

TEST_CASE("LatentMoE with projections, latent norm and shared experts", "[moe]") {
  const std::int64_t d = 32, L = 16, E = 6, I = 8, T = 5, Is = 12;
  MoeDims m{d, L, E, 2, I, true, 1.0f, 4.0f, 25.0f, 1e-5f};
  MoeWeights w;
  w.router = RandomTensor({E, d}, 1, 0.4f);
  w.down = RandomTensor({L, d}, 2, 0.3f);
  w.up = RandomTensor({d, L}, 3, 0.3f);
  w.latent_norm = RandomTensor({L}, 4, 1.0f);
  w.shared_gate = RandomTensor({Is, d}, 5, 0.3f);
  w.shared_up = RandomTensor({Is, d}, 6, 0.3f);
  w.shared_down = RandomTensor({d, Is}, 7, 0.3f);
  REQUIRE(CheckMoeWeights(w, m, "").ok());
  auto ex = MakeExperts(E, I, L, 50);
  const auto x = RandomVec(T * d, 9);
  std::vector<float> got(T * d);
  Routing r;
  REQUIRE(MoeForward(w, m, 2, &ex, x.data(), T, got.data(), &r).ok());
  // Recompute token by token from the routing: z = down x; y = sum w_e expert_e(z); norm; up; + shared.
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<float> z(L), y(L, 0.0f), want(d);
    ops::Linear(&x[t * d], 1, d, w.down.ptr(), L, z.data());
    for (std::int64_t j = 0; j < 2; ++j) {
      const auto& ew = ex.experts[r.ids[t * 2 + j]];
      std::vector<float> g(I), u(I), ye(L);
      ops::Linear(z.data(), 1, L, ew.w1.ptr(), I, g.data());
      ops::Linear(z.data(), 1, L, ew.w3.ptr(), I, u.data());
      for (std::int64_t i = 0; i < I; ++i) g[i] = ops::Situ(g[i], u[i], 4.0f, 25.0f);
      ops::Linear(g.data(), 1, I, ew.w2.ptr(), L, ye.data());
      for (std::int64_t i = 0; i < L; ++i) y[i] += r.weights[t * 2 + j] * ye[i];
    }
    ops::RmsNorm(y.data(), 1, L, w.latent_norm.ptr(), 1e-5f, y.data());
    ops::Linear(y.data(), 1, L, w.up.ptr(), d, want.data());
    SituGluMlp(w.shared_gate, w.shared_up, w.shared_down, 4.0f, 25.0f, &x[t * d], 1, want.data(), true);
    CHECK(RelErr(std::vector<float>(got.begin() + t * d, got.begin() + (t + 1) * d), want) < 1e-5);
  }
}

class MapSource : public WeightSource {
 public:
  std::map<std::string, std::pair<TensorView, std::vector<std::uint8_t>>, std::less<>> t;
  void Add(const std::string& name, DType dt, std::vector<std::int64_t> shape, std::vector<std::uint8_t> bytes) {
    auto& e = t[name];
    e.second = std::move(bytes);
    e.first = TensorView{dt, std::move(shape), std::as_bytes(std::span<const std::uint8_t>(e.second))};
  }
  Result<TensorView> Get(std::string_view name) const override {
    auto it = t.find(name);
    if (it == t.end()) return Status::NotFound(std::string(name));
    return it->second.first;
  }
  bool Has(std::string_view name) const override { return t.find(name) != t.end(); }
  std::vector<std::string> Names() const override { return {}; }
};

TEST_CASE("LoadExpert keeps MXFP4 experts as MXFP4 views and rejects bad shapes", "[moe]") {
  const std::int64_t L = 64, I = 32;
  MapSource src;
  std::map<std::string, std::vector<float>> want;
  for (auto [p, rows, cols] : {std::tuple{"w1", I, L}, std::tuple{"w2", L, I}, std::tuple{"w3", I, L}}) {
    const auto v = RandomVec(rows * cols, rows + cols + p[1]);
    std::vector<std::uint8_t> packed, scales;
    REQUIRE(QuantizeMxfp4(v, rows, cols, &packed, &scales).ok());
    std::vector<float> deq(rows * cols);
    REQUIRE(DequantizeMxfp4(packed, scales, rows, cols, deq).ok());
    want[p] = deq;
    src.Add(std::string("experts.3.") + p + ".weight_packed", DType::kU8, {rows, cols / 2}, packed);
    src.Add(std::string("experts.3.") + p + ".weight_scale", DType::kU8, {rows, cols / 32}, scales);
  }
  auto e = LoadExpert(src, "experts.3.", L, I);
  REQUIRE(e.ok());
  REQUIRE(e->format == ExpertFormat::kMxfp4);
  CHECK(e->w1.data.empty());
  CHECK(e->intermediate() == I);
  CHECK(e->latent() == L);
  const auto dequant = [](const Mxfp4Matrix& q) {
    std::vector<float> out(static_cast<std::size_t>(q.rows * q.cols));
    REQUIRE(DequantizeMxfp4({q.packed, static_cast<std::size_t>(q.packed_bytes())},
                            {q.scales, static_cast<std::size_t>(q.scale_bytes())}, q.rows, q.cols, out)
                .ok());
    return out;
  };
  CHECK(e->q1.rows == I);
  CHECK(e->q2.rows == L);
  CHECK(dequant(e->q1) == want["w1"]);
  CHECK(dequant(e->q2) == want["w2"]);
  CHECK(dequant(e->q3) == want["w3"]);
  auto bad = LoadExpert(src, "experts.3.", L, I * 2);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("experts.3.w1.weight_packed") != std::string::npos);
  auto missing = LoadExpert(src, "experts.4.", L, I);
  CHECK(missing.status().IsNotFound());
}

}  // namespace
}  // namespace terrace::model
