// KDA recurrence: recurrent and chunkwise forms.
#include "src/model/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <cblas.h>

#include "src/model/kda_pairs.h"
#include "src/model/ops.h"
#include "src/model/vec_math.h"

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

// Per chunk of L tokens with start state S0, per-token decays e_t = exp(g_t) and their running
// products D(j, i] = e_{j+1} * ... * e_i (element-wise over K; D(j, j] = 1):
//   S_i = diag(D(-1, i]) S0 + sum_{j<=i} diag(D(j, i]) k_j u_j^T
// where the pseudo-values u solve the unit-lower-triangular system
//   u_i + sum_{j<i} beta_i (k_i . D(j, i] k_j) u_j = beta_i (v_i - S0^T (D(-1, i] * k_i))
// (the UT transform). Then o_i = S0^T (D(-1, i] * q_i) + sum_{j<=i} (q_i . D(j, i] k_j) u_j and the
// chunk's final state is diag(D(-1, L-1]) S0 + sum_j (D(j, L-1] * k_j) u_j^T.
// Every D is a product of the factors e, never a quotient: with g <= 0 all lie in [0, 1], and
// nothing overflows at any gate value (exp(sum g) would be the same number, but the products
// avoid the cancellation of G_i - G_j between two large cumulative sums).
void KdaChunked(const KdaCoreArgs& a, float* state, float* o, std::int64_t chunk) {
  const std::int64_t H = a.heads, K = a.key_dim, V = a.value_dim;
  chunk = std::max<std::int64_t>(1, chunk);
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  std::vector<float> q(n(chunk * K)), k(n(chunk * K)), e(n(chunk * K)), qg(n(chunk * K)), kg(n(chunk * K));
  std::vector<float> kd(n(chunk * K)), u(n(chunk * V)), oc(n(chunk * V)), A(n(chunk * chunk)),
      P(n(chunk * chunk)), b(n(chunk)), run(n(K));
  for (std::int64_t h = 0; h < H; ++h) {
    float* S = state + h * K * V;
    for (std::int64_t c0 = 0; c0 < a.tokens; c0 += chunk) {
      const std::int64_t L = std::min(chunk, a.tokens - c0);
      for (std::int64_t i = 0; i < L; ++i) {
        const std::int64_t row = (c0 + i) * H + h;
        std::copy_n(a.q + row * K, K, &q[n(i * K)]);
        std::copy_n(a.k + row * K, K, &k[n(i * K)]);
        std::copy_n(a.g + row * K, K, &e[n(i * K)]);
        std::copy_n(a.v + row * V, V, &u[n(i * V)]);
        b[n(i)] = a.beta[row];
      }
      ops::ExpInPlace(e.data(), L * K);
      // qg_i, kg_i = D(-1, i] * q_i, k_i; run ends as D(-1, L-1].
      std::fill(run.begin(), run.end(), 1.0f);
      for (std::int64_t i = 0; i < L; ++i) {
        for (std::int64_t d = 0; d < K; ++d) {
          run[n(d)] *= e[n(i * K + d)];
          qg[n(i * K + d)] = q[n(i * K + d)] * run[n(d)];
          kg[n(i * K + d)] = k[n(i * K + d)] * run[n(d)];
        }
      }
      KdaDecayedPairs(q.data(), k.data(), e.data(), b.data(), L, K, chunk, A.data(), P.data());
      // u <- beta (v - kg S0), then solve (I + A) u = rhs.
      ops::Gemm(false, false, L, V, K, -1.0f, kg.data(), K, S, V, 1.0f, u.data(), V);
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t x = 0; x < V; ++x) u[n(i * V + x)] *= b[n(i)];
      if (L != chunk) {  // compact A to an L x L matrix for the solver
        for (std::int64_t i = 0; i < L; ++i) std::copy_n(&A[n(i * chunk)], L, &A[n(i * L)]);
      }
      ops::SolveUnitLower(A.data(), L, u.data(), V, V);
      // o = qg S0 + P u.
      ops::Gemm(false, false, L, V, K, 1.0f, qg.data(), K, S, V, 0.0f, oc.data(), V);
      ops::Gemm(false, false, L, V, L, 1.0f, P.data(), chunk, u.data(), V, 1.0f, oc.data(), V);
      for (std::int64_t i = 0; i < L; ++i) std::copy_n(&oc[n(i * V)], V, o + ((c0 + i) * H + h) * V);
      // S <- diag(D(-1, L-1]) S0 + kd^T u with kd_j = D(j, L-1] * k_j (built from the last row up).
      for (std::int64_t d = 0; d < K; ++d) {
        for (std::int64_t x = 0; x < V; ++x) S[d * V + x] *= run[n(d)];
      }
      std::fill(run.begin(), run.end(), 1.0f);
      for (std::int64_t j = L - 1; j >= 0; --j) {
        for (std::int64_t d = 0; d < K; ++d) {
          kd[n(j * K + d)] = k[n(j * K + d)] * run[n(d)];
          run[n(d)] *= e[n(j * K + d)];
        }
      }
      ops::Gemm(true, false, K, V, L, 1.0f, kd.data(), K, u.data(), V, 1.0f, S, V);
    }
  }
}

}  // namespace terrace::model
