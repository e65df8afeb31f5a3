// MLA (absorbed == naive, cache continuation) and Block Attention Residuals.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "math_test_util.h"
#include "src/model/attnres.h"
#include "src/model/mla.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

using testing::RandomTensor;
using testing::RandomVec;
using testing::RelErr;

struct Mla {
  MlaDims dims;
  MlaWeights w;
};

Mla MakeMla(bool q_lora, bool gate, std::uint64_t seed) {
  Mla m;
  m.dims = MlaDims{64, 4, q_lora ? 32 : 0, 24, 16, 8, 12, gate, 1e-5f};
  const auto& d = m.dims;
  auto& w = m.w;
  if (q_lora) {
    w.q_a = RandomTensor({d.q_lora, d.hidden}, seed++, 0.125f);
    w.q_a_norm = RandomTensor({d.q_lora}, seed++, 1.0f);
    w.q_b = RandomTensor({d.heads * d.QkDim(), d.q_lora}, seed++, 0.3f);
  } else {
    w.q_proj = RandomTensor({d.heads * d.QkDim(), d.hidden}, seed++, 0.2f);
  }
  w.kv_a = RandomTensor({d.CacheWidth(), d.hidden}, seed++, 0.125f);
  w.kv_a_norm = RandomTensor({d.kv_lora}, seed++, 1.0f);
  w.kv_b = RandomTensor({d.heads * (d.nope + d.v), d.kv_lora}, seed++, 0.3f);
  w.o_proj = RandomTensor({d.hidden, d.heads * d.v}, seed++, 0.15f);
  if (gate) w.g_proj = RandomTensor({d.heads * d.v, d.hidden}, seed++, 0.125f);
  return m;
}

TEST_CASE("MLA absorbed form equals the naive form", "[mla]") {
  for (bool q_lora : {true, false}) {
    for (bool gate : {true, false}) {
      CAPTURE(q_lora, gate);
      const auto m = MakeMla(q_lora, gate, 10 + q_lora * 2 + gate);
      REQUIRE(CheckMlaWeights(m.w, m.dims, "").ok());
      const std::int64_t T = 13, d = m.dims.hidden;
      const auto x = RandomVec(T * d, 4);
      std::vector<float> cache_n, cache_a, out_n(T * d), out_a(T * d);
      MlaForward(m.w, m.dims, x.data(), T, &cache_n, false, out_n.data());
      MlaForward(m.w, m.dims, x.data(), T, &cache_a, true, out_a.data());
      CHECK(RelErr(out_a, out_n) < 1e-5);
      CHECK(cache_n == cache_a);
      CHECK(cache_n.size() == static_cast<std::size_t>(T * m.dims.CacheWidth()));
      CHECK(testing::MaxAbs(out_n) > 1e-3);
    }
  }
}

TEST_CASE("MLA: token-by-token absorbed decode and split prefill equal one naive prefill", "[mla]") {
  const auto m = MakeMla(true, true, 3);
  const std::int64_t T = 11, d = m.dims.hidden;
  const auto x = RandomVec(T * d, 8);
  std::vector<float> cache, full(T * d);
  MlaForward(m.w, m.dims, x.data(), T, &cache, false, full.data());

  std::vector<float> cache2, step(T * d);
  for (std::int64_t t = 0; t < T; ++t) MlaForward(m.w, m.dims, &x[t * d], 1, &cache2, true, &step[t * d]);
  CHECK(RelErr(step, full) < 1e-5);
  CHECK(RelErr(cache2, cache) < 1e-6);

  std::vector<float> cache3, split(T * d);
  MlaForward(m.w, m.dims, x.data(), 4, &cache3, false, split.data());
  MlaForward(m.w, m.dims, &x[4 * d], T - 4, &cache3, false, &split[4 * d]);
  CHECK(RelErr(split, full) < 1e-5);
  // The first token attends only to itself: its output does not depend on later tokens.
  std::vector<float> cache4, first(d);
  MlaForward(m.w, m.dims, x.data(), 1, &cache4, false, first.data());
  CHECK(RelErr(first, std::vector<float>(full.begin(), full.begin() + d)) < 1e-5);
}

TEST_CASE("MLA cache rows are [RMSNorm(c_KV) | k_pe]", "[mla]") {
  const auto m = MakeMla(false, false, 21);
  const std::int64_t d = m.dims.hidden, W = m.dims.CacheWidth(), R = m.dims.kv_lora;
  const auto x = RandomVec(d, 2);
  std::vector<float> cache, out(d);
  MlaForward(m.w, m.dims, x.data(), 1, &cache, true, out.data());
  std::vector<double> raw(W, 0.0);
  for (std::int64_t r = 0; r < W; ++r)
    for (std::int64_t i = 0; i < d; ++i) raw[r] += static_cast<double>(m.w.kv_a.data[r * d + i]) * x[i];
  double ss = 0.0;
  for (std::int64_t r = 0; r < R; ++r) ss += raw[r] * raw[r];
  const double inv = 1.0 / std::sqrt(ss / R + 1e-5);
  for (std::int64_t r = 0; r < W; ++r) {
    const double want = r < R ? raw[r] * inv * m.w.kv_a_norm.data[r] : raw[r];
    CHECK(cache[r] == Approx(want).epsilon(1e-4).margin(1e-5));
  }
}

TEST_CASE("AttnRes with zero pseudo-queries is the mean of its sources", "[attnres]") {
  const std::int64_t T = 3, d = 16;
  std::vector<std::vector<float>> src;
  for (int s = 0; s < 4; ++s) src.push_back(RandomVec(T * d, 40 + s, -3.0f, 3.0f));
  std::vector<const float*> ptrs;
  for (auto& s : src) ptrs.push_back(s.data());
  const std::vector<float> zero(d, 0.0f);
  const auto n = RandomVec(d, 1);
  for (std::size_t count = 1; count <= src.size(); ++count) {
    std::vector<float> out(T * d), mean(T * d, 0.0f);
    AttnResMix(std::span(ptrs.data(), count), T, d, zero.data(), n.data(), out.data());
    for (std::size_t s = 0; s < count; ++s)
      for (std::int64_t i = 0; i < T * d; ++i) mean[i] += src[s][i] / static_cast<float>(count);
    CHECK(RelErr(out, mean) < 1e-6);
  }
}

TEST_CASE("AttnRes weights sources by softmax of w*n . v / rms(v) and returns raw values", "[attnres]") {
  const std::int64_t T = 2, d = 8;
  const auto a = RandomVec(T * d, 1, -2.0f, 2.0f), b = RandomVec(T * d, 2, -0.5f, 0.5f);
  const auto w = RandomVec(d, 3), n = RandomVec(d, 4, 0.5f, 1.5f);
  const float* ptrs[] = {a.data(), b.data()};
  std::vector<float> out(T * d);
  AttnResMix(ptrs, T, d, w.data(), n.data(), out.data());
  for (std::int64_t t = 0; t < T; ++t) {
    double score[2];
    for (int s = 0; s < 2; ++s) {
      const float* v = (s == 0 ? a.data() : b.data()) + t * d;
      double dot = 0.0, ss = 0.0;
      for (std::int64_t i = 0; i < d; ++i) {
        dot += static_cast<double>(w[i]) * n[i] * v[i];
        ss += static_cast<double>(v[i]) * v[i];
      }
      score[s] = dot / std::sqrt(ss / d + 1e-5);
    }
    const double pa = 1.0 / (1.0 + std::exp(score[1] - score[0]));
    for (std::int64_t i = 0; i < d; ++i)
      CHECK(out[t * d + i] == Approx(pa * a[t * d + i] + (1 - pa) * b[t * d + i]).epsilon(1e-5).margin(1e-6));
  }
}

}  // namespace
}  // namespace terrace::model
