// terrace bench experts: decode speed with the routed experts offloaded (docs/experts.md,
// "Benchmark"). Side by side in one run: all-resident; on-demand; lru+lookahead;
// utility+statistical; oracle; oracle+belady (each at every --budget, experts cold on the NVMe tier with O_DIRECT,
// the host-to-HBM link modelled by the emulated HBM tier); and an mmap baseline (experts read
// through mmap of the safetensors files, page cache dropped first where permitted, coldness checked
// with mincore). Prints the regime (expert bytes, bytes an all-miss token moves, compute per token),
// the I/O bound at each measured hit rate, per-layer recall and the targets.
//
// This file: the flags and the run's order. The rows are measured in bench_experts_rows.cpp, the
// targets and output are in bench_experts_report.cpp (bench_experts.h).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "src/cli/bench_experts.h"
#include "src/cli/bench_own_store.h"
#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/model_run_experts.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/experts/mmap_experts.h"
#include "src/model/ops.h"

namespace terrace::cli {
namespace {

using bench_experts::Args;
using bench_experts::kAllConfigs;
using bench_experts::kExpertsMarker;

// --budgets: comma-separated percentages (no sizes: an error offers only percentages).
Result<std::vector<experts::CacheBudget>> ParseBudgets(const std::string& list) {
  std::vector<experts::CacheBudget> budgets;
  for (const std::string& item : SplitCommas(list)) {
    auto b = experts::CacheBudget::ParsePercent(item);
    if (!b.ok()) return Status::InvalidArgument("--budgets: " + b.status().message());
    for (const experts::CacheBudget& seen : budgets)
      if (seen.fraction == b->fraction)  // each budget's rows and summary are its own
        return Status::InvalidArgument(fmt::format("--budgets: {} is given twice; list each budget once", item));
    budgets.push_back(*b);
  }
  return budgets;
}

// --configs: comma-separated names from kAllConfigs.
Result<std::vector<std::string>> ParseConfigs(const std::string& list) {
  const std::string all = std::string(",") + kAllConfigs + ",";
  std::vector<std::string> wanted = SplitCommas(list);
  for (const std::string& name : wanted)
    if (name.empty() || all.find("," + name + ",") == std::string::npos)
      return Status::InvalidArgument(fmt::format("--configs: unknown configuration '{}' (choose from {})", name, kAllConfigs));
  for (std::size_t i = 0; i < wanted.size(); ++i)
    if (std::find(wanted.begin(), wanted.begin() + i, wanted[i]) != wanted.begin() + i)
      return Status::InvalidArgument(fmt::format("--configs: '{}' is given twice; list each configuration once", wanted[i]));
  return wanted;
}

// The lookahead flags tune only the rows whose predictor is lookahead: refused without one.
Status CheckLookaheadFlags(const Args& a, const std::vector<std::string>& wanted) {
  const bool any_lookahead = std::any_of(wanted.begin(), wanted.end(),
                                         [](const std::string& n) { return n.find("lookahead") != std::string::npos; });
  if (any_lookahead) return Status::Ok();
  const std::pair<bool, const char*> lookahead_flags[] = {
      {a.lookahead_depth_given, "--lookahead-depth"},
      {a.lookahead_embedding_depth_given, "--lookahead-embedding-depth"},
      {a.lookahead_min_confidence.has_value(), "--lookahead-min-confidence"},
      {a.lookahead_min_rank_precision.has_value(), "--lookahead-min-rank-precision"},
      {a.lookahead_busy_rank_precision.has_value(), "--lookahead-busy-rank-precision"},
      {a.no_lookahead_supersede, "--no-lookahead-supersede"},
      {a.lookahead_provisional, "--lookahead-provisional"}};
  for (const auto& [given, flag] : lookahead_flags) {
    if (given)
      return Status::InvalidArgument(fmt::format("{} tunes the lookahead rows, and --configs '{}' has none; add one "
                                                 "(e.g. lru+lookahead) or drop {}",
                                                 flag, a.configs, flag));
  }
  return Status::Ok();
}

// The lead-protection flags size the cache partition of the store-backed rows other than
// oracle+belady (the replacement bound, which runs unpartitioned): refused without one, and the
// share without protected layers.
Status CheckLeadFlags(const Args& a, const std::vector<std::string>& wanted) {
  const bool any_partitioned = std::any_of(wanted.begin(), wanted.end(), [](const std::string& n) {
    return n != "mmap" && n != "mmap-unbounded" && n != bench_experts::kBeladyRow;
  });
  const std::pair<bool, const char*> lead_flags[] = {{a.lead_protected_layers_given, "--lead-protected-layers"},
                                                     {a.lead_protected_share.has_value(), "--lead-protected-share"}};
  for (const auto& [given, flag] : lead_flags) {
    if (given && !any_partitioned)
      return Status::InvalidArgument(fmt::format("{} sizes the expert cache of the store-backed rows other than {}, and "
                                                 "--configs '{}' has none; add one (e.g. on-demand) or drop {}",
                                                 flag, bench_experts::kBeladyRow, a.configs, flag));
  }
  if (a.lead_protected_share && a.lead_protected_layers == 0)
    return Status::InvalidArgument("--lead-protected-share is the budget share of the --lead-protected-layers experts, "
                                   "and --lead-protected-layers is 0 (off); give --lead-protected-layers N or drop "
                                   "--lead-protected-share");
  return Status::Ok();
}

// --lookahead-busy-rank-precision raises the rank gate from --lookahead-min-rank-precision toward
// it: a value at or below the minimum would leave the gate where it is (LookaheadOptions::
// RankThreshold reads it as off) while the report records it. 0 is the documented "off".
Status CheckBusyRankPrecision(const Args& a) {
  if (!a.lookahead_busy_rank_precision || *a.lookahead_busy_rank_precision == 0) return Status::Ok();
  const double busy = *a.lookahead_busy_rank_precision;
  const double min = a.lookahead_min_rank_precision.value_or(experts::LookaheadOptions{}.min_rank_precision);
  if (busy > min) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "--lookahead-busy-rank-precision {:g} is not above --lookahead-min-rank-precision {:g}{}: the busy threshold is "
      "where the gate rises to from that minimum under load; give a value above {:g}, or 0 (off)",
      busy, min, a.lookahead_min_rank_precision ? "" : " (its default)", min));
}

// The flags counting layers stay within the model: --lookahead-depth below its layer count (no
// layer lies further ahead), --lookahead-embedding-depth and --lead-protected-layers at most its
// MoE layers (more would change nothing while the report records them).
Status CheckLayerFlags(const Args& a, const model::ModelConfig& config) {
  const int moe_layers = config.NumMoeLayers();
  if (a.lookahead_depth_given) TERRACE_RETURN_IF_ERROR(CheckLookaheadDepth(a.lookahead_depth, config));
  const std::pair<int, const char*> moe_flags[] = {
      {a.lookahead_embedding_depth_given ? a.lookahead_embedding_depth : 0, "--lookahead-embedding-depth"},
      {a.lead_protected_layers_given ? a.lead_protected_layers : 0, "--lead-protected-layers"}};
  for (const auto& [value, flag] : moe_flags)
    if (value > moe_layers)
      return Status::InvalidArgument(fmt::format("{} {} is more than the model's {} MoE layers; give at most {}", flag,
                                                 value, moe_layers, moe_layers));
  return Status::Ok();
}

// --drop-caches drops the page cache before the mmap rows only: refused without one.
Status CheckDropCaches(const Args& a, const std::vector<std::string>& wanted) {
  const bool any_mmap =
      std::any_of(wanted.begin(), wanted.end(), [](const std::string& n) { return n == "mmap" || n == "mmap-unbounded"; });
  if (!a.drop_caches || any_mmap) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "--drop-caches drops the page cache before the mmap rows, and --configs '{}' has none; add mmap or "
      "mmap-unbounded, or drop --drop-caches",
      a.configs));
}

constexpr const char* kBenchExpertsWho = "terrace bench experts";

// Whether the run created --dir itself (a folder that already existed stays, even one that held an
// earlier run's store: it may be the user's). Whether a store in --dir is the run's own is
// Run::made_store, set only by the run's first store open.
struct DirClaim {
  bool created_dir = false;
};

// Removes the store the run made in --dir (run.made_store), marked or not (RemoveOwnStore), and
// --dir itself when the run created it and it is empty then; with --keep, marks that store instead
// (MarkOwnStore), so a later run recognises it. A run that made no store removes and marks nothing
// in --dir. True when a store was removed; the error naming --dir otherwise.
Result<bool> RemoveBenchStore(const Args& a, const DirClaim& claim, const bench_experts::Run& run) {
  if (a.keep) {
    if (run.made_store) TERRACE_RETURN_IF_ERROR(MarkOwnStore(a.dir, kExpertsMarker, kBenchExpertsWho));
    return false;
  }
  bool removed = false;
  if (run.made_store) {
    TERRACE_ASSIGN_OR_RETURN(removed, RemoveOwnStore(a.dir, kExpertsMarker, "--dir"));
  }
  std::error_code ec;
  if (claim.created_dir) std::filesystem::remove(a.dir, ec);  // only if empty
  return removed;
}

// The flags, each refused with a usage error naming it; the model's config and the parsed budgets
// into `run` and `budgets`. 0, or the process exit code.
int PrepareRun(const Args& a, bench_experts::Run* run, std::vector<experts::CacheBudget>* budgets,
               std::vector<std::string>* wanted, std::unique_ptr<model::ModelDir>* md) {
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckStoreDirArg(a.dir, "--dir"); !s.ok()) return FailUsage(s.message());
  auto parsed = ParseBudgets(a.budgets);
  if (!parsed.ok()) return FailUsage(parsed.status().message());
  *budgets = std::move(parsed).value();
  // --link-gbps is checked by its option (above 0).
  auto configs = ParseConfigs(a.configs);
  if (!configs.ok()) return FailUsage(configs.status().message());
  *wanted = std::move(configs).value();
  if (Status s = CheckLookaheadFlags(a, *wanted); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckDropCaches(a, *wanted); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckLeadFlags(a, *wanted); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckBusyRankPrecision(a); !s.ok()) return FailUsage(s.message());
  model::ops::SetBlasThreads(a.threads);
  auto opened = model::ModelDir::Open(a.model);
  if (!opened.ok()) return Fail(opened.status().ToString());
  *md = std::move(opened).value();
  run->a = a;
  run->config = (*md)->config();
  if (!run->config.HasRoutedExperts()) {
    return FailUsage("--model: the model has no routed experts (num_experts is 0 or every layer is dense); bench "
                     "experts needs a MoE model");
  }
  if (Status s = CheckLayerFlags(a, run->config); !s.ok()) return FailUsage(s.message());
  for (int i = 0; i < a.prompt; ++i) run->prompt.push_back((i * 37 + 5) % run->config.vocab_size);
  run->regime = experts::BenchRegimeOf(run->config);
  run->total = run->regime.routed_expert_bytes;
  run->link.bandwidth_bytes_per_s = a.link_gbps * 1e9;
  // Before any row runs, every budget must hold one expert: a store block, and for the mmap row its
  // largest expert's whole pages (below that every load of it overcommits the budget).
  std::uint64_t mmap_span = 0;
  if (std::find(wanted->begin(), wanted->end(), "mmap") != wanted->end()) {
    auto probe = experts::MmapExpertProvider::Open(**md, {});
    if (!probe.ok()) return Fail(probe.status().ToString());
    mmap_span = (*probe)->max_expert_span_bytes();
  }
  const auto least_percent = [&](std::uint64_t bytes) {
    return std::ceil(1e4 * static_cast<double>(bytes) / static_cast<double>(run->total)) / 100.0;
  };
  for (const experts::CacheBudget& b : *budgets) {
    const std::uint64_t bytes = b.Resolve(run->total);
    if (bytes < run->regime.block_bytes)
      return FailUsage(fmt::format("--budgets: {} of this model's routed experts ({} bytes) is {} bytes, smaller than one "
                                   "expert block ({} bytes); give at least {:.2f}%",
                                   b.ToString(), run->total, bytes, run->regime.block_bytes,
                                   least_percent(run->regime.block_bytes)));
    if (bytes < mmap_span)
      return FailUsage(fmt::format("--budgets: {} of this model's routed experts ({} bytes) is {} bytes, smaller than the "
                                   "whole pages of its largest expert in the checkpoint ({} bytes), which the mmap row "
                                   "must hold; give at least {:.2f}%, or leave mmap out of --configs",
                                   b.ToString(), run->total, bytes, mmap_span, least_percent(mmap_span)));
  }
  return 0;
}

// Takes --dir for the run: removes an earlier run's marked leftover, creates it when absent. 0, or
// the process exit code.
int ClaimDir(const Args& a, DirClaim* claim) {
  const std::filesystem::path dir(a.dir);
  std::error_code ec;
  const bool existed = std::filesystem::exists(std::filesystem::symlink_status(dir, ec));
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    auto removed = RemoveOwnedStore(dir, kExpertsMarker, "--dir", kBenchExpertsWho);
    if (!removed.ok()) return FailUsage(removed.status().message());
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
  claim->created_dir = !existed;
  return 0;
}

// Runs every row in order (resident; the experts onto the NVMe tier; the store-backed rows at each
// budget; the mmap rows) into `run`, leaving the cleanup of --dir to the caller. 0, or the process
// exit code.
int RunRows(const Args& a, DirClaim* claim, bench_experts::Run* run, std::vector<experts::CacheBudget>* budgets) {
  std::vector<std::string> wanted;
  std::unique_ptr<model::ModelDir> md;
  if (int rc = PrepareRun(a, run, budgets, &wanted, &md); rc != 0) return rc;
  auto run_config = [&](const std::string& name) { return std::find(wanted.begin(), wanted.end(), name) != wanted.end(); };
  if (int rc = ClaimDir(a, claim); rc != 0) return rc;
  auto resident = bench_experts::RunResidentRow(run, *md);
  if (!resident.ok()) return FailUnlessStopped(resident.status());
  run->results.push_back(std::move(resident).value());
  if (Status s = bench_experts::StoreExpertsAndMeasureDrive(run, *md, a.dir); !s.ok()) return FailUnlessStopped(s);
  for (const auto& budget : *budgets) {
    for (const bench_experts::CachedConfig& c : bench_experts::CachedConfigs()) {
      if (!run_config(c.name)) continue;
      auto r = bench_experts::RunCachedRow(run, *md, c, budget);
      if (!r.ok()) return FailUnlessStopped(r.status());
      run->results.push_back(std::move(r).value());
    }
  }
  md.reset();  // the checkpoint's own mapping goes: the mmap rows drop its pages from the page cache
  auto mmap_row = [&](const std::string& name, double fraction, std::uint64_t budget_bytes) -> Status {
    TERRACE_ASSIGN_OR_RETURN(auto r, bench_experts::RunMmapRow(run, name, fraction, budget_bytes));
    run->results.push_back(std::move(r));
    return Status::Ok();
  };
  if (run_config("mmap-unbounded"))
    if (Status s = mmap_row("mmap-unbounded", 1.0, 0); !s.ok()) return FailUnlessStopped(s);
  if (run_config("mmap"))
    for (const auto& budget : *budgets)
      if (Status s = mmap_row("mmap", budget.fraction, budget.Resolve(run->total)); !s.ok()) return FailUnlessStopped(s);
  return 0;
}

// The rows, then the cleanup of --dir on every exit path (an error, a stop signal, success), then
// the results (only when every row ran and the cleanup succeeded). The process exit code.
int RunBenchExperts(const Args& a) {
  StopSignals stop_signals;  // Ctrl-C: stop before the next decode step, remove the store in --dir (unless --keep)
  DirClaim claim;
  bench_experts::Run run;
  std::vector<experts::CacheBudget> budgets;
  int rc = RunRows(a, &claim, &run, &budgets);
  const Result<bool> removed = RemoveBenchStore(a, claim, run);
  if (StopSignalReceived() != 0)
    return ExitStopped("bench experts", removed.ok() && *removed ? "; removed the store it created in --dir" : "");
  if (!removed.ok()) {
    fmt::print(stderr, "{}: left {} in place: {}\n", kBenchExpertsWho, a.dir, removed.status().message());
    return rc != 0 ? rc : 1;
  }
  if (rc != 0) return rc;
  const std::vector<bench_experts::TargetSummary> summaries = bench_experts::SummarizeTargets(&run, budgets);
  if (a.json) {
    bench_experts::PrintJson(run, summaries);
  } else {
    bench_experts::PrintText(run, summaries);
  }
  return 0;
}

}  // namespace

void RegisterBenchExperts(CLI::App* bench, Runner* run) {
  auto a = std::make_shared<bench_experts::Args>();
  auto* cmd = bench->add_subcommand("experts", "Decode speed with routed experts offloaded to NVMe, per cache policy and predictor");
  cmd->add_option("--model", a->model, "MXFP4 model directory (e.g. from terrace model init)")->required();
  cmd->add_option("--dir", a->dir, "NVMe tier directory for the expert store; created, marked "
                                   "(terrace-bench-experts.marker) and removed afterwards, also on SIGINT/SIGTERM (unless "
                                   "--keep; the folder too when the bench created it); the next run removes a marked "
                                   "leftover of a killed run")
      ->capture_default_str()->transform(NormalizedPath());
  cmd->add_option("--budgets", a->budgets, "Fast-tier budgets, percentages of the routed expert bytes")->capture_default_str();
  cmd->add_option("--configs", a->configs,
                  "Rows to run besides resident, comma-separated (a quick A/B; the targets need on-demand, oracle, mmap and a "
                  "real predictor)")
      ->capture_default_str();
  AddIntOption(cmd, "--prompt", &a->prompt, 1, 65536, "Prompt tokens (prefilled, untimed)");
  AddIntOption(cmd, "--decode", &a->decode, 1, 65536, "Timed decode tokens per configuration");
  AddIntOption(cmd, "--threads", &a->threads, 1, 256, "OpenBLAS threads");
  auto* depth_opt =
      AddIntOption(cmd, "--lookahead-depth", &a->lookahead_depth, 1, 64, "Layers the lookahead rows predict ahead");
  auto* embedding_depth_opt = AddIntOption(cmd, "--lookahead-embedding-depth", &a->lookahead_embedding_depth, 0, 64,
               "MoE layers the lookahead rows predict from the embedding at token start (0: off; default 1)");
  AddDoubleOption(cmd, "--lookahead-min-confidence", &a->lookahead_min_confidence, 0.0, 1.0,
                  "Running precision below which lookahead stops predicting a distance > 1 or an embedding target "
                  "(default 0.5)");
  AddDoubleOption(cmd, "--lookahead-min-rank-precision", &a->lookahead_min_rank_precision, 0.0, 1.0,
                  "Lookahead prefetches only the experts whose top-k rank's running precision at their distance is at "
                  "least this (0: off; default 0.7)");
  AddDoubleOption(cmd, "--lookahead-busy-rank-precision", &a->lookahead_busy_rank_precision, 0.0, 1.0,
                  "Raise that threshold with the drive's load: linearly from --lookahead-min-rank-precision while "
                  "expert loads were in flight for half of the last token's time, to this when they were all of it "
                  "(0: off, the default)");
  cmd->add_flag("--no-lookahead-supersede", a->no_lookahead_supersede,
                "Keep queued lookahead prefetches that a nearer prediction of the same layer leaves out");
  cmd->add_flag("--lookahead-provisional", a->lookahead_provisional,
                "Hold lookahead's distance > 1 predictions to two in flight until the nearer prediction arrives");
  auto* lead_opt = AddIntOption(cmd, "--lead-protected-layers", &a->lead_protected_layers, 0, 64,
               "First MoE layers whose experts get a reserved share of every store-backed row's cache (their misses "
               "have no lead time to hide behind; 0: off; default 1)");
  AddDoubleOption(cmd, "--lead-protected-share", &a->lead_protected_share, 0.0, 1.0,
                  "Share of the budget reserved for the --lead-protected-layers experts (default 0.5)");
  AddPositiveDoubleOption(cmd, "--link-gbps", &a->link_gbps_arg, 1e6,
                          fmt::format("Host-to-HBM link model, GB/s (emulated HBM tier; default {:g})", a->link_gbps));
  cmd->add_flag("--json", a->json, "Print one JSON object with a configs list");
  cmd->add_flag("--keep", a->keep, "Keep the NVMe directory afterwards");
  cmd->add_flag("--drop-caches", a->drop_caches,
                "Before the mmap baseline, also drop the whole system's page cache (echo 1 > "
                "/proc/sys/vm/drop_caches; root only)");
  cmd->callback([run, a, depth_opt, embedding_depth_opt, lead_opt] {
    a->lookahead_depth_given = depth_opt->count() > 0;
    a->lead_protected_layers_given = lead_opt->count() > 0;
    a->lookahead_embedding_depth_given = embedding_depth_opt->count() > 0;
    if (a->link_gbps_arg) a->link_gbps = *a->link_gbps_arg;
    *run = [a] { return RunBenchExperts(*a); };
  });
}

}  // namespace terrace::cli
