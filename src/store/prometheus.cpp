// Stats snapshots and their Prometheus text exposition (format 0.0.4).
#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
namespace {

// The histogram's nominal bucket bounds, in nanoseconds (1 us to 10 s). Each is exposed as the
// upper edge of the last LatencyHistogram bucket at or below it (1 us: le="0.000000959"), as the
// exact count of observations <= le, never one that holds some values above it.
constexpr std::uint64_t kLatencyBoundsNanos[] = {
    1'000,      2'500,      5'000,       10'000,      25'000,      50'000,        100'000,       250'000,
    500'000,    1'000'000,  2'500'000,   5'000'000,   10'000'000,  25'000'000,    50'000'000,    100'000'000,
    250'000'000, 500'000'000, 1'000'000'000, 2'500'000'000, 5'000'000'000, 10'000'000'000};

void Header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// A label value as the text format requires: backslash, double quote and line feed escaped.
std::string LabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// `nanos` as seconds in decimal, exactly (no rounding: an le bound must not move).
std::string ExactSeconds(std::uint64_t nanos) {
  std::string s = fmt::format("{}.{:09}", nanos / 1'000'000'000, nanos % 1'000'000'000);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

// One consistent pass over the buckets: the le counts are cumulative and +Inf equals _count.
void Histogram(std::string& out, std::string_view name, std::string_view tier_name, const LatencyHistogram& h) {
  const std::string tier = LabelValue(tier_name);
  std::uint64_t counts[LatencyHistogram::kBuckets];
  std::uint64_t total = 0;
  for (int i = 0; i < LatencyHistogram::kBuckets; ++i) {
    counts[i] = h.BucketCount(i);
    total += counts[i];
  }
  int b = 0;
  std::uint64_t cumulative = 0;
  for (std::uint64_t bound_ns : kLatencyBoundsNanos) {
    while (b < LatencyHistogram::kBuckets && LatencyHistogram::BucketUpperBound(b) <= bound_ns) cumulative += counts[b++];
    // b > 0: the first bucket (0 ns) lies below every bound.
    const std::uint64_t edge = LatencyHistogram::BucketUpperBound(b - 1);
    out += fmt::format("{}_bucket{{tier=\"{}\",le=\"{}\"}} {}\n", name, tier, ExactSeconds(edge), cumulative);
  }
  out += fmt::format("{}_bucket{{tier=\"{}\",le=\"+Inf\"}} {}\n", name, tier, total);
  out += fmt::format("{}_sum{{tier=\"{}\"}} {:.9f}\n", name, tier, static_cast<double>(h.sum_nanos()) / 1e9);
  out += fmt::format("{}_count{{tier=\"{}\"}} {}\n", name, tier, total);
}

}  // namespace

StoreStats StoreImpl::Stats() const {
  StoreStats st;
  auto ld = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  for (int i = 0; i < slot_count(); ++i) {
    const Tier& t = tier(i);
    TierStatsSnapshot s = t.Stats();
    const TierCaps& caps = t.caps();
    const TierCounters& m = slot(i).measured;
    s.name = SlotName(i);
    s.emulated = caps.emulated;
    s.host_addressable = caps.memory == MemoryKind::kHost;
    s.capacity_bytes = caps.capacity_bytes;
    s.used_bytes = t.used_bytes();
    if (s.allocated_bytes < s.used_bytes) s.allocated_bytes = s.used_bytes;  // a tier that does not report it
    s.blocks = t.block_count();
    s.hits = ld(m.hits);
    s.misses = ld(m.misses);
    s.evictions = ld(m.evictions);
    s.corruptions = std::max(s.corruptions, ld(m.corruptions));
    s.io_errors = std::max(s.io_errors, ld(m.io_errors));
    SetLatencyFields(m.read_latency, m.write_latency, &s);
    st.slots.push_back(std::move(s));
  }
  for (int k = 0; k < kNumTiers; ++k) {  // the standard view: first slot of each kind
    const int i = SlotOf(static_cast<TierId>(k));
    if (i < 0) continue;
    st.present[static_cast<std::size_t>(k)] = true;
    st.tiers[static_cast<std::size_t>(k)] = st.slots[static_cast<std::size_t>(i)];
  }
  {
    MutexLock lock(&mu_);
    st.blocks = entries_.size();
    st.eviction_policy = std::string(Policy(0).name());
  }
  st.promotions = ld(promotions_);
  st.demotions = ld(demotions_);
  st.evictions = ld(evictions_);
  st.dropped_blocks = ld(dropped_blocks_);
  st.dedup_hits = ld(dedup_hits_);
  st.lower_tier_reads = ld(lower_tier_reads_);
  st.range_reads = ld(range_reads_);
  st.range_read_bytes = ld(range_read_bytes_);
  st.put_dedup_hits = ld(put_dedup_hits_);
  st.puts_placed_lower = ld(puts_placed_lower_);
  st.prefetch_issued = ld(prefetch_issued_);
  st.prefetch_useful = ld(prefetch_useful_);
  st.prefetch_late = ld(prefetch_late_);
  st.corruptions_dropped = ld(corruptions_dropped_);
  st.direct_transfers = ld(direct_transfers_);
  st.direct_transfer_bytes = ld(direct_transfer_bytes_);
  st.staged_transfers = ld(staged_transfers_);
  st.staged_transfer_bytes = ld(staged_transfer_bytes_);
  st.device_copies = ld(device_copies_);
  st.device_copy_bytes = ld(device_copy_bytes_);
  BouncePool::Memory bounce = bounce_.memory();
  bounce += batch_bounce_.memory();
  st.bounce_cuda_registered = bounce.cuda_registered;
  st.bounce_locked = bounce.locked;
  st.bounce_pageable = bounce.pageable;
  st.bounce_memory = std::string(bounce.Name());
  return st;
}

std::string StoreImpl::PrometheusText() const {
  StoreStats st = Stats();
  std::string out;
  struct TierMetric {
    const char* name;
    const char* type;
    const char* help;
    std::uint64_t TierStatsSnapshot::*field;
  };
  static constexpr TierMetric kTierMetrics[] = {
      {"terrace_tier_hits_total", "counter", "Caller reads (Get, GetBatch, GetRanges, Acquire) served from the tier; prefetches not counted.", &TierStatsSnapshot::hits},
      {"terrace_tier_misses_total", "counter", "Caller reads that found no copy in the tier (no readable copy anywhere: a miss in every tier).", &TierStatsSnapshot::misses},
      {"terrace_tier_written_bytes_total", "counter", "Bytes written into the tier.", &TierStatsSnapshot::bytes_written},
      {"terrace_tier_read_bytes_total", "counter", "Bytes read out of the tier.", &TierStatsSnapshot::bytes_read},
      {"terrace_tier_read_requests_total", "counter",
       "Read I/O requests the tier issued (NVMe: adjacent blocks of a batch share one).", &TierStatsSnapshot::read_requests},
      {"terrace_tier_puts_total", "counter", "Blocks written into the tier.", &TierStatsSnapshot::puts},
      {"terrace_tier_evictions_total", "counter", "Copies evicted from the tier.", &TierStatsSnapshot::evictions},
      {"terrace_tier_io_errors_total", "counter", "I/O errors the tier reported.", &TierStatsSnapshot::io_errors},
      {"terrace_tier_corruptions_total", "counter", "Copies dropped after failing validation.",
       &TierStatsSnapshot::corruptions},
      {"terrace_tier_queue_depth", "gauge", "I/O requests in flight.", &TierStatsSnapshot::queue_depth},
      {"terrace_tier_capacity_bytes", "gauge", "Tier capacity.", &TierStatsSnapshot::capacity_bytes},
      {"terrace_tier_used_bytes", "gauge", "Bytes of the blocks held (their sizes summed).", &TierStatsSnapshot::used_bytes},
      {"terrace_tier_allocated_bytes", "gauge",
       "Space the blocks take (host, HBM: whole pages, 4 KiB, larger on a CUDA HBM tier over 16 GiB; NVMe: data "
       "rounded up to 4 KiB plus a 4 KiB descriptor each); compare with capacity.",
       &TierStatsSnapshot::allocated_bytes},
      {"terrace_tier_blocks", "gauge", "Blocks resident.", &TierStatsSnapshot::blocks},
  };
  for (const auto& m : kTierMetrics) {
    Header(out, m.name, m.type, m.help);
    for (const TierStatsSnapshot& s : st.slots) {
      out += fmt::format("{}{{tier=\"{}\"}} {}\n", m.name, LabelValue(s.name), s.*m.field);
    }
  }
  Header(out, "terrace_tier_emulated", "gauge", "1 when the tier runs in host memory in place of a device.");
  for (const TierStatsSnapshot& s : st.slots) {
    out += fmt::format("terrace_tier_emulated{{tier=\"{}\"}} {}\n", LabelValue(s.name), s.emulated ? 1 : 0);
  }
  Header(out, "terrace_tier_read_latency_seconds", "histogram", "Latency of the store's reads from the tier.");
  for (int i = 0; i < slot_count(); ++i) {
    Histogram(out, "terrace_tier_read_latency_seconds", SlotName(i), slot(i).measured.read_latency);
  }
  Header(out, "terrace_tier_write_latency_seconds", "histogram", "Latency of the store's writes into the tier.");
  for (int i = 0; i < slot_count(); ++i) {
    Histogram(out, "terrace_tier_write_latency_seconds", SlotName(i), slot(i).measured.write_latency);
  }
  const std::pair<const char*, std::pair<const char*, std::uint64_t>> kStore[] = {
      {"terrace_store_promotions_total", {"Copies moved or copied to a faster tier.", st.promotions}},
      {"terrace_store_demotions_total", {"Victims written to a slower tier on eviction.", st.demotions}},
      {"terrace_store_dedup_hits_total", {"Fetches that joined an in-flight read of the same key.", st.dedup_hits}},
      {"terrace_store_lower_tier_reads_total", {"Reads issued below the put tier.", st.lower_tier_reads}},
      {"terrace_store_range_reads_total", {"Ranged reads (parts of blocks) answered.", st.range_reads}},
      {"terrace_store_range_read_bytes_total", {"Bytes of ranged reads.", st.range_read_bytes}},
      {"terrace_store_put_dedup_hits_total", {"Puts of bytes identical to the stored block.", st.put_dedup_hits}},
      {"terrace_store_puts_placed_lower_total",
       {"Write-through Puts stored in the lowest tier only, their target tier having no room.",
        st.puts_placed_lower}},
      {"terrace_store_prefetch_issued_total", {"Prefetch items that moved a block.", st.prefetch_issued}},
      {"terrace_store_prefetch_useful_total", {"Prefetched blocks later read by a Get.", st.prefetch_useful}},
      {"terrace_store_prefetch_late_total", {"Gets that waited on an in-flight prefetch.", st.prefetch_late}},
      {"terrace_store_corruptions_dropped_total", {"Copies dropped for failing their checksum.", st.corruptions_dropped}},
      {"terrace_store_direct_transfers_total",
       {"Blocks moved between tiers, or read from a slower tier into a caller's buffer, without a store-side copy.",
        st.direct_transfers}},
      {"terrace_store_direct_transfer_bytes_total", {"Bytes of direct transfers.", st.direct_transfer_bytes}},
      {"terrace_store_staged_transfers_total",
       {"Blocks moved between tiers, or read from a slower tier into a caller's buffer, through a store-side copy.",
        st.staged_transfers}},
      {"terrace_store_staged_transfer_bytes_total", {"Bytes of staged transfers.", st.staged_transfer_bytes}},
      {"terrace_store_device_copies_total", {"Blocks copied device to device into a caller's device buffer.", st.device_copies}},
      {"terrace_store_device_copy_bytes_total", {"Bytes of device copies.", st.device_copy_bytes}},
  };
  for (const auto& [name, hv] : kStore) {
    Header(out, name, "counter", hv.first);
    out += fmt::format("{} {}\n", name, hv.second);
  }
  Header(out, "terrace_store_evictions_total", "counter", "Copies evicted, by eviction policy.");
  out += fmt::format("terrace_store_evictions_total{{policy=\"{}\"}} {}\n", st.eviction_policy, st.evictions);
  Header(out, "terrace_store_dropped_blocks_total", "counter",
         "Blocks whose last copy was evicted (StoreOptions::lowest_tier_evicts: a cache).");
  out += fmt::format("terrace_store_dropped_blocks_total {}\n", st.dropped_blocks);
  Header(out, "terrace_store_bounce_buffers", "gauge", "Staging buffers allocated, by the memory they are in.");
  out += fmt::format("terrace_store_bounce_buffers{{memory=\"cuda-registered\"}} {}\n", st.bounce_cuda_registered);
  out += fmt::format("terrace_store_bounce_buffers{{memory=\"mlock\"}} {}\n", st.bounce_locked);
  out += fmt::format("terrace_store_bounce_buffers{{memory=\"pageable\"}} {}\n", st.bounce_pageable);
  Header(out, "terrace_store_blocks", "gauge", "Distinct blocks stored.");
  out += fmt::format("terrace_store_blocks {}\n", st.blocks);
  return out;
}

}  // namespace terrace::store_internal
