#include "tier_factories.h"

#include "terrace/options.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::conformance {
namespace {

Result<std::unique_ptr<Tier>> MakeHost(const std::filesystem::path&, std::uint64_t capacity) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = capacity / 4;  // several chunks: exercises lazy growth
  auto t = HostTier::Create(o);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t).value());
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

}  // namespace

const std::vector<TierFactory>& TierFactories() {
  static const std::vector<TierFactory> table = {
      {"host", MakeHost},
      {"hbm-emulated", MakeHbmEmulated},
      {"fault(host), nothing armed", MakeFaultWrappedHost},
      {"nvme", MakeNvme},
  };
  return table;
}

}  // namespace terrace::conformance
