#include "tiers/hbm/hbm_cuda.h"

namespace terrace::tiers {

Result<std::unique_ptr<Tier>> CreateCudaHbmTier(const HbmTierOptions& options) {
  (void)options;
  return Status::Unavailable("hbm tier: this Terrace build has no CUDA support; rebuild with -DTERRACE_CUDA=ON "
                             "on a machine with the CUDA toolkit, or use HbmMode::kEmulated");
}

}  // namespace terrace::tiers
