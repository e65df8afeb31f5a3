// The intra-chunk products of KDA's chunkwise form (KdaChunked), from per-token decay factors.
#pragma once

#include <cstdint>

namespace terrace::model {

// For rows j <= i < L of one chunk, with w_ji = k_j * e_{j+1} * ... * e_i (element-wise over the
// K channels; w_jj = k_j):
//   P[i, j] = q_i . w_ji          (j <= i)
//   A[i, j] = b[i] (k_i . w_ji)   (j < i)
// and 0 above the diagonal of P and on and above the diagonal of A. q, k, e are [L, K] row-major
// (e = exp(g), the per-token decay), b is [L], A and P are [L, ld] (ld >= L).
//
// w_ji is a running product of the factors as given, so with every e in [0, 1] (g <= 0) no
// intermediate exceeds |k|: nothing overflows however strong the decay; values below the
// normal range go through the subnormals to 0, as the exact products do.
// AVX2 + FMA when the CPU has them and K % 8 == 0, scalar loops otherwise; the result is a
// deterministic function of the inputs (independent of alignment). Reentrant (thread-local scratch).
void KdaDecayedPairs(const float* q, const float* k, const float* e, const float* b, std::int64_t L, std::int64_t K,
                     std::int64_t ld, float* A, float* P);

}  // namespace terrace::model
