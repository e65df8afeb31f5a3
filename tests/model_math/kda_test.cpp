// KDA: recurrent form vs an independent matrix-form oracle, chunkwise form vs recurrent form, and
// the full mixer's prefill/decode/split equivalences.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "math_test_util.h"
#include "src/model/kda.h"
#include "src/model/kda_pairs.h"
#include "src/model/short_conv.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

using testing::RandomTensor;
using testing::RandomVec;
using testing::RelErr;

struct CoreInputs {
  std::int64_t T, H, K, V;
  std::vector<float> q, k, v, g, beta;
  KdaCoreArgs Args() const { return {q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, K, V}; }
};

// Random inputs shaped like the real mixer's: unit-norm k, scaled q, beta in (0, 1), and a decay from
// either the bounded K3 gate or the unbounded Kimi Linear gate.
CoreInputs MakeInputs(std::int64_t T, std::int64_t H, std::int64_t K, std::int64_t V, bool bounded,
                      std::uint64_t seed) {
  CoreInputs in{T, H, K, V, RandomVec(T * H * K, seed), RandomVec(T * H * K, seed + 1), RandomVec(T * H * V, seed + 2),
                RandomVec(T * H * K, seed + 3, -3.0f, 3.0f), RandomVec(T * H, seed + 4, -2.0f, 2.0f)};
  for (std::int64_t r = 0; r < T * H; ++r) {
    ops::L2NormalizeInPlace(&in.q[r * K], K);
    ops::L2NormalizeInPlace(&in.k[r * K], K);
    for (std::int64_t i = 0; i < K; ++i) in.q[r * K + i] /= std::sqrt(static_cast<float>(K));
  }
  for (auto& b : in.beta) b = ops::Sigmoid(b);
  for (auto& g : in.g) g = bounded ? -5.0f * ops::Sigmoid(g) : -std::exp(-1.0f) * ops::Softplus(g);
  return in;
}

// S_t = (I - beta k k^T) diag(exp g) S_{t-1} + beta k v^T;  o_t = S_t^T q_t  (explicit matrices).
void OracleKda(const CoreInputs& in, std::vector<double>& S, std::vector<float>& o) {
  const auto K = in.K, V = in.V, H = in.H;
  std::vector<double> M(K * K), D(K * V);
  for (std::int64_t t = 0; t < in.T; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      const float* k = &in.k[(t * H + h) * K];
      const float* q = &in.q[(t * H + h) * K];
      const float* v = &in.v[(t * H + h) * V];
      const float* g = &in.g[(t * H + h) * K];
      const double b = in.beta[t * H + h];
      double* Sh = &S[h * K * V];
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < K; ++j) M[i * K + j] = (i == j ? 1.0 : 0.0) - b * k[i] * k[j];
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t e = 0; e < V; ++e) D[i * V + e] = std::exp(static_cast<double>(g[i])) * Sh[i * V + e];
      for (std::int64_t i = 0; i < K; ++i) {
        for (std::int64_t e = 0; e < V; ++e) {
          double acc = b * k[i] * v[e];
          for (std::int64_t j = 0; j < K; ++j) acc += M[i * K + j] * D[j * V + e];
          Sh[i * V + e] = acc;
        }
      }
      for (std::int64_t e = 0; e < V; ++e) {
        double acc = 0.0;
        for (std::int64_t i = 0; i < K; ++i) acc += Sh[i * V + e] * q[i];
        o[(t * H + h) * V + e] = static_cast<float>(acc);
      }
    }
  }
}

TEST_CASE("KDA recurrent form matches the matrix-form oracle", "[kda]") {
  for (bool bounded : {true, false}) {
    const auto in = MakeInputs(37, 2, 8, 6, bounded, bounded ? 11 : 12);
    auto init = RandomVec(2 * 8 * 6, 99);
    std::vector<float> state = init, o(37 * 2 * 6);
    std::vector<double> Sref(init.begin(), init.end());
    std::vector<float> oref(o.size());
    KdaRecurrent(in.Args(), state.data(), o.data());
    OracleKda(in, Sref, oref);
    CHECK(RelErr(o, oref) < 1e-5);
    CHECK(RelErr(state, std::vector<float>(Sref.begin(), Sref.end())) < 1e-5);
    CHECK(testing::MaxAbs(o) > 1e-3);  // a non-trivial output
  }
}

// P[i, j] = q_i . (k_j * e_{j+1} ... e_i) and A[i, j] = b_i k_i . (same), in double.
void OraclePairs(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& e,
                 const std::vector<float>& b, std::int64_t L, std::int64_t K, std::vector<double>& A,
                 std::vector<double>& P) {
  A.assign(L * L, 0.0);
  P.assign(L * L, 0.0);
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t j = 0; j <= i; ++j) {
      double sq = 0.0, sk = 0.0;
      for (std::int64_t d = 0; d < K; ++d) {
        double w = k[j * K + d];
        for (std::int64_t t = j + 1; t <= i; ++t) w *= e[t * K + d];
        sq += q[i * K + d] * w;
        sk += k[i * K + d] * w;
      }
      P[i * L + j] = sq;
      if (j < i) A[i * L + j] = b[i] * sk;
    }
}

TEST_CASE("KdaDecayedPairs == the double-precision products, zero above the diagonal", "[kda]") {
  // K = 64 and 40: the AVX2 body and its 8-wide tail; K = 12: the scalar path. Decays from mild to
  // strong enough that far products underflow to 0.
  for (std::int64_t K : {64, 40, 12}) {
    for (std::int64_t L : {1, 17, 64}) {
      for (float strength : {0.05f, 3.0f, 60.0f}) {
        CAPTURE(K, L, strength);
        const std::uint64_t seed = static_cast<std::uint64_t>(K * 1000 + L * 10) + static_cast<std::uint64_t>(strength);
        const auto q = RandomVec(L * K, seed), k = RandomVec(L * K, seed + 1), b = RandomVec(L, seed + 2, 0.1f, 1.0f);
        auto e = RandomVec(L * K, seed + 3, -strength, 0.0f);
        for (auto& x : e) x = std::exp(x);
        const std::int64_t ld = L + 3;  // a leading dimension wider than the chunk
        std::vector<float> A(L * ld, 7.0f), P(L * ld, 7.0f);
        KdaDecayedPairs(q.data(), k.data(), e.data(), b.data(), L, K, ld, A.data(), P.data());
        std::vector<double> Aref, Pref;
        OraclePairs(q, k, e, b, L, K, Aref, Pref);
        double maxp = 0.0, maxa = 0.0, errp = 0.0, erra = 0.0;
        for (std::int64_t i = 0; i < L; ++i) {
          for (std::int64_t j = 0; j < L; ++j) {
            const float p = P[i * ld + j], a = A[i * ld + j];
            REQUIRE(std::isfinite(p));
            REQUIRE(std::isfinite(a));
            if (j > i) CHECK(p == 0.0f);
            if (j >= i) CHECK(a == 0.0f);
            maxp = std::max(maxp, std::abs(Pref[i * L + j]));
            maxa = std::max(maxa, std::abs(Aref[i * L + j]));
            errp = std::max(errp, std::abs(p - Pref[i * L + j]));
            erra = std::max(erra, std::abs(a - Aref[i * L + j]));
          }
          CHECK(P[i * ld + L] == 7.0f);  // nothing written past column L
        }
        CHECK(errp <= 1e-5 * maxp);
        CHECK(erra <= 1e-5 * std::max(maxa, 1e-30));
        CHECK(maxp > 1e-3);
      }
    }
  }
}

TEST_CASE("KDA chunkwise form equals the recurrent form", "[kda]") {
  for (std::int64_t T : {1, 63, 64, 65, 200}) {
    for (std::int64_t H : {1, 3}) {
      for (bool bounded : {true, false}) {
        for (bool with_state : {false, true}) {
          CAPTURE(T, H, bounded, with_state);
          const std::int64_t K = 32, V = 24;
          const auto in = MakeInputs(T, H, K, V, bounded, static_cast<std::uint64_t>(T * 100 + H * 10 + bounded));
          std::vector<float> s0 = with_state ? RandomVec(H * K * V, 7 + T) : std::vector<float>(H * K * V, 0.0f);
          std::vector<float> s_rec = s0, s_chk = s0, o_rec(T * H * V), o_chk(T * H * V);
          KdaRecurrent(in.Args(), s_rec.data(), o_rec.data());
          KdaChunked(in.Args(), s_chk.data(), o_chk.data(), 64);
          CHECK(RelErr(o_chk, o_rec) < 1e-4);
          CHECK(RelErr(s_chk, s_rec) < 1e-4);
          CHECK(testing::MaxAbs(o_rec) > 1e-4);
        }
      }
    }
  }
}

TEST_CASE("KDA chunkwise form is independent of the chunk size", "[kda]") {
  const auto in = MakeInputs(50, 2, 16, 16, true, 5);
  std::vector<float> s1(2 * 16 * 16, 0.0f), s2 = s1, o1(50 * 2 * 16), o2(o1.size());
  KdaChunked(in.Args(), s1.data(), o1.data(), 7);
  KdaChunked(in.Args(), s2.data(), o2.data(), 64);
  CHECK(RelErr(o1, o2) < 1e-4);
  CHECK(RelErr(s1, s2) < 1e-4);
}

TEST_CASE("ShortConvSilu == a double-precision causal conv + SiLU, and continues across calls", "[kda]") {
  // channels 24: the AVX2 path; 12: the scalar one. The state block sits at a column offset inside
  // a wider state, whose other columns must not change.
  for (std::int64_t C : {24, 12}) {
    for (std::int64_t T : {1, 2, 9}) {
      CAPTURE(C, T);
      const std::int64_t kernel = 4, hist = 3, width = C + 5, col = 2;
      const auto w = RandomVec(C * kernel, 40 + C), x0 = RandomVec(T * C, 41 + T, -3.0f, 3.0f);
      const auto state0 = RandomVec(hist * width, 42);
      // The reference over the sequence [state rows; x rows].
      std::vector<double> seq;
      for (std::int64_t r = 0; r < hist; ++r)
        for (std::int64_t c = 0; c < C; ++c) seq.push_back(state0[r * width + col + c]);
      for (float v : x0) seq.push_back(v);
      std::vector<float> want(T * C);
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t c = 0; c < C; ++c) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < kernel; ++j) acc += w[c * kernel + j] * seq[(t + j) * C + c];
          want[t * C + c] = static_cast<float>(acc / (1.0 + std::exp(-acc)));
        }
      std::vector<float> x = x0, state = state0;
      ShortConvSilu(x.data(), T, C, w.data(), kernel, state.data(), width, col);
      CHECK(RelErr(x, want) < 1e-6);
      for (std::int64_t r = 0; r < hist; ++r)
        for (std::int64_t c = 0; c < width; ++c) {
          const bool mine = c >= col && c < col + C;
          CHECK(state[r * width + c] == (mine ? static_cast<float>(seq[(T + r) * C + c - col]) : state0[r * width + c]));
        }
      // Token by token through the state: the same bits as one call.
      std::vector<float> step = x0, state2 = state0;
      for (std::int64_t t = 0; t < T; ++t) ShortConvSilu(&step[t * C], 1, C, w.data(), kernel, state2.data(), width, col);
      CHECK(step == x);
      CHECK(state2 == state);
    }
  }
}

struct Mixer {
  KdaDims dims;
  KdaWeights w;
};

Mixer MakeMixer(bool bounded, bool full_rank, std::uint64_t seed) {
  Mixer m;
  m.dims.hidden = 48;
  m.dims.heads = 3;
  m.dims.head_dim = 16;
  m.dims.kernel = 4;
  if (bounded) m.dims.gate_lower_bound = -5.0f;
  m.dims.full_rank_gate = full_rank;
  const std::int64_t d = 48, H = 3, K = 16, C = H * K;
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  auto& w = m.w;
  w.q_proj = RandomTensor({C, d}, seed++, s);
  w.k_proj = RandomTensor({C, d}, seed++, s);
  w.v_proj = RandomTensor({C, d}, seed++, s);
  w.q_conv = RandomTensor({C, 1, 4}, seed++, 0.5f);
  w.k_conv = RandomTensor({C, 1, 4}, seed++, 0.5f);
  w.v_conv = RandomTensor({C, 1, 4}, seed++, 0.5f);
  w.f_a = RandomTensor({K, d}, seed++, s);
  w.f_b = RandomTensor({C, K}, seed++, 0.25f);
  w.b_proj = RandomTensor({H, d}, seed++, s);
  w.a_log = RandomTensor({H}, seed++, 0.5f);
  w.dt_bias = RandomTensor({C}, seed++, 0.5f);
  if (full_rank) {
    w.g_proj = RandomTensor({C, d}, seed++, s);
  } else {
    w.g_a = RandomTensor({K, d}, seed++, s);
    w.g_b = RandomTensor({C, K}, seed++, 0.25f);
  }
  w.o_norm = RandomTensor({K}, seed++, 1.0f);
  w.o_proj = RandomTensor({d, C}, seed++, 1.0f / std::sqrt(static_cast<float>(C)));
  return m;
}

TEST_CASE("KDA mixer: chunked prefill == token-by-token decode == split prefill", "[kda]") {
  for (bool bounded : {true, false}) {
    for (bool full_rank : {true, false}) {
      CAPTURE(bounded, full_rank);
      const auto m = MakeMixer(bounded, full_rank, bounded * 100 + full_rank * 50 + 1);
      REQUIRE(CheckKdaWeights(m.w, m.dims, "test.").ok());
      const std::int64_t T = 70, d = m.dims.hidden;
      const auto x = RandomVec(T * d, 3);
      std::vector<float> rec(m.dims.RecurrentStateSize(), 0.0f), conv(m.dims.ConvStateSize(), 0.0f);
      std::vector<float> full(T * d);
      KdaForward(m.w, m.dims, x.data(), T, rec, conv, true, full.data());

      std::vector<float> rec2(rec.size(), 0.0f), conv2(conv.size(), 0.0f), step(T * d);
      for (std::int64_t t = 0; t < T; ++t) KdaForward(m.w, m.dims, &x[t * d], 1, rec2, conv2, false, &step[t * d]);
      CHECK(RelErr(step, full) < 1e-4);
      CHECK(RelErr(rec2, rec) < 1e-4);
      CHECK(RelErr(conv2, conv) < 1e-5);

      std::vector<float> rec3(rec.size(), 0.0f), conv3(conv.size(), 0.0f), split(T * d);
      KdaForward(m.w, m.dims, x.data(), 5, rec3, conv3, true, split.data());
      KdaForward(m.w, m.dims, &x[5 * d], T - 5, rec3, conv3, true, &split[5 * d]);
      CHECK(RelErr(split, full) < 1e-4);
      CHECK(testing::MaxAbs(full) > 1e-3);
    }
  }
}

TEST_CASE("KDA weight check names the offending tensor", "[kda]") {
  auto m = MakeMixer(true, true, 1);
  m.w.f_b = RandomTensor({4, 4}, 1);
  const Status st = CheckKdaWeights(m.w, m.dims, "layers.0.self_attn.");
  REQUIRE(st.IsInvalidArgument());
  CHECK(st.message().find("layers.0.self_attn.f_b_proj.weight") != std::string::npos);
}

}  // namespace
}  // namespace terrace::model
