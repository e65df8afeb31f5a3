#include "tiers/hbm/emulated_hbm_tier.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "src/common/clock.h"

namespace terrace {
namespace {

void WaitUntilNs(std::uint64_t deadline_ns) {
  constexpr std::uint64_t kSpinBelowNs = 200'000;
  std::uint64_t now = SteadyNanos();
  if (now >= deadline_ns) return;
  if (deadline_ns - now > kSpinBelowNs) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(deadline_ns - now - kSpinBelowNs / 2));
  }
  while (SteadyNanos() < deadline_ns) {
  }
}

}  // namespace

Result<std::unique_ptr<EmulatedHbmTier>> EmulatedHbmTier::Create(const HbmTierOptions& options) {
  if (options.link.enabled && !(options.link.bandwidth_bytes_per_s > 0 && options.link.latency_us >= 0)) {
    return Status::InvalidArgument(fmt::format("hbm tier (emulated): the link model needs bandwidth_bytes_per_s > 0 "
                                               "and latency_us >= 0, got {} B/s and {} us; fix HbmTierOptions::link "
                                               "or disable it (link.enabled = false)",
                                               options.link.bandwidth_bytes_per_s, options.link.latency_us));
  }
  HostTierOptions host;
  host.capacity_bytes = options.capacity_bytes;
  host.chunk_bytes = std::min<std::uint64_t>(options.capacity_bytes, kChunkBytes);
  host.pin = false;
  host.logger = options.logger;
  auto h = HostTier::Create(host, "hbm (emulated)");
  if (!h.ok()) return h.status().WithContext("hbm tier (emulated)");
  return std::unique_ptr<EmulatedHbmTier>(new EmulatedHbmTier(options, std::move(h).value()));
}

EmulatedHbmTier::EmulatedHbmTier(const HbmTierOptions& options, std::unique_ptr<HostTier> host)
    : link_(options.link), host_(std::move(host)), caps_(host_->caps()) {
  caps_.id = TierId::kHbm;
  caps_.name = "hbm";
  caps_.emulated = true;
  caps_.memory = MemoryKind::kHost;
  caps_.reserves = false;  // every write goes through Put, which charges the link model
  caps_.device_buffers = true;
}

std::uint64_t EmulatedHbmTier::LinkNanos(std::uint64_t bytes) const {
  if (!link_.enabled) return 0;
  return static_cast<std::uint64_t>(link_.latency_us * 1e3 + static_cast<double>(bytes) / link_.bandwidth_bytes_per_s * 1e9);
}

void EmulatedHbmTier::ChargeLink(std::uint64_t start_ns, std::uint64_t bytes) {
  const std::uint64_t ns = LinkNanos(bytes);
  if (ns == 0) return;
  modelled_ns_.fetch_add(ns, std::memory_order_relaxed);
  WaitUntilNs(start_ns + ns);
}

Status EmulatedHbmTier::Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) {
  const std::uint64_t t0 = SteadyNanos();
  Status st = host_->Put(key, desc, data);
  if (!st.ok()) return st;
  ChargeLink(t0, data.size());
  latency_.write_latency.Record(SteadyNanos() - t0);
  return st;
}

Status EmulatedHbmTier::Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  const std::uint64_t t0 = SteadyNanos();
  BlockDesc got;
  Status st = host_->Get(key, out, &got);
  if (!st.ok()) return st;
  ChargeLink(t0, got.size);
  latency_.read_latency.Record(SteadyNanos() - t0);
  if (desc) *desc = got;
  return st;
}

std::vector<Status> EmulatedHbmTier::GetRangeBatch(std::span<RangeOp> ops) {
  std::vector<Status> st;
  st.reserve(ops.size());
  for (RangeOp& op : ops) {  // one at a time: each range pays the link's latency, as each Get does
    const std::uint64_t t0 = SteadyNanos();
    Status s = std::move(host_->GetRangeBatch(std::span<RangeOp>(&op, 1))[0]);
    if (s.ok()) {
      ChargeLink(t0, op.length);
      latency_.read_latency.Record(SteadyNanos() - t0);
    }
    st.push_back(std::move(s));
  }
  return st;
}

Result<BlockDesc> EmulatedHbmTier::PutDevice(const BlockKey& key, Codec codec, std::span<const std::byte> device_data) {
  const std::uint64_t t0 = SteadyNanos();
  const BlockDesc desc = DescribeBlock(device_data, codec);  // where the data is: host memory here
  TERRACE_RETURN_IF_ERROR(host_->Put(key, desc, device_data));
  latency_.write_latency.Record(SteadyNanos() - t0);
  return desc;
}

Status EmulatedHbmTier::GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) {
  const std::uint64_t t0 = SteadyNanos();
  Status st = host_->Get(key, device_out, desc);  // verifies the checksum as it copies
  if (st.ok()) latency_.read_latency.Record(SteadyNanos() - t0);
  return st;
}

TierStatsSnapshot EmulatedHbmTier::Stats() const {
  TierStatsSnapshot s = host_->Stats();
  s.name = "hbm (emulated)";
  s.emulated = true;
  TierStatsSnapshot lat = SnapshotCounters(latency_);
  s.read_p50_ns = lat.read_p50_ns;
  s.read_p99_ns = lat.read_p99_ns;
  s.write_p50_ns = lat.write_p50_ns;
  s.write_p99_ns = lat.write_p99_ns;
  s.detail = link_.enabled
                 ? fmt::format("emulated in host memory; link model {:.0f} GB/s + {:.1f} us; modelled link time {:.3f} ms",
                               link_.bandwidth_bytes_per_s / 1e9, link_.latency_us, static_cast<double>(modelled_link_ns()) / 1e6)
                 : std::string("emulated in host memory; link model off");
  return s;
}

}  // namespace terrace
