// The fused MXFP4 dequantise-and-multiply kernel (src/model/mxfp4_matmul.h) against
// dequantise-then-multiply: DequantizeMxfp4 + ops::Linear (OpenBLAS) and a double-precision oracle.
//
// Bound: each dequantised weight is exact in fp32, so a kernel's only error is fp32 rounding in a
// K-term sum of products: |y - y_exact| <= gamma_K * S with S = sum_k |w_k x_k| and
// gamma_K = K u / (1 - K u), u = 2^-24 (any summation order, FMA or not). The fused kernel and the
// BLAS GEMV each meet it, so they differ by at most 2 gamma_K S. Checked for both kernel choices,
// T = 1 (GEMV path) and T > 1 (tile path), odd row counts, accumulate, and scales from 2^-127
// (subnormal weights) to 2^125.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "math_test_util.h"
#include "src/model/mxfp4.h"
#include "src/model/mxfp4_matmul.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

struct Quantised {
  std::int64_t rows = 0, cols = 0;
  std::vector<std::uint8_t> packed, scales;
  Mxfp4Matrix view() const { return {packed.data(), scales.data(), rows, cols}; }
  std::vector<float> dequant() const {
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    REQUIRE(DequantizeMxfp4(packed, scales, rows, cols, out).ok());
    return out;
  }
};

// Random bytes (every code, -0 included) and scales in [lo, hi].
Quantised RandomMxfp4(std::int64_t rows, std::int64_t cols, std::uint64_t seed, int lo = 118, int hi = 132) {
  std::mt19937_64 rng(seed);
  Quantised q;
  q.rows = rows;
  q.cols = cols;
  q.packed.resize(static_cast<std::size_t>(rows * cols / 2));
  q.scales.resize(static_cast<std::size_t>(rows * cols / 32));
  for (auto& b : q.packed) b = static_cast<std::uint8_t>(rng() & 0xFFu);
  std::uniform_int_distribution<int> sd(lo, hi);
  for (auto& s : q.scales) s = static_cast<std::uint8_t>(sd(rng));
  return q;
}

const char* Name(Mxfp4Kernel k) { return k == Mxfp4Kernel::kScalar ? "scalar" : "avx2"; }

std::vector<Mxfp4Kernel> Kernels() {
  std::vector<Mxfp4Kernel> k{Mxfp4Kernel::kScalar};
  if (Mxfp4Avx2Available()) {
    k.push_back(Mxfp4Kernel::kAvx2);
  } else {
    WARN("AVX2/FMA not available on this CPU: only the scalar MXFP4 kernel is tested");
  }
  return k;
}

// Checks y (from a kernel) and BLAS against the exact double result, and each other.
void CheckAgainstOracle(const Quantised& q, const std::vector<float>& x, std::int64_t m, const std::vector<float>& y,
                        const std::vector<float>& y0, bool accumulate) {
  const std::vector<float> w = q.dequant();
  const std::int64_t K = q.cols, N = q.rows;
  std::vector<float> blas(y0);
  ops::Linear(x.data(), m, K, w.data(), N, blas.data(), accumulate);
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1.0 - K * u);
  for (std::int64_t t = 0; t < m; ++t) {
    for (std::int64_t r = 0; r < N; ++r) {
      double exact = 0.0, s = 0.0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(w[static_cast<std::size_t>(r * K + k)]) * x[static_cast<std::size_t>(t * K + k)];
        exact += p;
        s += std::fabs(p);
      }
      const std::size_t i = static_cast<std::size_t>(t * N + r);
      double bound = gamma * s;
      if (accumulate) {
        // One more rounding: the add of y0 (|err| <= u |result|).
        exact += y0[i];
        bound += u * (std::fabs(exact) + bound);
      }
      CAPTURE(t, r, K, exact, y[i], blas[i], bound);
      REQUIRE(std::isfinite(y[i]));
      CHECK(std::fabs(y[i] - exact) <= bound);
      CHECK(std::fabs(blas[i] - exact) <= bound);
      CHECK(std::fabs(static_cast<double>(y[i]) - blas[i]) <= 2.0 * bound);
    }
  }
}

// Every kernel on random weights of each shape in rows x cols, for each token count in ms, with and
// without accumulate, against CheckAgainstOracle.
void CheckKernelsOnGrid(std::initializer_list<std::int64_t> rows_list, std::initializer_list<std::int64_t> cols_list,
                        std::initializer_list<std::int64_t> ms, std::uint64_t seed) {
  for (const Mxfp4Kernel kernel : Kernels()) {
    for (const std::int64_t rows : rows_list) {
      for (const std::int64_t cols : cols_list) {
        for (const std::int64_t m : ms) {
          for (const bool accumulate : {false, true}) {
            CAPTURE(Name(kernel), rows, cols, m, accumulate);
            const Quantised q = RandomMxfp4(rows, cols, seed++);
            const auto x = testing::RandomVec(static_cast<std::size_t>(m * cols), seed++);
            const auto y0 = testing::RandomVec(static_cast<std::size_t>(m * rows), seed++);
            std::vector<float> y(y0);
            Mxfp4Linear(q.view(), x.data(), m, y.data(), accumulate, kernel);
            CheckAgainstOracle(q, x, m, y, y0, accumulate);
          }
        }
      }
    }
  }
}

TEST_CASE("Fused MXFP4 kernel == dequantise-then-multiply within fp32 rounding", "[mxfp4][kernel]") {
  CheckKernelsOnGrid({1, 3, 4, 5, 17, 64}, {32, 64, 96, 256}, {1, 2, 3, 4, 5, 7, 32}, 1);
}

TEST_CASE("Fused MXFP4 kernel: rows wider than one 256-column tile, with a partial last tile, sum every tile",
          "[mxfp4][kernel]") {
  // Model widths are thousands of columns: the tiled multi-token path dequantises 256 columns at a
  // time and must carry each tile's sums into the next, including a last tile of fewer columns.
  CheckKernelsOnGrid({5, 16, 17}, {288, 544, 800}, {1, 2, 7}, 1000);
}

TEST_CASE("Fused MXFP4 kernel: extreme scales (subnormal and huge weights) stay exact", "[mxfp4][kernel]") {
  for (const Mxfp4Kernel kernel : Kernels()) {
    for (const auto& [lo, hi] : {std::pair{0, 3}, std::pair{250, 252}}) {
      CAPTURE(Name(kernel), lo, hi);
      const std::int64_t rows = 9, cols = 128;
      const Quantised q = RandomMxfp4(rows, cols, 99 + lo, lo, hi);
      for (const std::int64_t m : {1, 6}) {
        // x scaled so the products stay finite and normal-ish: 2^-120 for huge weights, 2^100 for tiny.
        auto x = testing::RandomVec(static_cast<std::size_t>(m * cols), 5 + m);
        for (auto& v : x) v = std::ldexp(v, lo > 200 ? -120 : 100);
        std::vector<float> y(static_cast<std::size_t>(m * rows), 0.0f);
        Mxfp4Linear(q.view(), x.data(), m, y.data(), false, kernel);
        CheckAgainstOracle(q, x, m, y, y, false);
      }
    }
  }
}

TEST_CASE("Fused MXFP4 kernel decodes each code: one-hot weights pick out single products", "[mxfp4][kernel]") {
  // W has one non-zero code per row, at column c = row; y = value(code, scale) * x[c] exactly.
  for (const Mxfp4Kernel kernel : Kernels()) {
    const std::int64_t cols = 64, rows = cols;
    Quantised q;
    q.rows = rows;
    q.cols = cols;
    q.packed.assign(static_cast<std::size_t>(rows * cols / 2), 0);
    q.scales.assign(static_cast<std::size_t>(rows * cols / 32), 127);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t code = static_cast<std::uint8_t>(r % 16);
      const std::int64_t c = r;
      auto& byte = q.packed[static_cast<std::size_t>(r * cols / 2 + c / 2)];
      byte = static_cast<std::uint8_t>(byte | (c % 2 == 0 ? code : code << 4));
      q.scales[static_cast<std::size_t>(r * cols / 32 + c / 32)] = static_cast<std::uint8_t>(120 + r % 13);
    }
    std::vector<float> x(static_cast<std::size_t>(2 * cols));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + static_cast<float>(i) / 128.0f;
    for (const std::int64_t m : {1, 2}) {
      std::vector<float> y(static_cast<std::size_t>(m * rows), -1.0f);
      Mxfp4Linear(q.view(), x.data(), m, y.data(), false, kernel);
      for (std::int64_t t = 0; t < m; ++t)
        for (std::int64_t r = 0; r < rows; ++r) {
          const float want = E2M1ToFloat(static_cast<std::uint8_t>(r % 16)) * std::ldexp(1.0f, (120 + r % 13) - 127) *
                             x[static_cast<std::size_t>(t * cols + r)];
          CAPTURE(Name(kernel), m, t, r);
          CHECK(y[static_cast<std::size_t>(t * rows + r)] == want);
        }
    }
  }
}

TEST_CASE("Fused MXFP4 kernel is deterministic and reads unaligned views", "[mxfp4][kernel]") {
  const Quantised q = RandomMxfp4(33, 96, 4242);
  // The same bytes at an odd address: bit-identical results.
  std::vector<std::uint8_t> buf(q.packed.size() + q.scales.size() + 3);
  std::memcpy(buf.data() + 1, q.packed.data(), q.packed.size());
  std::memcpy(buf.data() + 1 + q.packed.size(), q.scales.data(), q.scales.size());
  const Mxfp4Matrix shifted{buf.data() + 1, buf.data() + 1 + q.packed.size(), q.rows, q.cols};
  for (const std::int64_t m : {1, 9}) {
    const auto x = testing::RandomVec(static_cast<std::size_t>(m * q.cols), 17);
    std::vector<float> a(static_cast<std::size_t>(m * q.rows)), b(a.size());
    Mxfp4Linear(q.view(), x.data(), m, a.data());
    Mxfp4Linear(shifted, x.data(), m, b.data());
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
}

}  // namespace
}  // namespace terrace::model
