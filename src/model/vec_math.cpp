#include "src/model/vec_math.h"

#include <algorithm>
#include <cmath>

#include "src/model/avx2_math.h"
#include "src/model/ops.h"

namespace terrace::model::ops {
namespace {

#ifdef TERRACE_SIMD_X86
// x[0, n) = f(x[0, n)) for a per-lane f; the tail through a zero-padded 8-lane copy.
template <typename F>
TERRACE_SIMD_AVX2 inline void Map8(float* x, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, f(_mm256_loadu_ps(x + i)));
  if (i == n) return;
  alignas(32) float tail[8] = {};
  std::copy(x + i, x + n, tail);
  _mm256_store_ps(tail, f(_mm256_load_ps(tail)));
  std::copy(tail, tail + (n - i), x + i);
}

struct Exp {
  TERRACE_SIMD_AVX2 __m256 operator()(__m256 v) const { return simd::Exp8(v); }
};
struct Sigm {
  TERRACE_SIMD_AVX2 __m256 operator()(__m256 v) const { return simd::Sigmoid8(v); }
};
struct Silu8 {
  TERRACE_SIMD_AVX2 __m256 operator()(__m256 v) const { return _mm256_mul_ps(v, simd::Sigmoid8(v)); }
};

TERRACE_SIMD_AVX2 void ExpAvx2(float* x, std::int64_t n) { Map8(x, n, Exp{}); }
TERRACE_SIMD_AVX2 void SigmoidAvx2(float* x, std::int64_t n) { Map8(x, n, Sigm{}); }
TERRACE_SIMD_AVX2 void SiluAvx2(float* x, std::int64_t n) { Map8(x, n, Silu8{}); }

TERRACE_SIMD_AVX2 void MulSigmoidAvx2(float* x, const float* gate, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), simd::Sigmoid8(_mm256_loadu_ps(gate + i))));
  if (i == n) return;
  alignas(32) float g[8] = {}, v[8] = {};
  std::copy(gate + i, gate + n, g);
  std::copy(x + i, x + n, v);
  _mm256_store_ps(v, _mm256_mul_ps(_mm256_load_ps(v), simd::Sigmoid8(_mm256_load_ps(g))));
  std::copy(v, v + (n - i), x + i);
}
#endif

}  // namespace

bool HasAvx2Fma() {
#ifdef TERRACE_SIMD_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

void ExpInPlace(float* x, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return ExpAvx2(x, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

void SigmoidInPlace(float* x, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return SigmoidAvx2(x, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) x[i] = Sigmoid(x[i]);
}

void SiluInPlace(float* x, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return SiluAvx2(x, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) x[i] = Silu(x[i]);
}

void MulSigmoidInPlace(float* x, const float* gate, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return MulSigmoidAvx2(x, gate, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) x[i] *= Sigmoid(gate[i]);
}

}  // namespace terrace::model::ops
