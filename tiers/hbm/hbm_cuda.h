// Internal: the CUDA HBM tier's factory. Implemented by hbm_cuda.cpp in CUDA builds and by
// hbm_cuda_stub.cpp otherwise (which always returns Unavailable).
#pragma once

#include <memory>

#include "terrace/options.h"
#include "terrace/tier.h"

namespace terrace::tiers {

Result<std::unique_ptr<Tier>> CreateCudaHbmTier(const HbmTierOptions& options);

}  // namespace terrace::tiers
