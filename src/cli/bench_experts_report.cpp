// terrace bench experts: the targets from the measured rows, and the run printed as JSON
// (--json) or text (bench_experts.h).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
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

// What a ratio, bound or target against a row left out by --configs prints (JSON: null).
constexpr std::string_view kRowNotRun = "n/a (row not run)";

// A figure of row `name` at `budget`; unset when the row did not run.
template <typename Get>
std::optional<double> RowFigure(const Run& run, const std::string& name, double budget, Get get) {
  const ConfigResult* r = Lookup(run, name, budget);
  return r != nullptr ? std::optional<double>(get(*r)) : std::nullopt;
}

std::optional<double> TokensPerS(const Run& run, const std::string& name, double budget) {
  return RowFigure(run, name, budget, [](const ConfigResult& r) { return r.tokens_per_s; });
}

// a / b; unset when either side is (its row did not run) or b is 0.
std::optional<double> RatioOf(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b == 0) return std::nullopt;
  return *a / *b;
}

// A figure in JSON: null when unset (or not finite).
nlohmann::json JsonOrNull(std::optional<double> v) {
  return v && std::isfinite(*v) ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// "<ratio>x <what> (>= <goal>: met)" (or NOT met), or "<what> n/a (row not run)" when the baseline
// row <what> did not run (the best predictor's row is known to have run).
std::string TargetClause(std::optional<double> ratio, std::string_view what, double goal) {
  if (!ratio) return fmt::format("{} {}", what, kRowNotRun);
  return fmt::format("{:.2f}x {} (>= {:g}: {})", *ratio, what, goal, Yes(*ratio >= goal));
}

// "<ratio>x <what>", or "<what> n/a (row not run)" (as TargetClause).
std::string RatioClause(std::optional<double> ratio, std::string_view what) {
  return ratio ? fmt::format("{:.2f}x {}", *ratio, what) : fmt::format("{} {}", what, kRowNotRun);
}

// Figures both outputs print, derived from the run.
struct Figures {
  double all_miss_s = 0, all_miss_ratio = 0;  // an all-miss token's transfers, and over its compute
  double chance_recall = 0;                   // top-k of the experts per layer, picked at random
  std::optional<double> resident_tps, mmap_unbounded_tps;  // unset: the row did not run
  // The checkpoint's residency before the unbounded mmap row was measured (the row ran and
  // mincore answered), and it was out of the page cache: cold is meaningful only when measured.
  bool residency_measured = false, cold = false;
};

Figures FiguresOf(const Run& run) {
  Figures f;
  f.all_miss_s = run.regime.AllMissSeconds(run.nvme_bytes_per_s, run.link.bandwidth_bytes_per_s);
  f.all_miss_ratio = f.all_miss_s / std::max(run.compute_s_per_token, 1e-12);
  f.chance_recall = static_cast<double>(run.regime.top_k) / std::max(run.regime.experts_per_layer, 1);
  f.resident_tps = TokensPerS(run, "resident", 1);
  f.mmap_unbounded_tps = TokensPerS(run, "mmap-unbounded", 1);
  f.residency_measured = run.before.has_value() && run.before->measured;
  f.cold = f.residency_measured && run.before->file_bytes > 0 && run.before->fraction() < 0.05;
  return f;
}

bool AnyMmapRow(const Run& run) {
  return std::any_of(run.results.begin(), run.results.end(), [](const ConfigResult& r) { return r.IsMmap(); });
}

}  // namespace

std::vector<TargetSummary> SummarizeTargets(Run* run, const std::vector<experts::CacheBudget>& budgets) {
  const Run& r0 = *run;
  const auto overlap_tps = [&](double drive_bytes) { return r0.OverlapTokensPerS(drive_bytes); };
  const auto nvme_per_token = [&](const ConfigResult& r) { return r0.NvmePerToken(r); };
  const auto lookup = [&](const std::string& name, double budget) { return Lookup(r0, name, budget); };
  // The drive bound of every row that read from the drive (perfect overlap of compute and its reads).
  for (auto& r : run->results)
    if (nvme_per_token(r) > 0) r.drive_bound_tokens_per_s = overlap_tps(nvme_per_token(r));
  std::vector<TargetSummary> summaries;
  for (const auto& b : budgets) {
    TargetSummary s;
    s.budget = b.fraction;
    for (const char* n : {"lru+lookahead", "utility+statistical", "utility+lookahead"}) {
      const ConfigResult* r = lookup(n, b.fraction);
      if (r != nullptr && (!s.best_tps || r->tokens_per_s > *s.best_tps)) {
        s.best = n;
        s.best_tps = r->tokens_per_s;
        s.io_bound_best = r->io_bound_tokens_per_s;
      }
    }
    s.oracle = TokensPerS(r0, "oracle", b.fraction);
    s.io_bound_oracle =
        RowFigure(r0, "oracle", b.fraction, [](const ConfigResult& r) { return r.io_bound_tokens_per_s; }).value_or(0);
    s.on_demand = TokensPerS(r0, "on-demand", b.fraction);
    const auto recall = [](const ConfigResult& r) { return r.recall; };
    s.lookahead_recall = lookup("lru+lookahead", b.fraction) != nullptr
                             ? RowFigure(r0, "lru+lookahead", b.fraction, recall)
                             : RowFigure(r0, "utility+lookahead", b.fraction, recall);
    s.mmap = RowFigure(r0, "mmap", b.fraction, [](const ConfigResult& r) { return r.mmap_tokens_per_s_without_drops; });
    s.mmap_with_drops = TokensPerS(r0, "mmap", b.fraction);
    for (const auto& r : r0.results) {
      if (r.IsMmap() || r.name == "resident" || r.name == kBeladyRow || r.budget_fraction != b.fraction) continue;
      if (!s.min_nvme_bytes_per_token || nvme_per_token(r) < *s.min_nvme_bytes_per_token) {
        s.min_nvme_bytes_per_token = nvme_per_token(r);
      }
    }
    if (s.min_nvme_bytes_per_token) s.overlap_bound_tps = overlap_tps(*s.min_nvme_bytes_per_token);
    s.overlap_bound_vs_on_demand = RatioOf(s.overlap_bound_tps, s.on_demand);
    // The same against on-demand's own serial model (compute, then its reads), which does not
    // carry the machine's descheduling into the ratio; unset without an on-demand row.
    std::optional<double> od_serial_s;
    if (const ConfigResult* od = lookup("on-demand", b.fraction)) {
      const double od_bytes = nvme_per_token(*od);
      od_serial_s = r0.compute_s_per_token + od_bytes / std::max(r0.nvme_bytes_per_s, 1.0) +
                    od_bytes / r0.link.bandwidth_bytes_per_s;
    }
    if (od_serial_s && s.overlap_bound_tps) s.overlap_bound_vs_serial_on_demand = *od_serial_s * *s.overlap_bound_tps;
    if (r0.recorded) {
      // Step 0 is the prefill: every demand-paged cache misses its distinct experts alike, so
      // Belady's misses in the decode steps are the fewest any demand-paged cache can have there. A
      // prefetching row may read up to its depth's MoE layers of the first decode step during the
      // prefill, out of the decode's window: the bound leaves those out.
      s.belady_capacity_blocks = b.Resolve(r0.total) / r0.regime.block_bytes;
      s.belady_demand_paged_misses = experts::SimulateBelady(*r0.recorded, s.belady_capacity_blocks).From(1);
      s.belady_prefill_slack_blocks =
          static_cast<std::uint64_t>(std::max({kOracleDepth, r0.a.lookahead_depth, 1})) * r0.regime.top_k;
      const std::uint64_t misses = s.belady_demand_paged_misses - std::min(s.belady_demand_paged_misses, s.belady_prefill_slack_blocks);
      s.belady_nvme_bytes_per_token = static_cast<double>(misses * r0.regime.block_bytes) / r0.a.decode;
      s.belady_bound_tps = overlap_tps(*s.belady_nvme_bytes_per_token);
      s.belady_bound_vs_on_demand = RatioOf(s.belady_bound_tps, s.on_demand);
      if (od_serial_s) s.belady_bound_vs_serial_on_demand = *od_serial_s * s.belady_bound_tps;
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
  j["hbm_emulated"] = true;  // the reference model reads experts on the CPU: the fast tier is host memory
  j["nvme_read_bytes_per_s"] = run.nvme_bytes_per_s;
  j["compute_s_per_token"] = run.compute_s_per_token;
  j["compute_is_cpu_time"] = a.threads == 1;
  j["resident_wall_s_per_token"] = run.resident_wall_s_per_token;
  j["mmap_page_cache_dropped"] = run.advised;
  j["mmap_drop_caches"] = run.drop_caches;
  // The unbounded mmap row's residency: null (and measured false) when the row did not run or
  // mincore failed.
  j["mmap_resident_fraction_before"] =
      f.residency_measured ? nlohmann::json(run.before->fraction()) : nlohmann::json(nullptr);
  j["mmap_resident_fraction_after"] =
      f.residency_measured && run.after ? nlohmann::json(run.after->fraction()) : nlohmann::json(nullptr);
  j["mmap_residency_measured"] = f.residency_measured;
  j["mmap_cold"] = f.residency_measured ? nlohmann::json(f.cold) : nlohmann::json(nullptr);
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
    c["stall_share"] = JsonOrNull(r.stall_share);  // null: not measured (mmap rows)
    c["wall_s_per_token"] = r.wall_s_per_token;
    c["forward_cpu_s_per_token"] = r.forward_cpu_s_per_token;
    c["background_cpu_s_per_token"] = r.background_cpu_s_per_token;
    c["hit_rate"] = JsonOrNull(r.hit_rate);  // null: the row has no such figure (ConfigResult)
    c["recall"] = JsonOrNull(r.recall);
    c["precision"] = JsonOrNull(r.precision);
    c["bound_tokens_per_s"] = JsonOrNull(r.bound_tokens_per_s);  // null: not measured (mmap rows)
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
      c["mmap_resident_fraction_at_decode"] = r.mmap_fraction_at_decode;
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
    c["speculative_unused_bytes"] = r.unused_bytes;
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
    // null: a row the figure needs did not run (--configs).
    nlohmann::json t = {{"budget_fraction", s.budget},
                        {"best_real", s.best.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.best)},
                        {"best_vs_oracle", JsonOrNull(RatioOf(s.best_tps, s.oracle))},
                        {"best_vs_on_demand", JsonOrNull(RatioOf(s.best_tps, s.on_demand))},
                        {"best_vs_mmap", JsonOrNull(RatioOf(s.best_tps, s.mmap))},
                        {"best_vs_mmap_with_drops", JsonOrNull(RatioOf(s.best_tps, s.mmap_with_drops))},
                        {"best_vs_mmap_unbounded", JsonOrNull(RatioOf(s.best_tps, f.mmap_unbounded_tps))},
                        {"min_nvme_bytes_per_token", JsonOrNull(s.min_nvme_bytes_per_token)},
                        {"overlap_bound_tokens_per_s", JsonOrNull(s.overlap_bound_tps)},
                        {"overlap_bound_vs_on_demand", JsonOrNull(s.overlap_bound_vs_on_demand)},
                        {"overlap_bound_vs_serial_on_demand", JsonOrNull(s.overlap_bound_vs_serial_on_demand)},
                        {"best_vs_resident", JsonOrNull(RatioOf(s.best_tps, f.resident_tps))},
                        {"oracle_vs_resident", JsonOrNull(RatioOf(s.oracle, f.resident_tps))},
                        {"lookahead_recall", JsonOrNull(s.lookahead_recall)}};
    // The Belady bound: null without a store-backed row (no recorded routing to simulate).
    const bool belady = s.belady_nvme_bytes_per_token.has_value();
    auto if_belady = [&](auto v) { return belady ? nlohmann::json(v) : nlohmann::json(nullptr); };
    t["belady_capacity_blocks"] = if_belady(s.belady_capacity_blocks);
    t["belady_demand_paged_misses"] = if_belady(s.belady_demand_paged_misses);
    t["belady_prefill_slack_blocks"] = if_belady(s.belady_prefill_slack_blocks);
    t["belady_nvme_bytes_per_token"] = if_belady(s.belady_nvme_bytes_per_token.value_or(0));
    t["belady_overlap_bound_tokens_per_s"] = if_belady(s.belady_bound_tps);
    t["belady_bound_vs_on_demand"] = JsonOrNull(s.belady_bound_vs_on_demand);
    t["belady_bound_vs_serial_on_demand"] = JsonOrNull(s.belady_bound_vs_serial_on_demand);
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
             "{:.0f} GB/s: the fast tier is HBM emulated in host memory, each load into it charged that link's time) against {:.2f} ms of compute per token (resident decode, {}; wall {:.2f} ms): {:.2f}x (target >= 3x: {})\n",
             run.regime.top_k, run.regime.moe_layers, run.regime.block_bytes, static_cast<double>(run.regime.all_miss_bytes_per_token) / (1 << 20),
             f.all_miss_s * 1e3, run.nvme_bytes_per_s / 1e9, a.link_gbps, run.compute_s_per_token * 1e3,
             a.threads == 1 ? "thread CPU time" : "wall time", run.resident_wall_s_per_token * 1e3, f.all_miss_ratio,
             Yes(f.all_miss_ratio >= 3));
  Table t({"config", "budget", "tokens/s", "io bound", "drive bound", "bound", "stall", "hit rate", "recall", "precision",
           "nvme MiB", "host MiB", "spec MiB", "spec wasted MiB", "spec unused MiB"});
  auto mib = [](std::uint64_t b) { return fmt::format("{:.1f}", static_cast<double>(b) / (1 << 20)); };
  for (const auto& r : run.results) {
    const bool cached = r.name != "resident" && !r.IsMmap();
    const bool budgeted = cached || (r.IsMmap() && r.mmap_budget_bytes > 0);
    t.Add({r.name, budgeted ? fmt::format("{:g}%", r.budget_fraction * 100) : "-", fmt::format("{:.1f}", r.tokens_per_s),
           cached && r.io_bound_tokens_per_s > 0 ? fmt::format("{:.1f}", r.io_bound_tokens_per_s) : "-",
           r.drive_bound_tokens_per_s > 0 ? fmt::format("{:.1f}", r.drive_bound_tokens_per_s) : "-",
           cached ? fmt::format("{:.1f}", r.bound_tokens_per_s.value_or(0)) : "-",
           cached ? fmt::format("{:.1f}%", 100 * r.stall_share.value_or(0)) : "-",
           r.hit_rate ? fmt::format("{:.3f}", *r.hit_rate) : "-", r.recall ? fmt::format("{:.3f}", *r.recall) : "-",
           r.precision ? fmt::format("{:.3f}", *r.precision) : "-", mib(r.bytes_read[2]), mib(r.bytes_read[1]),
           cached ? mib(r.speculative_bytes) : "-", cached ? mib(r.wasted_bytes) : "-", cached ? mib(r.unused_bytes) : "-"});
  }
  fmt::print("{}", t.Render());
  fmt::print("io bound = the tokens/s the drive and the link allow at the row's hit rate (misses x block bytes per token, "
             "no compute); drive bound = compute and the row's NVMe reads perfectly overlapped, 1 / max(compute, nvme bytes "
             "per token / drive rate + / link); bound = compute + the misses' transfers, serially; mmap hit rate = acquires "
             "of an expert whose pages were charged to the budget; hit rate, recall, precision and nvme / host MiB over "
             "the decode steps; spec MiB = prefetched bytes landed, of which evicted before any use (wasted) and "
             "resident and not used at the end (unused), over the whole run; - = no such figure for the row\n");
  {
    // The bounds rest on one pass over the drive before the rows: on a shared or bursty drive a row
    // can read faster than that pass did, and then its bound is no bound.
    std::vector<std::string> beaten;
    for (const auto& r : run.results)
      if (r.drive_bound_tokens_per_s > 0 && r.tokens_per_s > r.drive_bound_tokens_per_s)
        beaten.push_back(fmt::format("{} at {:g}%", r.name, r.budget_fraction * 100));
    if (!beaten.empty()) {
      fmt::print("note: {} ran faster than {} drive bound: the drive read faster during {} than in the one pass that "
                 "measured it ({:.2f} GB/s), so the bounds of this run, the drive bound and the overlap bounds below, "
                 "are estimates, not limits\n",
                 fmt::join(beaten, ", "), beaten.size() == 1 ? "its" : "their", beaten.size() == 1 ? "it" : "them",
                 run.nvme_bytes_per_s / 1e9);
    }
  }
  for (const auto& r : run.results) {
    if (!r.IsMmap()) continue;
    const auto bytes = [](std::uint64_t n) { return FormatBytes(static_cast<double>(n)); };
    fmt::print("{}{}: page cache held {:.1f}% of the checkpoint before the run and {:.1f}% when the timed decode started "
               "(after the prefill); experts' page-cache bytes after it (mincore) "
               "{}{}; peak charged {}; {} evictions, {} over-budget loads, {} of read-ahead spill "
               "dropped, {} failed drops; {:.1f} ms per token evicting and sweeping, {:.2f} tok/s without it\n",
               r.name, r.mmap_budget_bytes > 0 ? fmt::format(" at {:g}%", r.budget_fraction * 100) : "",
               100 * r.mmap_cold_fraction_before, 100 * r.mmap_fraction_at_decode, bytes(r.mmap_expert_bytes_after),
               r.mmap_budget_bytes > 0
                   ? fmt::format(", {} once the read-ahead in flight had landed and was dropped (budget {}: {})",
                                 bytes(r.mmap_expert_bytes_settled), bytes(r.mmap_budget_bytes),
                                 r.mmap_expert_bytes_settled <= r.mmap_budget_bytes ? "within" : "OVER")
                   : " (no budget)",
               bytes(r.mmap_peak_charged_bytes), r.mmap_evictions, r.mmap_overcommits,
               bytes(r.mmap_spill_dropped_bytes), r.mmap_drop_failures,
               r.mmap_drop_s_per_token * 1e3, r.mmap_tokens_per_s_without_drops);
  }
  for (const auto& r : run.results) {
    if (r.name != "lru+lookahead" && r.name != "utility+statistical" && r.name != "utility+lookahead") continue;
    std::string layers;
    for (double v : r.layer_recall) layers += fmt::format(" {:.2f}", v);
    fmt::print("per-layer recall, {} at {:g}%:{}\n", r.name, r.budget_fraction * 100, layers);
  }
  fmt::print("recall by chance (top-{} of {} experts): {:.3f}\n", run.regime.top_k, run.regime.experts_per_layer, f.chance_recall);
  for (const auto& r : run.results) {
    if (r.name == "resident" || r.IsMmap()) continue;
    const double stalled = r.stall_share.value_or(0) * r.wall_s_per_token;
    fmt::print("ms per decode token, {} at {:g}%: wall {:.1f} = forward-thread CPU {:.1f} + stalled {:.1f} + other {:.1f} "
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
    fmt::print("schedule, {} at {:g}%, per decode token: loads outstanding {:.1f} ms, none {:.1f} ms; stall per MoE layer "
               "(ms){}; over the {} decode tokens: speculative loads {} landed ({:.1f} ms issue-to-landing), {} used, issued "
               "{:.2f} layers / {:.1f} ms ahead, {} late, {} evicted unused ({} before their target); {} selection batches, {} "
               "behind speculation ({} keys); queue held by the in-flight limit {}, the bytes cap {}, a selection batch {}\n",
               r.name, r.budget_fraction * 100, busy * 1e3, std::max(r.wall_s_per_token - busy, 0.0) * 1e3, stalls, a.decode,
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
  // Only where an mmap row ran: what its page-cache drop did, and the residency only where the
  // unbounded row measured it.
  if (AnyMmapRow(run)) {
    std::string residency = "not measured (no mmap-unbounded row)";
    if (run.before && !run.before->measured) residency = "not measured (mincore failed)";
    if (f.residency_measured) {
      const auto unbounded = std::find_if(run.results.begin(), run.results.end(),
                                          [](const ConfigResult& r) { return r.name == "mmap-unbounded"; });
      residency = fmt::format("{:.1f}% ({}), when the timed decode started: {}, after: {:.1f}%",
                              100 * run.before->fraction(), f.cold ? "cold" : "NOT cold: the kernel kept the pages",
                              unbounded == run.results.end() ? std::string("-")
                                                             : fmt::format("{:.1f}%", 100 * unbounded->mmap_fraction_at_decode),
                              100 * (run.after ? run.after->fraction() : 0.0));
    }
    fmt::print("mmap: POSIX_FADV_DONTNEED {}; drop_caches {}; checkpoint resident in the page cache before the run: {}\n",
               run.advised ? "accepted" : "refused for some shard", run.drop_caches, residency);
  }
  const std::string unbounded_note = !f.mmap_unbounded_tps ? ""
                                     : !f.residency_measured ? ", its residency not measured"
                                     : f.cold               ? ""
                                                            : ", not cold";
  for (const auto& s : summaries) {
    const std::optional<double> oracle_vs_resident = RatioOf(s.oracle, f.resident_tps);
    std::string resident_target = oracle_vs_resident ? fmt::format("; oracle {:.2f}x resident", *oracle_vs_resident)
                                                     : fmt::format("; oracle vs resident {}", kRowNotRun);
    if (oracle_vs_resident && *oracle_vs_resident >= 0.9 && s.best_tps) {
      resident_target += fmt::format(" so best >= 0.85x resident: {}",
                                     TargetClause(RatioOf(s.best_tps, f.resident_tps), "resident", 0.85));
    } else if (oracle_vs_resident && *oracle_vs_resident < 0.9) {
      resident_target += " (< 0.9x: the resident target does not apply)";
    }
    const std::string recall =
        s.lookahead_recall ? fmt::format("{:.3f} (>= 0.8: {})", *s.lookahead_recall, Yes(*s.lookahead_recall >= 0.8))
                           : std::string(kRowNotRun);
    if (!s.best_tps) {
      // No real predictor's row ran: every target that compares it is n/a, whatever the baselines.
      fmt::print("targets at {:g}%: best real predictor n/a (no lru+lookahead, utility+statistical or "
                 "utility+lookahead row run): its targets against oracle, on-demand, mmap and resident are n/a{}; "
                 "lookahead recall {}\n",
                 s.budget * 100, resident_target, recall);
    } else {
      fmt::print("targets at {:g}%: best real predictor {} {:.1f} tok/s = {}, {}, {} [{}, {}{}]{}; lookahead recall {}\n",
                 s.budget * 100, s.best, *s.best_tps, TargetClause(RatioOf(s.best_tps, s.oracle), "oracle", 0.9),
                 TargetClause(RatioOf(s.best_tps, s.on_demand), "on-demand", 2),
                 TargetClause(RatioOf(s.best_tps, s.mmap), "mmap at the same budget without its eviction work", 3),
                 RatioClause(RatioOf(s.best_tps, s.mmap_with_drops), "with it"),
                 RatioClause(RatioOf(s.best_tps, f.mmap_unbounded_tps), "mmap-unbounded"), unbounded_note,
                 resident_target, recall);
    }
    if (!s.min_nvme_bytes_per_token) {
      fmt::print("bound at {:g}%: n/a (no store-backed row but oracle+belady ran at this budget)\n", s.budget * 100);
    } else {
      const std::string vs_on_demand =
          s.overlap_bound_vs_on_demand && s.overlap_bound_vs_serial_on_demand
              ? fmt::format("{:.2f}x on-demand's measured {:.1f} tok/s and {:.2f}x on-demand's serial model (compute + "
                            "its reads): 2x on-demand is {}",
                            *s.overlap_bound_vs_on_demand, *s.on_demand, *s.overlap_bound_vs_serial_on_demand,
                            *s.overlap_bound_vs_serial_on_demand >= 2
                                ? "within the bound"
                                : "beyond reach at these miss bytes, on any drive (overlap alone gains at most 2x, and "
                                  "only when a token's reads take exactly its compute time; 2x needs fewer missed bytes)")
              : fmt::format("on-demand {}", kRowNotRun);
      fmt::print("bound at {:g}%: the fewest drive bytes any row but oracle+belady read, {:.1f} MiB per token, at {:.2f} "
                 "GB/s with compute ({:.1f} ms) perfectly overlapped allow {:.1f} tok/s = {}\n",
                 s.budget * 100, *s.min_nvme_bytes_per_token / (1 << 20), run.nvme_bytes_per_s / 1e9,
                 run.compute_s_per_token * 1e3, *s.overlap_bound_tps, vs_on_demand);
    }
    if (!s.belady_nvme_bytes_per_token) continue;
    const std::string belady_vs_on_demand =
        s.belady_bound_vs_on_demand && s.belady_bound_vs_serial_on_demand
            ? fmt::format("{:.2f}x on-demand's measured and {:.2f}x its serial model: 2x on-demand is {}",
                          *s.belady_bound_vs_on_demand, *s.belady_bound_vs_serial_on_demand,
                          *s.belady_bound_vs_serial_on_demand >= 2
                              ? "within the bound"
                              : "beyond reach at this budget even with perfect knowledge of the routing and perfect "
                                "overlap")
            : fmt::format("on-demand {}", kRowNotRun);
    fmt::print("Belady bound at {:g}%: the fewest drive bytes a cache of {} experts can read in the decode on this run's "
               "routing (Belady's replacement over the recorded trace: {} blocks demand-paged, less {} a depth-{} prefetch "
               "may read during the prefill), {:.2f} MiB per token ({}), with compute perfectly overlapped allow {:.1f} "
               "tok/s = {}\n",
               s.budget * 100, s.belady_capacity_blocks, s.belady_demand_paged_misses, s.belady_prefill_slack_blocks,
               s.belady_prefill_slack_blocks / static_cast<std::uint64_t>(std::max(run.regime.top_k, 1)), *s.belady_nvme_bytes_per_token / (1 << 20),
               s.belady_row_nvme_bytes_per_token
                   ? fmt::format("the oracle+belady row read {:.2f}", *s.belady_row_nvme_bytes_per_token / (1 << 20))
                   : std::string("no oracle+belady row"),
               s.belady_bound_tps, belady_vs_on_demand);
  }
}

}  // namespace terrace::cli::bench_experts
