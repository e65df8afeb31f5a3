// Dense fp32 kernels of the reference forward pass. Matrix products go through OpenBLAS
// (cblas_sgemm / cblas_sgemv); the element-wise helpers are plain loops over contiguous rows.
//
// Conventions: row-major; a linear weight is [out_features, in_features] (PyTorch nn.Linear), so
// Linear computes y = x W^T. Every function is reentrant; none allocates unless it returns a value.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "src/model/tensor.h"

namespace terrace::model {

// A linear weight [out, in] in fp32 (the Tensor), plus, when the checkpoint stored it in BF16, the
// same values' bf16 bits: their fp32 widening is exactly `data`. ops::Linear's one-row path (decode)
// reads the bf16 copy instead: half the bytes, the same products. Implicitly made from a Tensor
// (no bf16 copy), so plain fp32 weights work unchanged.
struct Weight : Tensor {
  std::vector<std::uint16_t> bf16;  // empty, or numel() values
  Weight() = default;
  Weight(Tensor t) : Tensor(std::move(t)) {}  // NOLINT(google-explicit-constructor): see above
};

}  // namespace terrace::model

namespace terrace::model::ops {

// y[m, n] = x[m, k] * w[n, k]^T (+ y when accumulate). Uses sgemv for m == 1.
void Linear(const float* x, std::int64_t m, std::int64_t k, const float* w, std::int64_t n, float* y,
            bool accumulate = false);

// Linear with a Weight: for m == 1 and a bf16 copy, a GEMV over the bf16 bits (AVX2 + FMA when the
// CPU has them), fp32 products and fp32 accumulation; otherwise Linear over w's fp32 values.
void Linear(const float* x, std::int64_t m, std::int64_t k, const Weight& w, std::int64_t n, float* y,
            bool accumulate = false);
// y[n] (+)= w_bf16[n, k] x[k]: the bf16 GEMV itself (the fp32 widening of each weight is exact).
void Bf16Gemv(const float* x, std::int64_t k, const std::uint16_t* w, std::int64_t n, float* y, bool accumulate);

// c[m, n] = alpha * op(a) * op(b) + beta * c with explicit leading dimensions (row-major).
void Gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);

// Solves (I + L) X = B in place for X, L = the strictly lower triangle of l[n, n] (its diagonal and
// upper triangle are ignored); b is [n, cols] with leading dimension ldb.
void SolveUnitLower(const float* l, std::int64_t n, float* b, std::int64_t cols, std::int64_t ldb);

// sum_i a[i] b[i], sum_i x[i]^2, and y[i] += alpha x[i], over n values. With AVX2 + FMA the sums
// keep four 8-lane partial sums, combined in a fixed order, then add the last n % 8 products in
// order; the result depends only on the values and n (not on alignment). Scalar loops otherwise.
float Dot(const float* a, const float* b, std::int64_t n);
float SumSquares(const float* x, std::int64_t n);
void Axpy(float alpha, const float* x, float* y, std::int64_t n);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight, for `rows` rows of width n.
// out may alias x. weight may be null (no scale).
void RmsNorm(const float* x, std::int64_t rows, std::int64_t n, const float* weight, float eps, float* out);

// x / sqrt(sum(x^2) + eps), in place, over n values.
void L2NormalizeInPlace(float* x, std::int64_t n, float eps = 1e-6f);

// Numerically stable softmax over n values, in place (exp through ExpInPlace, vec_math.h).
void SoftmaxInPlace(float* x, std::int64_t n);

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float Silu(float x) { return x * Sigmoid(x); }
inline float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
// SiTU-GLU: (beta_g * tanh(g / beta_g) * sigmoid(g)) * (beta_u * tanh(u / beta_u)).
inline float Situ(float g, float u, float beta_g, float beta_u) {
  return beta_g * std::tanh(g / beta_g) * Sigmoid(g) * (beta_u * std::tanh(u / beta_u));
}

// g[i] = Situ(g[i], u[i], beta_g, beta_u) for i < n. With AVX2 + FMA, tanh and exp are computed
// by polynomials (tanh: a [13/6] rational on [-7.9988, 7.9988], +-1 beyond, x itself below 4e-4;
// sigmoid: simd::Sigmoid8, avx2_math.h): within 1e-6 of the scalar Situ relative to the row's
// largest value (ops_test). Without AVX2: the scalar Situ.
void SituInPlace(float* g, const float* u, std::int64_t n, float beta_g, float beta_u);

// Sets the OpenBLAS thread count (>= 1) for this process.
void SetBlasThreads(int threads);
int BlasThreads();

}  // namespace terrace::model::ops
