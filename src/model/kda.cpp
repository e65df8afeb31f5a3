// KDA recurrence: recurrent and chunkwise forms.
#include "src/model/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <cblas.h>

#include "src/model/ops.h"

namespace terrace::model {

void KdaRecurrent(const KdaCoreArgs& a, float* state, float* o) {
  const std::int64_t H = a.heads, K = a.key_dim, V = a.value_dim;
  std::vector<float> kv(static_cast<std::size_t>(V));
  for (std::int64_t t = 0; t < a.tokens; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      float* S = state + h * K * V;
      const float* q = a.q + (t * H + h) * K;
      const float* k = a.k + (t * H + h) * K;
      const float* g = a.g + (t * H + h) * K;
      const float* v = a.v + (t * H + h) * V;
      const float b = a.beta[t * H + h];
      for (std::int64_t d = 0; d < K; ++d) {
        const float decay = std::exp(g[d]);
        float* row = S + d * V;
        for (std::int64_t e = 0; e < V; ++e) row[e] *= decay;
      }
      // kv = S^T k; u = beta (v - kv); S += k outer u; o = S^T q.
      cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<blasint>(K), static_cast<blasint>(V), 1.0f, S,
                  static_cast<blasint>(V), k, 1, 0.0f, kv.data(), 1);
      for (std::int64_t e = 0; e < V; ++e) kv[e] = b * (v[e] - kv[e]);
      cblas_sger(CblasRowMajor, static_cast<blasint>(K), static_cast<blasint>(V), 1.0f, k, 1, kv.data(), 1, S,
                 static_cast<blasint>(V));
      cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<blasint>(K), static_cast<blasint>(V), 1.0f, S,
                  static_cast<blasint>(V), q, 1, 0.0f, o + (t * H + h) * V, 1);
    }
  }
}

// A (strictly lower, row i scaled by beta_i) and P (lower, with the diagonal) of one chunk:
//   A_ij = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d]),  P_ij = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d]).
// Blocks of kSub rows: a pair of blocks J < I goes through one GEMM each, with the decay split at the
// last row r of block J as exp(G_i - G_r) * exp(G_r - G_j) (both exponents <= 0); diagonal blocks are
// computed pair by pair. ld is the row stride of A and P.
namespace {

constexpr std::int64_t kSub = 16;
void DecayedProducts(const float* q, const float* k, const float* G, const float* b, std::int64_t L, std::int64_t K,
                     std::int64_t ld, float* A, float* P, std::vector<float>& sc) {
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  std::fill(A, A + L * ld, 0.0f);
  std::fill(P, P + L * ld, 0.0f);
  sc.resize(n(3 * kSub * K));
  float* qi = sc.data();
  float* ki = qi + kSub * K;
  float* kj = ki + kSub * K;
  for (std::int64_t i0 = 0; i0 < L; i0 += kSub) {
    const std::int64_t ni = std::min(kSub, L - i0);
    for (std::int64_t j0 = 0; j0 < i0; j0 += kSub) {
      const std::int64_t nj = std::min(kSub, L - j0);
      const float* Gr = G + (j0 + nj - 1) * K;
      for (std::int64_t i = 0; i < ni; ++i)
        for (std::int64_t d = 0; d < K; ++d) {
          const float e = std::exp(G[(i0 + i) * K + d] - Gr[d]);
          qi[i * K + d] = q[(i0 + i) * K + d] * e;
          ki[i * K + d] = k[(i0 + i) * K + d] * e * b[i0 + i];
        }
      for (std::int64_t j = 0; j < nj; ++j)
        for (std::int64_t d = 0; d < K; ++d) kj[j * K + d] = k[(j0 + j) * K + d] * std::exp(Gr[d] - G[(j0 + j) * K + d]);
      ops::Gemm(false, true, ni, nj, K, 1.0f, qi, K, kj, K, 0.0f, P + i0 * ld + j0, ld);
      ops::Gemm(false, true, ni, nj, K, 1.0f, ki, K, kj, K, 0.0f, A + i0 * ld + j0, ld);
    }
    for (std::int64_t i = i0; i < i0 + ni; ++i) {
      for (std::int64_t j = i0; j <= i; ++j) {
        float sq = 0.0f, sk = 0.0f;
        for (std::int64_t d = 0; d < K; ++d) {
          const float w = k[j * K + d] * std::exp(G[i * K + d] - G[j * K + d]);
          sq += q[i * K + d] * w;
          sk += k[i * K + d] * w;
        }
        P[i * ld + j] = sq;
        if (j < i) A[i * ld + j] = b[i] * sk;
      }
    }
  }
}

}  // namespace

// Per chunk of L tokens with start state S0 and cumulative log-decay G_i = sum_{j<=i} g_j:
//   S_i = diag(exp G_i) S0 + sum_{j<=i} diag(exp(G_i - G_j)) k_j u_j^T
// where the pseudo-values u solve the unit-lower-triangular system
//   u_i + sum_{j<i} beta_i (k_i . exp(G_i - G_j) . k_j) u_j = beta_i (v_i - S0^T (exp G_i * k_i))
// (the UT transform). Then o_i = S0^T (exp G_i * q_i) + sum_{j<=i} (q_i . exp(G_i - G_j) . k_j) u_j
// and the chunk's final state is diag(exp G_L) S0 + sum_j (exp(G_L - G_j) * k_j) u_j^T.
// Every exponent is of a difference G_i - G_j with j <= i, hence <= 0: no overflow at any gate value.
void KdaChunked(const KdaCoreArgs& a, float* state, float* o, std::int64_t chunk) {
  const std::int64_t H = a.heads, K = a.key_dim, V = a.value_dim;
  chunk = std::max<std::int64_t>(1, chunk);
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  std::vector<float> q(n(chunk * K)), k(n(chunk * K)), G(n(chunk * K)), qg(n(chunk * K)), kg(n(chunk * K));
  std::vector<float> kd(n(chunk * K)), u(n(chunk * V)), oc(n(chunk * V)), A(n(chunk * chunk)),
      P(n(chunk * chunk)), b(n(chunk)), sc;
  for (std::int64_t h = 0; h < H; ++h) {
    float* S = state + h * K * V;
    for (std::int64_t c0 = 0; c0 < a.tokens; c0 += chunk) {
      const std::int64_t L = std::min(chunk, a.tokens - c0);
      for (std::int64_t i = 0; i < L; ++i) {
        const std::int64_t row = (c0 + i) * H + h;
        std::copy_n(a.q + row * K, K, &q[n(i * K)]);
        std::copy_n(a.k + row * K, K, &k[n(i * K)]);
        std::copy_n(a.v + row * V, V, &u[n(i * V)]);
        b[n(i)] = a.beta[row];
        const float* g = a.g + row * K;
        for (std::int64_t d = 0; d < K; ++d) G[n(i * K + d)] = g[d] + (i > 0 ? G[n((i - 1) * K + d)] : 0.0f);
        for (std::int64_t d = 0; d < K; ++d) {
          const float e = std::exp(G[n(i * K + d)]);
          qg[n(i * K + d)] = q[n(i * K + d)] * e;
          kg[n(i * K + d)] = k[n(i * K + d)] * e;
        }
      }
      DecayedProducts(q.data(), k.data(), G.data(), b.data(), L, K, chunk, A.data(), P.data(), sc);
      // u <- beta (v - kg S0), then solve (I + A) u = rhs.
      ops::Gemm(false, false, L, V, K, -1.0f, kg.data(), K, S, V, 1.0f, u.data(), V);
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t e = 0; e < V; ++e) u[n(i * V + e)] *= b[n(i)];
      if (L == chunk) {
        ops::SolveUnitLower(A.data(), L, u.data(), V, V);
      } else {  // compact A to an L x L matrix for the solver
        for (std::int64_t i = 0; i < L; ++i) std::copy_n(&A[n(i * chunk)], L, &A[n(i * L)]);
        ops::SolveUnitLower(A.data(), L, u.data(), V, V);
      }
      // o = qg S0 + P u.
      ops::Gemm(false, false, L, V, K, 1.0f, qg.data(), K, S, V, 0.0f, oc.data(), V);
      ops::Gemm(false, false, L, V, L, 1.0f, P.data(), chunk, u.data(), V, 1.0f, oc.data(), V);
      for (std::int64_t i = 0; i < L; ++i) std::copy_n(&oc[n(i * V)], V, o + ((c0 + i) * H + h) * V);
      // S <- diag(exp G_L) S0 + kd^T u with kd_j = exp(G_L - G_j) * k_j.
      const float* GL = &G[n((L - 1) * K)];
      for (std::int64_t d = 0; d < K; ++d) {
        const float e = std::exp(GL[d]);
        for (std::int64_t x = 0; x < V; ++x) S[d * V + x] *= e;
      }
      for (std::int64_t j = 0; j < L; ++j)
        for (std::int64_t d = 0; d < K; ++d) kd[n(j * K + d)] = k[n(j * K + d)] * std::exp(GL[d] - G[n(j * K + d)]);
      ops::Gemm(true, false, K, V, L, 1.0f, kd.data(), K, u.data(), V, 1.0f, S, V);
    }
  }
}

}  // namespace terrace::model
