#include "tier_factories.h"

#include "store/fake_tier.h"
#include "terrace/options.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::conformance {
namespace {

Result<std::unique_ptr<Tier>> MakeHostWith(std::uint64_t capacity, std::uint64_t stream_get_min_bytes) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = capacity / 4;  // several chunks: exercises lazy growth
  o.stream_get_min_bytes = stream_get_min_bytes;
  auto t = HostTier::Create(o);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t).value());
}

Result<std::unique_ptr<Tier>> MakeHost(const std::filesystem::path&, std::uint64_t capacity) {
  return MakeHostWith(capacity, 0);
}

// Every get of a block of >= 256 KiB streams into the caller's buffer.
Result<std::unique_ptr<Tier>> MakeHostStreamingGets(const std::filesystem::path&, std::uint64_t capacity) {
  return MakeHostWith(capacity, 1);
}

Result<std::unique_ptr<Tier>> MakeHbmEmulated(const std::filesystem::path&, std::uint64_t capacity) {
  HbmTierOptions o;
  o.mode = HbmMode::kEmulated;
  o.capacity_bytes = capacity;
  o.link.enabled = false;  // speed; the link model has its own tests (tests/hbm)
  return CreateHbmTier(o);
}

Result<std::unique_ptr<Tier>> MakeFaultWrappedHost(const std::filesystem::path& dir, std::uint64_t capacity) {
  auto inner = MakeHost(dir, capacity);
  if (!inner.ok()) return inner.status();
  return std::unique_ptr<Tier>(std::make_unique<FaultInjectingTier>(std::move(inner).value()));
}

Result<std::unique_ptr<Tier>> MakeNvme(const std::filesystem::path& dir, std::uint64_t capacity) {
  NvmeTierOptions o;
  o.path = dir / "nvme";
  o.capacity_bytes = capacity;
  o.create_if_missing = true;
  auto t = NvmeTier::Open(o);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t).value());
}

Result<std::unique_ptr<Tier>> MakeHbmCuda(const std::filesystem::path&, std::uint64_t capacity) {
  HbmTierOptions o;
  o.mode = HbmMode::kCuda;
  o.capacity_bytes = capacity;
  return CreateHbmTier(o);
}

// The test double the store tests compose stores from (tests/store/fake_tier.h), as a memory tier
// and as a non-addressable (NVMe-like) one.
Result<std::unique_ptr<Tier>> MakeFakeMemory(const std::filesystem::path&, std::uint64_t capacity) {
  return std::unique_ptr<Tier>(std::make_unique<testing::FakeTier>(TierId::kHost, capacity));
}
Result<std::unique_ptr<Tier>> MakeFakeNvme(const std::filesystem::path&, std::uint64_t capacity) {
  return std::unique_ptr<Tier>(std::make_unique<testing::FakeTier>(TierId::kNvme, capacity));
}

bool CudaDevicePresent() {
  HbmTierOptions o;
  o.mode = HbmMode::kCuda;
  o.capacity_bytes = 1 * kMiB;
  return CreateHbmTier(o).ok();
}

}  // namespace

const std::vector<TierFactory>& TierFactories() {
  static const std::vector<TierFactory> table = [] {
    std::vector<TierFactory> t = {
        {"host", MakeHost},
        {"host, streaming gets", MakeHostStreamingGets},
        {"hbm-emulated", MakeHbmEmulated},
        {"fault(host), nothing armed", MakeFaultWrappedHost},
        {"nvme", MakeNvme},
        {"fake (store tests' double, memory)", MakeFakeMemory},
        {"fake (store tests' double, not addressable)", MakeFakeNvme},
    };
    // The CUDA HBM tier runs only where a device exists (the CUDA build's hbm tests say so when not).
    if (CudaDevicePresent()) t.push_back({"hbm-cuda", MakeHbmCuda});
    return t;
  }();
  return table;
}

}  // namespace terrace::conformance
