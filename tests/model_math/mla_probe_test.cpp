// The MLA attention probe (ForwardOptions::on_mla_attention, MlaForward's probe): the rows it sees
// are the softmax a brute-force recomputation from the weights and the latent cache gives, their
// top-8 positions match, both MLA forms agree, and the model's output does not change with a probe.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "math_test_util.h"
#include "src/model/mla.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "src/model/weights_init.h"
#include "test_util.h"

namespace terrace::model {
namespace {

using testing::RandomTensor;
using testing::RandomVec;

struct Mla {
  MlaDims dims;
  MlaWeights w;
};

Mla MakeMla(std::uint64_t seed) {
  Mla m;
  m.dims = MlaDims{48, 3, 24, 16, 8, 8, 8, true, 1e-5f};
  const auto& d = m.dims;
  auto& w = m.w;
  w.q_a = RandomTensor({d.q_lora, d.hidden}, seed++, 0.2f);
  w.q_a_norm = RandomTensor({d.q_lora}, seed++, 1.0f);
  w.q_b = RandomTensor({d.heads * d.QkDim(), d.q_lora}, seed++, 0.5f);
  w.kv_a = RandomTensor({d.CacheWidth(), d.hidden}, seed++, 0.2f);
  w.kv_a_norm = RandomTensor({d.kv_lora}, seed++, 1.0f);
  w.kv_b = RandomTensor({d.heads * (d.nope + d.v), d.kv_lora}, seed++, 0.5f);
  w.o_proj = RandomTensor({d.hidden, d.heads * d.v}, seed++, 0.15f);
  w.g_proj = RandomTensor({d.heads * d.v, d.hidden}, seed++, 0.125f);
  return m;
}

// Brute force in double: the probabilities of token x_t (at absolute position pos) of head h over
// cache rows [0, pos], queries from the weights, keys from the cache's latents.
std::vector<double> BruteProbs(const Mla& m, const float* x, const std::vector<float>& cache, std::int64_t pos,
                               std::int64_t h) {
  const auto& d = m.dims;
  const std::int64_t W = d.CacheWidth(), R = d.kv_lora, QK = d.QkDim(), NV = d.nope + d.v;
  std::vector<double> cq(static_cast<std::size_t>(d.q_lora));
  for (std::int64_t r = 0; r < d.q_lora; ++r)
    for (std::int64_t i = 0; i < d.hidden; ++i) cq[r] += static_cast<double>(m.w.q_a.data[r * d.hidden + i]) * x[i];
  double ss = 0;
  for (double v : cq) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d.q_lora) + d.rms_eps);
  for (std::int64_t r = 0; r < d.q_lora; ++r) cq[r] *= inv * m.w.q_a_norm.data[r];
  std::vector<double> q(static_cast<std::size_t>(QK));
  for (std::int64_t c = 0; c < QK; ++c)
    for (std::int64_t r = 0; r < d.q_lora; ++r) q[c] += static_cast<double>(m.w.q_b.data[(h * QK + c) * d.q_lora + r]) * cq[r];
  std::vector<double> s(static_cast<std::size_t>(pos + 1));
  for (std::int64_t j = 0; j <= pos; ++j) {
    const float* row = cache.data() + j * W;
    double dot = 0;
    for (std::int64_t c = 0; c < d.nope; ++c) {
      double k = 0;
      for (std::int64_t r = 0; r < R; ++r) k += static_cast<double>(m.w.kv_b.data[(h * NV + c) * R + r]) * row[r];
      dot += q[c] * k;
    }
    for (std::int64_t c = 0; c < d.rope; ++c) dot += q[d.nope + c] * row[R + c];
    s[j] = dot / std::sqrt(static_cast<double>(QK));
  }
  const double mx = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (auto& v : s) sum += (v = std::exp(v - mx));
  for (auto& v : s) v /= sum;
  return s;
}

std::vector<std::int64_t> BruteTop(const std::vector<double>& p, std::size_t k) {
  std::vector<std::int64_t> idx(p.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&p](std::int64_t a, std::int64_t b) { return p[a] > p[b]; });
  idx.resize(std::min(k, idx.size()));
  return idx;
}

TEST_CASE("MLA probe: probabilities and top-8 equal a brute-force recomputation", "[mla][probe]") {
  const auto m = MakeMla(31);
  const std::int64_t d = m.dims.hidden, past = 20, T = 12, N = past + T;
  const auto x = RandomVec(N * d, 9, -2.0f, 2.0f);
  for (bool absorbed : {false, true}) {
    CAPTURE(absorbed);
    std::vector<float> cache, out(N * d);
    MlaForward(m.w, m.dims, x.data(), past, &cache, absorbed, out.data());  // no probe: the past
    std::map<std::int64_t, std::vector<float>> seen;                         // head -> [T, N]
    std::int64_t calls = 0;
    const MlaAttentionProbe probe = [&](std::int64_t h, std::span<const float> probs, std::int64_t tokens,
                                        std::int64_t positions) {
      ++calls;
      CHECK(tokens == T);
      CHECK(positions == N);
      REQUIRE(probs.size() == static_cast<std::size_t>(tokens * positions));
      seen[h].assign(probs.begin(), probs.end());
    };
    MlaForward(m.w, m.dims, &x[past * d], T, &cache, absorbed, &out[past * d], &probe);
    CHECK(calls == m.dims.heads);
    REQUIRE(cache.size() == static_cast<std::size_t>(N * m.dims.CacheWidth()));
    int differing_tops = 0;
    for (std::int64_t h = 0; h < m.dims.heads; ++h) {
      REQUIRE(seen.count(h) == 1);
      for (std::int64_t i = 0; i < T; ++i) {
        const std::int64_t pos = past + i;
        const auto want = BruteProbs(m, &x[pos * d], cache, pos, h);
        const float* row = seen[h].data() + i * N;
        for (std::int64_t j = 0; j < N; ++j) {
          if (j <= pos) {
            CHECK(row[j] == Approx(want[static_cast<std::size_t>(j)]).margin(2e-6));
          } else {
            CHECK(row[j] == 0.0f);  // causal: later positions are not attended to
          }
        }
        const auto top = TopPositions(std::span(row, static_cast<std::size_t>(pos + 1)), 8);
        CHECK(top == BruteTop(want, 8));
        differing_tops += top != BruteTop(std::vector<double>(want.rbegin(), want.rend()), 8);
      }
    }
    CHECK(differing_tops > 0);  // the rows are not all alike: the comparison has teeth
  }
}

TEST_CASE("TopPositions: largest first, ties by position, k clipped", "[mla][probe]") {
  const std::vector<float> row = {0.1f, 0.3f, 0.1f, 0.5f};
  CHECK(TopPositions(row, 3) == std::vector<std::int64_t>{3, 1, 0});
  CHECK(TopPositions(row, 8) == std::vector<std::int64_t>{3, 1, 0, 2});
  CHECK(TopPositions(row, 0).empty());
}

TEST_CASE("Session probe: every MLA layer and head, rows sum to 1, output unchanged", "[model][probe]") {
  terrace::testing::TempDir dir("k3toy-probe");
  auto config = Preset("k3-toy");
  REQUIRE(config.ok());
  InitOptions opt;
  opt.seed = 5;
  REQUIRE(InitWeights(*config, dir.path(), opt).ok());
  auto mdir = ModelDir::Open(dir.path());
  REQUIRE(mdir.ok());
  auto model = Model::Load(*config, **mdir);
  REQUIRE(model.ok());
  std::vector<int> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[static_cast<std::size_t>(i)] = (i * 37 + 5) % 512;

  Session plain(**model), probed(**model);
  std::map<std::pair<int, std::int64_t>, int> calls;
  std::int64_t expect_tokens = 0, expect_positions = 0;
  double worst = 0;
  ForwardOptions hooks;
  hooks.on_mla_attention = [&](int layer, std::int64_t head, std::span<const float> probs, std::int64_t tokens,
                               std::int64_t positions) {
    ++calls[{layer, head}];
    CHECK(tokens == expect_tokens);
    CHECK(positions == expect_positions);
    for (std::int64_t i = 0; i < tokens; ++i) {
      double sum = 0;
      for (std::int64_t j = 0; j < positions; ++j) sum += probs[static_cast<std::size_t>(i * positions + j)];
      worst = std::max(worst, std::abs(sum - 1.0));
    }
  };
  probed.set_hooks(hooks);
  expect_tokens = 40;
  expect_positions = 40;
  auto a = plain.Prefill(prompt);
  auto b = probed.Prefill(prompt);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->data == b->data);
  expect_tokens = 1;
  expect_positions = 41;
  auto da = plain.Decode(7);
  auto db = probed.Decode(7);
  REQUIRE(da.ok());
  REQUIRE(db.ok());
  CHECK(*da == *db);
  CHECK(worst < 1e-5);
  int mla_layers = 0;
  for (int l = 0; l < (**model).config().num_hidden_layers; ++l) {
    if (!(**model).layer(l).is_mla) continue;
    ++mla_layers;
    for (std::int64_t h = 0; h < (**model).mla_dims().heads; ++h) CHECK(calls[{l, h}] == 2);  // prefill + decode
  }
  CHECK(mla_layers > 0);
  CHECK(calls.size() == static_cast<std::size_t>(mla_layers * (**model).mla_dims().heads));
}

}  // namespace
}  // namespace terrace::model
