#include "src/model/ops.h"

#include <algorithm>

#include <cblas.h>

namespace terrace::model::ops {

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

void RmsNorm(const float* x, std::int64_t rows, std::int64_t n, const float* weight, float eps, float* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = out + r * n;
    float ss = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    if (weight != nullptr) {
      for (std::int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * weight[i];
    } else {
      for (std::int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  }
}

void L2NormalizeInPlace(float* x, std::int64_t n, float eps) {
  float ss = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + eps);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void SoftmaxInPlace(float* x, std::int64_t n) {
  if (n <= 0) return;
  const float mx = *std::max_element(x, x + n);
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void SetBlasThreads(int threads) { openblas_set_num_threads(std::max(1, threads)); }
int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace terrace::model::ops
