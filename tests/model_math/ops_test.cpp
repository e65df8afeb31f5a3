// The BLAS-backed ops against plain double-precision loops.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "math_test_util.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

using testing::RandomVec;
using testing::RelErr;

TEST_CASE("Linear computes x W^T (matrix and vector paths, accumulate)", "[ops]") {
  for (std::int64_t m : {1, 5}) {
    const std::int64_t k = 19, n = 7;
    const auto x = RandomVec(m * k, 1), w = RandomVec(n * k, 2), y0 = RandomVec(m * n, 3);
    std::vector<float> want(m * n), want_acc(m * n);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (std::int64_t t = 0; t < k; ++t) s += static_cast<double>(x[i * k + t]) * w[j * k + t];
        want[i * n + j] = static_cast<float>(s);
        want_acc[i * n + j] = static_cast<float>(s + y0[i * n + j]);
      }
    std::vector<float> y(m * n, 123.0f), acc = y0;
    ops::Linear(x.data(), m, k, w.data(), n, y.data());
    ops::Linear(x.data(), m, k, w.data(), n, acc.data(), true);
    CHECK(RelErr(y, want) < 1e-6);
    CHECK(RelErr(acc, want_acc) < 1e-6);
  }
}

TEST_CASE("Bf16Gemv == the fp32 GEMV over the widened weights within fp32 rounding", "[ops][bf16]") {
  // The widening is exact, so only summation order differs: |y - exact| <= gamma_k sum|w x| for
  // both, u = 2^-24. k with and without the 32-wide body, an 8-wide step and a scalar tail.
  for (const std::int64_t n : {1, 3, 4, 9}) {
    for (const std::int64_t k : {1, 7, 8, 33, 47, 72, 256, 517}) {
      CAPTURE(n, k);
      const auto wf = RandomVec(static_cast<std::size_t>(n * k), 10 + n * k);
      Weight w(Tensor({n, k}));
      for (std::size_t i = 0; i < wf.size(); ++i) {
        w.bf16.push_back(FloatToBf16(wf[i]));
        w.data[i] = Bf16ToFloat(w.bf16.back());
      }
      const auto x = RandomVec(static_cast<std::size_t>(k), 3 + k);
      std::vector<float> y(static_cast<std::size_t>(n), 0.5f), via_weight(y), fp32(y);
      ops::Bf16Gemv(x.data(), k, w.bf16.data(), n, y.data(), true);
      ops::Linear(x.data(), 1, k, w, n, via_weight.data(), true);
      ops::Linear(x.data(), 1, k, w.ptr(), n, fp32.data(), true);
      CHECK(via_weight == y);  // the one-row Linear of a Weight with bf16 bits is the bf16 GEMV
      const double u = std::ldexp(1.0, -24), gamma = (k + 1) * u / (1.0 - (k + 1) * u);
      for (std::int64_t r = 0; r < n; ++r) {
        double exact = 0.5, s = 0.5;
        for (std::int64_t j = 0; j < k; ++j) {
          const double p = static_cast<double>(w.data[static_cast<std::size_t>(r * k + j)]) * x[static_cast<std::size_t>(j)];
          exact += p;
          s += std::fabs(p);
        }
        CHECK(std::fabs(y[static_cast<std::size_t>(r)] - exact) <= gamma * s);
        CHECK(std::fabs(fp32[static_cast<std::size_t>(r)] - exact) <= gamma * s);
      }
      // Several rows: the fp32 path, exactly as with a plain Tensor.
      const auto x2 = RandomVec(static_cast<std::size_t>(2 * k), 8 + k);
      std::vector<float> a(static_cast<std::size_t>(2 * n)), b(a.size());
      ops::Linear(x2.data(), 2, k, w, n, a.data());
      ops::Linear(x2.data(), 2, k, w.ptr(), n, b.data());
      CHECK(a == b);
    }
  }
}

TEST_CASE("SituInPlace (vectorised tanh / exp) == the scalar SiTU within 1e-6 relative", "[ops][situ]") {
  for (const float range : {0.01f, 1.0f, 8.0f, 40.0f, 200.0f}) {
    CAPTURE(range);
    const std::int64_t n = 1003;  // a scalar tail
    auto g = RandomVec(static_cast<std::size_t>(n), 5, -range, range);
    const auto u = RandomVec(static_cast<std::size_t>(n), 6, -range * 4, range * 4);
    g[0] = 0.0f;
    g[1] = -0.0001f;  // below tanh's "tiny" threshold after / beta
    std::vector<float> want(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) want[i] = ops::Situ(g[i], u[i], 4.0f, 25.0f);
    ops::SituInPlace(g.data(), u.data(), n, 4.0f, 25.0f);
    CHECK(RelErr(g, want) < 1e-6);
    // Elementwise too, relative to each value (with an absolute floor for values near 0).
    for (std::size_t i = 0; i < g.size(); ++i) {
      CAPTURE(i, want[i], g[i]);
      CHECK(std::fabs(g[i] - want[i]) <= 2e-6 * std::fabs(want[i]) + 1e-30f);
    }
  }
}

TEST_CASE("Dot, SumSquares and Axpy == double loops; Dot independent of alignment", "[ops]") {
  // n with and without the 32-wide body, the 8-wide step and a scalar tail.
  for (const std::int64_t n : {0, 1, 7, 8, 31, 32, 45, 512, 517}) {
    CAPTURE(n);
    const auto a = RandomVec(static_cast<std::size_t>(n) + 8, 31), b = RandomVec(static_cast<std::size_t>(n) + 8, 32);
    double dot = 0.0, ss = 0.0, bound = 0.0;
    for (std::int64_t i = 0; i < n; ++i) {
      dot += static_cast<double>(a[i]) * b[i];
      ss += static_cast<double>(a[i]) * a[i];
      bound += std::abs(static_cast<double>(a[i]) * b[i]);
    }
    // |error| <= gamma_n sum |a b| for any summation order (u = 2^-24).
    const double gamma = static_cast<double>(n) * 0x1p-24 / (1.0 - static_cast<double>(n) * 0x1p-24);
    const float d0 = ops::Dot(a.data(), b.data(), n);
    CHECK(std::abs(d0 - dot) <= gamma * bound + 1e-30);
    CHECK(std::abs(ops::SumSquares(a.data(), n) - ss) <= gamma * ss + 1e-30);
    for (std::int64_t off = 1; off < 8; ++off) {
      std::vector<float> a2(a.size() + 8), b2(b.size() + 8);
      std::copy(a.begin(), a.begin() + n, a2.begin() + off);
      std::copy(b.begin(), b.begin() + n, b2.begin() + off);
      CHECK(ops::Dot(a2.data() + off, b2.data() + off, n) == d0);
    }
    auto y = RandomVec(static_cast<std::size_t>(n) + 1, 33);
    const auto y0 = y;
    ops::Axpy(-0.75f, a.data(), y.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const double want = y0[i] - 0.75 * static_cast<double>(a[i]);
      CHECK(std::abs(y[i] - want) <= 0x1p-23 * (std::abs(y0[i]) + 0.75 * std::abs(a[i])));
    }
    CHECK(y[n] == y0[n]);  // nothing written past n
  }
}

TEST_CASE("SolveUnitLower solves (I + strictly-lower L) X = B", "[ops]") {
  const std::int64_t n = 9, cols = 4;
  auto l = RandomVec(n * n, 4, -0.3f, 0.3f);
  const auto x = RandomVec(n * cols, 5);
  std::vector<float> b(n * cols, 0.0f);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < cols; ++c) {
      double s = x[i * cols + c];
      for (std::int64_t j = 0; j < i; ++j) s += static_cast<double>(l[i * n + j]) * x[j * cols + c];
      b[i * cols + c] = static_cast<float>(s);
    }
  for (std::int64_t i = 0; i < n; ++i) l[i * n + i] = 99.0f;  // the diagonal must be ignored
  ops::SolveUnitLower(l.data(), n, b.data(), cols, cols);
  CHECK(RelErr(b, x) < 1e-5);
}

TEST_CASE("Norms, softmax and SiTU", "[ops]") {
  std::vector<float> x{3.0f, 4.0f};
  ops::L2NormalizeInPlace(x.data(), 2, 0.0f);
  CHECK(x[0] == Approx(0.6f));
  CHECK(x[1] == Approx(0.8f));
  const std::vector<float> r{1.0f, -2.0f, 2.0f, 0.0f}, w{1.0f, 2.0f, 1.0f, 1.0f};
  std::vector<float> out(4);
  ops::RmsNorm(r.data(), 1, 4, w.data(), 0.0f, out.data());
  const float rms = std::sqrt(9.0f / 4.0f);
  CHECK(out[1] == Approx(-4.0f / rms));
  std::vector<float> s{1000.0f, 1000.0f, -1000.0f};
  ops::SoftmaxInPlace(s.data(), 3);
  CHECK(s[0] == Approx(0.5f));
  CHECK(s[2] == 0.0f);
  CHECK(ops::Situ(1.0f, 2.0f, 4.0f, 25.0f) ==
        Approx(4.0 * std::tanh(0.25) / (1.0 + std::exp(-1.0)) * 25.0 * std::tanh(2.0 / 25.0)));
  CHECK(ops::Softplus(30.0f) == Approx(30.0f));
  CHECK(ops::Softplus(0.0f) == Approx(std::log(2.0f)));
}

}  // namespace
}  // namespace terrace::model
