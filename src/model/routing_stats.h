// Expert-usage statistics over a prompt: how often each routed expert of each MoE layer is chosen
// and the entropy of that usage (bits; log2(num_experts) when perfectly balanced, 0 when one expert
// takes everything). Used by `terrace model init` and `terrace model run --json`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "src/model/model.h"
#include "terrace/status.h"

namespace terrace::model {

struct LayerRouting {
  int layer = 0;                      // 0-based
  std::vector<std::int64_t> counts;   // [num_experts]: token-slots routed to each expert
  double entropy_bits = 0.0;
  int experts_used = 0;               // experts with count > 0
};

struct RoutingStats {
  std::vector<LayerRouting> layers;   // MoE layers only, in order
  double mean_entropy_bits = 0.0;
  double max_entropy_bits = 0.0;      // log2(num_experts)
  int min_experts_used = 0;           // over layers
};

// Entropy in bits of the distribution counts / sum(counts) (0 for all-zero counts).
double EntropyBits(std::span<const std::int64_t> counts);

// Runs `tokens` through a fresh sequence of `model` (prefill) and tallies its routing.
Result<RoutingStats> MeasureRouting(const Model& model, std::span<const int> tokens);

}  // namespace terrace::model
