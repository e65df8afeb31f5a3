// The table of tiers the conformance suite runs over. Each factory makes a fresh, empty tier whose
// files (if any) live under `dir`, with roughly `capacity_bytes` of space.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "terrace/tier.h"

namespace terrace::conformance {

struct TierFactory {
  std::string name;
  std::function<Result<std::unique_ptr<Tier>>(const std::filesystem::path& dir, std::uint64_t capacity_bytes)> make;
};

const std::vector<TierFactory>& TierFactories();

}  // namespace terrace::conformance
