// Builds the real tiers a StoreOptions names. Internal to the store.
#pragma once

#include <array>
#include <memory>

#include "terrace/options.h"
#include "terrace/tier.h"

namespace terrace::store_internal {

// Index = TierId; null where a tier is not configured (hbm.mode == kOff, empty nvme.path,
// host.capacity_bytes == 0). Each tier whose options have no logger gets options.logger.
Result<std::array<std::unique_ptr<Tier>, kNumTiers>> BuildTiers(const StoreOptions& options);

}  // namespace terrace::store_internal
