#include "src/model/routing_stats.h"

#include <algorithm>
#include <cmath>

namespace terrace::model {

double EntropyBits(std::span<const std::int64_t> counts) {
  double total = 0.0;
  for (auto c : counts) total += static_cast<double>(c);
  if (total <= 0.0) return 0.0;
  double h = 0.0;
  for (auto c : counts) {
    if (c <= 0) continue;
    const double p = static_cast<double>(c) / total;
    h -= p * std::log2(p);
  }
  return h;
}

Result<RoutingStats> MeasureRouting(const Model& model, std::span<const int> tokens) {
  const ModelConfig& c = model.config();
  RoutingStats stats;
  std::vector<int> slot(static_cast<std::size_t>(c.num_hidden_layers), -1);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.IsDenseLayer(l)) continue;
    slot[static_cast<std::size_t>(l)] = static_cast<int>(stats.layers.size());
    LayerRouting lr;
    lr.layer = l;
    lr.counts.assign(static_cast<std::size_t>(c.num_experts), 0);
    stats.layers.push_back(std::move(lr));
  }
  SequenceState state = SequenceState::ForConfig(c);
  ForwardOptions o;
  o.all_logits = false;
  o.on_routing = [&](int layer, const Routing& r) {
    auto& lr = stats.layers[static_cast<std::size_t>(slot[static_cast<std::size_t>(layer)])];
    for (int id : r.ids) ++lr.counts[static_cast<std::size_t>(id)];
  };
  TERRACE_ASSIGN_OR_RETURN(Tensor logits, model.Forward(tokens, &state, o));
  (void)logits;
  stats.max_entropy_bits = c.num_experts > 0 ? std::log2(static_cast<double>(c.num_experts)) : 0.0;
  stats.min_experts_used = stats.layers.empty() ? 0 : c.num_experts;
  for (auto& lr : stats.layers) {
    lr.entropy_bits = EntropyBits(lr.counts);
    lr.experts_used = static_cast<int>(std::count_if(lr.counts.begin(), lr.counts.end(), [](auto x) { return x > 0; }));
    stats.mean_entropy_bits += lr.entropy_bits / static_cast<double>(stats.layers.size());
    stats.min_experts_used = std::min(stats.min_experts_used, lr.experts_used);
  }
  return stats;
}

}  // namespace terrace::model
