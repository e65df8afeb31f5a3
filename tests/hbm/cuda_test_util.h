// Shared by the CUDA tests (test_hbm_cuda, test_hbm_store_cuda).
#pragma once

#include <catch2/catch.hpp>

#include <iostream>

#include "tiers/hbm/hbm_tier.h"

namespace terrace::testing {

// True (after printing the line ctest's SKIP_REGULAR_EXPRESSION matches) when no CUDA device is
// usable; the case should return at once.
inline bool SkipWithoutDevice() {
  if (HbmCudaDeviceAvailable()) return false;
  std::cout << "SKIPPED: no CUDA device" << std::endl;
  SUCCEED("SKIPPED: no CUDA device");
  return true;
}

}  // namespace terrace::testing
