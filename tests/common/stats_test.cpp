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

TEST_CASE("LatencyHistogram percentiles of small exact values pick the value at rank floor(q*(n-1))+1") {
  // Values below kSubBuckets have a bucket each, so the percentiles are exact.
  LatencyHistogram h;
  for (std::uint64_t v = 1; v <= 5; ++v) h.Record(v);
  CHECK(h.Percentile(0.0) == 1);
  CHECK(h.Percentile(0.5) == 3);
  CHECK(h.Percentile(1.0) == 5);
  // q is clamped to [0, 1].
  CHECK(h.Percentile(1.5) == h.Percentile(1.0));
  CHECK(h.Percentile(-0.5) == h.Percentile(0.0));
}

TEST_CASE("LatencyHistogram bucket upper bounds are values of their own bucket") {
  for (int b = 0; b + 1 < LatencyHistogram::kBuckets; ++b) {
    LatencyHistogram h;
    h.Record(LatencyHistogram::BucketUpperBound(b));
    INFO("bucket " << b);
    REQUIRE(h.Percentile(1.0) == LatencyHistogram::BucketUpperBound(b));
  }
}

TEST_CASE("LatencyHistogram MergeFrom adds the other's sum and Reset clears it") {
  LatencyHistogram a, b;
  a.Record(100);
  b.Record(23);
  b.MergeFrom(a);
  CHECK(b.count() == 2);
  CHECK(b.sum_nanos() == 123);
  b.Reset();
  CHECK(b.count() == 0);
  CHECK(b.sum_nanos() == 0);
}

TEST_CASE("SetLatencyFields takes p99 at the 99th percentile") {
  // 98 fast reads and 2 slow ones: the 99th percentile is a slow one (the 90th would be a fast one).
  LatencyHistogram reads, writes;
  for (int i = 0; i < 98; ++i) {
    reads.Record(1);
    writes.Record(2);
  }
  for (int i = 0; i < 2; ++i) {
    reads.Record(1000);
    writes.Record(5000);
  }
  terrace::TierStatsSnapshot s;
  terrace::SetLatencyFields(reads, writes, &s);
  CHECK(s.reads == 100);
  CHECK(s.writes == 100);
  CHECK(s.read_p50_ns == 1);
  CHECK(s.write_p50_ns == 2);
  // Within one bucket (12.5%) above the exact value.
  CHECK(s.read_p99_ns >= 1000);
  CHECK(s.read_p99_ns <= 1125);
  CHECK(s.write_p99_ns >= 5000);
  CHECK(s.write_p99_ns <= 5625);
}
