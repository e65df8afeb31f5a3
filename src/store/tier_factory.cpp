#include "src/store/tier_factory.h"

#include <fmt/format.h>

#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::store_internal {

Result<std::array<std::unique_ptr<Tier>, kNumTiers>> BuildTiers(const StoreOptions& store_options) {
  // A tier without its own logger logs where the store does.
  StoreOptions options = store_options;
  for (std::shared_ptr<Logger>* l : {&options.hbm.logger, &options.host.logger, &options.nvme.logger}) {
    if (!*l) *l = store_options.logger;
  }
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  if (options.hbm.mode != HbmMode::kOff) {
    auto hbm = CreateHbmTier(options.hbm);
    if (!hbm.ok()) return hbm.status().WithContext("open store: hbm tier (set hbm.mode = kOff to run without it)");
    tiers[static_cast<int>(TierId::kHbm)] = std::move(*hbm);
  }
  if (options.host.capacity_bytes > 0) {
    auto host = HostTier::Create(options.host);
    if (!host.ok()) return host.status().WithContext("open store: host tier");
    tiers[static_cast<int>(TierId::kHost)] = std::move(*host);
  }
  if (!options.nvme.path.empty()) {
    auto nvme = NvmeTier::Open(options.nvme);
    if (!nvme.ok()) {
      return nvme.status().WithContext(fmt::format("open store: nvme tier at {}", options.nvme.path.string()));
    }
    tiers[static_cast<int>(TierId::kNvme)] = std::move(*nvme);
  }
  return tiers;
}

}  // namespace terrace::store_internal
