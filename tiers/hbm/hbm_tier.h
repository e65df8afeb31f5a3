// The HBM tier: GPU device memory, or host memory standing in for it.
//
// CreateHbmTier picks the implementation from HbmTierOptions::mode:
// - kAuto: CUDA device memory when this build has CUDA and cudaGetDeviceCount() > 0, else emulated.
// - kCuda: CUDA device memory; Unavailable when the build has no CUDA or no device is present.
// - kEmulated: host memory with the link model (emulated_hbm_tier.h).
// - kOff: InvalidArgument (the caller should not create a tier).
// An emulated tier (kEmulated, or kAuto without a device) logs one kInfo line saying so, and why, to
// HbmTierOptions::logger (stderr when null) each time one is created.
// The CUDA tier (hbm_cuda.cpp): one cudaMalloc of capacity_bytes sub-allocated by the shared
// BlockArena, copy_streams streams with double-buffered pinned staging (or direct copies when the
// caller's buffer is already pinned); ResidentPtr is a device pointer (caps().memory == kDevice);
// Get verifies the checksum on the host side; GetRangeBatch copies just each range out, unhashed
// (ranged reads are unverified, terrace/tier.h). Device pointers (caps().device_buffers): Put / Get
// with a device pointer copy device to device; PutDevice / GetDevice hash the stored bytes from a
// staged copy (no kernel), never bouncing the caller's buffer through the host. CUDA errors become Status (IoError / Unavailable)
// carrying the CUDA error string; nothing aborts.
#pragma once

#include <memory>

#include "terrace/options.h"
#include "terrace/tier.h"

namespace terrace {

Result<std::unique_ptr<Tier>> CreateHbmTier(const HbmTierOptions& options);

// True when this build has CUDA and at least one device is usable (cached).
bool HbmCudaDeviceAvailable();

}  // namespace terrace
