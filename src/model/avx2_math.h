// Inline AVX2 + FMA element-wise math for the model's kernels (x86 only; internal header).
//
// A function that calls these must itself carry TERRACE_SIMD_AVX2 (GCC inlines only into a caller
// with the same target), and must run only where ops::HasAvx2Fma() is true.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TERRACE_SIMD_X86 1
#define TERRACE_SIMD_AVX2 __attribute__((target("avx2,fma")))

namespace terrace::model::simd {

// exp(x) per lane, within 1 ulp of the correctly rounded value for every float input (checked over
// all 2^32 bit patterns when it was written; vec_math_test sweeps a subset against std::exp),
// subnormal results included. NaN -> NaN; +inf, and x >= 88.72283935546875 (the first float above
// ln FLT_MAX) -> +inf; -inf and x <= -104 -> 0.
// x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two for an exact n ln2), p(r) Cephes' degree-6
// expf polynomial, result p(r) * 2^(n - n/2) * 2^(n/2): two exact power-of-two scalings, so a
// subnormal result is rounded once.
TERRACE_SIMD_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283935546875f);
  // max(lo, x) then min(hi, .) return their second operand, x, when x is NaN: NaN flows through.
  const __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n is in [-150, 128]: both halves are in [-75, 64], normal powers of two.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

// 1 / (1 + exp(-x)), the scalar ops::Sigmoid's formula with Exp8 (an IEEE division, no reciprocal
// estimate): 0 for x <= -88.73 (exp(-x) is +inf), NaN -> NaN.
TERRACE_SIMD_AVX2 inline __m256 Sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

TERRACE_SIMD_AVX2 inline float HorizontalSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace terrace::model::simd

#endif  // x86
