#include <catch2/catch.hpp>

#include <random>

#include "terrace/stats.h"

using terrace::LatencyHistogram;

TEST_CASE("LatencyHistogram percentiles are within one bucket of the exact value") {
  LatencyHistogram h;
  CHECK(h.Percentile(0.5) == 0);
  std::vector<std::uint64_t> values;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 10000; ++i) {
    std::uint64_t v = 1 + rng() % 5'000'000;
    values.push_back(v);
    h.Record(v);
  }
  std::sort(values.begin(), values.end());
  CHECK(h.count() == values.size());
  for (double q : {0.5, 0.9, 0.99}) {
    auto exact = values[static_cast<std::size_t>(q * (values.size() - 1))];
    auto est = h.Percentile(q);
    CHECK(est >= exact);
    CHECK(static_cast<double>(est) <= static_cast<double>(exact) * 1.13 + 1);
  }
}

TEST_CASE("LatencyHistogram bucket bounds are monotonic and cover their values") {
  for (int b = 1; b < LatencyHistogram::kBuckets; ++b) {
    CHECK(LatencyHistogram::BucketUpperBound(b) > LatencyHistogram::BucketUpperBound(b - 1));
  }
  LatencyHistogram h;
  for (std::uint64_t v : {0ull, 1ull, 7ull, 8ull, 9ull, 1000ull, 123456789ull}) {
    h.Reset();
    h.Record(v);
    CHECK(h.Percentile(1.0) >= v);
  }
}
