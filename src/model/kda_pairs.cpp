#include "src/model/kda_pairs.h"

#include <algorithm>
#include <vector>

#include "src/model/avx2_math.h"
#include "src/model/vec_math.h"

namespace terrace::model {
namespace {

void ZeroUpper(std::int64_t L, std::int64_t ld, float* A, float* P) {
  for (std::int64_t i = 0; i < L; ++i) {
    std::fill(P + i * ld + i + 1, P + i * ld + L, 0.0f);
    std::fill(A + i * ld + i, A + i * ld + L, 0.0f);
  }
}

void PairsScalar(const float* q, const float* k, const float* e, const float* b, std::int64_t L, std::int64_t K,
                 std::int64_t ld, float* A, float* P, float* w) {
  for (std::int64_t j = 0; j < L; ++j) {
    std::copy_n(k + j * K, K, w);
    for (std::int64_t i = j; i < L; ++i) {
      const float* qi = q + i * K;
      const float* ki = k + i * K;
      const float* ei = e + i * K;
      float sq = 0.0f, sk = 0.0f;
      for (std::int64_t d = 0; d < K; ++d) {
        if (i > j) w[d] *= ei[d];
        sq += qi[d] * w[d];
        sk += ki[d] * w[d];
      }
      P[i * ld + j] = sq;
      if (i > j) A[i * ld + j] = b[i] * sk;
    }
  }
}

#ifdef TERRACE_SIMD_X86
// Row i against the running product w (K % 8 == 0); with kDecay, w *= e_i first (stored back).
// Four accumulators per dot product hide the FMA latency.
template <bool kDecay>
TERRACE_SIMD_AVX2 inline void PairRow(const float* qi, const float* ki, const float* ei, std::int64_t K, float* w,
                                      float* pq, float* pk) {
  __m256 aq[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 ak[4] = {aq[0], aq[0], aq[0], aq[0]};
  std::int64_t d = 0;
  for (; d + 32 <= K; d += 32) {
    #pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      __m256 wv = _mm256_loadu_ps(w + d + 8 * m);
      if constexpr (kDecay) {
        wv = _mm256_mul_ps(wv, _mm256_loadu_ps(ei + d + 8 * m));
        _mm256_storeu_ps(w + d + 8 * m, wv);
      }
      aq[m] = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d + 8 * m), wv, aq[m]);
      ak[m] = _mm256_fmadd_ps(_mm256_loadu_ps(ki + d + 8 * m), wv, ak[m]);
    }
  }
  for (; d < K; d += 8) {
    __m256 wv = _mm256_loadu_ps(w + d);
    if constexpr (kDecay) {
      wv = _mm256_mul_ps(wv, _mm256_loadu_ps(ei + d));
      _mm256_storeu_ps(w + d, wv);
    }
    aq[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), wv, aq[0]);
    ak[0] = _mm256_fmadd_ps(_mm256_loadu_ps(ki + d), wv, ak[0]);
  }
  *pq = simd::HorizontalSum8(_mm256_add_ps(_mm256_add_ps(aq[0], aq[1]), _mm256_add_ps(aq[2], aq[3])));
  *pk = simd::HorizontalSum8(_mm256_add_ps(_mm256_add_ps(ak[0], ak[1]), _mm256_add_ps(ak[2], ak[3])));
}

TERRACE_SIMD_AVX2 void PairsAvx2(const float* q, const float* k, const float* e, const float* b, std::int64_t L,
                                 std::int64_t K, std::int64_t ld, float* A, float* P, float* w) {
  for (std::int64_t j = 0; j < L; ++j) {
    std::copy_n(k + j * K, K, w);
    float sk = 0.0f;
    PairRow<false>(q + j * K, k + j * K, nullptr, K, w, &P[j * ld + j], &sk);
    for (std::int64_t i = j + 1; i < L; ++i) {
      PairRow<true>(q + i * K, k + i * K, e + i * K, K, w, &P[i * ld + j], &sk);
      A[i * ld + j] = b[i] * sk;
    }
  }
}
#endif

}  // namespace

void KdaDecayedPairs(const float* q, const float* k, const float* e, const float* b, std::int64_t L, std::int64_t K,
                     std::int64_t ld, float* A, float* P) {
  if (L <= 0) return;
  ZeroUpper(L, ld, A, P);
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<std::size_t>(std::max<std::int64_t>(K, 1)));
#ifdef TERRACE_SIMD_X86
  if (K % 8 == 0 && ops::HasAvx2Fma()) return PairsAvx2(q, k, e, b, L, K, ld, A, P, scratch.data());
#endif
  PairsScalar(q, k, e, b, L, K, ld, A, P, scratch.data());
}

}  // namespace terrace::model
