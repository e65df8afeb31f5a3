#include "src/model/ops.h"

#include <algorithm>
#include <cstring>

#include <cblas.h>

#include "src/model/avx2_math.h"
#include "src/model/vec_math.h"

namespace terrace::model::ops {
namespace {

float WidenBf16(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void Bf16GemvScalar(const float* x, std::int64_t k, const std::uint16_t* w, std::int64_t n, float* y,
                    bool accumulate) {
  for (std::int64_t r = 0; r < n; ++r) {
    const std::uint16_t* wr = w + r * k;
    float acc = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) acc += WidenBf16(wr[j]) * x[j];
    y[r] = accumulate ? y[r] + acc : acc;
  }
}

#ifdef TERRACE_SIMD_X86

TERRACE_SIMD_AVX2 inline __m256 Load8Bf16(const std::uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Readers of 8 values of a dot product's first operand, as floats (Dot4): float and bf16 rows.
struct F32Reader {
  TERRACE_SIMD_AVX2 __m256 operator()(const float* p) const { return _mm256_loadu_ps(p); }
  float operator()(float v) const { return v; }
};
struct Bf16Reader {
  TERRACE_SIMD_AVX2 __m256 operator()(const std::uint16_t* p) const { return Load8Bf16(p); }
  float operator()(std::uint16_t v) const { return WidenBf16(v); }
};

// sum_i a[i] b[i]: four 8-lane accumulators over steps of 32 (they hide the FMA latency), then
// steps of 8 into the first, combined in a fixed order, then the last n % 8 products in order.
template <typename T, typename Reader>
TERRACE_SIMD_AVX2 inline float Dot4(const T* a, const float* b, std::int64_t n, Reader read) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(read(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(read(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(read(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(read(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(read(a + i), _mm256_loadu_ps(b + i), s0);
  float s = simd::HorizontalSum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; ++i) s += read(a[i]) * b[i];
  return s;
}

// One row at a time, so the weights are read as one sequential stream (rows are contiguous): the
// hardware prefetcher keeps up with that at memory bandwidth, but not with several interleaved
// short row streams (k = 512 bf16 is 16 cache lines), which ran at a third of it. Four
// accumulators hide the FMA latency.
TERRACE_SIMD_AVX2 void Bf16GemvAvx2(const float* x, std::int64_t k, const std::uint16_t* w, std::int64_t n, float* y,
                                    bool accumulate) {
  for (std::int64_t r = 0; r < n; ++r) {
    const float s = Dot4(w + r * k, x, k, Bf16Reader{});
    y[r] = accumulate ? y[r] + s : s;
  }
}

// tanh(x): odd [13/6] rational on the clamped range (Eigen's fast tanh), x itself for |x| < 4e-4.
TERRACE_SIMD_AVX2 inline __m256 VecTanh(__m256 a) {
  const __m256 x = _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(-7.99881172180175781f)),
                                 _mm256_set1_ps(7.99881172180175781f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-2.76076847742355e-16f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.00018790482477e-13f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.60467152213735e-11f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(5.12229709037114e-08f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.48572235717979e-05f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(6.37261928875436e-04f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(4.89352455891786e-03f));
  p = _mm256_mul_ps(p, x);
  __m256 q = _mm256_set1_ps(1.19825839466702e-06f);
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(1.18534705686654e-04f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(2.26843463243900e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(4.89352518554385e-03f));
  const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a), _mm256_set1_ps(0.0004f), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_div_ps(p, q), a, tiny);
}

TERRACE_SIMD_AVX2 float DotAvx2(const float* a, const float* b, std::int64_t n) { return Dot4(a, b, n, F32Reader{}); }

TERRACE_SIMD_AVX2 void AxpyAvx2(float alpha, const float* x, float* y, std::int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

TERRACE_SIMD_AVX2 void SituAvx2(float* g, const float* u, std::int64_t n, float beta_g, float beta_u) {
  const __m256 bg = _mm256_set1_ps(beta_g), bu = _mm256_set1_ps(beta_u);
  const __m256 ibg = _mm256_set1_ps(1.0f / beta_g), ibu = _mm256_set1_ps(1.0f / beta_u);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
    const __m256 sig = simd::Sigmoid8(gv);
    const __m256 tg = _mm256_mul_ps(bg, VecTanh(_mm256_mul_ps(gv, ibg)));
    const __m256 tu = _mm256_mul_ps(bu, VecTanh(_mm256_mul_ps(uv, ibu)));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(tg, sig), tu));
  }
  for (; i < n; ++i) g[i] = Situ(g[i], u[i], beta_g, beta_u);
}

#endif

}  // namespace

void Bf16Gemv(const float* x, std::int64_t k, const std::uint16_t* w, std::int64_t n, float* y, bool accumulate) {
  if (n <= 0) return;
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) {
    Bf16GemvAvx2(x, k, w, n, y, accumulate);
    return;
  }
#endif
  Bf16GemvScalar(x, k, w, n, y, accumulate);
}

void SituInPlace(float* g, const float* u, std::int64_t n, float beta_g, float beta_u) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) {
    SituAvx2(g, u, n, beta_g, beta_u);
    return;
  }
#endif
  for (std::int64_t i = 0; i < n; ++i) g[i] = Situ(g[i], u[i], beta_g, beta_u);
}

void Linear(const float* x, std::int64_t m, std::int64_t k, const Weight& w, std::int64_t n, float* y,
            bool accumulate) {
  if (m == 1 && k > 0 && !w.bf16.empty()) {
    Bf16Gemv(x, k, w.bf16.data(), n, y, accumulate);
    return;
  }
  Linear(x, m, k, w.ptr(), n, y, accumulate);
}

void Linear(const float* x, std::int64_t m, std::int64_t k, const float* w, std::int64_t n, float* y,
            bool accumulate) {
  if (m <= 0 || n <= 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  if (k <= 0) {
    if (!accumulate) std::fill(y, y + m * n, 0.0f);
    return;
  }
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, w,
                static_cast<blasint>(k), x, 1, beta, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k), w, static_cast<blasint>(k), beta, y,
              static_cast<blasint>(n));
}

void Gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void SolveUnitLower(const float* l, std::int64_t n, float* b, std::int64_t cols, std::int64_t ldb) {
  if (n <= 0 || cols <= 0) return;
  cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, static_cast<blasint>(n),
              static_cast<blasint>(cols), 1.0f, l, static_cast<blasint>(n), b, static_cast<blasint>(ldb));
}

float Dot(const float* a, const float* b, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return DotAvx2(a, b, n);
#endif
  float s = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

float SumSquares(const float* x, std::int64_t n) { return Dot(x, x, n); }

void Axpy(float alpha, const float* x, float* y, std::int64_t n) {
#ifdef TERRACE_SIMD_X86
  if (HasAvx2Fma()) return AxpyAvx2(alpha, x, y, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void RmsNorm(const float* x, std::int64_t rows, std::int64_t n, const float* weight, float eps, float* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = out + r * n;
    const float ss = SumSquares(xr, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    if (weight != nullptr) {
      for (std::int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * weight[i];
    } else {
      for (std::int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  }
}

void L2NormalizeInPlace(float* x, std::int64_t n, float eps) {
  const float ss = SumSquares(x, n);
  const float inv = 1.0f / std::sqrt(ss + eps);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void SoftmaxInPlace(float* x, std::int64_t n) {
  if (n <= 0) return;
  const float mx = *std::max_element(x, x + n);
  for (std::int64_t i = 0; i < n; ++i) x[i] -= mx;
  ExpInPlace(x, n);
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) sum += x[i];
  const float inv = 1.0f / sum;
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void SetBlasThreads(int threads) { openblas_set_num_threads(std::max(1, threads)); }
int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace terrace::model::ops
