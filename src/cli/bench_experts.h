// terrace bench experts, shared by its files: cmd_bench_experts.cpp (flags, the run's order),
// bench_experts_rows.cpp (measuring each row: resident, store-backed, mmap) and
// bench_experts_report.cpp (the targets, JSON and text output). Private to the CLI.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/experts/bench_regime.h"
#include "src/experts/lookahead_limit.h"
#include "src/model/safetensors.h"
#include "terrace/experts.h"
#include "terrace/model.h"
#include "terrace/store.h"

namespace terrace::cli::bench_experts {

// Marks a --dir as this bench's (owned_dirs.h): only a marked directory is ever removed.
inline constexpr std::string_view kExpertsMarker = "terrace-bench-experts.marker";
inline constexpr const char* kAllConfigs =
    "on-demand,lru+lookahead,utility+statistical,utility+lookahead,oracle,oracle+belady,mmap-unbounded,mmap";
// The row whose drive bytes approach the demand-paging minimum (oracle predictor, belady policy).
inline constexpr std::string_view kBeladyRow = "oracle+belady";
// How many MoE layers ahead the oracle rows' predictor prefetches.
inline constexpr int kOracleDepth = 2;

struct Args {
  std::string model;
  std::string dir = "terrace-bench-experts";
  std::string budgets = "25%,50%";
  std::string configs = kAllConfigs;  // the rows to run besides resident (comma-separated)
  int prompt = 16;
  int decode = 32;
  int threads = 1;
  int lookahead_depth = 2;
  int lookahead_embedding_depth = experts::LookaheadOptions{}.embedding_depth;
  bool lookahead_depth_given = false;            // on the command line (refused without a lookahead row)
  bool lookahead_embedding_depth_given = false;  // likewise
  std::optional<double> lookahead_min_confidence;  // unset: LookaheadOptions' default
  std::optional<double> lookahead_min_rank_precision;  // unset: LookaheadOptions' default
  std::optional<double> lookahead_busy_rank_precision;  // unset: LookaheadOptions' default (off)
  bool no_lookahead_supersede = false;
  bool lookahead_provisional = false;
  int lead_protected_layers = experts::ExpertOffloadOptions{}.lead_protected_layers;
  bool lead_protected_layers_given = false;
  std::optional<double> lead_protected_share;  // unset: ExpertOffloadOptions' default
  double link_gbps = 55.0;
  std::optional<double> link_gbps_arg;  // --link-gbps as given (finite); copied into link_gbps
  bool json = false;
  bool keep = false;
  bool drop_caches = false;  // also echo 1 > /proc/sys/vm/drop_caches before the mmap run (root only)
};

// Progress lines on stderr: phase starts, and within a long phase at most one line per 2 s.
class PhaseProgress {
 public:
  void Phase(const std::string& what);
  void Tick(const char* step, int done, int total);

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
  std::string phase_;
};

// Page-cache residency of the checkpoint's shards (mincore over a fresh read-only mapping of each).
struct Residency {
  std::uint64_t file_bytes = 0, resident_bytes = 0;
  bool measured = true;  // false when some shard could not be mapped or queried
  double fraction() const { return file_bytes == 0 ? 0.0 : static_cast<double>(resident_bytes) / static_cast<double>(file_bytes); }
};

// One row of the table: a configuration at a budget.
struct ConfigResult {
  std::string name;
  double budget_fraction = 1.0;
  double tokens_per_s = 0;
  // Unset (null in the JSON, "-" in the table) where the row has no such figure: hit_rate for
  // resident (nothing is loaded) and mmap-unbounded (no budget to charge an expert to); recall and
  // precision for resident, on-demand and the mmap rows (no predictor; on-demand's layer_recall is
  // empty too); precision also where a predictor predicted nothing (0/0).
  std::optional<double> hit_rate, recall, precision;
  // The share of the decode time the forward pass waited on expert loads (resident: 0), and the
  // tokens/s of compute + this hit rate's miss transfers, serially. Unset (null in the JSON) for the
  // mmap rows, which measure neither (their waits are page faults inside the forward pass).
  std::optional<double> stall_share, bound_tokens_per_s;
  double io_bound_tokens_per_s = 0;  // the miss transfers alone (link + drive): no predictor can beat it; 0: no misses
  double miss_bytes_per_token = 0;
  std::uint64_t bytes_read[kNumTiers] = {0, 0, 0};
  // Whole run: prefetched bytes landed; of them, evicted before any use, and resident unused at the end.
  std::uint64_t speculative_bytes = 0, wasted_bytes = 0, unused_bytes = 0;
  std::vector<double> layer_recall;
  // Per decode token, every row: the wall time, the forward (this) thread's CPU time, and the CPU
  // time of the process's other threads (the store's lanes, the NVMe tier's rings) over the same steps.
  double wall_s_per_token = 0, forward_cpu_s_per_token = 0, background_cpu_s_per_token = 0;
  std::vector<std::uint64_t> expert_load;  // whole run (prefill included): tokens routed to each expert id, summed over MoE layers
  std::vector<int> hot_experts;            // ids hot (load > hot_factor x the layer mean) in some MoE layer
  // Store-backed rows: the decode steps' schedule (ExpertScheduleMetrics, m1 - m0) and stall per MoE layer.
  experts::ExpertScheduleMetrics schedule;
  std::vector<double> layer_stall_s_per_token;
  // Perfect overlap of compute and this row's drive reads: 1 / max(compute, NVMe bytes per token /
  // drive rate + / link). 0 for rows without NVMe reads.
  double drive_bound_tokens_per_s = 0;
  // mmap rows: the page-cache budget (0: unbounded), the checkpoint's residency before the run, the
  // experts' page-cache bytes after it (mincore) and the provider's counters.
  std::uint64_t mmap_budget_bytes = 0, mmap_expert_bytes_after = 0, mmap_peak_charged_bytes = 0, mmap_evictions = 0,
                mmap_overcommits = 0, mmap_spill_dropped_bytes = 0, mmap_drop_failures = 0;
  std::uint64_t mmap_expert_bytes_settled = 0;
  double mmap_drop_s_per_token = 0, mmap_tokens_per_s_without_drops = 0;
  bool mmap_settled = true;
  double mmap_cold_fraction_before = 0;
  // The checkpoint's page-cache residency when the timed decode started (after the untimed prefill
  // and the read-ahead it set off): a row "cold" before the run may decode warm.
  double mmap_fraction_at_decode = 0;
  bool mmap_cold_measured = false;
  bool IsMmap() const { return name.starts_with("mmap"); }
  std::uint64_t nvme_bytes() const { return bytes_read[static_cast<int>(TierId::kNvme)]; }
};

// A store-backed configuration: a cache policy and a predictor.
struct CachedConfig {
  std::string name;
  experts::CachePolicyKind policy;
  experts::PredictorKind predictor;
};

// The store-backed rows, in the order they run.
const std::vector<CachedConfig>& CachedConfigs();

// What the rows of one run share and what they measured, filled in the order the run goes.
struct Run {
  Args a;
  model::ModelConfig config;
  std::vector<int> prompt;
  experts::BenchRegime regime;
  std::uint64_t total = 0;  // routed expert bytes
  LinkModel link;
  PhaseProgress progress;
  // From the resident row: a token's compute (this thread's CPU time with one BLAS thread, else
  // wall time) and its wall time; the lookahead's limit on this model.
  double compute_s_per_token = 0, resident_wall_s_per_token = 0;
  experts::LookaheadLimit limit;
  double nvme_bytes_per_s = 0;  // the drive's read rate over every expert block (MeasureDrive)
  // The routing of the prompt and decode steps as the first store-backed row recorded it (the
  // same in every row): oracle+belady replays it, and the Belady bound is computed over it.
  std::shared_ptr<const experts::RoutingTrace> recorded;
  std::vector<ConfigResult> results;
  // Whether this run took --dir's store as its own: set by StoreExpertsAndMeasureDrive right before
  // its store open, --dir then being empty (CheckStillNew). Only then does the cleanup remove the
  // store in --dir (marked or not), or mark it with --keep.
  bool made_store = false;
  // The mmap rows: whether every shard took POSIX_FADV_DONTNEED, what --drop-caches did, and the
  // checkpoint's residency around the unbounded row (unset unless that row ran).
  bool advised = true;
  std::string drop_caches = "not requested (pass --drop-caches, as root)";
  std::optional<Residency> before, after;

  // NVMe bytes per decode token of `r`.
  double NvmePerToken(const ConfigResult& r) const { return static_cast<double>(r.nvme_bytes()) / a.decode; }
  // Tokens/s with compute and `drive_bytes` per token of reads (off the drive, over the link)
  // perfectly overlapped.
  double OverlapTokensPerS(double drive_bytes) const;
};

// The row all-resident (experts in memory): also sets run->compute_s_per_token,
// resident_wall_s_per_token and limit.
Result<ConfigResult> RunResidentRow(Run* run, const model::ModelDir& md);

// Stores every routed expert on the NVMe tier under `dir` (marking it as this bench's), then reads
// every block back: run->nvme_bytes_per_s. The run's first store open: `dir` must still be empty
// (CheckStillNew's Unavailable otherwise, nothing opened), and run->made_store is set before the open.
Status StoreExpertsAndMeasureDrive(Run* run, const model::ModelDir& md, const std::filesystem::path& dir);

// One store-backed row: a cold cache of `budget` over the NVMe tier, the configuration's policy and
// predictor, `a.decode` timed decode steps. Records run->recorded on the first such row.
Result<ConfigResult> RunCachedRow(Run* run, const model::ModelDir& md, const CachedConfig& c,
                                  const experts::CacheBudget& budget);

// One mmap row: the checkpoint read through mmap, its pages dropped first; `budget_bytes` 0: unbounded.
Result<ConfigResult> RunMmapRow(Run* run, const std::string& name, double fraction, std::uint64_t budget_bytes);

// The targets at one budget. A figure whose row --configs left out is unset, and so is every
// ratio that needs it: the outputs print "n/a (row not run)" (JSON: null), never a ratio against
// an absent row's 0 tokens/s (inf, or 0) or a target "met" against it.
struct TargetSummary {
  double budget = 0;
  std::string best;  // the fastest real predictor's row; empty when none of them ran
  std::optional<double> best_tps, oracle, on_demand, lookahead_recall;
  double io_bound_oracle = 0, io_bound_best = 0;  // 0: the row did not run, or had no misses
  std::optional<double> mmap;             // the budgeted mmap baseline at this budget, its eviction work left out
  std::optional<double> mmap_with_drops;  // and as measured
  // The 2x-on-demand question: the fewest drive bytes per decode token any store-backed row read
  // at this budget (unset: none ran), what that allows with compute and reads perfectly overlapped,
  // and that over on-demand's serial time (compute + its stall) and over its measured tokens/s
  // (unset without an on-demand row).
  // oracle+belady is left out of that minimum, so that it stays comparable with runs before the
  // row existed; the Belady minimum below is the bound proper.
  std::optional<double> min_nvme_bytes_per_token, overlap_bound_tps, overlap_bound_vs_on_demand,
      overlap_bound_vs_serial_on_demand;
  // The same for the fewest drive bytes any demand-paged cache of this budget can read on this run's
  // routing (Belady's replacement, simulated over the recorded trace: SimulateBelady); unset when
  // no store-backed row ran. belady_row_nvme_bytes_per_token: what the oracle+belady row read.
  std::optional<double> belady_nvme_bytes_per_token;
  double belady_bound_tps = 0;
  std::optional<double> belady_bound_vs_on_demand, belady_bound_vs_serial_on_demand;
  std::uint64_t belady_capacity_blocks = 0;
  // Blocks a row's prefetches may read during the prefill for the first decode step (its deepest
  // predictor's depth x top-k): Belady's decode-step misses less these bound every row's decode
  // reads, prefetching ones included (belady_nvme_bytes_per_token is that bound).
  std::uint64_t belady_prefill_slack_blocks = 0, belady_demand_paged_misses = 0;
  std::optional<double> belady_row_nvme_bytes_per_token;  // unset: the row did not run
};

// Sets every row's drive bound and sums up the targets at each budget.
std::vector<TargetSummary> SummarizeTargets(Run* run, const std::vector<experts::CacheBudget>& budgets);

// The run as one JSON object on stdout (--json).
void PrintJson(const Run& run, const std::vector<TargetSummary>& summaries);

// The run as text on stdout: the regime, the table, the per-row details and the targets.
void PrintText(const Run& run, const std::vector<TargetSummary>& summaries);

}  // namespace terrace::cli::bench_experts
