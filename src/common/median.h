// The one median of repeated measurements that every benchmark reports (terrace bench ..., bench/):
// the middle value of an odd count, the mean of the two middle values of an even one. Header-only
// and free of the rest of the project, so that a benchmark built alone can include it.
#pragma once

#include <algorithm>
#include <vector>

namespace terrace {

// The median of `v`; 0 for an empty list.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A list's median with its smallest and largest values (all 0 for an empty list).
struct MedianSpread {
  double median = 0, min = 0, max = 0;
};

inline MedianSpread MedianSpreadOf(const std::vector<double>& v) {
  if (v.empty()) return {};
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return {Median(v), *lo, *hi};
}

}  // namespace terrace
