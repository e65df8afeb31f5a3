// terrace model init|inspect (and `run`, registered by cmd_model_run.cpp). Hidden helpers for tests:
// `model dequant-mxfp4` and `model quantize-mxfp4`.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <optional>
#include <string>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>
#include <sys/stat.h>
#include <unistd.h>
#include <csignal>
#include <sys/statvfs.h>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/list_dir.h"
#include "src/model/config.h"
#include "src/model/inspect.h"
#include "src/model/model.h"
#include "src/model/mxfp4.h"
#include "src/model/routing_stats.h"
#include "src/model/safetensors.h"
#include "src/model/weights_init.h"

namespace terrace::cli {
namespace {

using namespace terrace::model;

struct InitArgs {
  std::string preset;
  std::string config;
  std::string out;
  std::uint64_t seed = 0;
  std::uint64_t shard_bytes = 2ull << 30;
  bool force = false;
  int routing_tokens = 64;
  double residual_scale = 1.0;
  std::optional<double> residual_scale_arg;  // --residual-scale as given (range-checked); copied into residual_scale
};

// The smallest --residual-scale: below it the residual-writing weights (scale / sqrt(2 x layers x
// fan-in) x N(0, 1)) leave every layer's update under a millionth of the stream, and far below it
// (about 1e-30) they underflow bf16 (and f32) to zero, a model whose layers do nothing.
constexpr double kMinResidualScale = 1e-6;

constexpr int kMaxRoutingTokens = 1 << 16;

// The files a Terrace checkpoint consists of (what `model init` writes and replaces): config.json,
// model.safetensors, model-NNNNN-of-NNNNN.safetensors and model.safetensors.index.json.
bool IsCheckpointFile(std::string_view f) {
  if (f == kConfigFileName || f == kSingleFileName || f == kIndexFileName) return true;
  constexpr std::string_view kPattern = "model-#####-of-#####.safetensors";
  if (f.size() != kPattern.size()) return false;
  for (std::size_t i = 0; i < f.size(); ++i) {
    if (kPattern[i] == '#' ? (f[i] < '0' || f[i] > '9') : f[i] != kPattern[i]) return false;
  }
  return true;
}

// `model init --out DIR`: DIR is new, an empty directory, or (with --force) a directory whose
// checkpoint files are regular files, which init replaces; every other entry is left alone.
Status CheckInitOut(const std::string& out, bool force) {
  namespace fs = std::filesystem;
  if (out.empty()) return Status::InvalidArgument("--out is empty; give a directory for the model");
  struct stat st {};
  if (::lstat(out.c_str(), &st) != 0) return Status::Ok();  // created by init
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("--out {} is {}; give a new or empty directory", out, DescribePathKind(out)));
  }
  std::error_code ec;
  std::vector<std::string> entries;
  for (const auto& e : ListDir(out, &ec)) entries.push_back(e.path().filename().string());
  if (ec) return Status::InvalidArgument(fmt::format("--out {}: cannot list it: {}", out, ec.message()));
  if (entries.empty()) return Status::Ok();
  if (!force) {
    return Status::InvalidArgument(fmt::format(
        "--out {} is not empty ({} entries, e.g. '{}'); give a new or empty directory, or pass --force to replace "
        "the checkpoint files in it (config.json, model.safetensors, model-NNNNN-of-NNNNN.safetensors, "
        "model.safetensors.index.json; other files are left alone)",
        out, entries.size(), entries.front()));
  }
  for (const std::string& f : entries) {
    if (!IsCheckpointFile(f)) continue;
    const fs::path p = fs::path(out) / f;
    if (DescribePathKind(p) != "a regular file") {
      return Status::InvalidArgument(fmt::format(
          "--out {}: '{}' is {}, not a checkpoint file that --force may replace; move it away first", out, f,
          DescribePathKind(p)));
    }
  }
  return Status::Ok();
}

// Free bytes on the file system that would hold `dir` (its nearest existing ancestor); 0 if unknown.
std::uint64_t FreeBytesFor(std::filesystem::path dir) {
  std::error_code ec;
  dir = std::filesystem::absolute(dir, ec);
  while (!dir.empty() && !std::filesystem::exists(dir, ec) && dir != dir.parent_path()) dir = dir.parent_path();
  struct statvfs v {};
  if (::statvfs(dir.c_str(), &v) != 0) return 0;
  return static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
}

constexpr std::string_view kInitTmpPrefix = ".terrace-tmp-init-";

// Removes what a killed `model init` left in `out`: folders of this user named
// kInitTmpPrefix<ProcessTag()>, of a <pid> that no longer runs (DeadPidAfter), that hold only
// checkpoint files (and their ".tmp.<pid>" partial writes).
void RemoveInitLeftovers(const std::filesystem::path& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& e : ListDir(out, &ec)) {
    const std::string name = e.path().filename().string();
    std::string_view rest;
    if (!DeadPidAfter(name, kInitTmpPrefix, &rest) || !rest.empty() || !IsOwnRealDir(e.path())) continue;
    bool ours = true;
    for (const auto& f : ListDir(e.path(), &ec)) {
      const std::string fn = f.path().filename().string();
      const std::string base = fn.substr(0, fn.find(".tmp."));
      ours = ours && IsKind(f.path(), S_IFREG) && IsCheckpointFile(base);
    }
    if (ours && !ec) fs::remove_all(e.path(), ec);
  }
}

// Writes the checkpoint into a private folder inside `out` (same file system), then moves each file
// into place, each target checked to be absent or a regular file right before its rename, and
// finally removes the old checkpoint files the new one does not have. A failure while writing (a
// full disk) leaves the old checkpoint as it was; no other file in `out` is touched. Order of the
// moves: weights, then the index (or the removal of a stale one), then config.json.
Status WriteCheckpoint(const ModelConfig& config, const std::filesystem::path& out, const InitOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool created_out = !fs::exists(fs::symlink_status(out, ec));
  const fs::path tmp = out / fmt::format("{}{}", kInitTmpPrefix, ProcessTag());
  auto abandon = [&](Status s) {
    fs::remove_all(tmp, ec);
    if (created_out) fs::remove(out, ec);  // only if empty: nothing else is ever removed
    return s;
  };
  if (Status s = InitWeights(config, tmp, options); !s.ok()) {
    return abandon(s.WithContext(fmt::format("model init --out {} (nothing in it was changed)", out.string())));
  }
  if (options.stop_check) {
    if (Status s = options.stop_check(); !s.ok()) return abandon(s);  // stopped before anything moves into place
  }
  std::vector<std::string> written;
  for (const auto& e : ListDir(tmp, &ec)) written.push_back(e.path().filename().string());
  if (ec) return abandon(Status::IoError(fmt::format("--out {}: cannot list '{}': {}", out.string(), tmp.string(), ec.message())));
  const auto rank = [](const std::string& f) { return f == kConfigFileName ? 2 : f == kIndexFileName ? 1 : 0; };
  std::sort(written.begin(), written.end(), [&](const std::string& x, const std::string& y) {
    return rank(x) != rank(y) ? rank(x) < rank(y) : x < y;
  });
  for (const std::string& f : written) {
    if (!IsCheckpointFile(f)) return abandon(Status::Internal(fmt::format("model init wrote an unexpected file '{}'", f)));
    if (Status s = CheckOutputFile(out / f, "--out"); !s.ok()) return abandon(s);
  }
  const auto was_written = [&](const std::string& f) { return std::find(written.begin(), written.end(), f) != written.end(); };
  std::vector<fs::path> stale;
  for (const auto& e : ListDir(out, &ec)) {
    const std::string f = e.path().filename().string();
    if (IsCheckpointFile(f) && !was_written(f)) stale.push_back(e.path());
  }
  for (const std::string& f : written) {
    if (f == kConfigFileName) {  // the index question is settled before the config moves in
      for (const fs::path& p : stale) {
        if (p.filename() == kIndexFileName && DescribePathKind(p) == "a regular file") fs::remove(p, ec);
      }
    }
    if (Status s = CheckOutputFile(out / f, "--out"); !s.ok()) return abandon(s);
    if (::rename((tmp / f).c_str(), (out / f).c_str()) != 0) {
      return abandon(Status::IoError(fmt::format("--out {}: cannot move '{}' into place: {}", out.string(), f,
                                                 std::strerror(errno))));
    }
  }
  for (const fs::path& p : stale) {
    if (DescribePathKind(p) == "a regular file") fs::remove(p, ec);
  }
  fs::remove_all(tmp, ec);
  return Status::Ok();
}

// Routing over a seeded random prompt through the freshly written model.
std::string RoutingReport(const std::string& dir, const ModelConfig& config, std::uint64_t seed, int tokens) {
  auto md = ModelDir::Open(dir);
  if (!md.ok()) return "routing entropy: not measured (" + md.status().ToString() + ")";
  auto model = Model::Load(config, **md);
  if (!model.ok()) return "routing entropy: not measured (" + model.status().ToString() + ")";
  std::mt19937_64 rng(seed ^ 0x5EEDull);
  std::vector<int> ids(static_cast<std::size_t>(tokens));
  for (int& id : ids) id = static_cast<int>(rng() % static_cast<std::uint64_t>(config.vocab_size));
  auto stats = MeasureRouting(**model, ids);
  if (!stats.ok()) return "routing entropy: not measured (" + stats.status().ToString() + ")";
  return fmt::format("routing entropy: {:.2f} bits (max log2(E) = {:.2f}), experts used: {}/{} (fewest in any layer, "
                     "over {} prompt tokens)",
                     stats->mean_entropy_bits, stats->max_entropy_bits, stats->min_experts_used, config.num_experts,
                     tokens);
}

int RunInit(const InitArgs& a) {
  if (!a.config.empty()) {
    if (Status s = CheckInputFile(a.config, "--config", kMaxConfigJsonBytes); !s.ok()) return FailUsage(s.message());
  }
  RemoveInitLeftovers(a.out);  // before the emptiness check: a killed run's folder is not the user's
  if (Status s = CheckInitOut(a.out, a.force); !s.ok()) return FailUsage(s.message());
  Result<ModelConfig> config = a.preset.empty() ? LoadConfig(a.config) : Preset(a.preset);
  if (!config.ok()) return a.preset.empty() ? Fail(config.status().ToString()) : FailUsage(config.status().ToString());
  if (Status s = CheckInitConfig(*config); !s.ok()) {
    return Fail(s.WithContext(a.preset.empty() ? a.config : "--preset " + a.preset).ToString());
  }
  // A usage error (exit 2), before the free-space check: only --force gets past it.
  const std::uint64_t weights = WeightBytes(*config);
  if (weights > kMaxInitBytes && !a.force) {
    return FailUsage(fmt::format("{} needs {:.1f} GiB of weights, over the {} GiB safety limit for random init; use a "
                                 "smaller preset (k3-toy, k3-small) or pass --force",
                                 a.preset.empty() ? "--config " + a.config : "--preset " + a.preset,
                                 static_cast<double>(weights) / (1ull << 30), kMaxInitBytes >> 30));
  }
  const std::uint64_t need = weights + (1ull << 20);
  if (const std::uint64_t free = FreeBytesFor(a.out); free != 0 && need > free) {
    return FailUsage(fmt::format("--out {}: the model needs {:.2f} GiB and its file system has {:.2f} GiB free; "
                                 "choose a smaller preset or another --out",
                                 a.out, static_cast<double>(need) / (1ull << 30), static_cast<double>(free) / (1ull << 30)));
  }
  InitOptions options;
  options.seed = a.seed;
  options.shard_bytes = a.shard_bytes;
  options.force = a.force;
  options.random_expert_codes = !a.preset.empty() && PresetUsesRandomExpertCodes(a.preset);
  options.residual_scale = a.residual_scale;
  options.stop_check = StopCheck;
  StopSignals stop_signals;  // Ctrl-C: stop before the next tensor, remove what was written, exit 128 + signal
  Status s = WriteCheckpoint(*config, a.out, options);
  if (StopSignalReceived() != 0) {
    return ExitStopped("model init", s.ok() ? fmt::format("; after it had written the model to {}", a.out)
                                            : fmt::format("; removed what it had written, {} is as it was", a.out));
  }
  if (!s.ok()) return Fail(s.ToString());
  auto md = ModelDir::Open(a.out);
  if (!md.ok()) return Fail("wrote a model that does not load: " + md.status().ToString());
  fmt::print("wrote {} ({} tensors, {:.2f} MiB, {} shard(s), seed {})\n", a.out, (*md)->Names().size(),
             static_cast<double>(WeightBytes(*config)) / (1 << 20), (*md)->num_shards(), a.seed);
  if (a.routing_tokens > 0 && config->first_k_dense_replace < config->num_hidden_layers) {
    fmt::print("{}\n", RoutingReport(a.out, *config, a.seed, a.routing_tokens));
  }
  return 0;
}

int RunInspect(const std::string& dir, const std::string& preset, bool json, bool summary, bool tensors) {
  InspectReport report;
  if (!preset.empty()) {
    auto config = Preset(preset);
    if (!config.ok()) return FailUsage(config.status().ToString());
    report = InspectConfig(*config, "preset " + preset);
  } else {
    if (Status s = CheckModelDirInput(dir, "model inspect DIR"); !s.ok()) return FailUsage(s.message());
    auto r = InspectModelDir(dir);
    if (!r.ok()) return Fail(r.status().ToString());
    report = std::move(*r);
  }
  const bool list = tensors || (!summary && preset.empty());
  fmt::print("{}", json ? FormatInspectJson(report, list) : FormatInspectText(report, list));
  if (!report.problems.empty()) {
    return Fail(fmt::format("{} problem(s) in '{}'; see the list above", report.problems.size(), report.source));
  }
  return 0;
}

// The hidden test helpers' --in / --out / --force: like every output, --out replaces only a file
// Terrace wrote (any file with --force), never --in itself (or a file of the model directory --in).
struct HelperArgs {
  std::string in, out;
  bool force = false;
};

OutputRules HelperRules(const HelperArgs& a, bool dir_in) {
  return {.format = OutputFormat::kSafetensors, .force = a.force,
          .inputs = dir_in ? ModelDirInputs(a.in, "--in") : std::vector<OutputRules::Input>{{"--in", a.in}}};
}

Status CheckInOut(const HelperArgs& a, bool dir_ok = false) {
  std::error_code ec;
  const bool dir_in = dir_ok && std::filesystem::is_directory(a.in, ec);
  if (!dir_in) TERRACE_RETURN_IF_ERROR(CheckInputFile(a.in, "--in"));
  else TERRACE_RETURN_IF_ERROR(CheckModelDirInput(a.in, "--in"));
  return CheckOutputFile(a.out, "--out", HelperRules(a, dir_in));
}

Status WriteOut(const SafetensorsWriter& w, const HelperArgs& a, bool dir_in = false) {
  return WriteOutputFile(a.out, "--out", HelperRules(a, dir_in), [&](const std::filesystem::path& tmp) { return w.Write(tmp); });
}

int RunDequant(const HelperArgs& a) {
  const std::string& in = a.in;
  if (Status s = CheckInOut(a); !s.ok()) return FailUsage(s.message());
  auto file = SafetensorsFile::Open(in);
  if (!file.ok()) return Fail(file.status().ToString());
  auto packed = (*file)->Get("weight_packed");
  auto scales = (*file)->Get("weight_scale");
  if (!packed.ok() || !scales.ok()) return Fail(fmt::format("'{}' needs U8 tensors 'weight_packed' and 'weight_scale'", in));
  if (packed->dtype != DType::kU8 || scales->dtype != DType::kU8 || packed->shape.size() != 2) {
    return Fail(fmt::format("'{}': weight_packed and weight_scale must be 2-D U8", in));
  }
  const std::int64_t rows = packed->shape[0];
  const std::int64_t cols = packed->shape[1] * 2;
  Tensor w({rows, cols});
  auto as_u8 = [](const TensorView& v) {
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(v.data.data()), v.data.size());
  };
  Status s = DequantizeMxfp4(as_u8(*packed), as_u8(*scales), rows, cols, w.data);
  if (!s.ok()) return Fail(s.WithContext(in).ToString());
  SafetensorsWriter writer;
  s = writer.AddF32("weight", w);
  if (s.ok()) s = WriteOut(writer, a);
  return s.ok() ? 0 : Fail(s.ToString());
}

int RunQuant(const HelperArgs& a) {
  const std::string& in = a.in;
  if (Status s = CheckInOut(a); !s.ok()) return FailUsage(s.message());
  auto file = SafetensorsFile::Open(in);
  if (!file.ok()) return Fail(file.status().ToString());
  auto view = (*file)->Get("weight");
  if (!view.ok()) return Fail(view.status().ToString());
  auto w = ToFloat(*view, "weight");
  if (!w.ok() || w->shape.size() != 2) return Fail(fmt::format("'{}': 'weight' must be a 2-D float tensor", in));
  std::vector<std::uint8_t> packed, scales;
  Status s = QuantizeMxfp4(w->data, w->dim(0), w->dim(1), &packed, &scales);
  if (!s.ok()) return Fail(s.WithContext(in).ToString());
  SafetensorsWriter writer;
  s = writer.Add("weight_packed", DType::kU8, {w->dim(0), w->dim(1) / 2}, std::as_bytes(std::span(packed)));
  if (s.ok()) s = writer.Add("weight_scale", DType::kU8, {w->dim(0), w->dim(1) / 32}, std::as_bytes(std::span(scales)));
  if (s.ok()) s = WriteOut(writer, a);
  return s.ok() ? 0 : Fail(s.ToString());
}

// Copies every tensor of a safetensors file or a model directory into one file; with to_f32, float
// tensors (F32/BF16/F16) are converted to F32 and the rest copied as stored.
int RunCopy(const HelperArgs& a, bool to_f32) {
  const std::string& in = a.in;
  if (Status s = CheckInOut(a, /*dir_ok=*/true); !s.ok()) return FailUsage(s.message());
  std::unique_ptr<SafetensorsFile> file;
  std::unique_ptr<ModelDir> dir;
  std::error_code ec;
  if (std::filesystem::is_directory(in, ec)) {
    auto d = ModelDir::Open(in, /*check_tensors=*/false);
    if (!d.ok()) return Fail(d.status().ToString());
    dir = std::move(*d);
  } else {
    auto f = SafetensorsFile::Open(in);
    if (!f.ok()) return Fail(f.status().ToString());
    file = std::move(*f);
  }
  const std::vector<std::string> names = dir ? dir->Names() : file->Names();
  SafetensorsWriter writer;
  for (const auto& name : names) {
    auto view = dir ? dir->Get(name) : file->Get(name);
    if (!view.ok()) return Fail(view.status().ToString());
    const bool is_float = view->dtype == DType::kF32 || view->dtype == DType::kBF16 || view->dtype == DType::kF16;
    Status s;
    if (to_f32 && is_float) {
      auto t = ToFloat(*view, name);
      s = t.ok() ? writer.AddF32(name, *t) : t.status();
    } else {
      s = writer.Add(name, view->dtype, view->shape, view->data);
    }
    if (!s.ok()) return Fail(s.ToString());
  }
  Status s = WriteOut(writer, a, dir != nullptr);
  return s.ok() ? 0 : Fail(s.ToString());
}

}  // namespace

void RegisterModel(CLI::App& app, Runner* run) {
  auto* model = app.add_subcommand("model", "Reference model files: create random weights, inspect, run");
  model->require_subcommand(1);

  auto init = std::make_shared<InitArgs>();
  auto* i = model->add_subcommand("init", "Write config.json + safetensors with seeded random weights");
  auto* preset_opt = i->add_option("--preset", init->preset, "Preset: " + fmt::format("{}", fmt::join(PresetNames(), ", ")));
  auto* config_opt = i->add_option("--config", init->config, "Or: a config.json to instantiate");
  preset_opt->excludes(config_opt);
  i->add_option("--out", init->out, "Output model directory")->required()->transform(NormalizedPath());
  AddIntOption<std::uint64_t>(i, "--seed", &init->seed, 0, UINT64_MAX, "Random seed (same seed, same bytes)");
  AddSizeOption(i, "--shard-bytes", &init->shard_bytes, "Largest shard; above it, write sharded + index.json", 1);
  i->add_flag("--force", init->force,
              "Replace the checkpoint files (config.json, model*.safetensors, model.safetensors.index.json) in a "
              "non-empty --out, leaving other files alone; also allow models over the 4 GiB safety limit "
              "(kimi-k3, kimi-linear-48b)");
  AddIntOption(i, "--routing-tokens", &init->routing_tokens, 0, kMaxRoutingTokens,
               "Prompt tokens for the routing report (0: skip)");
  AddDoubleOption(i, "--residual-scale", &init->residual_scale_arg, kMinResidualScale, 1.0,
                  "Scale the weights that write into the residual stream (attention/MLP output projections, the MoE "
                  "output) by this factor: smaller layer updates relative to the stream, as in trained models "
                  "(docs/experts.md; default 1)",
                  "below 1e-6 every layer's update is under a millionth of the residual stream, so the layers do "
                  "next to nothing, and far below it the scaled weights underflow bf16 to zero");
  i->callback([run, init] {
    *run = [init] {
      if (init->preset.empty() && init->config.empty()) return FailUsage("model init needs --preset or --config");
      // --residual-scale is range-checked by its option ([kMinResidualScale, 1]).
      if (init->residual_scale_arg) init->residual_scale = *init->residual_scale_arg;
      return RunInit(*init);
    };
  });

  auto dir = std::make_shared<std::string>();
  auto preset = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  auto summary = std::make_shared<bool>(false);
  auto tensors = std::make_shared<bool>(false);
  auto* s = model->add_subcommand("inspect", "List a model's tensors and bytes per component; flag problems");
  auto* dir_opt = s->add_option("dir", *dir, "Model directory");
  s->add_option("--preset", *preset, "Show a preset's expected tensors instead (no files)")->excludes(dir_opt);
  s->add_flag("--json", *json, "JSON output");
  auto* summary_flag = s->add_flag("--summary", *summary, "Totals only, no per-tensor lines (the default for --preset)");
  s->add_flag("--tensors", *tensors, "List every tensor (also for --preset)")->excludes(summary_flag);
  s->callback([run, dir, preset, json, summary, tensors] {
    *run = [dir, preset, json, summary, tensors] {
      if (dir->empty() && preset->empty()) return FailUsage("model inspect needs a directory or --preset");
      return RunInspect(*dir, *preset, *json, *summary, *tensors);
    };
  });

  // The hidden test helpers (no --help group): --in, --out, --force as every output.
  auto helper = [&](const char* name, const char* what) {
    auto a = std::make_shared<HelperArgs>();
    auto* c = model->add_subcommand(name, what);
    c->group("");
    c->add_option("--in", a->in)->required();
    c->add_option("--out", a->out)->required();
    c->add_flag("--force", a->force, "Replace an existing --out Terrace did not write");
    return std::pair{c, a};
  };
  auto [dq, dqa] = helper("dequant-mxfp4", "weight_packed + weight_scale -> weight F32 (for tests)");
  dq->callback([run, a = dqa] { *run = [a] { return RunDequant(*a); }; });
  auto [q, qa] = helper("quantize-mxfp4", "weight F32 -> weight_packed + weight_scale (for tests)");
  q->callback([run, a = qa] { *run = [a] { return RunQuant(*a); }; });
  auto [cp, cpa] = helper("copy-tensors", "Copy a file's or model's tensors into one file (for tests)");
  auto f32 = std::make_shared<bool>(false);
  cp->add_flag("--f32", *f32);
  cp->callback([run, a = cpa, f32] { *run = [a, f32] { return RunCopy(*a, *f32); }; });

  RegisterModelRun(model, run);
}

}  // namespace terrace::cli
