// terrace bench experts: the targets from the measured rows, and the run printed as JSON
// (--json) or text (bench_experts.h).
#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/bench_experts.h"
#include "src/cli/cli_util.h"
#include "src/common/json_text.h"
#include "src/experts/belady.h"

namespace terrace::cli::bench_experts {
namespace {

std::string Yes(bool met) { return met ? "met" : "NOT met"; }

// Row `name` at `budget` (resident and mmap-unbounded have one, at any budget); null when it did
// not run.
const ConfigResult* Lookup(const Run& run, const std::string& name, double budget) {
  for (const auto& r : run.results)
    if (r.name == name && (name == "resident" || name == "mmap-unbounded" || r.budget_fraction == budget)) return &r;
  return nullptr;
}

// A row left out by --configs reads as an empty one (0 tok/s): its ratios print as inf / null.
const ConfigResult& Row(const Run& run, const std::string& name, double budget) {
  static const ConfigResult kAbsentRow;
  const ConfigResult* r = Lookup(run, name, budget);
  return r != nullptr ? *r : kAbsentRow;
}

// Figures both outputs print, derived from the run.
struct Figures {
  double all_miss_s = 0, all_miss_ratio = 0;  // an all-miss token's transfers, and over its compute
  double chance_recall = 0;                   // top-k of the experts per layer, picked at random
  double resident_tps = 0, mmap_unbounded_tps = 0;
  bool cold = false;  // the checkpoint was out of the page cache before the unbounded mmap row
};

Figures FiguresOf(const Run& run) {
  Figures f;
  f.all_miss_s = run.regime.AllMissSeconds(run.nvme_bytes_per_s, run.link.bandwidth_bytes_per_s);
  f.all_miss_ratio = f.all_miss_s / std::max(run.compute_s_per_token, 1e-12);
  f.chance_recall = static_cast<double>(run.regime.top_k) / std::max(run.regime.experts_per_layer, 1);
  f.resident_tps = Row(run, "resident", 1).tokens_per_s;
  f.mmap_unbounded_tps = Row(run, "mmap-unbounded", 1).tokens_per_s;
  f.cold = run.before.measured && run.before.file_bytes > 0 && run.before.fraction() < 0.05;
  return f;
}

}  // namespace

std::vector<TargetSummary> SummarizeTargets(Run* run, const std::vector<experts::CacheBudget>& budgets) {
  const Run& r0 = *run;
  const auto overlap_tps = [&](double drive_bytes) { return r0.OverlapTokensPerS(drive_bytes); };
  const auto nvme_per_token = [&](const ConfigResult& r) { return r0.NvmePerToken(r); };
  const auto lookup = [&](const std::string& name, double budget) { return Lookup(r0, name, budget); };
  const auto row = [&](const std::string& name, double budget) -> const ConfigResult& { return Row(r0, name, budget); };
  // The drive bound of every row that read from the drive (perfect overlap of compute and its reads).
  for (auto& r : run->results)
    if (nvme_per_token(r) > 0) r.drive_bound_tokens_per_s = overlap_tps(nvme_per_token(r));
  std::vector<TargetSummary> summaries;
  for (const auto& b : budgets) {
    TargetSummary s;
    s.budget = b.fraction;
    for (const char* n : {"lru+lookahead", "utility+statistical", "utility+lookahead"}) {
      const ConfigResult* r = lookup(n, b.fraction);
      if (r != nullptr && r->tokens_per_s > s.best_tps) {
        s.best = n;
        s.best_tps = r->tokens_per_s;
        s.io_bound_best = r->io_bound_tokens_per_s;
      }
    }
    s.oracle = row("oracle", b.fraction).tokens_per_s;
    s.io_bound_oracle = row("oracle", b.fraction).io_bound_tokens_per_s;
    s.on_demand = row("on-demand", b.fraction).tokens_per_s;
    s.lookahead_recall = lookup("lru+lookahead", b.fraction) != nullptr ? row("lru+lookahead", b.fraction).recall
                                                                         : row("utility+lookahead", b.fraction).recall;
    s.mmap = row("mmap", b.fraction).mmap_tokens_per_s_without_drops;
    s.mmap_with_drops = row("mmap", b.fraction).tokens_per_s;
    double fewest = 0;
    for (const auto& r : r0.results) {
      if (r.IsMmap() || r.name == "resident" || r.name == kBeladyRow || r.budget_fraction != b.fraction) continue;
      if (fewest == 0 || nvme_per_token(r) < fewest) fewest = nvme_per_token(r);
    }
    s.min_nvme_bytes_per_token = fewest;
    s.overlap_bound_tps = overlap_tps(fewest);
    s.overlap_bound_vs_on_demand = s.overlap_bound_tps / s.on_demand;
    // The same against on-demand's own serial model (compute, then its reads), which does not
    // carry the machine's descheduling into the ratio.
    const double od_bytes = nvme_per_token(row("on-demand", b.fraction));
    const double od_serial_s = r0.compute_s_per_token + od_bytes / std::max(r0.nvme_bytes_per_s, 1.0) +
                               od_bytes / r0.link.bandwidth_bytes_per_s;
    s.overlap_bound_vs_serial_on_demand = od_serial_s * s.overlap_bound_tps;
    if (r0.recorded) {
      // Step 0 is the prefill: every demand-paged cache misses its distinct experts alike, so
      // Belady's misses in the decode steps are the fewest any can have there.
      s.belady_capacity_blocks = b.Resolve(r0.total) / r0.regime.block_bytes;
      const std::uint64_t misses = experts::SimulateBelady(*r0.recorded, s.belady_capacity_blocks).From(1);
      s.belady_nvme_bytes_per_token = static_cast<double>(misses * r0.regime.block_bytes) / r0.a.decode;
      s.belady_bound_tps = overlap_tps(*s.belady_nvme_bytes_per_token);
      s.belady_bound_vs_on_demand = s.belady_bound_tps / s.on_demand;
      s.belady_bound_vs_serial_on_demand = od_serial_s * s.belady_bound_tps;
    }
    if (const ConfigResult* r = lookup(std::string(kBeladyRow), b.fraction)) s.belady_row_nvme_bytes_per_token = nvme_per_token(*r);
    summaries.push_back(s);
  }
  return summaries;
}

void PrintJson(const Run& run, const std::vector<TargetSummary>& summaries) {
  const Args& a = run.a;
  const Figures f = FiguresOf(run);
  nlohmann::json j;
  j["model"] = a.model;
  j["routed_expert_bytes"] = run.total;
  j["expert_block_bytes"] = run.regime.block_bytes;
  j["moe_layers"] = run.regime.moe_layers;
  j["experts_per_layer"] = run.regime.experts_per_layer;
  j["top_k"] = run.regime.top_k;
  j["all_miss_bytes_per_token"] = run.regime.all_miss_bytes_per_token;
  j["all_miss_transfer_s"] = f.all_miss_s;
  j["all_miss_compute_ratio"] = f.all_miss_ratio;
  j["prompt_tokens"] = a.prompt;
  j["lookahead_depth"] = a.lookahead_depth;
  j["lookahead_embedding_depth"] = a.lookahead_embedding_depth;
  j["lookahead_supersede"] = !a.no_lookahead_supersede;
  j["lookahead_provisional"] = a.lookahead_provisional;
  j["lead_protected_layers"] = a.lead_protected_layers;
  j["lead_protected_share"] = a.lead_protected_share.value_or(experts::ExpertOffloadOptions{}.lead_protected_share);
  j["lookahead_min_rank_precision"] =
      a.lookahead_min_rank_precision.value_or(experts::LookaheadOptions{}.min_rank_precision);
  j["lookahead_busy_rank_precision"] =
      a.lookahead_busy_rank_precision.value_or(experts::LookaheadOptions{}.busy_rank_precision);
  j["lookahead_min_confidence"] = a.lookahead_min_confidence.value_or(experts::LookaheadOptions{}.min_confidence);
  j["decode_tokens"] = a.decode;
  j["link_bytes_per_s"] = run.link.bandwidth_bytes_per_s;
  j["nvme_read_bytes_per_s"] = run.nvme_bytes_per_s;
  j["compute_s_per_token"] = run.compute_s_per_token;
  j["compute_is_cpu_time"] = a.threads == 1;
  j["resident_wall_s_per_token"] = run.resident_wall_s_per_token;
  j["mmap_page_cache_dropped"] = run.advised;
  j["mmap_drop_caches"] = run.drop_caches;
  j["mmap_resident_fraction_before"] = run.before.fraction();
  j["mmap_resident_fraction_after"] = run.after.fraction();
  j["mmap_residency_measured"] = run.before.measured;
  j["mmap_cold"] = f.cold;
  j["chance_recall"] = f.chance_recall;
  j["lookahead_limit"] = {{"layers", run.limit.layers},
                          {"recall_at_distance_1", run.limit.recall_lookahead},
                          {"recall_from_true_router_input", run.limit.recall_true_input},
                          {"attention_update_ratio", run.limit.update_ratio},
                          {"layer_update_ratio", run.limit.layer_update_ratio},
                          {"recall_from_embedding", run.limit.recall_embedding}};
  for (const auto& r : run.results) {
    nlohmann::json c;
    c["name"] = r.name;
    c["budget_fraction"] = r.budget_fraction;
    c["tokens_per_s"] = r.tokens_per_s;
    c["stall_share"] = r.stall_share;
    c["wall_s_per_token"] = r.wall_s_per_token;
    c["forward_cpu_s_per_token"] = r.forward_cpu_s_per_token;
    c["background_cpu_s_per_token"] = r.background_cpu_s_per_token;
    c["hit_rate"] = r.hit_rate;
    c["recall"] = r.recall;
    c["precision"] = r.precision;
    c["bound_tokens_per_s"] = r.bound_tokens_per_s;
    // null: the row had no misses in the decode steps, so the drive and link do not bound it.
    if (r.io_bound_tokens_per_s > 0) {
      c["io_bound_tokens_per_s"] = r.io_bound_tokens_per_s;
    } else {
      c["io_bound_tokens_per_s"] = nullptr;
    }
    c["miss_bytes_per_token"] = r.miss_bytes_per_token;
    if (r.drive_bound_tokens_per_s > 0) {
      c["drive_bound_tokens_per_s"] = r.drive_bound_tokens_per_s;
    } else {
      c["drive_bound_tokens_per_s"] = nullptr;
    }
    if (r.IsMmap()) {
      c["mmap_budget_bytes"] = r.mmap_budget_bytes;
      c["mmap_resident_fraction_before"] = r.mmap_cold_fraction_before;
      c["mmap_expert_page_cache_bytes_after"] = r.mmap_expert_bytes_after;
      c["mmap_expert_page_cache_bytes_settled"] = r.mmap_expert_bytes_settled;
      c["mmap_peak_charged_bytes"] = r.mmap_peak_charged_bytes;
      c["mmap_evictions"] = r.mmap_evictions;
      c["mmap_overcommits"] = r.mmap_overcommits;
      c["mmap_spill_dropped_bytes"] = r.mmap_spill_dropped_bytes;
      c["mmap_drop_failures"] = r.mmap_drop_failures;
      c["mmap_drop_s_per_token"] = r.mmap_drop_s_per_token;
      c["mmap_tokens_per_s_without_drops"] = r.mmap_tokens_per_s_without_drops;
    }
    for (int i = 0; i < kNumTiers; ++i) c["bytes_read"][std::string(TierName(static_cast<TierId>(i)))] = r.bytes_read[i];
    c["speculative_bytes"] = r.speculative_bytes;
    c["speculative_wasted_bytes"] = r.wasted_bytes;
    c["layer_recall"] = r.layer_recall;
    if (!r.IsMmap() && r.name != "resident") {
      const experts::ExpertScheduleMetrics& d = r.schedule;
      c["layer_stall_s_per_token"] = r.layer_stall_s_per_token;
      c["schedule"] = {{"load_busy_s_per_token", static_cast<double>(d.load_busy_ns) / 1e9 / a.decode},
                       {"load_idle_s_per_token", std::max(r.wall_s_per_token - static_cast<double>(d.load_busy_ns) / 1e9 / a.decode, 0.0)},
                       {"spec_landed", d.spec_landed},
                       {"spec_load_s_mean", d.spec_landed ? static_cast<double>(d.spec_load_ns) / 1e9 / static_cast<double>(d.spec_landed) : 0.0},
                       {"spec_used", d.spec_used},
                       {"spec_lead_layers_mean", d.spec_used ? static_cast<double>(d.spec_lead_layers) / static_cast<double>(d.spec_used) : 0.0},
                       {"spec_lead_s_mean", d.spec_used ? static_cast<double>(d.spec_lead_ns) / 1e9 / static_cast<double>(d.spec_used) : 0.0},
                       {"spec_late", d.spec_late},
                       {"spec_evicted_unused", d.spec_evicted_unused},
                       {"spec_evicted_before_target", d.spec_evicted_before_target},
                       {"selection_batches", d.selection_batches},
                       {"selection_behind_spec", d.selection_behind_spec},
                       {"selection_behind_spec_keys", d.selection_behind_spec_keys},
                       {"pump_held_inflight", d.pump_held_inflight},
                       {"pump_held_bytes", d.pump_held_bytes},
                       {"pump_held_selection", d.pump_held_selection}};
    }
    c["expert_load"] = r.expert_load;
    c["hot_experts"] = r.hot_experts;
    j["configs"].push_back(c);
  }
  for (const auto& s : summaries) {
    nlohmann::json t = {{"budget_fraction", s.budget},
                        {"best_real", s.best},
                        {"best_vs_oracle", s.best_tps / s.oracle},
                        {"best_vs_on_demand", s.best_tps / s.on_demand},
                        {"best_vs_mmap", s.best_tps / s.mmap},
                        {"best_vs_mmap_with_drops", s.best_tps / s.mmap_with_drops},
                        {"best_vs_mmap_unbounded", s.best_tps / f.mmap_unbounded_tps},
                        {"min_nvme_bytes_per_token", s.min_nvme_bytes_per_token},
                        {"overlap_bound_tokens_per_s", s.overlap_bound_tps},
                        {"overlap_bound_vs_on_demand", s.overlap_bound_vs_on_demand},
                        {"overlap_bound_vs_serial_on_demand", s.overlap_bound_vs_serial_on_demand},
                        {"best_vs_resident", s.best_tps / f.resident_tps},
                        {"oracle_vs_resident", s.oracle / f.resident_tps},
                        {"lookahead_recall", s.lookahead_recall}};
    // The Belady bound: null without a store-backed row (no recorded routing to simulate).
    const bool belady = s.belady_nvme_bytes_per_token.has_value();
    auto if_belady = [&](auto v) { return belady ? nlohmann::json(v) : nlohmann::json(nullptr); };
    t["belady_capacity_blocks"] = if_belady(s.belady_capacity_blocks);
    t["belady_nvme_bytes_per_token"] = if_belady(s.belady_nvme_bytes_per_token.value_or(0));
    t["belady_overlap_bound_tokens_per_s"] = if_belady(s.belady_bound_tps);
    t["belady_bound_vs_on_demand"] = if_belady(s.belady_bound_vs_on_demand);
    t["belady_bound_vs_serial_on_demand"] = if_belady(s.belady_bound_vs_serial_on_demand);
    t["belady_row_nvme_bytes_per_token"] = s.belady_row_nvme_bytes_per_token
                                               ? nlohmann::json(*s.belady_row_nvme_bytes_per_token)
                                               : nlohmann::json(nullptr);
    j["targets"].push_back(std::move(t));
  }
  fmt::print("{}\n", JsonText(j));
}

void PrintText(const Run& run, const std::vector<TargetSummary>& summaries) {
  const Args& a = run.a;
  const Figures f = FiguresOf(run);
  fmt::print("regime: routed experts {:.1f} MiB = {} MoE layers x {} experts x {} B blocks (target >= 2 GiB: {})\n",
             static_cast<double>(run.total) / (1 << 20), run.regime.moe_layers, run.regime.experts_per_layer, run.regime.block_bytes,
             Yes(run.total >= (2ull << 30)));
  fmt::print("regime: an all-miss token moves {} x {} x {} B = {:.1f} MiB: {:.1f} ms (NVMe reads {:.2f} GB/s, link model "
             "{:.0f} GB/s) against {:.2f} ms of compute per token (resident decode, {}; wall {:.2f} ms): {:.2f}x (target >= 3x: {})\n",
             run.regime.top_k, run.regime.moe_layers, run.regime.block_bytes, static_cast<double>(run.regime.all_miss_bytes_per_token) / (1 << 20),
             f.all_miss_s * 1e3, run.nvme_bytes_per_s / 1e9, a.link_gbps, run.compute_s_per_token * 1e3,
             a.threads == 1 ? "thread CPU time" : "wall time", run.resident_wall_s_per_token * 1e3, f.all_miss_ratio,
             Yes(f.all_miss_ratio >= 3));
  Table t({"config", "budget", "tokens/s", "io bound", "drive bound", "bound", "stall", "hit rate", "recall", "nvme MiB",
           "host MiB"});
  for (const auto& r : run.results) {
    const bool cached = r.name != "resident" && !r.IsMmap();
    const bool budgeted = cached || (r.IsMmap() && r.mmap_budget_bytes > 0);
    t.Add({r.name, budgeted ? fmt::format("{:.0f}%", r.budget_fraction * 100) : "-", fmt::format("{:.1f}", r.tokens_per_s),
           cached && r.io_bound_tokens_per_s > 0 ? fmt::format("{:.1f}", r.io_bound_tokens_per_s) : "-",
           r.drive_bound_tokens_per_s > 0 ? fmt::format("{:.1f}", r.drive_bound_tokens_per_s) : "-",
           cached ? fmt::format("{:.1f}", r.bound_tokens_per_s) : "-",
           cached ? fmt::format("{:.1f}%", 100 * r.stall_share) : "-",
           budgeted ? fmt::format("{:.3f}", r.hit_rate) : "-",
           cached ? fmt::format("{:.3f}", r.recall) : "-",
           fmt::format("{:.1f}", static_cast<double>(r.bytes_read[2]) / (1 << 20)),
           fmt::format("{:.1f}", static_cast<double>(r.bytes_read[1]) / (1 << 20))});
  }
  fmt::print("{}", t.Render());
  fmt::print("io bound = the tokens/s the drive and the link allow at the row's hit rate (misses x block bytes per token, "
             "no compute); drive bound = compute and the row's NVMe reads perfectly overlapped, 1 / max(compute, nvme bytes "
             "per token / drive rate + / link); bound = compute + the misses' transfers, serially; mmap hit rate = acquires "
             "of an expert whose pages were charged to the budget\n");
  for (const auto& r : run.results) {
    if (!r.IsMmap()) continue;
    fmt::print("{}{}: page cache held {:.1f}% of the checkpoint before the run; experts' page-cache bytes after it (mincore) "
               "{:.1f} MiB{}; peak charged {:.1f} MiB; {} evictions, {} over-budget loads, {:.1f} MiB of read-ahead spill "
               "dropped, {} failed drops; {:.1f} ms per token evicting and sweeping, {:.2f} tok/s without it\n",
               r.name, r.mmap_budget_bytes > 0 ? fmt::format(" at {:.0f}%", r.budget_fraction * 100) : "",
               100 * r.mmap_cold_fraction_before, static_cast<double>(r.mmap_expert_bytes_after) / (1 << 20),
               r.mmap_budget_bytes > 0
                   ? fmt::format(", {:.1f} MiB once the read-ahead in flight had landed and was dropped (budget {:.1f} MiB: {})",
                                 static_cast<double>(r.mmap_expert_bytes_settled) / (1 << 20),
                                 static_cast<double>(r.mmap_budget_bytes) / (1 << 20),
                                 r.mmap_expert_bytes_settled <= r.mmap_budget_bytes ? "within" : "OVER")
                   : " (no budget)",
               static_cast<double>(r.mmap_peak_charged_bytes) / (1 << 20), r.mmap_evictions, r.mmap_overcommits,
               static_cast<double>(r.mmap_spill_dropped_bytes) / (1 << 20), r.mmap_drop_failures,
               r.mmap_drop_s_per_token * 1e3, r.mmap_tokens_per_s_without_drops);
  }
  for (const auto& r : run.results) {
    if (r.name != "lru+lookahead" && r.name != "utility+statistical" && r.name != "utility+lookahead") continue;
    std::string layers;
    for (double v : r.layer_recall) layers += fmt::format(" {:.2f}", v);
    fmt::print("per-layer recall, {} at {:.0f}%:{}\n", r.name, r.budget_fraction * 100, layers);
  }
  fmt::print("recall by chance (top-{} of {} experts): {:.3f}\n", run.regime.top_k, run.regime.experts_per_layer, f.chance_recall);
  for (const auto& r : run.results) {
    if (r.name == "resident" || r.IsMmap()) continue;
    const double stalled = r.stall_share * r.wall_s_per_token;
    fmt::print("ms per decode token, {} at {:.0f}%: wall {:.1f} = forward-thread CPU {:.1f} + stalled {:.1f} + other {:.1f} "
               "(descheduled); other threads' CPU {:.1f} (resident compute {:.1f})\n",
               r.name, r.budget_fraction * 100, r.wall_s_per_token * 1e3, r.forward_cpu_s_per_token * 1e3, stalled * 1e3,
               std::max(r.wall_s_per_token - r.forward_cpu_s_per_token - stalled, 0.0) * 1e3,
               r.background_cpu_s_per_token * 1e3, run.compute_s_per_token * 1e3);
  }
  for (const auto& r : run.results) {
    if (r.name == "resident" || r.IsMmap()) continue;
    const experts::ExpertScheduleMetrics& d = r.schedule;
    const double busy = static_cast<double>(d.load_busy_ns) / 1e9 / a.decode;
    std::string stalls;
    for (double v : r.layer_stall_s_per_token) stalls += fmt::format(" {:.1f}", v * 1e3);
    fmt::print("schedule per decode token, {} at {:.0f}%: loads outstanding {:.1f} ms, none {:.1f} ms; stall per MoE layer "
               "(ms){}; speculative: {} landed ({:.1f} ms issue-to-landing), {} used, issued {:.2f} layers / {:.1f} ms ahead, {} "
               "late, {} evicted unused ({} before their target); {} selection batches, {} behind speculation ({} keys); "
               "queue held by the in-flight limit {}, the bytes cap {}, a selection batch {}\n",
               r.name, r.budget_fraction * 100, busy * 1e3, std::max(r.wall_s_per_token - busy, 0.0) * 1e3, stalls,
               d.spec_landed, d.spec_landed ? static_cast<double>(d.spec_load_ns) / 1e6 / static_cast<double>(d.spec_landed) : 0.0,
               d.spec_used, d.spec_used ? static_cast<double>(d.spec_lead_layers) / static_cast<double>(d.spec_used) : 0.0,
               d.spec_used ? static_cast<double>(d.spec_lead_ns) / 1e6 / static_cast<double>(d.spec_used) : 0.0, d.spec_late,
               d.spec_evicted_unused, d.spec_evicted_before_target, d.selection_batches, d.selection_behind_spec,
               d.selection_behind_spec_keys, d.pump_held_inflight, d.pump_held_bytes, d.pump_held_selection);
  }
  {
    std::string la, tr, up, lu, ls, le;
    for (std::size_t i = 0; i < run.limit.layers.size(); ++i) {
      ls += fmt::format(" {}", run.limit.layers[i]);
      le += fmt::format(" {:.2f}", run.limit.recall_embedding[i]);
      la += fmt::format(" {:.2f}", run.limit.recall_lookahead[i]);
      tr += fmt::format(" {:.2f}", run.limit.recall_true_input[i]);
      up += fmt::format(" {:.2f}", run.limit.update_ratio[i]);
      lu += fmt::format(" {:.2f}", run.limit.layer_update_ratio[i]);
    }
    fmt::print("lookahead limit (resident decode), MoE layers{}: router recall at distance 1 (lookahead's input){}, "
               "from the router's true input{}, from the embedding (token start){}; attention update / residual norm{}; "
               "whole-layer update / residual norm{}\n",
               ls, la, tr, le, up, lu);
  }
  fmt::print("mmap: POSIX_FADV_DONTNEED {}; drop_caches {}; checkpoint resident in the page cache before the run: {}\n",
             run.advised ? "accepted" : "refused for some shard", run.drop_caches,
             run.before.measured ? fmt::format("{:.1f}% ({}), after: {:.1f}%", 100 * run.before.fraction(),
                                           f.cold ? "cold" : "NOT cold: the kernel kept the pages", 100 * run.after.fraction())
                             : "not measured (mincore failed)");
  for (const auto& s : summaries) {
    fmt::print("targets at {:.0f}%: best real predictor {} {:.1f} tok/s = {:.2f}x oracle (>= 0.9: {}), {:.2f}x on-demand "
               "(>= 2: {}), {:.2f}x mmap at the same budget without its eviction work (>= 3: {}) [{:.2f}x with it, {:.2f}x "
               "mmap-unbounded{}]; oracle {:.2f}x resident{}; lookahead recall {:.3f} (>= 0.8: {})\n",
               s.budget * 100, s.best, s.best_tps, s.best_tps / s.oracle, Yes(s.best_tps >= 0.9 * s.oracle),
               s.best_tps / s.on_demand, Yes(s.best_tps >= 2 * s.on_demand), s.best_tps / s.mmap,
               Yes(s.best_tps >= 3 * s.mmap), s.best_tps / s.mmap_with_drops, s.best_tps / f.mmap_unbounded_tps,
               f.cold ? "" : ", not cold",
               s.oracle / f.resident_tps,
               s.oracle >= 0.9 * f.resident_tps
                   ? fmt::format(" so best >= 0.85x resident: {:.2f}x, {}", s.best_tps / f.resident_tps, Yes(s.best_tps >= 0.85 * f.resident_tps))
                   : " (< 0.9x: the resident target does not apply)",
               s.lookahead_recall, Yes(s.lookahead_recall >= 0.8));
    fmt::print("bound at {:.0f}%: the fewest drive bytes any row but oracle+belady read, {:.1f} MiB per token, at {:.2f} GB/s with compute ({:.1f} "
               "ms) perfectly overlapped allow {:.1f} tok/s = {:.2f}x on-demand's measured {:.1f} tok/s and {:.2f}x on-demand's "
               "serial model (compute + its reads): 2x on-demand is {}\n",
               s.budget * 100, s.min_nvme_bytes_per_token / (1 << 20), run.nvme_bytes_per_s / 1e9, run.compute_s_per_token * 1e3,
               s.overlap_bound_tps, s.overlap_bound_vs_on_demand, s.on_demand, s.overlap_bound_vs_serial_on_demand,
               s.overlap_bound_vs_serial_on_demand >= 2 ? "within the bound"
                                                       : "beyond reach at these miss bytes, on any drive (overlap alone gains at "
                                                         "most 2x, and only when a token's reads take exactly its compute time; "
                                                         "2x needs fewer missed bytes)");
    if (!s.belady_nvme_bytes_per_token) continue;
    fmt::print("Belady bound at {:.0f}%: the fewest drive bytes any demand-paged cache of {} experts can read on this run's "
               "routing (Belady's replacement over the recorded trace), {:.2f} MiB per token ({}), with compute perfectly "
               "overlapped allow {:.1f} tok/s = {:.2f}x on-demand's measured and {:.2f}x its serial model: 2x on-demand is {}\n",
               s.budget * 100, s.belady_capacity_blocks, *s.belady_nvme_bytes_per_token / (1 << 20),
               s.belady_row_nvme_bytes_per_token
                   ? fmt::format("the oracle+belady row read {:.2f}", *s.belady_row_nvme_bytes_per_token / (1 << 20))
                   : std::string("no oracle+belady row"),
               s.belady_bound_tps, s.belady_bound_vs_on_demand, s.belady_bound_vs_serial_on_demand,
               s.belady_bound_vs_serial_on_demand >= 2
                   ? "within the bound"
                   : "beyond reach at this budget even with perfect knowledge of the routing and perfect overlap");
  }
}

}  // namespace terrace::cli::bench_experts
