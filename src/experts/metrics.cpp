// ExpertMetrics as CLI text, JSON and Prometheus text.
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "terrace/experts.h"

namespace terrace::experts {
namespace {

// A ratio that may be undefined (PredictionCounts): 3 decimals, or "n/a".
std::string RatioText(std::optional<double> v) { return v ? fmt::format("{:.3f}", *v) : std::string("n/a"); }

// The same in JSON: the number, or null.
nlohmann::json RatioJson(std::optional<double> v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }

// One Prometheus sample of `name` for `layer`; none when `v` is undefined (no sample, not NaN).
std::string RatioSample(std::string_view name, int layer, std::optional<double> v) {
  return v ? fmt::format("terrace_experts_{}{{layer=\"{}\"}} {}\n", name, layer, *v) : std::string();
}

}  // namespace

double LayerMetrics::hit_rate() const {
  const std::uint64_t n = hits + late_hits + misses;
  return n == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(n);
}

std::string ExpertMetrics::ToText() const {
  std::string out;
  out += fmt::format("experts: policy {}, predictor {}, cache {:.2f} MiB of {:.2f} MiB routed experts ({:.1f}%)\n",
                     policy, predictor, static_cast<double>(budget_bytes) / (1 << 20),
                     static_cast<double>(total_expert_bytes) / (1 << 20),
                     total_expert_bytes ? 100.0 * static_cast<double>(budget_bytes) / static_cast<double>(total_expert_bytes) : 0.0);
  out += fmt::format("experts: hit rate {:.3f} ({} hits, {} late, {} misses); prediction precision {} recall {}\n",
                     hit_rate, hits, late_hits, misses, RatioText(prediction.precision_if_defined()),
                     RatioText(prediction.recall_if_defined()));
  out += fmt::format("experts: stall {:.3f} ms per token ({} tokens, {} steps); demand {:.2f} MiB, speculative {:.2f} MiB "
                     "moved ({:.2f} MiB evicted unused, {:.2f} MiB not used yet); prefetches {} issued, {} cancelled, {} "
                     "skipped; {} evictions, {} dropped as shared; {} corrupt copies re-read\n",
                     stall_ns_per_token / 1e6, tokens, steps, static_cast<double>(demand_bytes) / (1 << 20),
                     static_cast<double>(speculative_bytes) / (1 << 20),
                     static_cast<double>(speculative_wasted_bytes) / (1 << 20),
                     static_cast<double>(speculative_unused_bytes) / (1 << 20), prefetches_issued, prefetches_cancelled,
                     prefetches_skipped, evictions, shared_drops, corrupt_copies_reread);
  out += fmt::format("experts: load max/mean {:.2f}, cv {:.3f}, {} hot experts (> {:g}x their layer's mean)\n",
                     load_mean > 0 ? load_max / load_mean : 0.0, load_cv, hot_experts, hot_factor);
  {
    const ExpertScheduleMetrics& d = schedule;
    out += fmt::format("experts: loads outstanding {:.3f} s; speculative {} landed ({:.2f} ms issue-to-landing), {} chosen by "
                       "their layer ({} still in flight then), issued {:.2f} layers / {:.2f} ms before; {} evicted unused "
                       "({} before their predicted use); {} selection batches, {} behind speculation\n",
                       static_cast<double>(d.load_busy_ns) / 1e9, d.spec_landed,
                       d.spec_landed ? static_cast<double>(d.spec_load_ns) / 1e6 / static_cast<double>(d.spec_landed) : 0.0,
                       d.spec_used, d.spec_late,
                       d.spec_used ? static_cast<double>(d.spec_lead_layers) / static_cast<double>(d.spec_used) : 0.0,
                       d.spec_used ? static_cast<double>(d.spec_lead_ns) / 1e6 / static_cast<double>(d.spec_used) : 0.0,
                       d.spec_evicted_unused, d.spec_evicted_before_target, d.selection_batches, d.selection_behind_spec);
  }
  for (const auto& l : layers) {
    std::string hot;
    for (int e : l.hot_experts) hot += fmt::format("{}{}", hot.empty() ? "" : ",", e);
    out += fmt::format("  layer {:>3}: hit {:.3f} (late {}, miss {}), precision {} recall {}, load max/mean {:.2f} "
                       "cv {:.3f}{}\n",
                       l.layer, l.hit_rate(), l.late_hits, l.misses, RatioText(l.prediction.precision_if_defined()),
                       RatioText(l.prediction.recall_if_defined()),
                       l.load_mean > 0 ? l.load_max / l.load_mean : 0.0, l.load_cv, hot.empty() ? "" : ", hot " + hot);
  }
  return out;
}

std::string ExpertMetrics::ToJson() const {
  nlohmann::json j;
  j["policy"] = policy;
  j["predictor"] = predictor;
  j["budget_bytes"] = budget_bytes;
  j["total_expert_bytes"] = total_expert_bytes;
  j["resident_bytes"] = resident_bytes;
  j["hits"] = hits;
  j["late_hits"] = late_hits;
  j["misses"] = misses;
  j["hit_rate"] = hit_rate;
  j["precision"] = RatioJson(prediction.precision_if_defined());  // null: nothing was predicted
  j["recall"] = RatioJson(prediction.recall_if_defined());        // null: nothing was routed
  j["tokens"] = tokens;
  j["steps"] = steps;
  j["stall_ns"] = stall_ns;
  j["stall_ns_per_token"] = stall_ns_per_token;
  j["demand_bytes"] = demand_bytes;
  j["speculative_bytes"] = speculative_bytes;
  j["speculative_wasted_bytes"] = speculative_wasted_bytes;
  j["speculative_unused_bytes"] = speculative_unused_bytes;
  j["loads_from"] = nlohmann::json::object();
  for (int t = 0; t < kNumTiers; ++t) {
    const auto i = static_cast<std::size_t>(t);
    j["loads_from"][std::string(TierName(static_cast<TierId>(t)))] = {{"loads", loads_from[i]},
                                                                     {"bytes", loaded_bytes_from[i]}};
  }
  j["prefetches_issued"] = prefetches_issued;
  j["prefetches_cancelled"] = prefetches_cancelled;
  j["prefetches_skipped"] = prefetches_skipped;
  j["evictions"] = evictions;
  j["shared_drops"] = shared_drops;
  j["corrupt_copies_reread"] = corrupt_copies_reread;
  j["load_max"] = load_max;
  j["load_mean"] = load_mean;
  j["load_cv"] = load_cv;
  j["hot_factor"] = hot_factor;
  j["hot_experts"] = hot_experts;
  j["schedule"] = {{"load_busy_ns", schedule.load_busy_ns},
                   {"spec_landed", schedule.spec_landed},
                   {"spec_load_ns", schedule.spec_load_ns},
                   {"spec_used", schedule.spec_used},
                   {"spec_lead_layers", schedule.spec_lead_layers},
                   {"spec_lead_ns", schedule.spec_lead_ns},
                   {"spec_late", schedule.spec_late},
                   {"spec_evicted_unused", schedule.spec_evicted_unused},
                   {"spec_evicted_before_target", schedule.spec_evicted_before_target},
                   {"selection_batches", schedule.selection_batches},
                   {"selection_behind_spec", schedule.selection_behind_spec},
                   {"selection_behind_spec_keys", schedule.selection_behind_spec_keys},
                   {"pump_held_inflight", schedule.pump_held_inflight},
                   {"pump_held_bytes", schedule.pump_held_bytes},
                   {"pump_held_selection", schedule.pump_held_selection}};
  j["layers"] = nlohmann::json::array();
  for (const auto& l : layers) {
    j["layers"].push_back({{"layer", l.layer},
                           {"hits", l.hits},
                           {"late_hits", l.late_hits},
                           {"misses", l.misses},
                           {"hit_rate", l.hit_rate()},
                           {"precision", RatioJson(l.prediction.precision_if_defined())},
                           {"recall", RatioJson(l.prediction.recall_if_defined())},
                           {"true_positive", l.prediction.true_positive},
                           {"false_positive", l.prediction.false_positive},
                           {"false_negative", l.prediction.false_negative},
                           {"load", l.expert_load},
                           {"load_max", l.load_max},
                           {"load_mean", l.load_mean},
                           {"load_cv", l.load_cv},
                           {"hot_experts", l.hot_experts},
                           {"stall_ns", l.stall_ns}});
  }
  return j.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

std::string ExpertMetrics::PrometheusText() const {
  std::string out;
  auto metric = [&](std::string_view name, std::string_view type, std::string_view help) {
    out += fmt::format("# HELP terrace_experts_{} {}\n# TYPE terrace_experts_{} {}\n", name, help, name, type);
  };
  metric("accesses_total", "counter", "Expert acquires by outcome (hit, late: waited for its prefetch, miss) and layer.");
  for (const auto& l : layers) {
    out += fmt::format("terrace_experts_accesses_total{{layer=\"{}\",outcome=\"hit\"}} {}\n", l.layer, l.hits);
    out += fmt::format("terrace_experts_accesses_total{{layer=\"{}\",outcome=\"late\"}} {}\n", l.layer, l.late_hits);
    out += fmt::format("terrace_experts_accesses_total{{layer=\"{}\",outcome=\"miss\"}} {}\n", l.layer, l.misses);
  }
  metric("hit_rate", "gauge", "Fraction of expert acquires served from the fast tier without waiting, by layer.");
  for (const auto& l : layers) out += fmt::format("terrace_experts_hit_rate{{layer=\"{}\"}} {}\n", l.layer, l.hit_rate());
  // A layer with nothing predicted (or nothing routed) has no precision (recall) sample.
  metric("prediction_precision", "gauge", "Predicted experts that were routed to, by layer (no sample: none predicted).");
  for (const auto& l : layers) out += RatioSample("prediction_precision", l.layer, l.prediction.precision_if_defined());
  metric("prediction_recall", "gauge", "Routed experts that were predicted, by layer (no sample: none routed).");
  for (const auto& l : layers) out += RatioSample("prediction_recall", l.layer, l.prediction.recall_if_defined());
  metric("expert_load_cv", "gauge", "Coefficient of variation of the tokens routed to each expert, by layer.");
  for (const auto& l : layers) out += fmt::format("terrace_experts_expert_load_cv{{layer=\"{}\"}} {}\n", l.layer, l.load_cv);
  metric("expert_load_max_over_mean", "gauge", "Most-loaded expert's tokens over the layer mean, by layer.");
  for (const auto& l : layers)
    out += fmt::format("terrace_experts_expert_load_max_over_mean{{layer=\"{}\"}} {}\n", l.layer,
                       l.load_mean > 0 ? l.load_max / l.load_mean : 0.0);
  metric("expert_load_max", "gauge", "Tokens routed to the layer's most-loaded expert (selections without hooks), by layer.");
  for (const auto& l : layers) out += fmt::format("terrace_experts_expert_load_max{{layer=\"{}\"}} {}\n", l.layer, l.load_max);
  metric("expert_load_mean", "gauge", "Mean tokens routed per expert of the layer (selections without hooks), by layer.");
  for (const auto& l : layers) out += fmt::format("terrace_experts_expert_load_mean{{layer=\"{}\"}} {}\n", l.layer, l.load_mean);
  metric("hot_experts", "gauge", "Experts whose load exceeds hot_factor x their layer's mean.");
  out += fmt::format("terrace_experts_hot_experts {}\n", hot_experts);
  metric("layer_hot_experts", "gauge", "Experts whose load exceeds hot_factor x their layer's mean, by layer.");
  for (const auto& l : layers)
    out += fmt::format("terrace_experts_layer_hot_experts{{layer=\"{}\"}} {}\n", l.layer, l.hot_experts.size());
  metric("hot_expert_load", "gauge", "Tokens routed to each hot expert (load > hot_factor x its layer's mean), by layer and expert.");
  for (const auto& l : layers)
    for (int e : l.hot_experts)
      out += fmt::format("terrace_experts_hot_expert_load{{layer=\"{}\",expert=\"{}\"}} {}\n", l.layer, e,
                         l.expert_load[static_cast<std::size_t>(e)]);
  metric("stall_seconds_total", "counter", "Forward-thread time spent waiting for expert loads.");
  out += fmt::format("terrace_experts_stall_seconds_total {}\n", static_cast<double>(stall_ns) / 1e9);
  metric("layer_stall_seconds_total", "counter", "Forward-thread time spent waiting for expert loads, by layer.");
  for (const auto& l : layers)
    out += fmt::format("terrace_experts_layer_stall_seconds_total{{layer=\"{}\"}} {}\n", l.layer, static_cast<double>(l.stall_ns) / 1e9);
  metric("load_busy_seconds_total", "counter", "Wall time with at least one expert load outstanding.");
  out += fmt::format("terrace_experts_load_busy_seconds_total {}\n", static_cast<double>(schedule.load_busy_ns) / 1e9);
  metric("tokens_total", "counter", "Tokens run through the model.");
  out += fmt::format("terrace_experts_tokens_total {}\n", tokens);
  metric("bytes_total", "counter",
         "Bytes loaded into the fast tier, by kind: demand or speculative (prefetched); the kinds partition the bytes.");
  out += fmt::format("terrace_experts_bytes_total{{kind=\"demand\"}} {}\n", demand_bytes);
  out += fmt::format("terrace_experts_bytes_total{{kind=\"speculative\"}} {}\n", speculative_bytes);
  metric("speculative_wasted_bytes_total", "counter",
         "Prefetched bytes evicted from the fast tier before any use (part of bytes_total{kind=\"speculative\"}).");
  out += fmt::format("terrace_experts_speculative_wasted_bytes_total {}\n", speculative_wasted_bytes);
  metric("speculative_unused_bytes", "gauge",
         "Prefetched bytes resident in the fast tier and not used yet (part of bytes_total{kind=\"speculative\"}).");
  out += fmt::format("terrace_experts_speculative_unused_bytes {}\n", speculative_unused_bytes);
  metric("prefetches_total", "counter", "Prefetches issued to the store, cancelled (their layer passed) and skipped (no room).");
  out += fmt::format("terrace_experts_prefetches_total{{outcome=\"issued\"}} {}\n", prefetches_issued);
  out += fmt::format("terrace_experts_prefetches_total{{outcome=\"cancelled\"}} {}\n", prefetches_cancelled);
  out += fmt::format("terrace_experts_prefetches_total{{outcome=\"skipped\"}} {}\n", prefetches_skipped);
  metric("evictions_total", "counter", "Experts dropped from the fast tier (never written back).");
  out += fmt::format("terrace_experts_evictions_total {}\n", evictions);
  metric("shared_drops_total", "counter",
         "Fast-tier copies dropped from the cache without evicting them (shared store: pinned by another holder, "
         "or evicted by the store).");
  out += fmt::format("terrace_experts_shared_drops_total {}\n", shared_drops);
  metric("corrupt_copies_reread_total", "counter", "Expert copies that failed their checksum and were re-read from a slower copy.");
  out += fmt::format("terrace_experts_corrupt_copies_reread_total {}\n", corrupt_copies_reread);
  metric("cache_bytes", "gauge", "Fast-tier budget and bytes resident.");
  out += fmt::format("terrace_experts_cache_bytes{{kind=\"budget\"}} {}\n", budget_bytes);
  out += fmt::format("terrace_experts_cache_bytes{{kind=\"resident\"}} {}\n", resident_bytes);
  return out;
}

}  // namespace terrace::experts
