// Counters and latency histograms. Updated with relaxed atomics on hot paths; read as snapshots.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

namespace terrace {

// Log-linear latency histogram in nanoseconds: 8 sub-buckets per power of two, from 1 ns to
// about 2^40 ns (18 minutes). Record() is lock-free and thread-safe; relative error <= 12.5%.
class LatencyHistogram {
 public:
  static constexpr int kSubBuckets = 8;
  static constexpr int kBuckets = 41 * kSubBuckets;

  void Record(std::uint64_t nanos);
  std::uint64_t count() const;
  // q in [0, 1]; returns an upper bound of the bucket holding the q-quantile, in ns; 0 if empty.
  std::uint64_t Percentile(double q) const;
  std::uint64_t sum_nanos() const { return sum_.load(std::memory_order_relaxed); }
  void MergeFrom(const LatencyHistogram& other);
  void Reset();
  // Bucket upper bounds and counts, for Prometheus exposition.
  static std::uint64_t BucketUpperBound(int bucket);
  std::uint64_t BucketCount(int bucket) const { return buckets_[bucket].load(std::memory_order_relaxed); }

 private:
  static int BucketOf(std::uint64_t nanos);
  std::array<std::atomic<std::uint64_t>, kBuckets> buckets_{};
  std::atomic<std::uint64_t> sum_{0};
};

// Per-tier counters. Every field is cumulative since open unless noted.
struct TierCounters {
  // The caller's reads (Get, GetBatch, GetRanges, Acquire, device Gets) served from this tier, and
  // those that found no copy here; a read that found no readable copy anywhere (NotFound, or a lost
  // key's Corruption) is a miss in every tier. Prefetches count neither.
  std::atomic<std::uint64_t> hits{0};
  std::atomic<std::uint64_t> misses{0};
  std::atomic<std::uint64_t> bytes_written{0};  // into this tier
  std::atomic<std::uint64_t> bytes_read{0};     // out of this tier
  std::atomic<std::uint64_t> puts{0};
  std::atomic<std::uint64_t> evictions{0};
  std::atomic<std::uint64_t> io_errors{0};
  std::atomic<std::uint64_t> corruptions{0};    // blocks dropped because they failed validation
  std::atomic<std::uint64_t> queue_depth{0};    // current, not cumulative
  LatencyHistogram read_latency;
  LatencyHistogram write_latency;

  void Add(std::atomic<std::uint64_t>& c, std::uint64_t v = 1) { c.fetch_add(v, std::memory_order_relaxed); }
};

// A plain copy of TierCounters plus occupancy, safe to pass around.
struct TierStatsSnapshot {
  std::string name;       // "hbm", "host", "nvme"
  bool emulated = false;  // true when the HBM tier runs in host memory
  // The tier's resident bytes are host memory (TierCaps::memory == kHost): the host may read a
  // BlockHandle's data() from it. False for GPU device memory and for non-addressable tiers (NVMe).
  bool host_addressable = false;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;  // the blocks' own bytes (their sizes summed)
  // The tier's space its blocks take (what runs out first): host and HBM, each block's whole pages
  // (4 KiB; the CUDA HBM tier's page grows above 16 GiB of capacity, to capacity / 2^22 rounded up
  // to a power of two); NVMe, each block's data rounded up to 4 KiB plus its 4 KiB descriptor; a
  // tier that stores the bytes as they are: used_bytes.
  std::uint64_t allocated_bytes = 0;
  // Bytes new blocks can still take, where the tier keeps space of its own besides its blocks (NVMe:
  // its free extents; the superblock area is neither allocated nor free). Unset elsewhere: there it
  // is capacity_bytes - allocated_bytes.
  std::optional<std::uint64_t> free_bytes;
  std::uint64_t blocks = 0;
  std::uint64_t hits = 0, misses = 0, bytes_written = 0, bytes_read = 0, puts = 0;
  std::uint64_t evictions = 0, io_errors = 0, corruptions = 0, queue_depth = 0;
  std::uint64_t read_p50_ns = 0, read_p99_ns = 0, write_p50_ns = 0, write_p99_ns = 0;
  std::uint64_t reads = 0, writes = 0;
  // I/O requests the tier itself issued for reads (0: a tier that does not count them). NVMe:
  // fewer than the blocks it read when a GetBatch read adjacent blocks together (read_gap_bytes).
  std::uint64_t read_requests = 0;
  std::string detail;  // free text from the tier, e.g. "pinned: no (mlock refused)"; may be empty
};

TierStatsSnapshot SnapshotCounters(const TierCounters& c);
// Sets s->reads / writes and the p50 / p99 fields from the two histograms.
void SetLatencyFields(const LatencyHistogram& reads, const LatencyHistogram& writes, TierStatsSnapshot* s);

}  // namespace terrace
