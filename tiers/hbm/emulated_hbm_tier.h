// EmulatedHbmTier: the HBM tier in host memory, for machines without a CUDA device.
//
// Storage is a HostTier (unpinned; arena chunks of min(capacity, 256 MiB)). When the link model is
// enabled, every Put and Get takes at least latency + bytes / bandwidth of wall time from its start
// (the real copy overlaps the modelled time: a 1 MiB copy at 55 GB/s lasts >= 21 us); the
// waiting is a busy-wait below 200 us and a sleep above. The modelled time is accounted in
// modelled_link_ns() and in Stats().detail. caps(): id kHbm, emulated true, memory kHost (the
// resident pointer is a host pointer), device_buffers true. Stats().name is "hbm (emulated)".
// Device buffers: "device memory" here is host memory standing in for it (tests model GPU
// buffers with it). PutDevice / GetDevice copy without the link model (a device-to-device copy
// does not cross the host link); PutDevice hashes the bytes it stores, GetDevice verifies them
// as Get does.
// Thread-safety: all methods.
#pragma once

#include <atomic>
#include <memory>

#include "terrace/options.h"
#include "terrace/tier.h"
#include "tiers/host/host_tier.h"

namespace terrace {

class EmulatedHbmTier final : public Tier {
 public:
  // The host memory behind it comes in chunks of this many bytes (fewer for a smaller tier).
  static constexpr std::uint64_t kChunkBytes = 256ull << 20;
  static Result<std::unique_ptr<EmulatedHbmTier>> Create(const HbmTierOptions& options);

  const TierCaps& caps() const override { return caps_; }
  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override;
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override;
  // The host tier's ranged copy (no checksum, no whole-block copy), each OK range charged to the
  // link model for its length as Get is for a whole block.
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override;
  Result<BlockDesc> PutDevice(const BlockKey& key, Codec codec, std::span<const std::byte> device_data) override;
  Status GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) override;
  Result<BlockDesc> Lookup(const BlockKey& key) const override { return host_->Lookup(key); }
  Status Erase(const BlockKey& key) override { return host_->Erase(key); }
  Status Pin(const BlockKey& key) override { return host_->Pin(key); }
  Status Unpin(const BlockKey& key) override { return host_->Unpin(key); }
  const std::byte* ResidentPtr(const BlockKey& key) const override { return host_->ResidentPtr(key); }
  std::uint64_t used_bytes() const override { return host_->used_bytes(); }
  std::uint64_t allocated_bytes() const override { return host_->allocated_bytes(); }
  std::uint64_t block_count() const override { return host_->block_count(); }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override {
    host_->ForEach(fn);
  }
  TierStatsSnapshot Stats() const override;

  // Total modelled link time charged so far, in ns (0 when the link model is off).
  std::uint64_t modelled_link_ns() const { return modelled_ns_.load(std::memory_order_relaxed); }
  // The modelled duration of one copy of `bytes` bytes, in ns (0 when the link model is off).
  std::uint64_t LinkNanos(std::uint64_t bytes) const;

 private:
  EmulatedHbmTier(const HbmTierOptions& options, std::unique_ptr<HostTier> host);
  void ChargeLink(std::uint64_t start_ns, std::uint64_t bytes);

  const LinkModel link_;
  std::unique_ptr<HostTier> host_;
  TierCaps caps_;
  std::atomic<std::uint64_t> modelled_ns_{0};
  mutable TierCounters latency_;  // only the histograms: whole-op times including the link wait
};

}  // namespace terrace
