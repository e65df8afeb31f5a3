// Helpers for the reference-model math tests: seeded random fp32 data and error measures.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "src/model/tensor.h"

namespace terrace::model::testing {

inline std::vector<float> RandomVec(std::size_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline Tensor RandomTensor(std::vector<std::int64_t> shape, std::uint64_t seed, float scale = 1.0f) {
  Tensor t(std::move(shape));
  t.data = RandomVec(t.data.size(), seed, -scale, scale);
  return t;
}

// max |a - b| / max(|b|, tiny): relative to the reference's magnitude.
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return 1e30;
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return num / std::max(den, 1e-30);
}

inline double MaxAbs(const std::vector<float>& a) {
  double m = 0.0;
  for (float x : a) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

}  // namespace terrace::model::testing
