// The expert-offload part of `terrace model run` (--expert-cache and its flags; docs/experts.md,
// "terrace model run"). Puts the routed experts into an expert store (DIR/experts on NVMe with
// --store DIR, host memory otherwise), serves them to the model through a fast-tier cache, and
// reports the cache's metrics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "src/cli/safe_files.h"
#include "terrace/experts.h"
#include "terrace/model.h"
#include "terrace/store.h"

namespace terrace::cli {

struct ExpertRunArgs {
  std::string cache;                  // --expert-cache; empty: all experts resident
  std::string predictor = "lookahead";
  std::string policy = "utility";
  std::string home;                   // --expert-home host|nvme; default nvme with --store, else host
  int depth = 2;
  std::string prometheus;             // --expert-prometheus FILE
  // Given on the command line (each is refused without --expert-cache; --lookahead-depth also where
  // neither the predictor nor the policy uses it).
  bool predictor_given = false, policy_given = false, depth_given = false;
};

void AddExpertFlags(CLI::App* cmd, ExpertRunArgs* args);

struct ExpertRun {
  std::unique_ptr<Store> store;
  std::shared_ptr<experts::ExpertOffload> offload;  // null without --expert-cache
  experts::PredictorKind predictor = experts::PredictorKind::kNone;
  int depth = 2;
  bool nvme_home = false;  // the experts' home copy is in --store's experts/ (--expert-home nvme)
};

// Checks the flags (usage errors name the flag: InvalidArgument; --expert-prometheus against
// `out_rules`, as Prometheus text) and loads the experts into the expert store (under
// `store_dir`/experts when not empty). Without --expert-cache: an empty run.
// The start of OpenExpertRun's error when the expert store does not open: a runtime failure (exit 1)
// whatever its code, unlike OpenExpertRun's other InvalidArgument errors, which are usage errors.
inline constexpr std::string_view kOpeningExpertStore = "--store: opening the expert store";
Result<ExpertRun> OpenExpertRun(const ExpertRunArgs& args, const std::string& store_dir,
                                const model::ModelConfig& config, const model::WeightSource& weights,
                                const OutputRules& out_rules);

// A budget (--expert-cache `text`, parsed into `budget`) must hold one expert block of `config`:
// InvalidArgument naming `flag`, the block's size and the smallest budget that works otherwise.
// Creates nothing: commands call it before any work.
Status CheckExpertBudget(const experts::CacheBudget& budget, const std::string& text, const model::ModelConfig& config,
                         std::string_view flag = "--expert-cache");

// A lookahead depth (`flag`, e.g. --lookahead-depth) must stay below `config`'s layer count: no layer
// lies further ahead. InvalidArgument naming the flag and the largest depth that works otherwise.
Status CheckLookaheadDepth(int depth, const model::ModelConfig& config, std::string_view flag = "--lookahead-depth");

// How the oracle's recording pass prefills the prompt: in the forward steps the measured run will
// take. `prefill` computes the whole prompt into a fresh session (empty: one Session::Prefill
// step); the measured run then skips its first `skipped_steps` steps (the pieces a prefix-cache
// restore covers), which are dropped from the recording.
struct OracleRecording {
  std::function<Status(model::Session*)> prefill;
  std::int64_t skipped_steps = 0;
};

// Once `model` is loaded over run->offload: installs the predictor and the hooks into `session`.
// The oracle first records the routing of the same run (prefill `prompt` as `recording` says, then
// max_new - 1 greedy decode steps) in a separate session, then replays it. No-op without an offload.
Status StartExpertRun(ExpertRun* run, const model::Model& model, model::Session* session,
                      const std::vector<int>& prompt, int max_new, const OracleRecording& recording = {});

// A forward pass's failure `s` with the CLI's remedy in place of the library's when an expert block
// was lost from the expert store (the library's kLostExpertRemedy is in it): running again with the
// same --model (and --store, for an NVMe home) stores the damaged or lost experts afresh. Other
// failures (a block that is not a valid expert, e.g. from damaged weights in --model) unchanged.
Status WithExpertRemedy(const ExpertRun& run, const Status& s);

// The report, every form from one snapshot (ExpertSnapshot: unset without an expert cache, and
// then the JSON is null, the text empty and no file is written): JSON object, text lines, and
// (with --expert-prometheus) the Prometheus file, whose first line is kPrometheusGeneratorLine
// (Terrace's mark), written under `out_rules`.
std::optional<experts::ExpertMetrics> ExpertSnapshot(const ExpertRun& run);
nlohmann::json ExpertReportJson(const std::optional<experts::ExpertMetrics>& metrics);
std::string ExpertReportText(const std::optional<experts::ExpertMetrics>& metrics);
Status WriteExpertPrometheus(const std::optional<experts::ExpertMetrics>& metrics, const ExpertRunArgs& args,
                             const OutputRules& out_rules);

}  // namespace terrace::cli
