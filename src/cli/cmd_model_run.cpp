// terrace model run: prefill a prompt, decode greedily, report speed, a logits digest and where the
// time went (docs/ref-cli.md).
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/demo_dir.h"
#include "src/cli/model_run_experts.h"
#include "src/cli/model_run_kv.h"
#include "src/cli/prefill_progress.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/json_text.h"
#include "src/common/start_thread.h"
#include "src/model/model.h"
#include "src/model/ops.h"
#include "src/model/routing_stats.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"

namespace terrace::cli {
namespace {

using namespace terrace::model;

// Option bounds: a larger --max-new is a usage error, not hours of decoding; OpenBLAS caps its
// own thread count far below kMaxThreads.
constexpr int kMaxNewTokens = 1 << 16;
constexpr int kMaxThreads = 256;

struct RunArgs {
  std::string model;
  std::string tokens;
  int max_new = 0;
  bool json = false;
  bool routing_stats = false;  // --routing-stats: a second, uncached prefill of the prompt
  std::string dump_logits;
  int threads = 1;
  bool no_reserve = false;  // --no-reserve: with --store, do not reserve the state's latents while the pools open
  bool force = false;       // --force: --dump-logits / --expert-prometheus may replace a file Terrace did not write
  KvRunArgs kv;  // --store and its flags (model_run_kv.h)
  ExpertRunArgs experts;  // --expert-cache and its flags (model_run_experts.h)
};

Result<std::vector<int>> ParseTokens(const std::string& text, int vocab) {
  std::vector<int> ids;
  for (std::string item : SplitCommas(text)) {
    // Blanks around an id are taken on either side (" 1, 2 ,3 "); inside one they are not.
    const std::size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    item = first == std::string::npos ? std::string() : item.substr(first, last - first + 1);
    std::size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || v < 0)
      return Status::InvalidArgument(fmt::format("--tokens: '{}' is not a non-negative integer; pass ids like 1,2,3", item));
    if (v >= vocab)
      return Status::InvalidArgument(
          fmt::format("--tokens: token id {} is outside the model's vocabulary [0, {})", v, vocab));
    ids.push_back(static_cast<int>(v));
  }
  if (ids.empty()) return Status::InvalidArgument("--tokens is empty; pass at least one token id");
  return ids;
}

int RunModel(const RunArgs& a) {
  // --threads and --max-new are range-checked by their options.
  if (a.tokens.empty()) return FailUsage("--tokens is empty; pass at least one token id, e.g. --tokens 1,2,3");
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  if (a.force && a.dump_logits.empty() && a.experts.prometheus.empty())
    return FailUsage("--force lets --dump-logits and --expert-prometheus replace a file, and neither is given; leave "
                     "--force out");
  // The output files replace a file Terrace wrote, any file with --force, never the model's own files.
  const OutputRules out_rules{.format = OutputFormat::kSafetensors, .force = a.force,
                              .inputs = ModelDirInputs(a.model, "--model")};
  for (auto [path, flag] : {std::pair{&a.dump_logits, "--dump-logits"}, std::pair{&a.experts.prometheus, "--expert-prometheus"}}) {
    if (path->empty() || a.kv.store.empty()) continue;
    for (const char* pool : kDemoStores) {  // the store's files are in these pools of --store
      const std::filesystem::path dir = std::filesystem::path(a.kv.store) / pool;
      if (Status s = CheckOutsideDir(*path, flag, dir, a.kv.dir_flag + "'s pool"); !s.ok()) return FailUsage(s.message());
    }
  }
  if (!a.dump_logits.empty()) {
    if (Status s = CheckOutputFile(a.dump_logits, "--dump-logits", out_rules); !s.ok()) return FailUsage(s.message());
  }
  // Two outputs into one file: the second would replace the first (with --force), or find a file
  // this run wrote and refuse it at the end, after all the work.
  if (!a.dump_logits.empty() && !a.experts.prometheus.empty() && SameFile(a.dump_logits, a.experts.prometheus))
    return FailUsage(fmt::format("--dump-logits {} and --expert-prometheus {} name the same file; give each output a "
                                 "file of its own",
                                 a.dump_logits, a.experts.prometheus));
  ops::SetBlasThreads(a.threads);
  // Ctrl-C: the forward pass stops at its next layer, what the store was handed is written, and the
  // run exits 128 + the signal number saying how far it got.
  StopSignals stop_signals;
  auto dir = ModelDir::Open(a.model);
  if (!dir.ok()) return Fail(dir.status().ToString());
  const ModelConfig& config = (*dir)->config();
  auto prompt = ParseTokens(a.tokens, config.vocab_size);
  if (!prompt.ok()) return FailUsage(prompt.status().message());
  if (!a.kv.store.empty()) {
    if (Status s = CheckKvRunArgs(a.kv, config); !s.ok()) return FailUsage(s.message());
  }
  auto ex = OpenExpertRun(a.experts, a.kv.store, config, **dir, out_rules);
  if (!ex.ok()) {
    const bool usage = ex.status().IsInvalidArgument() && !ex.status().message().starts_with(kOpeningExpertStore);
    return usage ? FailUsage(ex.status().message()) : Fail(ex.status().ToString());
  }
  auto model = Model::Load(config, **dir, ex->offload);
  if (!model.ok()) return Fail(model.status().ToString());
  if (StopSignalReceived() != 0) return ExitStopped("terrace model run", " before the prompt was run");

  Session session(**model);
  Result<Tensor> logits = Tensor();
  std::optional<KvRun> kv_run;
  std::optional<kv::CachedPrefill> cached;
  std::pair<double, double> kv_prepare{0, 0};  // seconds: the state's reservation, the pools' opening (beside it)
  // Progress lines on stderr for long passes; their hooks run after the ones StartExpertRun set (own).
  const int last_layer = config.num_hidden_layers - 1;
  PrefillProgress prefill_progress("terrace model run", "prefill",
                                   a.kv.store.empty() ? static_cast<std::int64_t>(prompt->size()) : 0, last_layer);
  ForwardOptions own;
  auto with_progress = [&] {
    own = session.hooks();
    session.set_hooks(ChainHooks(own, prefill_progress.Hooks()));
  };
  // After a stop: the store's writes handed over so far finish (a chunk block is never written with
  // a layer missing), then "stopped by SIGINT <what>".
  auto stopped = [&](const std::string& what) {
    std::string stored;
    if (kv_run) {
      kv_run->cache->Flush();
      for (Store* st : {kv_run->kv_store.get(), kv_run->state_store.get()}) (void)st->Flush();
      stored = "; --store: " + WriteBackText(kv_run->cache->Stats());
    }
    return ExitStopped("terrace model run", " " + what + stored);
  };
  auto stopped_in_prefill = [&] {
    return stopped(fmt::format("in the prefill of the prompt's {} tokens: {}", prompt->size(), prefill_progress.Where()));
  };
  if (a.kv.store.empty()) {
    if (Status s = StartExpertRun(&*ex, **model, &session, *prompt, a.max_new); !s.ok()) return Fail(s.ToString());
    with_progress();
    logits = session.Prefill(*prompt);
  } else {
    // The state's MLA latent caches get room for the whole prompt (written once, so its pages are
    // in) on a thread of their own while the pools open, off the request's path: the restore then
    // decodes into memory already faulted in, as in a serving process that prepared at start-up
    // (docs/prefix-cache.md, "Prepared restore memory"), and the computed suffix appends in place.
    Status reserved;
    double reserve_s = 0, open_s = 0;
    std::thread reserver;
    auto reserve = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      reserved = session.state().Reserve(static_cast<std::int64_t>(prompt->size()));
      reserve_s = SecondsSince(t0);
    };
    if (!a.no_reserve) {
      // Where no thread can be had, the reservation runs here, before the pools open.
      if (auto t = StartThread("the state's reservation thread", reserve); t.ok()) reserver = std::move(t).value();
      else reserve();
    }
    const auto t_open = std::chrono::steady_clock::now();
    auto opened = OpenKvRun(a.kv, config, **dir);
    open_s = SecondsSince(t_open);
    if (reserver.joinable()) reserver.join();
    kv_prepare = {reserve_s, open_s};
    if (!reserved.ok()) return Fail(reserved.ToString());
    if (!opened.ok()) {
      // CheckKvRunArgs above checked the flags; a pool created since with another size is refused on open.
      const Status& e = opened.status();
      return KvSizeFlagRefused(a.kv, e) ? FailUsage(e.message()) : Fail(e.ToString());
    }
    kv_run = std::move(opened).value();
    const auto request = kv_run->cache->Prepare(*prompt, a.kv.tenant);
    // The oracle records the routing in the forward steps this prefill takes: the prompt in the
    // cache's chunk pieces, less those the restore will cover (its lookup's boundary).
    OracleRecording recording;
    if (ex->predictor == experts::PredictorKind::kOracle) {
      recording.prefill = [&](Session* first) {
        return kv::PrefillWithCache(first, *kv_run->cache, request, {.restore = false, .write_back = false}).status();
      };
      auto lookup = kv_run->cache->Lookup(request);
      if (!lookup.ok()) return Fail(lookup.status().ToString());
      recording.skipped_steps = lookup->boundary_tokens / kv_run->cache->layout().chunk_tokens();
    }
    if (Status s = StartExpertRun(&*ex, **model, &session, *prompt, a.max_new, recording); !s.ok())
      return StopSignalReceived() != 0 ? stopped("before the prompt was run") : Fail(s.ToString());
    with_progress();
    auto p = kv::PrefillWithCache(&session, *kv_run->cache, request);
    if (!p.ok()) return StopSignalReceived() != 0 ? stopped_in_prefill() : Fail(WithExpertRemedy(*ex, p.status()).ToString());
    cached = std::move(p).value();
    logits = std::move(cached->logits);
    if (ex->predictor == experts::PredictorKind::kOracle &&
        cached->restored_tokens / kv_run->cache->layout().chunk_tokens() != recording.skipped_steps) {
      fmt::print(stderr, "{}\n", fmt::format("terrace model run: warning: the restore fell back to {} tokens, below the {} its lookup "
                           "promised; --predictor oracle replays a recording that skipped the lookup's pieces, so its "
                           "predictions for this run are off by the difference (its precision and recall understate "
                           "the oracle)",
                           cached->restored_tokens,
                           recording.skipped_steps * kv_run->cache->layout().chunk_tokens()));
    }
  }
  if (!logits.ok()) {
    return StopSignalReceived() != 0 ? stopped_in_prefill() : Fail(WithExpertRemedy(*ex, logits.status()).ToString());
  }
  std::vector<int> generated;
  PrefillProgress decode_progress("terrace model run", "decode", std::max(0, a.max_new - 1), last_layer);
  session.set_hooks(ChainHooks(own, decode_progress.Hooks()));
  for (int i = 0; i < a.max_new; ++i) {
    generated.push_back(Argmax(session.last_logits()));
    if (i + 1 < a.max_new) {
      auto l = session.Decode(generated.back());
      if (!l.ok()) {
        if (StopSignalReceived() == 0) return Fail(WithExpertRemedy(*ex, l.status()).ToString());
        return stopped(fmt::format("in the decode, after {} of --max-new {} tokens: [{}]", generated.size(), a.max_new,
                                   fmt::join(generated, ", ")));
      }
    }
  }
  kv::PrefixCacheStats kv_stats;
  if (kv_run) {
    kv_run->cache->Flush();  // the write-back ran during decode; wait for it
    kv_stats = kv_run->cache->Stats();
    if (std::string failed = WriteFailureText(a.kv, kv_stats); !failed.empty())
      fmt::print(stderr, "terrace model run: warning: {}\n", failed);
    for (Store* st : {kv_run->kv_store.get(), kv_run->state_store.get()})
      if (Status s = st->Flush(); !s.ok()) return Fail(s.ToString());
  }
  // The expert metrics of the run itself, before the extra pass below (which goes through the same
  // expert cache): one snapshot, so the Prometheus file, the JSON and the text agree.
  const std::optional<experts::ExpertMetrics> expert_metrics = ExpertSnapshot(*ex);
  if (Status s = WriteExpertPrometheus(expert_metrics, a.experts, out_rules); !s.ok()) return Fail(s.ToString());
  const nlohmann::json expert_json = ExpertReportJson(expert_metrics);
  const std::string expert_text = ExpertReportText(expert_metrics);
  if (!a.dump_logits.empty()) {
    if (cached && cached->restored_tokens > 0) {
      // Restored positions have no logits: recompute them in a cold pass over [0, b) with the same
      // chunk pieces (bitwise what a run without the cache would give for them).
      Session cold(**model);
      PrefillProgress cold_progress("terrace model run", "--dump-logits: recomputing the restored positions",
                                    cached->restored_tokens, last_layer);
      cold.set_hooks(cold_progress.Hooks());
      const auto head_req = kv_run->cache->Prepare(std::span(*prompt).first(static_cast<std::size_t>(cached->restored_tokens)),
                                                   a.kv.tenant);
      auto h = kv::PrefillWithCache(&cold, *kv_run->cache, head_req, {.restore = false, .write_back = false});
      if (!h.ok()) {
        return StopSignalReceived() != 0 ? stopped("while recomputing the restored positions for --dump-logits (not written)")
                                         : Fail(h.status().ToString());
      }
      h->logits.data.insert(h->logits.data.end(), logits->data.begin(), logits->data.end());
      h->logits.shape = {static_cast<std::int64_t>(prompt->size()), config.vocab_size};
      logits = std::move(h->logits);
    }
    SafetensorsWriter w;
    Status s = w.AddF32("logits", *logits);
    if (s.ok())
      s = WriteOutputFileNamingTarget(a.dump_logits, "--dump-logits", out_rules, "the logits",
                                      [&](const std::filesystem::path& tmp) { return w.Write(tmp); });
    if (!s.ok()) return Fail(s.ToString());
  }
  const std::vector<float>& last = session.last_logits();
  const std::uint64_t digest = XXH3_64bits(last.data(), last.size() * sizeof(float));
  const double prefill_tps = static_cast<double>(session.prefill_tokens()) / session.prefill_seconds();
  const double decode_tps = session.decode_tokens() > 0
                                ? static_cast<double>(session.decode_tokens()) / session.decode_seconds()
                                : 0.0;
  const Profile& prof = session.profile();
  std::vector<float> head(last.begin(), last.begin() + std::min<std::size_t>(4, last.size()));

  // A stop during the steps without a checkpoint (the write-back's wait, --dump-logits' file).
  if (StopSignalReceived() != 0) return stopped("after the run, before its report was printed");
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["prompt_tokens"] = prompt->size();
    j["generated"] = generated;
    j["prefill_tokens_per_s"] = prefill_tps;
    j["decode_tokens"] = session.decode_tokens();
    // No decode step ran (--max-new 0): a rate over nothing is null, as the demo writes it, not 0.
    j["decode_tokens_per_s"] = session.decode_tokens() > 0 ? nlohmann::json(decode_tps) : nlohmann::json(nullptr);
    j["logits_xxh3_64"] = fmt::format("{:016x}", digest);
    j["logits_head"] = head;
    j["threads"] = a.threads;
    if (ex->offload) j["experts"] = expert_json;
    if (cached) {
      const nlohmann::json kv_json = KvReportJson(*cached, kv_stats, kv_run->cache->layout());
      j.update(kv_json);
      j["state_reserve_s"] = kv_prepare.first;  // 0 with --no-reserve
      j["pools_open_s"] = kv_prepare.second;
    } else {
      j["restored_tokens"] = 0;
      j["computed_tokens"] = prompt->size();
    }
    for (int p = 0; p < kNumPhases; ++p) {
      j["time_share"][std::string(PhaseName(static_cast<Phase>(p)))] = prof.Share(static_cast<Phase>(p));
    }
    if (a.routing_stats) {
      auto routing = MeasureRouting(**model, *prompt);
      if (!routing.ok()) return Fail(routing.status().ToString());
      if (StopSignalReceived() != 0) return stopped("while measuring --routing-stats (no report printed)");
      j["routing"]["mean_entropy_bits"] = routing->mean_entropy_bits;
      j["routing"]["max_entropy_bits"] = routing->max_entropy_bits;
      j["routing"]["min_experts_used"] = routing->min_experts_used;
      for (const auto& l : routing->layers) {
        j["routing"]["layers"].push_back({{"layer", l.layer}, {"entropy_bits", l.entropy_bits},
                                          {"experts_used", l.experts_used}, {"counts", l.counts}});
      }
    }
    fmt::print("{}\n", JsonText(j));
    return 0;
  }
  fmt::print("prompt: {} tokens; generated: [{}]\n", prompt->size(), fmt::join(generated, ", "));
  fmt::print("prefill: {:.1f} tokens/s ({} tokens, {:.3f} s)\n", prefill_tps, session.prefill_tokens(),
             session.prefill_seconds());
  if (session.decode_tokens() > 0) {
    fmt::print("decode: {:.1f} tokens/s ({} tokens, {:.3f} s)\n", decode_tps, session.decode_tokens(),
               session.decode_seconds());
  } else {
    fmt::print("decode: no decode steps (--max-new {})\n", a.max_new);
  }
  fmt::print("final logits: xxh3-64 {:016x}, first values [{}]\n", digest, fmt::join(head, ", "));
  if (cached) fmt::print("{}", KvReportText(*cached, kv_stats, kv_run->cache->layout()));
  fmt::print("{}", expert_text);
  std::vector<std::string> shares;
  for (int p = 0; p < kNumPhases; ++p)
    shares.push_back(fmt::format("{} {:.1f}%", PhaseName(static_cast<Phase>(p)), 100.0 * prof.Share(static_cast<Phase>(p))));
  fmt::print("time share: {} (threads {})\n", fmt::join(shares, ", "), a.threads);
  return 0;
}

}  // namespace

void RegisterModelRun(CLI::App* model_cmd, Runner* run) {
  auto args = std::make_shared<RunArgs>();
  auto* cmd = model_cmd->add_subcommand("run", "Run the reference forward pass: prefill a prompt, decode greedily");
  cmd->add_option("--model", args->model, "Model directory (config.json + safetensors)")->required();
  cmd->add_option("--tokens", args->tokens, "Prompt token ids, comma separated (e.g. 1,2,3)")->required();
  AddIntOption(cmd, "--max-new", &args->max_new, 0, kMaxNewTokens, "Tokens to generate greedily (0: prefill only)");
  auto* json = cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->add_flag("--routing-stats", args->routing_stats,
                "With --json: add routing statistics over the prompt ('routing': per MoE layer counts, entropy, "
                "experts used), from a second prefill of the whole prompt with no cache (as long again as an "
                "uncached run)")
      ->needs(json);
  cmd->add_option("--dump-logits", args->dump_logits,
                  "Write the prefill logits of every prompt position as F32 'logits' [tokens, vocab] (safetensors); "
                  "with --store, positions restored from the cache are recomputed for the file");
  AddIntOption(cmd, "--threads", &args->threads, 1, kMaxThreads,
               "OpenBLAS threads (logits are bitwise reproducible for a given count; another may change their last bits)");
  AddKvFlags(cmd, &args->kv, /*with_store=*/true);
  cmd->add_flag("--no-reserve", args->no_reserve,
                "With --store: do not reserve the state's latent memory for the prompt while the pools open (it is "
                "then faulted in by the restore and the forward pass)")
      ->needs("--store");
  AddExpertFlags(cmd, &args->experts);
  cmd->add_flag("--force", args->force,
                "Let --dump-logits and --expert-prometheus replace an existing file Terrace did not write (never a "
                "file of --model)");
  cmd->callback([args, run] { *run = [args] { return RunModel(*args); }; });
}

}  // namespace terrace::cli
