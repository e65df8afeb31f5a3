#include "terrace/stats.h"

#include <bit>

namespace terrace {

int LatencyHistogram::BucketOf(std::uint64_t nanos) {
  if (nanos < kSubBuckets) return static_cast<int>(nanos);
  int msb = 63 - std::countl_zero(nanos);                 // >= 3
  int sub = static_cast<int>((nanos >> (msb - 3)) & (kSubBuckets - 1));
  int bucket = (msb - 2) * kSubBuckets + sub;
  return bucket < kBuckets ? bucket : kBuckets - 1;
}

std::uint64_t LatencyHistogram::BucketUpperBound(int bucket) {
  if (bucket < kSubBuckets) return static_cast<std::uint64_t>(bucket);
  int msb = bucket / kSubBuckets + 2;
  std::uint64_t sub = static_cast<std::uint64_t>(bucket % kSubBuckets);
  return ((kSubBuckets + sub + 1) << (msb - 3)) - 1;
}

void LatencyHistogram::Record(std::uint64_t nanos) {
  buckets_[BucketOf(nanos)].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(nanos, std::memory_order_relaxed);
}

std::uint64_t LatencyHistogram::count() const {
  std::uint64_t n = 0;
  for (const auto& b : buckets_) n += b.load(std::memory_order_relaxed);
  return n;
}

std::uint64_t LatencyHistogram::Percentile(double q) const {
  std::uint64_t total = count();
  if (total == 0) return 0;
  if (q < 0) q = 0;
  if (q > 1) q = 1;
  auto rank = static_cast<std::uint64_t>(q * static_cast<double>(total - 1)) + 1;
  std::uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets_[i].load(std::memory_order_relaxed);
    if (seen >= rank) return BucketUpperBound(i);
  }
  return BucketUpperBound(kBuckets - 1);
}

void LatencyHistogram::MergeFrom(const LatencyHistogram& other) {
  for (int i = 0; i < kBuckets; ++i) buckets_[i].fetch_add(other.BucketCount(i), std::memory_order_relaxed);
  sum_.fetch_add(other.sum_nanos(), std::memory_order_relaxed);
}

void LatencyHistogram::Reset() {
  for (auto& b : buckets_) b.store(0, std::memory_order_relaxed);
  sum_.store(0, std::memory_order_relaxed);
}

TierStatsSnapshot SnapshotCounters(const TierCounters& c) {
  TierStatsSnapshot s;
  auto ld = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  s.hits = ld(c.hits);
  s.misses = ld(c.misses);
  s.bytes_written = ld(c.bytes_written);
  s.bytes_read = ld(c.bytes_read);
  s.puts = ld(c.puts);
  s.evictions = ld(c.evictions);
  s.io_errors = ld(c.io_errors);
  s.corruptions = ld(c.corruptions);
  s.queue_depth = ld(c.queue_depth);
  SetLatencyFields(c.read_latency, c.write_latency, &s);
  return s;
}

void SetLatencyFields(const LatencyHistogram& reads, const LatencyHistogram& writes, TierStatsSnapshot* s) {
  s->reads = reads.count();
  s->writes = writes.count();
  s->read_p50_ns = reads.Percentile(0.5);
  s->read_p99_ns = reads.Percentile(0.99);
  s->write_p50_ns = writes.Percentile(0.5);
  s->write_p99_ns = writes.Percentile(0.99);
}

}  // namespace terrace
