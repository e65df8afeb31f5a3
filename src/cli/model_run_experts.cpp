#include "src/cli/model_run_experts.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/common/generator_mark.h"
#include "src/experts/bench_regime.h"

namespace terrace::cli {
namespace {

// The expert store behind --store DIR (DIR/experts) could not take this model's experts: says
// why that happens and what the user can do, in CLI words.
Status ExpertStoreFull(const ExpertRun& run, const std::string& nvme_dir, const model::ModelConfig& config,
                       const Status& s) {
  std::uint64_t blocks = 0;
  for (const TierStatsSnapshot& t : run.store->Stats().tiers) {
    if (t.name == "nvme") blocks = t.blocks;
  }
  std::uint64_t own = 0;
  for (int l = 0; l < config.num_hidden_layers; ++l) own += config.IsDenseLayer(l) ? 0 : config.num_experts;
  return Status::OutOfCapacity(fmt::format(
      "--store: the expert store {} is full: it holds {} blocks and this model has {} experts; its size was fixed "
      "when it was created (by the first model run with this --store), and it keeps the experts of every model "
      "(weights or config) run with it. Use another --store directory for this model, or remove {} (it holds "
      "only copies of experts, read again from --model on the next run). The store said: {}",
      nvme_dir, blocks, own, nvme_dir, s.message()));
}

}  // namespace

void AddExpertFlags(CLI::App* cmd, ExpertRunArgs* a) {
  cmd->add_option("--expert-cache", a->cache,
                  "Offload the routed experts: keep them as MXFP4 blocks in the expert store and cache this much of "
                  "them in the fast (HBM) tier, as a share of all routed expert bytes (25%) or a size (64MiB)");
  cmd->add_option("--predictor", a->predictor,
                  "Which experts to prefetch (with --expert-cache): lookahead (the next layers' routers on the current "
                  "hidden state), statistical (co-activation counts), none (on demand only), oracle (replays this "
                  "run's own routing, recorded in a first pass)")
      ->default_str("lookahead")
      ->each([a](const std::string&) { a->predictor_given = true; });
  cmd->add_option("--expert-policy", a->policy,
                  "Fast-tier cache policy (with --expert-cache): lru, lfu, utility (P(use within the lookahead "
                  "window) x reload cost), belady (evict the expert used farthest ahead; only with --predictor oracle, "
                  "whose recorded routing is the future it needs: the replacement bound)")
      ->default_str("utility")
      ->each([a](const std::string&) { a->policy_given = true; });
  cmd->add_option("--expert-home", a->home,
                  "Where each expert's one immutable copy lives: host or nvme (default: nvme with --store, in "
                  "DIR/experts; host otherwise)");
  AddIntOption(cmd, "--lookahead-depth", &a->depth, 1, 16,
               "Layers ahead the lookahead and oracle predictors look, and the utility policy's window (with "
               "--expert-cache)")
      ->each([a](const std::string&) { a->depth_given = true; });
  cmd->add_option("--expert-prometheus", a->prometheus,
                  "Also write the expert cache's metrics to this file in Prometheus text format");
}

Status CheckExpertBudget(const experts::CacheBudget& budget, const std::string& text, const model::ModelConfig& config,
                         std::string_view flag) {
  if (!config.HasRoutedExperts()) return Status::Ok();  // the caller refuses the model
  const experts::BenchRegime regime = experts::BenchRegimeOf(config);
  const std::uint64_t total = regime.routed_expert_bytes;
  const std::uint64_t bytes = budget.Resolve(total);
  if (bytes >= regime.block_bytes) return Status::Ok();
  const std::string what = budget.bytes != 0
                               ? fmt::format("{} {} ({} bytes)", flag, text, bytes)
                               : fmt::format("{} {} ({} bytes of the model's {} bytes of routed experts)", flag, text,
                                             bytes, total);
  return Status::InvalidArgument(fmt::format(
      "{} is smaller than one expert block ({} bytes); give at least {} bytes or {:.2f}%", what, regime.block_bytes,
      regime.block_bytes,
      std::ceil(1e4 * static_cast<double>(regime.block_bytes) / static_cast<double>(total)) / 100.0));
}

Status CheckLookaheadDepth(int depth, const model::ModelConfig& config, std::string_view flag) {
  const int layers = config.num_hidden_layers;
  if (depth < layers) return Status::Ok();
  return Status::InvalidArgument(fmt::format("{} {} reaches past the model: it has {} layers, so a layer lies at most "
                                             "{} ahead; give at most {}",
                                             flag, depth, layers, layers - 1, layers - 1));
}

Result<ExpertRun> OpenExpertRun(const ExpertRunArgs& a, const std::string& store_dir, const model::ModelConfig& config,
                                const model::WeightSource& weights, const OutputRules& out_rules) {
  ExpertRun run;
  if (a.cache.empty()) {
    for (const auto& [flag, set] :
         {std::pair{"--expert-home", !a.home.empty()}, {"--expert-prometheus", !a.prometheus.empty()},
          {"--predictor", a.predictor_given}, {"--expert-policy", a.policy_given}, {"--lookahead-depth", a.depth_given}})
      if (set) return Status::InvalidArgument(fmt::format("{} needs --expert-cache (e.g. --expert-cache 25%)", flag));
    return run;
  }
  auto budget = experts::CacheBudget::Parse(a.cache);
  if (!budget.ok()) return Status::InvalidArgument("--expert-cache: " + budget.status().message());
  TERRACE_RETURN_IF_ERROR(CheckExpertBudget(*budget, a.cache, config));
  auto predictor = experts::ParsePredictor(a.predictor);
  if (!predictor.ok()) return Status::InvalidArgument("--predictor: " + predictor.status().message());
  auto policy = experts::ParseCachePolicy(a.policy);
  if (!policy.ok()) return Status::InvalidArgument("--expert-policy: " + policy.status().message());
  if (Status s = experts::CheckPolicyPredictor(*policy, *predictor); !s.ok())
    return Status::InvalidArgument(fmt::format("--expert-policy {} with --predictor {}: {}; use --predictor oracle, "
                                               "or another --expert-policy (lru, lfu or utility)",
                                               a.policy, a.predictor, s.message()));
  // The depth is the lookahead and oracle predictors' reach and the utility policy's window.
  const bool uses_depth = *predictor == experts::PredictorKind::kLookahead ||
                          *predictor == experts::PredictorKind::kOracle || *policy == experts::CachePolicyKind::kUtility;
  if (a.depth_given && !uses_depth) {
    return Status::InvalidArgument(fmt::format(
        "--lookahead-depth sets how far the lookahead and oracle predictors look and the utility policy's window; "
        "--predictor {} with --expert-policy {} uses neither: drop --lookahead-depth",
        a.predictor, a.policy));
  }
  if (a.depth_given) TERRACE_RETURN_IF_ERROR(CheckLookaheadDepth(a.depth, config));
  if (!a.prometheus.empty())
    TERRACE_RETURN_IF_ERROR(
        CheckOutputFile(a.prometheus, "--expert-prometheus", out_rules.As(OutputFormat::kPrometheus)));
  const std::string home = a.home.empty() ? (store_dir.empty() ? "host" : "nvme") : a.home;
  if (home != "host" && home != "nvme")
    return Status::InvalidArgument(fmt::format("--expert-home: '{}' is not host or nvme", home));
  if (home == "nvme" && store_dir.empty())
    return Status::InvalidArgument("--expert-home nvme needs --store DIR (the experts go to DIR/experts)");
  if (!config.HasRoutedExperts()) {
    return Status::InvalidArgument(
        "--expert-cache: the model has no routed experts (num_experts is 0 or every layer is dense); leave it out");
  }

  const std::uint64_t total = experts::ExpertOffload::TotalExpertBytes(config);
  // With --expert-home host the experts live in host memory alone: the store has no NVMe tier, and
  // nothing is made in DIR/experts.
  std::string nvme_dir;
  if (home == "nvme") {
    TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(store_dir, "--store"));
    const std::filesystem::path dir = std::filesystem::path(store_dir) / "experts";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IoError(fmt::format("--store: cannot create {}: {}", dir.string(), ec.message()));
    nvme_dir = dir.string();
  }
  StoreOptions so = experts::ExpertOffload::OpenStoreOptions(total, budget->Resolve(total), nvme_dir);
  if (!nvme_dir.empty() && StoreDataExists(nvme_dir)) so.nvme.capacity_bytes = 0;  // keeps its size
  if (home == "host") so.put_tier = TierId::kHost;
  auto store = Store::Open(so);
  if (!store.ok()) {
    if (std::optional<Status> busy =
            store_cmd::DirInUse("--store", "expert store", nvme_dir, so.nvme.lock_wait, store.status()))
      return *busy;
    const Status e = store.status().WithContext(std::string(kOpeningExpertStore));
    store_cmd::StoreWords w = store_cmd::CommandDirWords(
        "--store", "--store",
        fmt::format("(or, to start over and lose every expert copy in it, remove {}: the next run reads the experts "
                    "again from --model)",
                    nvme_dir));
    // The expert store's size is the model's expert bytes: no flag sets it.
    w.lower_capacity = "give another --store directory, on a file system with that much free space (the expert "
                       "store's size comes from the model)";
    return Reworded(e, store_cmd::InCliWords(e.message(), w));
  }
  run.store = std::move(store).value();
  experts::ExpertOffloadOptions opt;
  opt.home = home == "host" ? TierId::kHost : TierId::kNvme;
  opt.budget = *budget;
  opt.policy = *policy;
  opt.window = a.depth;
  auto off = experts::ExpertOffload::Create(config, weights, run.store.get(), std::move(opt));
  if (!off.ok()) {
    // InvalidArgument: the budget (the other options are not the user's).
    if (off.status().IsInvalidArgument()) return off.status().WithContext("--expert-cache " + a.cache);
    if (off.status().IsOutOfCapacity() && !nvme_dir.empty()) return ExpertStoreFull(run, nvme_dir, config, off.status());
    return off.status();
  }
  run.offload = std::move(off).value();
  run.predictor = *predictor;
  run.depth = a.depth;
  run.nvme_home = home == "nvme";
  return run;
}

Status WithExpertRemedy(const ExpertRun& run, const Status& s) {
  if (!run.offload || !(s.IsNotFound() || s.IsCorruption())) return s;
  std::string msg = s.message();
  // The library's remedy names its API; the CLI's replaces it.
  const auto at = msg.find(experts::kLostExpertRemedy);
  if (at == std::string::npos) return s;
  msg.erase(at, experts::kLostExpertRemedy.size());
  msg += run.nvme_home ? "; run terrace model run again with the same --model and --store: it reads back every expert "
                         "block in the store and stores the damaged or lost ones afresh from the model's weights"
                       : "; run terrace model run again: with the experts' home in host memory (--expert-home host) "
                         "every run stores them afresh from --model's weights";
  return s.IsNotFound() ? Status::NotFound(std::move(msg)) : Status::Corruption(std::move(msg));
}

Status StartExpertRun(ExpertRun* run, const model::Model& model, model::Session* session,
                      const std::vector<int>& prompt, int max_new, const OracleRecording& recording) {
  if (!run->offload) return Status::Ok();
  experts::ExpertOffload& off = *run->offload;
  switch (run->predictor) {
    case experts::PredictorKind::kNone: off.SetPredictor(experts::MakeNonePredictor()); break;
    case experts::PredictorKind::kLookahead:
      off.SetPredictor(experts::MakeLookaheadPredictor(model, {.depth = run->depth, .min_confidence = 0.5}));
      break;
    case experts::PredictorKind::kStatistical:
      off.SetPredictor(experts::MakeStatisticalPredictor(model.config(), 1));
      break;
    case experts::PredictorKind::kOracle: {
      model::Session first(model);
      model::ForwardOptions hooks;
      off.AttachHooks(&hooks);
      first.set_hooks(hooks);
      const Status prefilled = recording.prefill ? recording.prefill(&first) : first.Prefill(prompt).status();
      TERRACE_RETURN_IF_ERROR(prefilled.WithContext("recording the routing for --predictor oracle"));
      for (int i = 0; i + 1 < max_new; ++i)
        TERRACE_RETURN_IF_ERROR(first.Decode(model::Argmax(first.last_logits())).status());
      auto trace = std::make_shared<experts::RoutingTrace>(*off.trace());
      const auto skipped = static_cast<std::size_t>(std::max<std::int64_t>(0, recording.skipped_steps));
      trace->steps.erase(trace->steps.begin(), trace->steps.begin() + std::min(skipped, trace->steps.size()));
      TERRACE_RETURN_IF_ERROR(off.Reset());
      off.SetPredictor(experts::MakeOraclePredictor(std::move(trace), run->depth));
      break;
    }
  }
  model::ForwardOptions hooks;
  off.AttachHooks(&hooks);
  session->set_hooks(hooks);
  return Status::Ok();
}

std::optional<experts::ExpertMetrics> ExpertSnapshot(const ExpertRun& run) {
  if (!run.offload) return std::nullopt;
  return run.offload->Metrics();
}

nlohmann::json ExpertReportJson(const std::optional<experts::ExpertMetrics>& metrics) {
  if (!metrics) return nullptr;
  return nlohmann::json::parse(metrics->ToJson());
}

std::string ExpertReportText(const std::optional<experts::ExpertMetrics>& metrics) {
  return metrics ? metrics->ToText() : std::string();
}

Status WriteExpertPrometheus(const std::optional<experts::ExpertMetrics>& metrics, const ExpertRunArgs& args,
                             const OutputRules& out_rules) {
  if (!metrics || args.prometheus.empty()) return Status::Ok();
  // The first line is Terrace's mark (a comment to a scraper), so that a later run may replace the file.
  const std::string text = fmt::format("{}\n{}", kPrometheusGeneratorLine, metrics->PrometheusText());
  return WriteOutputFile(args.prometheus, "--expert-prometheus", out_rules.As(OutputFormat::kPrometheus), text);
}

}  // namespace terrace::cli
