#include "src/experts/bench_regime.h"

#include <algorithm>

#include "terrace/experts.h"

namespace terrace::experts {

BenchRegime BenchRegimeOf(const model::ModelConfig& config) {
  BenchRegime r;
  for (int l = 0; l < config.num_hidden_layers; ++l) r.moe_layers += config.IsDenseLayer(l) ? 0 : 1;
  r.experts_per_layer = std::max(config.num_experts, 0);
  r.top_k = std::min(std::max(config.num_experts_per_token, 0), r.experts_per_layer);
  r.routed_expert_bytes = ExpertOffload::TotalExpertBytes(config);
  const auto blocks = static_cast<std::uint64_t>(r.moe_layers) * static_cast<std::uint64_t>(r.experts_per_layer);
  r.block_bytes = blocks == 0 ? 0 : r.routed_expert_bytes / blocks;
  r.all_miss_bytes_per_token = static_cast<std::uint64_t>(r.top_k) * static_cast<std::uint64_t>(r.moe_layers) * r.block_bytes;
  return r;
}

}  // namespace terrace::experts
