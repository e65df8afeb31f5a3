#include "tiers/hbm/hbm_tier.h"

#include <string>
#include <string_view>

#include <fmt/format.h>

#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/hbm/hbm_cuda.h"
#include "tiers/host/pinned_memory.h"

namespace terrace {
namespace {

Result<std::unique_ptr<Tier>> Emulated(const HbmTierOptions& o, std::string_view why) {
  auto t = EmulatedHbmTier::Create(o);
  if (!t.ok()) return t.status();
  const std::string link =
      o.link.enabled ? fmt::format("link model {:.0f} GB/s", o.link.bandwidth_bytes_per_s / 1e9) : "link model off";
  LoggerOrDefault(o.logger)->Log(LogLevel::kInfo, "hbm", fmt::format("emulated in host memory ({}); {}", why, link));
  return std::unique_ptr<Tier>(std::move(t).value());
}

}  // namespace

bool HbmCudaDeviceAvailable() { return tiers::CudaDeviceCount() > 0; }

Result<std::unique_ptr<Tier>> CreateHbmTier(const HbmTierOptions& o) {
  switch (o.mode) {
    case HbmMode::kOff:
      return Status::InvalidArgument("hbm tier: mode is off; do not create an HBM tier (or pick auto/cuda/emulated)");
    case HbmMode::kEmulated:
      return Emulated(o, "mode emulated");
    case HbmMode::kCuda:
      if (!HbmCudaDeviceAvailable()) {
        return Status::Unavailable(fmt::format("hbm tier: mode cuda but no CUDA device is usable ({}); use mode "
                                               "auto or emulated on this machine",
                                               tiers::CudaDeviceProbe().why_none));
      }
      return tiers::CreateCudaHbmTier(o);
    case HbmMode::kAuto:
      if (HbmCudaDeviceAvailable()) return tiers::CreateCudaHbmTier(o);
      return Emulated(o, "no CUDA device: " + tiers::CudaDeviceProbe().why_none);
  }
  return Status::InvalidArgument(fmt::format("hbm tier: unknown mode {}", static_cast<int>(o.mode)));
}

}  // namespace terrace
