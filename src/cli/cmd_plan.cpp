// `terrace plan`: the capacity planner (docs/plan.md). Analytic mode sizes memory, weights, expert
// cache, concurrency and bandwidth for a model on a node; with --trace it also replays a Mooncake
// request trace through simulated tiers with the store's eviction policies.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/json_text.h"
#include "src/common/param_count.h"
#include "src/model/names.h"
#include "src/model/safetensors.h"
#include "src/plan/analytic.h"
#include "src/plan/hardware.h"
#include "src/plan/replay.h"
#include "src/plan/trace.h"
#include "terrace/model_config.h"

namespace terrace::cli {
namespace {

using json = nlohmann::json;
using namespace terrace::plan;

constexpr std::uint64_t kMaxHardwareFileBytes = 1ull << 20;
constexpr std::uint64_t kMaxTraceFileBytes = 8ull << 30;

struct PlanArgs {
  std::string model = "kimi-k3";
  std::string hardware = "h200-gen5";
  std::string kv_codec = "bf16";
  std::string state_codec = "f32";
  int chunk_tokens = 256;
  int snapshot_every = 1;
  int gqa_kv_heads = 8;
  bool gqa_kv_heads_given = false;  // on the command line: refused above the model's attention heads
  std::optional<double> rate, prefix_reuse, expert_hit_target, expert_zipf;
  std::string context = "32k";
  int concurrency = 32;
  std::uint64_t decode_tokens = 512;
  std::optional<std::uint64_t> expert_cache;
  std::string trace;
  int trace_block_tokens = 512;
  std::string policy = "all";
  int nodes = 1;
  std::string routing = "prefix-affinity";
  std::string placement = "exclusive";
  std::string write_policy = "write-back";
  std::optional<std::uint64_t> kv_hbm, kv_host, kv_nvme;
  int sweep_points = 8;
  bool json = false;
  // Flags given on the command line that only mean something with --trace (or --nodes > 1).
  std::vector<std::string> trace_flags_given;
  bool routing_given = false;
  // Flags given on the command line that are refused for a model without the part they size.
  bool state_codec_given = false, snapshot_every_given = false;
};

// A size option whose default is computed by the plan (shown as such in --help): stays empty unless
// given. Negative, malformed and out-of-range values are usage errors naming the flag.
CLI::Option* AddAutoSizeOption(CLI::App* app, const std::string& name, std::optional<std::uint64_t>* value,
                               const std::string& help) {
  return app
      ->add_option_function<std::string>(
          name,
          [value, name](const std::string& text) {
            if (!text.empty() && text[0] == '-') {
              throw CLI::ValidationError(fmt::format("{} '{}': a size cannot be negative", name, text));
            }
            auto r = ParseSize(text, name);
            if (!r.ok()) throw CLI::ValidationError(r.status().message());
            *value = *r;
          },
          help + " (e.g. 64GiB, 1TiB)")
      ->type_name("SIZE");
}

struct ResolvedModel {
  model::ModelConfig config;
  model::ExpertFormat experts = model::ExpertFormat::kMxfp4;  // how its checkpoint stores the routed experts
  std::string experts_from;                                    // why the plan assumes that
  std::vector<model::TensorSpec> tensors;                      // the checkpoint's, as stored; empty without one
};

// The weights' format of a config.json (docs/plan.md, "Weights and the expert cache"): where the file
// is a model directory's config.json and the directory holds a checkpoint, its tensors as stored
// (StoredTensors); a checkpoint that does not open as `model run` opens it is an error, never a
// fallback to the config. Else MXFP4 experts when the file has a quantization_config (ParseConfigJson
// accepts only compressed-tensors MXFP4), assumed BF16 (plain matrices, as Kimi Linear ships) when not.
Status ConfigWeights(const std::filesystem::path& file, const model::ConfigKeys& keys, ResolvedModel* out) {
  const std::filesystem::path dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  const bool has_checkpoint = std::filesystem::exists(dir / model::kSingleFileName, ec) ||
                              std::filesystem::exists(dir / model::kIndexFileName, ec);
  if (file.filename() == model::kConfigFileName && has_checkpoint) {
    const std::string context = fmt::format(
        "--model {}: plan sizes the weights from the checkpoint in that directory, and it does not open (repair "
        "it, or give --model a copy of config.json in a directory of its own to plan from the config alone)",
        dir.string());
    auto md = model::ModelDir::Open(dir);
    if (!md.ok()) return md.status().WithContext(context);
    auto tensors = StoredTensors(**md, out->config);
    if (!tensors.ok()) return tensors.status().WithContext(context);
    out->experts = model::DetectExpertFormat(**md, out->config);
    out->experts_from = "the checkpoint's tensors";
    out->tensors = std::move(*tensors);
    return Status::Ok();
  }
  bool quantized = false;
  for (const std::string& k : keys.read) {
    quantized = quantized || k == "quantization_config" || k == "text_config.quantization_config";
  }
  out->experts = quantized ? model::ExpertFormat::kMxfp4 : model::ExpertFormat::kF32;
  out->experts_from = quantized ? "config.json's quantization_config"
                                : "config.json has no quantization_config and no checkpoint beside it: BF16 assumed";
  return Status::Ok();
}

// A preset name, else a config.json path or a model directory holding one. Errors name --model;
// *usage is set when the flag's value is wrong (no preset, no readable file), left false when the
// file is read but its config does not parse or the checkpoint beside it does not open (a model that
// does not open: exit 1, as model run).
Result<ResolvedModel> ResolveModel(const std::string& given, bool* usage) {
  *usage = true;
  for (const std::string& p : model::PresetNames()) {
    if (p != given) continue;
    ResolvedModel r;
    TERRACE_ASSIGN_OR_RETURN(r.config, model::Preset(given));
    TERRACE_ASSIGN_OR_RETURN(r.experts, PresetExpertFormat(given));
    r.experts_from = given == "kimi-linear-48b" ? "the published checkpoint stores them in BF16"
                     : given == "kimi-k3"       ? "the published checkpoint stores them in MXFP4"
                                                : "as `terrace model init` writes them";
    return r;
  }
  std::error_code ec;
  const std::string name = std::filesystem::is_directory(given, ec) ? (std::filesystem::path(given) / "config.json").string()
                                                                    : given;
  if (Status s = CheckInputFile(name, "--model", model::kMaxConfigJsonBytes); !s.ok()) {
    return Status::InvalidArgument(fmt::format("--model '{}' is neither a preset ({}) nor a readable config.json: {}",
                                               name, fmt::join(model::PresetNames(), ", "), s.message()));
  }
  *usage = false;
  auto text = ReadInputFile(name, "--model", model::kMaxConfigJsonBytes);
  if (!text.ok()) return text.status();
  model::ConfigKeys keys;
  auto config = model::ParseConfigJson(*text, name, &keys);
  if (!config.ok()) return config.status().WithContext("--model");
  ResolvedModel r;
  r.config = std::move(*config);
  TERRACE_RETURN_IF_ERROR(ConfigWeights(name, keys, &r));
  return r;
}

Result<Hardware> ResolveHardware(const std::string& name) {
  for (const std::string& p : HardwarePresetNames()) {
    if (p == name) return HardwarePreset(name);
  }
  if (Status s = CheckInputFile(name, "--hardware", kMaxHardwareFileBytes); !s.ok()) {
    return Status::InvalidArgument(fmt::format("--hardware '{}' is neither a preset ({}) nor a readable JSON file: {}",
                                               name, fmt::join(HardwarePresetNames(), ", "), s.message()));
  }
  auto text = ReadInputFile(name, "--hardware", kMaxHardwareFileBytes);
  if (!text.ok()) return text.status();
  auto hw = ParseHardwareJson(*text, name);
  if (!hw.ok()) return Status::InvalidArgument(fmt::format("--hardware: {}", hw.status().message()));
  return hw;
}

// Why the plan takes the routed experts' format it does: none to take for a model without MoE layers.
std::string ExpertFormatFrom(const Plan& p) {
  return p.weights.moe_layers == 0 ? std::string("the model has no MoE layers") : p.options.expert_format_from;
}

// A WeightPlan format ("bf16+f32") as the text prints it ("BF16+F32").
std::string Upper(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

std::string RateText(double bytes_per_s) { return FormatBytes(bytes_per_s) + "/s"; }
std::string Sec(double s) {
  if (s >= 1.0) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

json PlanJson(const Plan& p) {
  json j;
  j["kind"] = "plan";
  j["model"] = p.model_name;
  j["hardware"] = json::parse(HardwareToJson(p.hardware));
  j["kv_codec"] = p.kv_codec;
  j["state_codec"] = p.state_codec;
  j["layout_id"] = p.layout_id;
  const Workload& w = p.options.workload;
  json dist = json::array();
  for (const ContextShare& c : w.context) dist.push_back({{"tokens", c.tokens}, {"share", c.share}});
  j["workload"] = {{"rate_rps", w.rate_rps},
                   {"context_tokens", static_cast<std::uint64_t>(std::llround(w.MeanContext()))},
                   {"context_tokens_mean", w.MeanContext()},
                   {"context_tokens_max", w.MaxContext()},
                   {"context_distribution", dist},
                   {"prefix_reuse", w.prefix_reuse},
                   {"concurrency", w.concurrency},
                   {"decode_tokens", w.decode_tokens}};
  const MemoryPlan& m = p.memory;
  json curve = json::array();
  for (const CurvePoint& c : m.curve) {
    curve.push_back({{"tokens", c.tokens}, {"mla_bytes", c.mla_bytes}, {"kda_bytes", c.kda_bytes},
                     {"total_bytes", c.total_bytes}, {"mha_bytes", c.mha_bytes}, {"gqa_bytes", c.gqa_bytes}});
  }
  json per_context = json::array();
  for (const MemoryPlan::ContextRow& r : m.per_context) {
    per_context.push_back({{"sequence_tokens", r.tokens}, {"share", r.share}, {"sequence_bytes", r.bytes}});
  }
  j["memory"] = {{"layers", m.layers},
                 {"mla_layers", m.mla_layers},
                 {"kda_layers", m.kda_layers},
                 {"mla_bytes_per_token", m.mla_bytes_per_token},
                 {"kda_recurrent_bytes_per_layer", m.kda_recurrent_bytes_per_layer},
                 {"kda_conv_bytes_per_layer", m.kda_conv_bytes_per_layer},
                 {"kda_state_bytes_per_sequence", m.kda_state_bytes_per_sequence},
                 {"mla_chunk_block_bytes", m.mla_chunk_block_bytes},
                 {"mla_stored_bytes_per_token", m.mla_stored_bytes_per_token},
                 {"state_block_bytes", m.state_block_bytes},
                 {"attnres_sources", m.attnres_sources},
                 {"attnres_bank_bytes_per_token", m.attnres_bank_bytes_per_token},
                 {"mha_kv_heads", m.mha_kv_heads},
                 {"mha_bytes_per_token", m.mha_bytes_per_token},
                 {"gqa_kv_heads", m.gqa_kv_heads},
                 {"gqa_bytes_per_token", m.gqa_bytes_per_token},
                 {"sequence_tokens", m.sequence_tokens},
                 {"sequence_bytes", m.sequence_bytes},
                 {"longest_sequence_tokens", m.longest_sequence_tokens},
                 {"longest_sequence_bytes", m.longest_sequence_bytes},
                 {"per_context", per_context},
                 {"curve", curve}};
  json comps = json::object();
  for (const auto& [name, bytes] : p.weights.bytes_by_component) comps[name] = bytes;
  const WeightPlan& wp = p.weights;
  j["weights"] = {{"total_bytes", wp.total_bytes},         {"resident_bytes", wp.resident_bytes},
                  {"routed_expert_bytes", wp.routed_expert_bytes}, {"expert_bytes", wp.expert_bytes},
                  {"expert_format", wp.expert_format},     {"expert_format_from", ExpertFormatFrom(p)},
                  {"resident_format", wp.resident_format},
                  {"lookup_embedding_bytes", wp.lookup_embedding_bytes},
                  {"embedding_row_bytes", wp.embedding_row_bytes},
                  {"resident_fits_hbm", wp.resident_fits_hbm},
                  {"moe_layers", wp.moe_layers},           {"experts_per_layer", wp.experts_per_layer},
                  {"experts_per_token", wp.experts_per_token}, {"active_params_per_token", wp.active_params_per_token},
                  {"by_component", comps}};
  const ExpertPlan& e = p.experts;
  j["experts"] = {{"zipf", p.options.expert_zipf},
                  {"hit_target", e.hit_target},
                  {"experts_per_layer_for_target", e.experts_per_layer_for_target},
                  {"bytes_for_target", e.bytes_for_target},
                  {"budget_bytes", e.budget_bytes},
                  {"budget_requested_bytes", e.budget_requested_bytes},
                  {"budget_given", e.budget_given},
                  {"budget_capped", e.budget_capped},
                  {"cached_per_layer", e.cached_per_layer},
                  {"hit_rate", p.weights.moe_layers > 0 ? json(e.hit_rate) : json()},  // none without experts
                  {"miss_bytes_per_token_batch1", e.miss_bytes_per_token_batch1},
                  {"miss_bytes_per_token_batched", e.miss_bytes_per_token_batched},
                  {"stall_s_per_token_batch1", e.stall_s_per_token_batch1},
                  {"stall_s_per_token_batched", e.stall_s_per_token_batched}};
  json tiers = json::array();
  for (const TierPlan& t : p.tiers) {
    tiers.push_back({{"name", t.name}, {"capacity_bytes", t.capacity_bytes}, {"kv_bytes", t.kv_bytes},
                     {"sequences", t.sequences}, {"sequences_longest", t.sequences_longest},
                     {"other_bytes", t.other_bytes}, {"holds", t.holds}});
  }
  j["tiers"] = tiers;
  json bw = json::array();
  for (const BandwidthLine& b : p.bandwidth) {
    bw.push_back({{"link", b.link}, {"required_bytes_per_s", b.required}, {"available_bytes_per_s", b.available},
                  {"utilisation", b.utilisation()}, {"what", b.what}});
  }
  j["bandwidth"] = bw;
  const LifecyclePlan& l = p.lifecycle;
  j["lifecycle"] = {{"weight_load_s", l.weight_load_s},
                    {"kv_state_bytes_per_request", l.kv_state_bytes_per_request},
                    {"router_flops_per_token", l.router_flops_per_token},
                    {"routing_flops_share", l.routing_flops_share},
                    {"prefill_tokens_needed_per_s", l.prefill_tokens_needed_per_s},
                    {"prefill_utilisation", l.prefill_utilisation},
                    {"offload_bytes_per_request", l.offload_bytes_per_request},
                    {"restore_bytes_per_request", l.restore_bytes_per_request},
                    {"writeback_bytes_per_request", l.writeback_bytes_per_request},
                    {"snapshots_per_request", l.snapshots_per_request},
                    {"snapshot_bytes", l.snapshot_bytes},
                    {"prefill_tokens_per_s", l.prefill_tokens_per_s},
                    {"decode_step_bytes", l.decode_step_bytes},
                    {"decode_step_s", l.decode_step_s},
                    {"decode_tokens_per_s", l.decode_tokens_per_s},
                    {"decode_step_with_stalls_s", l.decode_step_with_stalls_s},
                    {"decode_tokens_per_s_with_stalls", l.decode_tokens_per_s_with_stalls},
                    {"decode_tokens_needed_per_s", l.decode_tokens_needed_per_s}};
  j["warnings"] = p.warnings;
  return j;
}

// The expert cache's lines of the text output (a model with routed experts).
void PrintExpertCache(const Plan& p) {
  const ExpertPlan& e = p.experts;
  fmt::print("expert cache (Zipf {} routing skew, hottest experts cached):\n", p.options.expert_zipf);
  fmt::print("  {} hit rate needs {} experts per layer = {} of HBM\n", FormatPercent(e.hit_target),
             e.experts_per_layer_for_target, FormatBytes(static_cast<double>(e.bytes_for_target)));
  const std::string budget_why =
      e.budget_capped ? fmt::format("--expert-cache {} capped at all routed experts",
                                    FormatBytes(static_cast<double>(e.budget_requested_bytes)))
      : e.budget_given ? std::string(e.budget_bytes == 0 ? "--expert-cache 0: no expert cache" : "--expert-cache")
                       : std::string("default: half the HBM left after the resident weights, at most all "
                                                   "routed experts");
  fmt::print("  budget {} ({}) holds {} per layer: hit rate {}, stall {} per token at batch 1, "
             "{} per token at --concurrency {}\n\n",
             FormatBytes(static_cast<double>(e.budget_bytes)), budget_why, e.cached_per_layer, FormatPercent(e.hit_rate),
             Sec(e.stall_s_per_token_batch1), Sec(e.stall_s_per_token_batched), p.options.workload.concurrency);
}

void PrintPlan(const Plan& p) {
  const MemoryPlan& m = p.memory;
  fmt::print("plan: {} on {} ({} GPUs), KV codec {}, state codec {}\n", p.model_name, p.hardware.name,
             p.hardware.gpus, p.kv_codec, p.state_codec);
  fmt::print("layout: {}\n\n", p.layout_id);
  Table mem({"memory", "per token", "per sequence", "note"});
  mem.Add({"MLA latents", FormatBytes(static_cast<double>(m.mla_bytes_per_token)),
           FormatBytes(static_cast<double>(m.sequence_tokens * m.mla_bytes_per_token)),
           fmt::format("{} MLA layers, grows with context; stored {} per token (scales, headers, alignment)",
                       m.mla_layers, FormatBytes(m.mla_stored_bytes_per_token))});
  mem.Add({"KDA state", "-", FormatBytes(static_cast<double>(m.kda_state_bytes_per_sequence)),
           fmt::format("{} KDA layers x ({} recurrent + {} conv), fixed", m.kda_layers,
                       FormatBytes(static_cast<double>(m.kda_recurrent_bytes_per_layer)),
                       FormatBytes(static_cast<double>(m.kda_conv_bytes_per_layer)))});
  if (m.attnres_sources > 0) {
    mem.Add({"AttnRes bank", FormatBytes(static_cast<double>(m.attnres_bank_bytes_per_token)), "-",
             fmt::format("transient, {} vectors per token during a forward pass", m.attnres_sources)});
  } else {
    mem.Add({"AttnRes bank", "-", "-", "none: this model has no AttnRes"});
  }
  mem.Add({fmt::format("MHA ({} KV heads)", m.mha_kv_heads), FormatBytes(static_cast<double>(m.mha_bytes_per_token)),
           FormatBytes(static_cast<double>(m.sequence_tokens * m.mha_bytes_per_token)),
           fmt::format("all {} layers full attention, for comparison", m.layers)});
  mem.Add({fmt::format("GQA ({} KV heads)", m.gqa_kv_heads), FormatBytes(static_cast<double>(m.gqa_bytes_per_token)),
           FormatBytes(static_cast<double>(m.sequence_tokens * m.gqa_bytes_per_token)), "for comparison"});
  fmt::print("{}  (one sequence = {} tokens: --context{} + --decode-tokens)\n\n", mem.Render(), m.sequence_tokens,
             m.per_context.size() > 1 ? " mean" : "");
  if (m.per_context.size() > 1) {
    Table dist({"sequence (context + decode)", "share", "MLA + KDA"});
    for (const MemoryPlan::ContextRow& r : m.per_context) {
      dist.Add({std::to_string(r.tokens), FormatPercent(r.share), FormatBytes(static_cast<double>(r.bytes))});
    }
    fmt::print("--context distribution\n{}\n", dist.Render());
  }

  Table curve({"context", "MLA", "KDA", "total", "MHA", "GQA", "total/MHA"});
  for (const CurvePoint& c : m.curve) {
    curve.Add({fmt::format("{}k", c.tokens / 1024), FormatBytes(static_cast<double>(c.mla_bytes)),
               FormatBytes(static_cast<double>(c.kda_bytes)), FormatBytes(static_cast<double>(c.total_bytes)),
               FormatBytes(static_cast<double>(c.mha_bytes)), FormatBytes(static_cast<double>(c.gqa_bytes)),
               c.mha_bytes ? fmt::format("{:.3f}", static_cast<double>(c.total_bytes) / static_cast<double>(c.mha_bytes))
                           : "-"});
  }
  fmt::print("memory vs context (one sequence)\n{}\n", curve.Render());

  const WeightPlan& w = p.weights;
  Table wt({"weights", "bytes"});
  for (const auto& [name, bytes] : w.bytes_by_component) wt.Add({name, FormatBytes(static_cast<double>(bytes))});
  wt.Add({"total", FormatBytes(static_cast<double>(w.total_bytes))});
  wt.Add({fmt::format("resident (all but routed experts; {})", Upper(w.resident_format)),
          FormatBytes(static_cast<double>(w.resident_bytes))});
  const std::string experts_in = w.expert_format == "none" ? "no routed experts" : "routed experts in " + Upper(w.expert_format);
  fmt::print("{}  {} ({}); one routed expert {} ({} per layer x {} MoE layers, top-{}); {} active "
             "params per token{}\n\n",
             wt.Render(), experts_in, ExpertFormatFrom(p),
             FormatBytes(static_cast<double>(w.expert_bytes)), w.experts_per_layer, w.moe_layers, w.experts_per_token,
             ParamCount(w.active_params_per_token),
             w.lookup_embedding_bytes > 0 ? " (embed_tokens left out: a lookup)" : "");

  if (p.weights.moe_layers == 0) {
    fmt::print("expert cache: none (the model has no routed experts)\n\n");
  } else {
    PrintExpertCache(p);
  }

  Table tiers({"tier", "capacity", "for KV/state", "sequences", "if all longest", "also holds"});
  for (const TierPlan& t : p.tiers) {
    tiers.Add({t.name, FormatBytes(static_cast<double>(t.capacity_bytes)), FormatBytes(static_cast<double>(t.kv_bytes)),
               std::to_string(t.sequences), std::to_string(t.sequences_longest),
               FormatBytes(static_cast<double>(t.other_bytes)) + " " + t.holds});
  }
  fmt::print("{}\n", tiers.Render());
  Table bw({"link", "required", "available", "use", "for"});
  for (const BandwidthLine& b : p.bandwidth) {
    bw.Add({b.link, RateText(b.required), RateText(b.available), FormatPercent(b.utilisation()), b.what});
  }
  fmt::print("{}\n", bw.Render());
  const LifecyclePlan& l = p.lifecycle;
  fmt::print("lifecycle{}: weight load {} | KV+state {} per request | routing {} of FLOPs | offload I/O {} per request | "
             "prefill {:.0f} tok/s ({} busy at --rate) | decode step {} ({:.0f} tok/s; {:.0f} tok/s with expert "
             "stalls; workload needs {:.0f})\n",
             p.weights.resident_fits_hbm ? "" : " (as if the resident weights fitted in HBM: they do not)",
             Sec(l.weight_load_s), FormatBytes(static_cast<double>(l.kv_state_bytes_per_request)),
             FormatPercent(l.routing_flops_share), FormatBytes(static_cast<double>(l.offload_bytes_per_request)),
             l.prefill_tokens_per_s, FormatPercent(l.prefill_utilisation), Sec(l.decode_step_s), l.decode_tokens_per_s,
             l.decode_tokens_per_s_with_stalls, l.decode_tokens_needed_per_s);
  for (const std::string& warning : p.warnings) fmt::print("warning: {}\n", warning);
}

// "2 snapshots", "1 snapshot", "1/16 of a snapshot": KDA snapshots per trace block.
std::string SnapshotCountText(double per_block) {
  if (per_block >= 1) return fmt::format("{:g} snapshot{}", per_block, per_block == 1 ? "" : "s");
  return fmt::format("1/{:g} of a snapshot", 1 / per_block);
}

// "1 request", "2 requests": n and the noun in its number.
std::string Count(std::uint64_t n, std::string_view one, std::string_view many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

// A sum over the replay's requests, per request (0 for no requests).
double PerRequest(const ReplayResult& r, double total) {
  return r.requests ? total / static_cast<double>(r.requests) : 0.0;
}

// A share of the trace's prompt blocks: null in JSON where there are none (0/0: a trace of empty
// prompts), never a measured 0.
json BlockShare(std::uint64_t blocks, double share) { return blocks == 0 ? json() : json(share); }
// The text of such a share: "n/a" for null.
std::string ShareText(const json& share) { return share.is_number() ? FormatPercent(share.get<double>()) : "n/a"; }

json ReplayJson(const ReplayResult& r) {
  json tiers = json::array();
  for (std::size_t t = 0; t < r.tiers.size(); ++t) {
    const TierReplayStats& s = r.tiers[t];
    tiers.push_back({{"name", s.name}, {"capacity_blocks", s.capacity_blocks}, {"hit_blocks", s.hit_blocks},
                     {"hit_rate", BlockShare(r.blocks, r.tier_hit_rate(t))}, {"bytes_read", s.bytes_read},
                     {"bytes_written", s.bytes_written}, {"evictions", s.evictions}});
  }
  return {{"hit_rate", BlockShare(r.blocks, r.hit_rate())},
          {"hit_blocks", r.hit_blocks},
          {"hit_tokens", r.hit_tokens},
          {"tiers", tiers},
          {"ttft_saved_s", r.ttft_saved_s},
          {"ttft_saved_s_per_request", PerRequest(r, r.ttft_saved_s)},
          {"restore_s", r.restore_s},
          {"queue_wait_s", r.queue_wait_s},
          {"queue_wait_s_per_request", PerRequest(r, r.queue_wait_s)},
          {"restores", r.restores},
          {"restores_slower_than_recompute", r.restores_slower_than_recompute},
          {"bytes_moved", r.bytes_moved()},
          {"requests_per_node", r.requests_per_node}};
}

// The load a replay puts on the node over the trace's span (docs/plan.md, "Trace replay"): each lower
// tier's write rate against the hardware's write bandwidth into it, and the recompute of the tokens
// not hit against the prefill speed, on the busiest node, averaged over the trace's last timestamp
// minus its first. The replay times neither (writes take no link time, prefills never queue), so
// where one is over 100% its TTFT saved and restore times are optimistic: `warnings` gets a line.
// A trace that spans 0 s has no rate (nulls).
json TraceLoadJson(const ReplayResult& r, std::string_view policy, const Hardware& hw, double prefill_tokens_per_s,
                   std::vector<std::string>* warnings) {
  const double duration_s = static_cast<double>(r.duration_ms) / 1000.0;
  const bool timed = r.duration_ms > 0;
  auto rate = [&](double amount) { return timed ? json(amount / duration_s) : json(); };
  auto share = [&](double amount, double capacity) { return timed ? json(amount / duration_s / capacity) : json(); };
  json tiers = json::array();
  for (std::size_t k = 1; k < r.tiers.size() && k < 3; ++k) {
    const TierReplayStats& t = r.tiers[k];
    const double bw = k == 1 ? hw.pcie_bandwidth() : hw.nvme_write_bandwidth;
    const char* what = k == 1 ? "PCIe device-to-host, pcie_bandwidth_per_gpu x gpus (--hardware)"
                              : "nvme_write_bandwidth (--hardware)";
    const auto bytes = static_cast<double>(t.max_node_bytes_written);
    tiers.push_back({{"name", t.name}, {"max_node_bytes_written", t.max_node_bytes_written},
                     {"write_bytes_per_s", rate(bytes)}, {"write_bandwidth", bw},
                     {"write_utilisation", share(bytes, bw)}});
    if (timed && bytes / duration_s > bw) {
      warnings->push_back(fmt::format(
          "trace replay ({}): the busiest node writes {} into {} over the trace's {:.0f} s, {} on average, {:.0f}% of "
          "its write bandwidth ({}, {}); the replay does not time writes (no restore waits for them), so its restore "
          "times and TTFT saved are optimistic",
          policy, FormatBytes(bytes), t.name, duration_s, RateText(bytes / duration_s), 100.0 * bytes / duration_s / bw,
          RateText(bw), what));
    }
  }
  const auto tokens = static_cast<double>(r.max_node_recomputed_tokens);
  if (timed && tokens / duration_s > prefill_tokens_per_s) {
    warnings->push_back(fmt::format(
        "trace replay ({}): recomputing the prompt tokens not hit needs {:.0f} tokens/s on the busiest node ({} tokens "
        "over the trace's {:.0f} s), {:.0f}% of the node's {:.0f} tokens/s prefill (--hardware); the replay does not "
        "queue prefills, so its TTFT saved is optimistic",
        policy, tokens / duration_s, r.max_node_recomputed_tokens, duration_s,
        100.0 * tokens / duration_s / prefill_tokens_per_s, prefill_tokens_per_s));
  }
  return {{"duration_s", duration_s},
          {"tiers", tiers},
          {"max_node_recomputed_tokens", r.max_node_recomputed_tokens},
          {"recompute_tokens_per_s", rate(tokens)},
          {"prefill_tokens_per_s", prefill_tokens_per_s},
          {"prefill_utilisation", share(tokens, prefill_tokens_per_s)}};
}

// The trace's replays' progress on stderr, at most every kEverySeconds ("terrace plan: trace replay
// K of N (what): R of M requests, T s"), and their checkpoints, which stop a replay once SIGINT or
// SIGTERM was recorded (StopSignals).
class ReplayProgress {
 public:
  static constexpr double kEverySeconds = 5.0;
  ReplayProgress(std::size_t replays, std::size_t requests)
      : replays_(replays), requests_(requests), t0_(std::chrono::steady_clock::now()), last_(t0_) {}
  // The checkpoint of the next replay, `what` naming it.
  std::function<Status(std::uint64_t)> Next(std::string what) {
    ++started_;
    return [this, what = std::move(what)](std::uint64_t done) -> Status {
      TERRACE_RETURN_IF_ERROR(StopCheck());
      const auto now = std::chrono::steady_clock::now();
      if (std::chrono::duration<double>(now - last_).count() < kEverySeconds) return Status::Ok();
      last_ = now;
      fmt::print(stderr, "terrace plan: trace replay {} of {} ({}): {} of {} requests, {:.0f} s\n", started_, replays_,
                 what, done, requests_, SecondsSince(t0_));
      std::fflush(stderr);
      return Status::Ok();
    };
  }
  // Exit status of a failed replay: 128 + the signal after a stop (saying how far it got), else a usage error.
  int Failed(const Status& s) const {
    if (StopSignalReceived() == 0) return FailUsage(s.message());
    return ExitStopped("terrace plan", fmt::format(" in trace replay {} of {}; nothing was printed", started_, replays_));
  }

 private:
  const std::size_t replays_, requests_;
  std::size_t started_ = 0;
  const std::chrono::steady_clock::time_point t0_;
  std::chrono::steady_clock::time_point last_;
};

// `trace` was read and parsed (in parse_s seconds) before anything is printed, so a bad file prints
// only its error. Fills (*out)["trace"] and, without --json, *text with the tables (printed after the
// plan's). replay_seconds counts the parse and everything here.
int RunTrace(const PlanArgs& a, const Plan& plan, const Trace* trace, double parse_s, json* out, std::string* text) {
  const auto t0 = std::chrono::steady_clock::now();
  std::uint64_t mismatched = 0;
  // Whether every mismatching count is floor(input_length / B): an exporter that leaves out a
  // prompt's partial last block, not a wrong --trace-block-tokens.
  bool mismatched_all_floor = true;
  const auto bt = static_cast<std::uint64_t>(a.trace_block_tokens);
  for (const TraceRequest& r : trace->requests) {
    if (r.hash_ids.size() == (r.input_length + bt - 1) / bt) continue;
    ++mismatched;
    mismatched_all_floor = mismatched_all_floor && r.hash_ids.size() == r.input_length / bt;
  }
  // A chained prefix hash never repeats within one prompt: a request that does is damaged or not a
  // prefix-chained trace, and the replay would count its repeats as hits.
  std::uint64_t repeating = 0, first_repeating = 0;
  for (std::size_t i = 0; i < trace->requests.size(); ++i) {
    std::vector<std::uint64_t> ids = trace->requests[i].hash_ids;
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) == ids.end()) continue;
    if (repeating++ == 0) first_repeating = i + 1;
  }

  // What the store holds per trace block (ChargeTraceBlock); a restore reads one snapshot.
  const std::uint64_t snapshot_bytes = static_cast<std::uint64_t>(plan.memory.kda_layers) * plan.memory.state_block_bytes;
  auto charge = ChargeTraceBlock(bt, static_cast<std::uint64_t>(a.chunk_tokens), plan.memory.mla_chunk_block_bytes,
                                 plan.options.layout.snapshot_every, snapshot_bytes);
  if (!charge.ok()) return FailUsage(charge.status().message());
  const PrefixCeiling ceiling = ComputePrefixCeiling(*trace, charge->restore_every_blocks);
  ReplayOptions ro;
  ro.block_tokens = bt;
  ro.block_bytes = charge->kv_bytes;
  ro.snapshot_bytes_per_block = charge->snapshot_bytes;
  ro.restore_every_blocks = charge->restore_every_blocks;
  ro.restore_extra_bytes = snapshot_bytes;
  ro.prefill_tokens_per_s = plan.lifecycle.prefill_tokens_per_s;
  ro.nodes = a.nodes;
  ro.routing = a.routing == "round-robin" ? plan::Routing::kRoundRobin : plan::Routing::kPrefixAffinity;
  ro.placement = a.placement == "inclusive" ? terrace::Placement::kInclusive : terrace::Placement::kExclusive;
  ro.write_policy =
      a.write_policy == "write-through" ? terrace::WritePolicy::kWriteThrough : terrace::WritePolicy::kWriteBack;
  const Hardware& hw = plan.hardware;
  ro.tiers = {{"hbm", a.kv_hbm.value_or(plan.tiers[0].kv_bytes), 0},
              {"host", a.kv_host.value_or(plan.tiers[1].kv_bytes), hw.pcie_bandwidth()},
              {"nvme", a.kv_nvme.value_or(plan.tiers[2].kv_bytes), std::min(hw.nvme_read_bandwidth, hw.pcie_bandwidth())}};
  std::vector<ReplayPolicy> policies;
  if (a.policy == "all" || a.policy == "lru") policies.push_back(ReplayPolicy::kLru);
  if (a.policy == "all" || a.policy == "s3fifo") policies.push_back(ReplayPolicy::kS3Fifo);

  json tj;
  tj["file"] = a.trace;
  tj["requests"] = trace->requests.size();
  tj["blocks"] = ceiling.blocks;
  tj["unique_blocks"] = ceiling.unique_blocks;
  tj["block_tokens"] = bt;
  tj["block_bytes"] = ro.block_bytes;
  tj["chunks_per_block"] = charge->chunks_per_block;
  tj["restore_every_blocks"] = charge->restore_every_blocks;
  tj["snapshots_per_block"] = snapshot_bytes == 0 ? 0.0 : charge->snapshots_per_block;
  tj["snapshot_bytes_per_block"] = ro.snapshot_bytes_per_block;
  tj["stored_block_bytes"] = ro.stored_block_bytes();
  // Whether the tiers' capacity holds the KDA snapshots with the blocks (false: a model without KDA
  // layers, whose blocks are KV alone).
  tj["snapshots_simulated"] = ro.snapshot_bytes_per_block > 0;
  tj["restore_state_bytes"] = ro.restore_extra_bytes;
  tj["blocks_not_matching_input_length"] = mismatched;
  const std::string mismatched_text = Count(mismatched, "request has", "requests have");
  const std::string mismatch_warning =
      mismatched == 0 ? std::string()
      : mismatched_all_floor
          ? fmt::format("{} a hash_ids count of floor(input_length / {}), one short of ceil(input_length / {}): the "
                        "trace leaves out each prompt's partial last block (as some exporters do), so those tokens "
                        "are never a hit and are recomputed; --trace-block-tokens {} matches the full blocks",
                        mismatched_text, bt, bt, bt)
          : fmt::format("{} a hash_ids count that does not match ceil(input_length / {}); is "
                        "--trace-block-tokens right?",
                        mismatched_text, bt);
  if (!mismatch_warning.empty()) (*out)["warnings"].push_back(mismatch_warning);
  tj["requests_repeating_a_hash_id"] = repeating;
  const std::string repeat_warning =
      repeating == 0 ? std::string()
                     : fmt::format("{} {} a hash id within its own hash_ids (the first: request {}), which a "
                                   "chained prefix hash cannot; the trace may be damaged or not prefix-chained, "
                                   "and the replay counts each repeat as a hit",
                                   repeating, repeating == 1 ? "request repeats" : "requests repeat", first_repeating);
  if (!repeat_warning.empty()) (*out)["warnings"].push_back(repeat_warning);
  tj["prefix_hit_ceiling"] = BlockShare(ceiling.blocks, ceiling.fraction());
  tj["nodes"] = a.nodes;
  tj["routing"] = RoutingName(ro.routing);
  tj["placement"] = a.placement;
  tj["write_policy"] = a.write_policy;
  // What the output notes (JSON `notes`, text `note:` lines): a block's snapshots and restore runs
  // (with the trace line), tiers left out and idle nodes (with the tiers line), sweep capacities left
  // out (with the sweep).
  std::vector<std::string> trace_notes, tier_notes, sweep_notes;
  if (ro.snapshot_bytes_per_block > 0) {
    trace_notes.push_back(fmt::format(
        "a block is {} of KV and {} of KDA state ({} of {}, at its restore boundaries); the tiers, "
        "the footprint ({}) and the sweep's capacities hold both, so the hit rates are for KV + snapshots",
        FormatBytes(static_cast<double>(ro.block_bytes)), FormatBytes(static_cast<double>(ro.snapshot_bytes_per_block)),
        SnapshotCountText(charge->snapshots_per_block), FormatBytes(static_cast<double>(snapshot_bytes)),
        FormatBytes(static_cast<double>(ceiling.unique_blocks * ro.stored_block_bytes()))));
  }
  if (ro.restore_every_blocks > 1) {
    trace_notes.push_back(fmt::format(
        "a restore boundary falls every {} blocks of {} tokens (--chunk-tokens {}), so prefix hits count in "
        "runs of {} blocks, as the store restores; each block is charged its share of a chunk",
        ro.restore_every_blocks, bt, a.chunk_tokens, ro.restore_every_blocks));
  }
  if (ceiling.blocks == 0) {
    trace_notes.push_back("the trace's prompts hold no block, so every hit rate and the ceiling are 0/0: n/a (null in JSON)");
  }
  json tiers_j = json::array();
  const char* const tier_flags[] = {"--kv-hbm", "--kv-host", "--kv-nvme"};
  for (std::size_t k = 0; k < ro.tiers.size(); ++k) {
    const TierSpec& t = ro.tiers[k];
    const std::uint64_t blocks = t.capacity_bytes / ro.stored_block_bytes();
    tiers_j.push_back({{"name", t.name}, {"capacity_bytes", t.capacity_bytes}, {"capacity_blocks", blocks},
                       {"read_bytes_per_s", t.read_bandwidth}});
    // Size 0 asks for no tier; a size under one block gets none all the same, and says so.
    if (blocks == 0 && t.capacity_bytes > 0) {
      tier_notes.push_back(fmt::format("{} {} holds no {} block, so it is left out of the replay as a tier of size 0 "
                                       "is (raise {} to at least {} to replay it)",
                                       t.name, FormatBytes(static_cast<double>(t.capacity_bytes)),
                                       FormatBytes(static_cast<double>(ro.stored_block_bytes())), tier_flags[k],
                                       ro.stored_block_bytes()));
    }
  }
  tj["tiers"] = tiers_j;
  // The store's rule under write-through: a block also lands in the lowest tier when it is written,
  // and an HBM victim with a copy lower down is dropped, not demoted; so with an HBM tier above it,
  // host never receives one (without one, host is the first tier and takes every new block).
  const auto holds_blocks = [&](std::size_t k) { return ro.tiers[k].capacity_bytes >= ro.stored_block_bytes(); };
  if (ro.write_policy == terrace::WritePolicy::kWriteThrough && holds_blocks(0) && holds_blocks(1) &&
      holds_blocks(2)) {
    tier_notes.push_back(
        "with --write-policy write-through every block is also written to nvme, and an hbm victim that has a copy "
        "there is dropped, not demoted (the store's rule): host receives no block, so --kv-host does not change "
        "the hit rates; use --write-policy write-back to replay the host tier");
  }
  if (static_cast<std::uint64_t>(a.nodes) > trace->requests.size()) {
    tier_notes.push_back(fmt::format("{} nodes for {} requests: at least {} nodes get no request", a.nodes,
                                     trace->requests.size(), static_cast<std::uint64_t>(a.nodes) - trace->requests.size()));
  }
  // Hit rate vs capacity (below): one tier of capacity footprint / 2^i for i = points-1 .. 0; a
  // capacity under one block is left out (counted, and noted). The footprint and each capacity
  // count the blocks' KDA snapshots with their KV.
  const std::uint64_t footprint = ceiling.unique_blocks * ro.stored_block_bytes();
  std::vector<int> sweep_points;  // i: capacity footprint / 2^i
  for (int i = a.sweep_points - 1; i >= 0; --i) {
    if (static_cast<std::uint64_t>(std::ldexp(static_cast<double>(footprint), -i)) >= ro.stored_block_bytes())
      sweep_points.push_back(i);
  }
  const int sweep_left_out = a.sweep_points - static_cast<int>(sweep_points.size());
  tj["sweep_points_left_out"] = sweep_left_out;
  if (sweep_left_out > 0) {
    sweep_notes.push_back(fmt::format(
        "{} of the sweep's {} capacities (footprint / 2^i, i = {} .. 0) hold less than one block ({}) and are left "
        "out{}",
        sweep_left_out, a.sweep_points, a.sweep_points - 1, FormatBytes(static_cast<double>(ro.stored_block_bytes())),
        sweep_points.empty() ? "" : fmt::format(": the smallest swept is footprint / 2^{}", sweep_points.front())));
  }
  // The cluster projection's row for --routing is the first policy's replay above (the same options).
  ReplayProgress progress(policies.size() * (1 + sweep_points.size()) + (a.nodes > 1 ? 1 : 0), trace->requests.size());

  json pol = json::array();
  std::vector<ReplayResult> results;
  std::vector<std::string> load_warnings;
  for (ReplayPolicy p : policies) {
    ro.policy = p;
    ro.checkpoint = progress.Next(fmt::format("policy {}", ReplayPolicyName(p)));
    auto r = Replay(*trace, ro);
    if (!r.ok()) return progress.Failed(r.status());
    json pj = ReplayJson(*r);
    pj["policy"] = ReplayPolicyName(p);
    pj["load"] = TraceLoadJson(*r, ReplayPolicyName(p), hw, ro.prefill_tokens_per_s, &load_warnings);
    pol.push_back(pj);
    results.push_back(std::move(*r));
  }
  tj["policies"] = pol;
  for (const std::string& w : load_warnings) (*out)["warnings"].push_back(w);
  if (results.front().duration_ms == 0) {
    trace_notes.push_back("the trace spans 0 s (one timestamp), so no write or recompute rate is checked against the "
                          "hardware (the rates in trace.policies[].load are null)");
  }

  json sweep = json::array();
  for (ReplayPolicy p : policies) {
    for (int i : sweep_points) {
      ReplayOptions so = ro;
      so.policy = p;
      so.nodes = 1;
      so.tiers = {{"cache", static_cast<std::uint64_t>(std::ldexp(static_cast<double>(footprint), -i)), 0}};
      so.checkpoint = progress.Next(fmt::format("{} sweep, 1/{} of the footprint", ReplayPolicyName(p), 1ull << i));
      auto r = Replay(*trace, so);
      if (!r.ok()) return progress.Failed(r.status());
      sweep.push_back({{"policy", ReplayPolicyName(p)},
                       {"capacity_bytes", so.tiers[0].capacity_bytes},
                       {"capacity_blocks", r->tiers[0].capacity_blocks},
                       {"capacity_share_of_footprint", std::ldexp(1.0, -i)},
                       {"hit_rate", BlockShare(r->blocks, r->hit_rate())}});
    }
  }
  tj["sweep"] = sweep;
  tj["footprint_bytes"] = footprint;
  tj["footprint_kv_bytes"] = ceiling.unique_blocks * ro.block_bytes;
  tj["footprint_snapshot_bytes"] = ceiling.unique_blocks * ro.snapshot_bytes_per_block;

  // Cluster projection: both routings, first policy. The row for --routing is that policy's replay
  // above (same options, same figures); the other routing is replayed here.
  if (a.nodes > 1) {
    json cl = json::array();
    for (plan::Routing rt : {plan::Routing::kPrefixAffinity, plan::Routing::kRoundRobin}) {
      std::optional<ReplayResult> own;
      const ReplayResult* r = &results.front();
      if (rt != ro.routing) {
        ReplayOptions co = ro;
        co.policy = policies.front();
        co.routing = rt;
        co.checkpoint = progress.Next(fmt::format("cluster, {} routing", RoutingName(rt)));
        auto replayed = Replay(*trace, co);
        if (!replayed.ok()) return progress.Failed(replayed.status());
        own = std::move(*replayed);
        r = &*own;
      }
      std::uint64_t mx = 0;
      for (auto n : r->requests_per_node) mx = std::max(mx, n);
      const double mean = static_cast<double>(r->requests) / a.nodes;
      cl.push_back({{"routing", RoutingName(rt)}, {"policy", ReplayPolicyName(policies.front())},
                    {"hit_rate", BlockShare(r->blocks, r->hit_rate())}, {"ttft_saved_s", r->ttft_saved_s},
                    {"load_imbalance", mean > 0 ? mx / mean : 0.0}, {"requests_per_node", r->requests_per_node}});
    }
    tj["cluster"] = cl;
  }
  std::vector<std::string> notes = trace_notes;
  notes.insert(notes.end(), tier_notes.begin(), tier_notes.end());
  notes.insert(notes.end(), sweep_notes.begin(), sweep_notes.end());
  tj["notes"] = notes;
  tj["parse_seconds"] = parse_s;
  tj["replay_seconds"] = parse_s + SecondsSince(t0);

  if (!a.json) {
    *text += fmt::format("\ntrace {}: {}, {} blocks of {} tokens ({} unique, {} each), prefix-hit ceiling {}\n", a.trace,
               Count(trace->requests.size(), "request", "requests"), ceiling.blocks, bt, ceiling.unique_blocks,
               FormatBytes(static_cast<double>(ro.stored_block_bytes())), ShareText(tj["prefix_hit_ceiling"]));
    for (const std::string& n : trace_notes) *text += fmt::format("note: {}\n", n);
    if (!mismatch_warning.empty()) *text += fmt::format("warning: {}\n", mismatch_warning);
    if (!repeat_warning.empty()) *text += fmt::format("warning: {}\n", repeat_warning);
    *text += fmt::format("tiers per node: hbm {} | host {} | nvme {} (--kv-hbm, --kv-host, --kv-nvme); {} placement, {}; {} "
               "node(s), {}\n",
               FormatBytes(static_cast<double>(ro.tiers[0].capacity_bytes)),
               FormatBytes(static_cast<double>(ro.tiers[1].capacity_bytes)),
               FormatBytes(static_cast<double>(ro.tiers[2].capacity_bytes)), a.placement, a.write_policy, a.nodes,
               RoutingName(ro.routing));
    for (const std::string& n : tier_notes) *text += fmt::format("note: {}\n", n);
    Table t({"policy", "hit", "hbm", "host", "nvme", "TTFT saved/req", "queued restore wait/req",
             "slower than recompute", "bytes moved"});
    for (std::size_t i = 0; i < results.size(); ++i) {
      const ReplayResult& r = results[i];
      const json& pj = pol[i];
      t.Add({std::string(ReplayPolicyName(policies[i])), ShareText(pj["hit_rate"]), ShareText(pj["tiers"][0]["hit_rate"]),
             ShareText(pj["tiers"][1]["hit_rate"]), ShareText(pj["tiers"][2]["hit_rate"]),
             Sec(PerRequest(r, r.ttft_saved_s)), Sec(PerRequest(r, r.queue_wait_s)),
             std::to_string(r.restores_slower_than_recompute), FormatBytes(static_cast<double>(r.bytes_moved()))});
    }
    *text += fmt::format("{}\n", t.Render());
    for (const std::string& w : load_warnings) *text += fmt::format("warning: {}\n", w);
    Table s({"policy", "capacity", "share of footprint", "hit rate"});
    for (const auto& pt : sweep) {
      s.Add({pt["policy"].get<std::string>(), FormatBytes(pt["capacity_bytes"].get<double>()),
             FormatPercent(pt["capacity_share_of_footprint"].get<double>()), ShareText(pt["hit_rate"])});
    }
    *text += fmt::format("hit rate vs capacity (one tier)\n{}\n", s.Render());
    for (const std::string& n : sweep_notes) *text += fmt::format("note: {}\n", n);
    if (tj.contains("cluster")) {
      Table c({"routing", "hit rate", "load imbalance (max/mean)"});
      for (const auto& cl : tj["cluster"]) {
        c.Add({cl["routing"].get<std::string>(), ShareText(cl["hit_rate"]),
               fmt::format("{:.2f}", cl["load_imbalance"].get<double>())});
      }
      *text += fmt::format("cluster of {} nodes, {} eviction (the first policy replayed above)\n{}\n", a.nodes,
                           ReplayPolicyName(policies.front()), c.Render());
    }
    *text += fmt::format("replayed in {:.2f} s\n", tj["replay_seconds"].get<double>());
  }
  (*out)["trace"] = tj;
  return 0;
}

int RunPlan(const PlanArgs& a) {
  if (a.trace.empty() && !a.trace_flags_given.empty()) {
    const bool one = a.trace_flags_given.size() == 1;
    return FailUsage(fmt::format("{} {} only to a trace replay: add --trace FILE.jsonl or drop {}",
                                 fmt::join(a.trace_flags_given, ", "), one ? "applies" : "apply", one ? "it" : "them"));
  }
  if (a.routing_given && a.nodes < 2) {
    return FailUsage("--routing chooses between nodes: it needs --nodes 2 or more");
  }
  bool usage = false;
  auto resolved = ResolveModel(a.model, &usage);
  if (!resolved.ok()) return usage ? FailUsage(resolved.status().message()) : Fail(resolved.status().ToString());
  const model::ModelConfig* config = &resolved->config;
  if (a.gqa_kv_heads_given && a.gqa_kv_heads > config->num_attention_heads) {
    return FailUsage(fmt::format("--gqa-kv-heads {} is more than the model's {} attention heads; give at most {}",
                                 a.gqa_kv_heads, config->num_attention_heads, config->num_attention_heads));
  }
  if (a.snapshot_every == 0 && !a.trace.empty()) {
    return FailUsage("--snapshot-every 0 (a snapshot at each prompt's last full chunk only) cannot be replayed: --trace "
                     "restores at chunk boundaries with a snapshot; give --snapshot-every 1 or more with --trace");
  }
  // A config sized in MXFP4 with partial blocks: exit 1, as `model init` and a config that does not parse.
  if (Status s = CheckExpertDims(*config, resolved->experts, resolved->experts_from);
      !s.ok() && resolved->tensors.empty()) {
    return Fail(s.WithContext(fmt::format("--model {}", a.model)).ToString());
  }
  const auto t0 = std::chrono::steady_clock::now();
  // With --trace, Ctrl-C stops the replays at their next checkpoint (ReplayProgress): exit 128 + the signal.
  std::optional<StopSignals> stop_signals;
  if (!a.trace.empty()) stop_signals.emplace();
  std::optional<Trace> trace;
  if (!a.trace.empty()) {
    auto text = ReadInputFile(a.trace, "--trace", kMaxTraceFileBytes);
    if (!text.ok()) {
      return text.status().code() == Code::kIoError ? Fail(text.status().ToString()) : FailUsage(text.status().message());
    }
    auto parsed = ParseTrace(*text, a.trace);
    if (!parsed.ok()) return FailUsage(fmt::format("--trace: {}", parsed.status().message()));
    trace = std::move(*parsed);
  }
  const double parse_s = SecondsSince(t0);
  if (StopSignalReceived() != 0) return ExitStopped("terrace plan", " while reading --trace; nothing was printed");
  auto hw = ResolveHardware(a.hardware);
  if (!hw.ok()) return FailUsage(hw.status().message());
  PlanOptions o;
  auto kv = codec::CodecSpec::Parse(a.kv_codec);
  if (!kv.ok()) return FailUsage(fmt::format("--kv-codec: {}", kv.status().message()));
  auto st = codec::CodecSpec::Parse(a.state_codec);
  if (!st.ok()) return FailUsage(fmt::format("--state-codec: {}", st.status().message()));
  // Sizes are planned from the codec's encoded size before its lossless stage (what it saves depends
  // on the data): a "+zstd" / "+lz4" codec would be planned as its base codec under another name.
  for (const auto& [flag, text, spec] : {std::tuple{"--kv-codec", &a.kv_codec, &*kv}, {"--state-codec", &a.state_codec, &*st}}) {
    if (spec->lossless == codec::Lossless::kNone) continue;
    const std::string base = text->substr(0, text->rfind('+'));
    return FailUsage(fmt::format("{} {}: the plan sizes blocks before the lossless stage (what it saves depends on "
                                 "the data), so it would plan {} under another name; give {} {}",
                                 flag, *text, base, flag, base));
  }
  o.layout.kv_codec = *kv;
  o.layout.state_codec = *st;
  o.layout.chunk_tokens = a.chunk_tokens;
  o.layout.snapshot_every = a.snapshot_every;
  o.gqa_kv_heads = a.gqa_kv_heads;
  if (a.rate) o.workload.rate_rps = *a.rate;
  if (a.prefix_reuse) o.workload.prefix_reuse = *a.prefix_reuse;
  auto context = ParseContextDistribution(a.context, "--context");
  if (!context.ok()) return FailUsage(context.status().message());
  o.workload.context = *context;
  o.workload.concurrency = a.concurrency;
  o.workload.decode_tokens = a.decode_tokens;
  if (a.expert_hit_target) o.expert_hit_target = *a.expert_hit_target;
  if (a.expert_zipf) o.expert_zipf = *a.expert_zipf;
  o.expert_cache_bytes = a.expert_cache;
  o.expert_format = resolved->experts;
  o.expert_format_from = resolved->experts_from;
  o.tensors = std::move(resolved->tensors);
  auto plan = MakePlan(*config, a.model, *hw, o);
  if (!plan.ok()) return FailUsage(plan.status().message());
  // Flags that size a part the model lacks would change nothing: refused when given.
  std::vector<std::string> expert_flags;
  if (a.expert_cache) expert_flags.emplace_back("--expert-cache");
  if (a.expert_zipf) expert_flags.emplace_back("--expert-zipf");
  if (a.expert_hit_target) expert_flags.emplace_back("--expert-hit-target");
  if (plan->weights.moe_layers == 0 && !expert_flags.empty()) {
    return FailUsage(fmt::format("--model {}: the model has no routed experts; leave out {}", a.model,
                                 fmt::join(expert_flags, ", ")));
  }
  // (--kv-codec stays: without MLA layers it still sizes the GQA/MHA comparison.)
  if (plan->memory.kda_layers == 0 && (a.state_codec_given || a.snapshot_every_given)) {
    return FailUsage(fmt::format("--model {}: the model has no KDA layers (no state to encode or snapshot); leave out {}",
                                 a.model, a.state_codec_given ? "--state-codec" : "--snapshot-every"));
  }
  // Beside a trace replay the analytic plan's warnings are still those of the flags' workload, not
  // the trace's: each says so, naming the flags (the trace's own warnings start "trace replay").
  if (trace) {
    const Workload& w = plan->options.workload;
    const std::string from =
        fmt::format("analytic plan at --rate {:g} --context {} --prefix-reuse {:g} --concurrency {} --decode-tokens {} "
                    "(from these flags, not from the trace)",
                    w.rate_rps, a.context, w.prefix_reuse, w.concurrency, w.decode_tokens);
    for (std::string& warning : plan->warnings) warning = fmt::format("{}: {}", from, warning);
  }
  json j = PlanJson(*plan);
  std::string trace_text;
  if (trace) {
    if (int rc = RunTrace(a, *plan, &*trace, parse_s, &j, &trace_text); rc != 0) return rc;
  }
  if (!a.json) {
    PrintPlan(*plan);
    fmt::print("{}", trace_text);
  }
  if (a.json) fmt::print("{}\n", JsonText(j, 2));
  return 0;
}

}  // namespace

void RegisterPlan(CLI::App& app, Runner* run) {
  auto a = std::make_shared<PlanArgs>();
  auto* c = app.add_subcommand("plan", "Capacity planning: memory, weights, expert cache, tiers, bandwidth; "
                                       "--trace replays a request trace through the store's eviction policies");
  c->add_option("--model", a->model, "Model preset (" + fmt::format("{}", fmt::join(model::PresetNames(), ", ")) +
                                         "), a config.json path or a model directory")
      ->capture_default_str();
  c->add_option("--hardware", a->hardware,
                "Hardware preset (" + fmt::format("{}", fmt::join(HardwarePresetNames(), ", ")) +
                    ") or a JSON file (docs/plan.md)")
      ->capture_default_str();
  c->add_option("--kv-codec", a->kv_codec, "Codec of the MLA latents (bf16, fp8, int8, int4-g32, ...)")->capture_default_str();
  c->add_option("--state-codec", a->state_codec, "Codec of the KDA state (f32, bf16, ...)")->capture_default_str();
  AddIntOption(c, "--chunk-tokens", &a->chunk_tokens, 1, 65536, "Tokens per stored KV chunk");
  AddIntOption(c, "--snapshot-every", &a->snapshot_every, 0, 1048576,
               "KDA snapshot every N chunks, as `model run --snapshot-every` (0: only at the request's last full "
               "chunk; not with --trace)");
  AddIntOption(c, "--gqa-kv-heads", &a->gqa_kv_heads, 1, 4096,
               "KV heads of the GQA comparison model (at most the model's attention heads; the default 8 is capped "
               "at them)")
      ->each([a](const std::string&) { a->gqa_kv_heads_given = true; });
  AddDoubleOption(c, "--rate", &a->rate, 0, 1e6, "Requests per second per node (default 1)");
  c->add_option("--context", a->context,
                "Prompt tokens per request (k = 1024, M = 1024k), or a distribution of lengths with weights, "
                "e.g. 4k:0.5,32k:0.3,128k:0.2")
      ->type_name("TOKENS")
      ->capture_default_str();
  AddDoubleOption(c, "--prefix-reuse", &a->prefix_reuse, 0, 1, "Share of each prompt found in the prefix cache (default 0.5)");
  AddIntOption(c, "--concurrency", &a->concurrency, 1, 1'000'000, "Sequences decoding at once per node");
  AddIntOption<std::uint64_t>(c, "--decode-tokens", &a->decode_tokens, 0, 1ull << 24, "Output tokens per request");
  AddDoubleOption(c, "--expert-hit-target", &a->expert_hit_target, 1e-6, 1, "Expert-cache hit rate to size for (default 0.9)");
  AddDoubleOption(c, "--expert-zipf", &a->expert_zipf, 0, 8, "Routing skew: expert i chosen with p ~ 1/(i+1)^s (default 1)");
  AddAutoSizeOption(c, "--expert-cache", &a->expert_cache,
                    "HBM for the routed-expert cache (default: half the HBM left after the resident weights, at most all "
                    "routed experts; a larger value is capped at them; 0: no expert cache)");
  c->add_option("--trace", a->trace, "Mooncake-format JSONL request trace to replay");
  AddIntOption(c, "--trace-block-tokens", &a->trace_block_tokens, 1, 65536, "Tokens per trace hash id");
  c->add_option("--policy", a->policy, "Eviction policy to replay: lru, s3fifo or all")
      ->check(CLI::IsMember({"lru", "s3fifo", "all"}))
      ->capture_default_str();
  AddIntOption(c, "--nodes", &a->nodes, 1, 4096, "Nodes of the cluster projection, each with its own tiers");
  c->add_option("--routing", a->routing, "Request routing across --nodes: prefix-affinity or round-robin")
      ->check(CLI::IsMember({"prefix-affinity", "round-robin"}))
      ->capture_default_str();
  c->add_option("--placement", a->placement,
                "The store's placement in the replay: exclusive (a hit moves the block up) or inclusive (keeps "
                "the copy below)")
      ->check(CLI::IsMember({"exclusive", "inclusive"}))
      ->capture_default_str();
  c->add_option("--write-policy", a->write_policy,
                "The store's write policy in the replay: write-back (new blocks reach lower tiers when evicted) "
                "or write-through (also written to the lowest tier)")
      ->check(CLI::IsMember({"write-back", "write-through"}))
      ->capture_default_str();
  AddAutoSizeOption(c, "--kv-hbm", &a->kv_hbm, "HBM per node for KV blocks in the replay (default: the plan's HBM left for KV)");
  AddAutoSizeOption(c, "--kv-host", &a->kv_host, "Host RAM per node for KV blocks in the replay (default: the plan's)");
  AddAutoSizeOption(c, "--kv-nvme", &a->kv_nvme, "NVMe per node for KV blocks in the replay (default: the plan's)");
  AddIntOption(c, "--sweep-points", &a->sweep_points, 1, 32,
               "Capacities of the hit-rate-vs-capacity sweep: footprint / 2^i for i = N-1 .. 0; those under one "
               "block are left out (and counted)");
  c->add_flag("--json", a->json, "JSON output (docs/plan.md lists the keys)");
  c->callback([run, a, c] {
    a->trace_flags_given.clear();
    for (const char* f : {"--trace-block-tokens", "--policy", "--nodes", "--routing", "--kv-hbm", "--kv-host", "--kv-nvme",
                          "--sweep-points", "--placement", "--write-policy"}) {
      if (c->count(f) > 0) a->trace_flags_given.emplace_back(f);
    }
    a->routing_given = c->count("--routing") > 0;
    a->state_codec_given = c->count("--state-codec") > 0;
    a->snapshot_every_given = c->count("--snapshot-every") > 0;
    *run = [a] { return RunPlan(*a); };
  });
}

}  // namespace terrace::cli
