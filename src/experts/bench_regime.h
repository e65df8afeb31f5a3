// The expert-offload benchmark's regime figures for a model (docs/benchmarks.md, "Expert offload"):
// how many bytes of routed experts it has and what a token whose experts all miss must move. Derived
// from the config alone, so `terrace bench experts` and the tests agree by construction.
#pragma once

#include <cstdint>

#include "terrace/model_config.h"

namespace terrace::experts {

struct BenchRegime {
  int moe_layers = 0;
  int experts_per_layer = 0;
  int top_k = 0;
  std::uint64_t block_bytes = 0;               // one expert's store block: w1, w2, w3 MXFP4 + scales + header
  std::uint64_t routed_expert_bytes = 0;       // moe_layers x experts_per_layer x block_bytes
  std::uint64_t all_miss_bytes_per_token = 0;  // top_k x moe_layers x block_bytes

  // Seconds a token whose experts all miss spends moving them: off the drive, then over the link
  // (bytes per second each; both must be positive).
  double AllMissSeconds(double drive_bytes_per_s, double link_bytes_per_s) const {
    const auto b = static_cast<double>(all_miss_bytes_per_token);
    return b / drive_bytes_per_s + b / link_bytes_per_s;
  }
};

BenchRegime BenchRegimeOf(const model::ModelConfig& config);

}  // namespace terrace::experts
