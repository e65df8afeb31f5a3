#include "src/plan/analytic.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "src/common/size_parse.h"
#include "src/model/mxfp4.h"
#include "src/model/names.h"
#include "src/model/weights_init.h"
#include "terrace/model_tensor.h"

namespace terrace::plan {
namespace {

std::uint64_t SpecBytes(const model::TensorSpec& s) {
  return static_cast<std::uint64_t>(model::NumElements(s.shape)) * model::DTypeSize(s.dtype);
}

// The dtypes of the `specs` that `pick` selects, lower case, most bytes first, joined by "+"
// ("bf16+f32"); "mxfp4" when any of them is an MXFP4 tensor; "none" when it selects none.
template <typename Pick>
std::string DTypesOf(const std::vector<model::TensorSpec>& specs, Pick pick) {
  std::vector<std::pair<std::uint64_t, model::DType>> bytes;  // (bytes, dtype)
  for (const model::TensorSpec& s : specs) {
    if (!pick(s)) continue;
    if (s.mxfp4) return "mxfp4";
    auto it = std::find_if(bytes.begin(), bytes.end(), [&](const auto& b) { return b.second == s.dtype; });
    if (it == bytes.end()) it = bytes.insert(bytes.end(), {0, s.dtype});
    it->first += SpecBytes(s);
  }
  if (bytes.empty()) return "none";
  std::stable_sort(bytes.begin(), bytes.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out;
  for (const auto& [n, dtype] : bytes) {
    if (!out.empty()) out += '+';
    for (char c : model::DTypeName(dtype)) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

std::vector<double> ZipfWeights(int experts, double s) {
  std::vector<double> p(static_cast<std::size_t>(std::max(experts, 0)));
  double sum = 0;
  for (int i = 0; i < experts; ++i) sum += p[static_cast<std::size_t>(i)] = 1.0 / std::pow(i + 1.0, s);
  for (double& x : p) x /= sum;
  return p;
}

constexpr std::uint64_t kMaxContextTokens = 1ull << 24;

double Gib(std::uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(1ull << 30); }

Status CheckWorkload(const PlanOptions& o) {
  const Workload& w = o.workload;
  if (!(w.rate_rps >= 0) || w.rate_rps > 1e6) return Status::InvalidArgument("--rate must be 0 to 1e6 requests/s");
  if (w.context.empty()) return Status::InvalidArgument("--context needs at least one prompt length");
  double shares = 0;
  for (const ContextShare& c : w.context) {
    if (c.tokens == 0 || c.tokens > kMaxContextTokens) {
      return Status::InvalidArgument("--context lengths must be 1 to 16777216 tokens");
    }
    if (!(c.share > 0 && c.share <= 1)) return Status::InvalidArgument("--context weights must be positive");
    shares += c.share;
  }
  if (std::abs(shares - 1.0) > 1e-9) return Status::InvalidArgument("--context shares must sum to 1");
  if (!(w.prefix_reuse >= 0 && w.prefix_reuse <= 1)) return Status::InvalidArgument("--prefix-reuse must be 0 to 1");
  if (w.concurrency < 1 || w.concurrency > 1'000'000) return Status::InvalidArgument("--concurrency must be 1 to 1000000");
  if (w.decode_tokens > (1ull << 24)) return Status::InvalidArgument("--decode-tokens must be 0 to 16777216");
  if (!(o.expert_hit_target > 0 && o.expert_hit_target <= 1)) {
    return Status::InvalidArgument("--expert-hit-target must be in (0, 1]");
  }
  if (!(o.expert_zipf >= 0 && o.expert_zipf <= 8)) return Status::InvalidArgument("--expert-zipf must be 0 to 8");
  if (o.gqa_kv_heads < 1) return Status::InvalidArgument("--gqa-kv-heads must be positive");
  return Status::Ok();
}

// Router gate parameters of every MoE layer, from the tensor list (the `gate.weight` tensor of each
// layer's block_sparse_moe, [experts, hidden]).
double RouterParams(const std::vector<model::TensorSpec>& specs) {
  double params = 0;
  for (const model::TensorSpec& s : specs) {
    if (s.component == model::Component::kMoeRouting && s.layer >= 0 &&
        s.name == model::MoeTensorName(s.layer, "gate.weight")) {
      params += static_cast<double>(s.params());
    }
  }
  return params;
}

}  // namespace

std::vector<ContextShare> Workload::DefaultContext() {
  std::vector<ContextShare> v(1);
  v[0].tokens = 32768;
  v[0].share = 1.0;
  return v;
}

double Workload::MeanContext() const {
  double m = 0;
  for (const ContextShare& c : context) m += static_cast<double>(c.tokens) * c.share;
  return m;
}

std::uint64_t Workload::MaxContext() const {
  std::uint64_t m = 0;
  for (const ContextShare& c : context) m = std::max(m, c.tokens);
  return m;
}

Result<std::uint64_t> ParseTokens(std::string_view text, std::string_view flag) {
  auto bad = [&] {
    return Status::InvalidArgument(fmt::format(
        "{} '{}' is not a token count; use a whole number with an optional k (x1024) or M (x1048576) suffix, "
        "e.g. 4096, 32k, 1M",
        flag, text));
  };
  std::uint64_t mult = 1;
  std::string_view digits = text;
  if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
    mult = 1024;
    digits.remove_suffix(1);
  } else if (!digits.empty() && digits.back() == 'M') {
    mult = 1024 * 1024;
    digits.remove_suffix(1);
  }
  std::uint64_t v = 0;
  const char* end = digits.data() + digits.size();
  auto [ptr, ec] = std::from_chars(digits.data(), end, v);
  if (digits.empty() || ec != std::errc() || ptr != end) return bad();
  if (v > kMaxContextTokens) return bad();
  v *= mult;
  if (v == 0 || v > kMaxContextTokens) {
    return Status::InvalidArgument(fmt::format("{} {} is out of range: accepted 1 to {} tokens (16M)", flag, text,
                                               kMaxContextTokens));
  }
  return v;
}

Result<std::vector<ContextShare>> ParseContextDistribution(std::string_view text, std::string_view flag) {
  std::vector<ContextShare> out;
  double total = 0;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    ContextShare c;
    const std::size_t colon = item.find(':');
    TERRACE_ASSIGN_OR_RETURN(c.tokens, ParseTokens(item.substr(0, colon), flag));
    c.share = 1.0;
    if (colon != std::string_view::npos) {
      const std::string_view w = item.substr(colon + 1);
      const std::string ws(w);
      char* e = nullptr;
      c.share = ws.empty() ? -1 : std::strtod(ws.c_str(), &e);
      if (ws.empty() || e != ws.c_str() + ws.size() || !(c.share > 0) || !std::isfinite(c.share)) {
        return Status::InvalidArgument(fmt::format(
            "{} '{}': the weight after ':' must be a positive number, e.g. --context 4k:0.5,32k:0.3,128k:0.2", flag,
            item));
      }
    } else if (text.find(',') != std::string_view::npos) {
      return Status::InvalidArgument(fmt::format(
          "{} '{}': a distribution needs a weight for every length, e.g. --context 4k:0.5,32k:0.3,128k:0.2", flag,
          item));
    }
    total += c.share;
    out.push_back(c);
    if (comma == text.size()) break;
  }
  for (ContextShare& c : out) c.share /= total;
  return out;
}

Result<std::vector<model::TensorSpec>> StoredTensors(const model::WeightSource& source,
                                                     const model::ModelConfig& config) {
  std::vector<model::TensorSpec> specs = model::ExpectedTensors(config, model::DetectExpertFormat(source, config));
  for (model::TensorSpec& s : specs) {
    TERRACE_ASSIGN_OR_RETURN(const model::TensorView view, source.Get(s.name));
    s.dtype = view.dtype;
    s.shape = view.shape;
  }
  return specs;
}

Result<model::ExpertFormat> PresetExpertFormat(std::string_view preset) {
  TERRACE_RETURN_IF_ERROR(model::Preset(preset).status());
  return preset == "kimi-linear-48b" ? model::ExpertFormat::kF32 : model::ExpertFormat::kMxfp4;
}

std::vector<double> ExpertInclusion(int experts, double zipf_s, int top_k) {
  const std::vector<double> w = ZipfWeights(experts, zipf_s);  // non-increasing
  std::vector<double> p(w.size(), 0.0);
  if (top_k <= 0 || experts <= 0) return p;
  if (top_k >= experts) {
    std::fill(p.begin(), p.end(), 1.0);
    return p;
  }
  // The hottest `saturated` experts are always picked; the rest scale as c x w_i with c spending the
  // remaining picks over their weight. Add saturated experts until the hottest unsaturated one fits.
  std::vector<double> tail(w.size() + 1, 0.0);  // tail[i] = w_i + ... + w_{E-1}
  for (std::size_t i = w.size(); i-- > 0;) tail[i] = tail[i + 1] + w[i];
  std::size_t saturated = 0;
  double c = 0;
  for (; saturated < static_cast<std::size_t>(top_k); ++saturated) {
    c = (static_cast<double>(top_k) - static_cast<double>(saturated)) / tail[saturated];
    if (c * w[saturated] <= 1.0) break;
  }
  for (std::size_t i = 0; i < w.size(); ++i) p[i] = i < saturated ? 1.0 : std::min(1.0, c * w[i]);
  return p;
}

double ZipfMass(int experts, double zipf_s, int top_k, int cached) {
  if (cached >= experts) return 1.0;
  if (cached <= 0 || top_k <= 0) return 0.0;
  const std::vector<double> p = ExpertInclusion(experts, zipf_s, top_k);
  double m = 0;
  for (int i = 0; i < cached; ++i) m += p[static_cast<std::size_t>(i)];
  return std::min(m / top_k, 1.0);
}

int ExpertsForHitRate(int experts, double zipf_s, int top_k, double target) {
  if (top_k <= 0) return experts;
  const std::vector<double> p = ExpertInclusion(experts, zipf_s, top_k);
  double m = 0;
  for (int i = 0; i < experts; ++i) {
    m += p[static_cast<std::size_t>(i)];
    if (m / top_k >= target - 1e-12) return i + 1;
  }
  return experts;
}

Status CheckExpertDims(const model::ModelConfig& config, model::ExpertFormat format, std::string_view why) {
  if (format != model::ExpertFormat::kMxfp4) return Status::Ok();
  return model::CheckMxfp4ExpertDims(config, fmt::format("the plan sizes the routed experts in MXFP4 ({})", why));
}

Result<Plan> MakePlan(const model::ModelConfig& config, std::string model_name, const Hardware& hw,
                      const PlanOptions& o) {
  TERRACE_RETURN_IF_ERROR(CheckWorkload(o));
  TERRACE_RETURN_IF_ERROR(ValidateHardware(hw, "--hardware"));
  TERRACE_ASSIGN_OR_RETURN(kv::KvLayout layout, kv::KvLayout::FromConfig(config, o.layout));
  if (o.tensors.empty()) TERRACE_RETURN_IF_ERROR(CheckExpertDims(config, o.expert_format, o.expert_format_from));
  Plan plan;
  plan.model_name = std::move(model_name);
  plan.hardware = hw;
  plan.options = o;
  plan.kv_codec = layout.kv_codec().Name();
  plan.state_codec = layout.state_codec().Name();
  plan.layout_id = layout.Id();
  const Workload& w = o.workload;

  // ---- Memory (KvLayout) ----
  MemoryPlan& m = plan.memory;
  m.layers = layout.num_layers();
  m.mla_layers = static_cast<int>(layout.mla_layers().size());
  m.kda_layers = static_cast<int>(layout.kda_layers().size());
  m.mla_bytes_per_token = layout.mla_bytes_per_token();
  m.kda_recurrent_bytes_per_layer = layout.kda_recurrent_bytes_per_layer();
  m.kda_conv_bytes_per_layer = layout.kda_conv_bytes_per_layer();
  m.kda_state_bytes_per_sequence = layout.kda_state_bytes_per_sequence();
  m.mla_chunk_block_bytes = layout.mla_chunk_block_bytes();
  m.mla_stored_bytes_per_token = static_cast<double>(m.mla_chunk_block_bytes) / layout.chunk_tokens();
  m.state_block_bytes = layout.state_block_bytes();
  if (config.attn_res_block_size > 0) {
    m.attnres_sources = config.AttnResBankBlocks() + 1;  // the blocks and the running partial sum
    m.attnres_bank_bytes_per_token = static_cast<std::uint64_t>(m.attnres_sources) *
                                     static_cast<std::uint64_t>(config.hidden_size) * sizeof(float);
  }
  const double kv_value_bytes = layout.kv_codec().NominalBytesPerValue();
  const double head_values = config.QkHeadDim() + config.v_head_dim;
  m.mha_kv_heads = config.num_attention_heads;
  m.gqa_kv_heads = std::min(o.gqa_kv_heads, config.num_attention_heads);
  m.mha_bytes_per_token = static_cast<std::uint64_t>(std::llround(m.mha_kv_heads * head_values * kv_value_bytes *
                                                                  config.num_hidden_layers));
  m.gqa_bytes_per_token = static_cast<std::uint64_t>(std::llround(m.gqa_kv_heads * head_values * kv_value_bytes *
                                                                  config.num_hidden_layers));
  auto seq_bytes = [&](double tokens) {
    return static_cast<std::uint64_t>(std::llround(tokens * static_cast<double>(m.mla_bytes_per_token))) +
           m.kda_state_bytes_per_sequence;
  };
  const double mean_context = w.MeanContext();
  m.sequence_tokens = static_cast<std::uint64_t>(std::llround(mean_context)) + w.decode_tokens;
  m.sequence_bytes = seq_bytes(mean_context + static_cast<double>(w.decode_tokens));
  m.longest_sequence_tokens = w.MaxContext() + w.decode_tokens;
  m.longest_sequence_bytes = seq_bytes(static_cast<double>(m.longest_sequence_tokens));
  for (const ContextShare& c : w.context) {
    m.per_context.push_back({c.tokens + w.decode_tokens, c.share,
                             seq_bytes(static_cast<double>(c.tokens + w.decode_tokens))});
  }
  for (std::uint64_t t = 1024; t <= (1u << 20); t *= 2) {
    CurvePoint p;
    p.tokens = t;
    p.mla_bytes = t * m.mla_bytes_per_token;
    p.kda_bytes = m.kda_state_bytes_per_sequence;
    p.total_bytes = p.mla_bytes + p.kda_bytes;
    p.mha_bytes = t * m.mha_bytes_per_token;
    p.gqa_bytes = t * m.gqa_bytes_per_token;
    m.curve.push_back(p);
  }

  // ---- Weights (ExpectedTensors) ----
  WeightPlan& wp = plan.weights;
  std::vector<std::uint64_t> by_comp(model::kNumComponents, 0);
  double params_resident = 0, params_expert = 0, params_lookup = 0;
  int first_moe = -1;
  const std::vector<model::TensorSpec> specs =
      o.tensors.empty() ? model::ExpectedTensors(config, o.expert_format) : o.tensors;
  const auto routed = [](const model::TensorSpec& s) { return s.component == model::Component::kRoutedExperts; };
  wp.expert_format = DTypesOf(specs, routed);
  wp.resident_format = DTypesOf(specs, [&](const model::TensorSpec& s) { return !routed(s); });
  for (const model::TensorSpec& s : specs) {
    const std::uint64_t b = SpecBytes(s);
    by_comp[static_cast<std::size_t>(s.component)] += b;
    wp.total_bytes += b;
    if (s.component == model::Component::kRoutedExperts) {
      wp.routed_expert_bytes += b;
      if (first_moe < 0) first_moe = s.layer;
      if (s.layer == first_moe && s.expert == 0) {
        wp.expert_bytes += b;
        params_expert += static_cast<double>(s.params());
      }
    } else {
      params_resident += static_cast<double>(s.params());
      // Untied, embed_tokens is a lookup: no FLOPs, one row read per token. Tied, it is also the
      // lm_head (there is no lm_head tensor), a matmul over all of it.
      if (s.name == model::kEmbed && !config.tie_word_embeddings) {
        params_lookup += static_cast<double>(s.params());
        wp.lookup_embedding_bytes += b;
        wp.embedding_row_bytes = s.shape.empty() || s.shape[0] == 0 ? 0 : b / static_cast<std::uint64_t>(s.shape[0]);
      }
    }
  }
  for (int c = 0; c < model::kNumComponents; ++c) {
    wp.bytes_by_component.emplace_back(std::string(model::ComponentName(static_cast<model::Component>(c))),
                                       by_comp[static_cast<std::size_t>(c)]);
  }
  wp.resident_bytes = wp.total_bytes - wp.routed_expert_bytes;
  wp.moe_layers = config.HasRoutedExperts() ? config.NumMoeLayers() : 0;
  wp.experts_per_layer = config.num_experts;
  wp.experts_per_token = config.num_experts_per_token;
  wp.active_params_per_token =
      params_resident - params_lookup + params_expert * wp.experts_per_token * wp.moe_layers;

  // ---- Expert cache ----
  ExpertPlan& ep = plan.experts;
  const std::uint64_t expert_layer_bytes = wp.expert_bytes * static_cast<std::uint64_t>(wp.moe_layers);
  const std::uint64_t hbm = hw.hbm_bytes();
  const std::uint64_t hbm_after_resident = hbm > wp.resident_bytes ? hbm - wp.resident_bytes : 0;
  wp.resident_fits_hbm = wp.resident_bytes <= hbm;
  ep.hit_target = o.expert_hit_target;
  if (wp.moe_layers > 0 && wp.expert_bytes > 0) {
    ep.experts_per_layer_for_target =
        ExpertsForHitRate(wp.experts_per_layer, o.expert_zipf, wp.experts_per_token, o.expert_hit_target);
    ep.bytes_for_target = static_cast<std::uint64_t>(ep.experts_per_layer_for_target) * expert_layer_bytes;
    // A cache larger than all routed experts holds nothing more: the default is half the HBM left
    // after the resident weights, at most all routed experts, and a larger --expert-cache is capped.
    ep.budget_requested_bytes = o.expert_cache_bytes.value_or(0);
    ep.budget_given = o.expert_cache_bytes.has_value();
    ep.budget_bytes = o.expert_cache_bytes.value_or(std::min(hbm_after_resident / 2, wp.routed_expert_bytes));
    if (ep.budget_bytes > hbm_after_resident) {
      return Status::InvalidArgument(fmt::format(
          "--expert-cache {:.1f} GiB is more than the {:.1f} GiB of HBM left after the resident weights ({:.1f} GiB "
          "of {:.1f} GiB); lower --expert-cache or add GPUs (--hardware)",
          Gib(ep.budget_bytes), Gib(hbm_after_resident), Gib(wp.resident_bytes), Gib(hbm)));
    }
    if (ep.budget_bytes > wp.routed_expert_bytes) {
      ep.budget_bytes = wp.routed_expert_bytes;
      ep.budget_capped = true;
    }
    ep.cached_per_layer = static_cast<int>(std::min<std::uint64_t>(ep.budget_bytes / expert_layer_bytes,
                                                                   static_cast<std::uint64_t>(wp.experts_per_layer)));
    ep.hit_rate = ZipfMass(wp.experts_per_layer, o.expert_zipf, wp.experts_per_token, ep.cached_per_layer);
    const std::vector<double> p = ExpertInclusion(wp.experts_per_layer, o.expert_zipf, wp.experts_per_token);
    // Batch 1: top-k picks per layer, each a miss with probability (1 - hit).
    ep.miss_bytes_per_token_batch1 = ep.cached_per_layer >= wp.experts_per_layer
                                         ? 0.0
                                         : (1.0 - ep.hit_rate) * wp.experts_per_token * static_cast<double>(expert_layer_bytes);
    // Expert misses come from host RAM when the routed experts fit there, else from NVMe.
    const double link = wp.routed_expert_bytes <= hw.host_bytes ? hw.pcie_bandwidth()
                                                                : std::min(hw.pcie_bandwidth(), hw.nvme_read_bandwidth);
    ep.stall_s_per_token_batch1 = ep.miss_bytes_per_token_batch1 / link;
    // Batched: an uncached expert is loaded once per step when any of the step's sequences picked it.
    double misses_per_step = 0;
    for (int e = ep.cached_per_layer; e < wp.experts_per_layer; ++e) {
      misses_per_step += 1.0 - std::pow(1.0 - p[static_cast<std::size_t>(e)], w.concurrency);
    }
    ep.miss_bytes_per_token_batched =
        misses_per_step * static_cast<double>(expert_layer_bytes) / static_cast<double>(w.concurrency);
    ep.stall_s_per_token_batched = ep.miss_bytes_per_token_batched / link;
  }

  // ---- Tiers ----
  const std::uint64_t seq = std::max<std::uint64_t>(m.sequence_bytes, 1);
  const std::uint64_t longest = std::max<std::uint64_t>(m.longest_sequence_bytes, 1);
  {
    TierPlan t;
    t.name = "hbm";
    t.capacity_bytes = hbm;
    const std::uint64_t used = wp.resident_bytes + ep.budget_bytes;
    t.kv_bytes = hbm > used ? hbm - used : 0;
    t.sequences = t.kv_bytes / seq;
    t.sequences_longest = t.kv_bytes / longest;
    t.other_bytes = used;
    t.holds = "resident weights + expert cache";
    plan.tiers.push_back(t);
  }
  const std::uint64_t experts_in_host = std::min(wp.routed_expert_bytes, hw.host_bytes);
  {
    TierPlan t;
    t.name = "host";
    t.capacity_bytes = hw.host_bytes;
    t.kv_bytes = hw.host_bytes - experts_in_host;
    t.sequences = t.kv_bytes / seq;
    t.sequences_longest = t.kv_bytes / longest;
    t.other_bytes = experts_in_host;
    t.holds = "routed experts";
    plan.tiers.push_back(t);
  }
  {
    TierPlan t;
    t.name = "nvme";
    t.capacity_bytes = hw.nvme_bytes;
    const std::uint64_t spill = wp.routed_expert_bytes - experts_in_host;
    t.kv_bytes = hw.nvme_bytes > wp.total_bytes + spill ? hw.nvme_bytes - wp.total_bytes - spill : 0;
    t.sequences = t.kv_bytes / seq;
    t.sequences_longest = t.kv_bytes / longest;
    t.other_bytes = wp.total_bytes + spill;
    t.holds = spill > 0 ? "checkpoint + routed experts not in host" : "checkpoint";
    plan.tiers.push_back(t);
  }

  // ---- Lifecycle and bandwidth ----
  LifecyclePlan& lc = plan.lifecycle;
  lc.prefill_tokens_per_s = wp.active_params_per_token > 0
                                ? hw.gpu_flops() * hw.mfu / (2.0 * wp.active_params_per_token)
                                : 0;
  // Restore and write-back at the stored block sizes (see LifecyclePlan).
  const double reuse_tokens = w.prefix_reuse * mean_context;
  const double new_prompt_tokens = mean_context - reuse_tokens;
  lc.snapshot_bytes = static_cast<double>(m.kda_layers) * static_cast<double>(m.state_block_bytes);
  if (m.kda_layers > 0) {
    // As KvLayout::SnapshotDue decides per prompt: the new full chunks (start, end] after the restored
    // ones, a snapshot at each multiple of snapshot_every among them and at the last (0: the last only).
    const std::uint64_t every = static_cast<std::uint64_t>(layout.snapshot_every());
    const auto C = static_cast<std::uint64_t>(layout.chunk_tokens());
    for (const ContextShare& c : w.context) {
      const std::uint64_t end = c.tokens / C;
      const auto start = static_cast<std::uint64_t>(w.prefix_reuse * static_cast<double>(c.tokens)) / C;
      if (end <= start) continue;
      const std::uint64_t due = every == 0 ? 1 : end / every - start / every + (end % every != 0 ? 1 : 0);
      lc.snapshots_per_request += c.share * static_cast<double>(due);
    }
  }
  const double restore_bytes = reuse_tokens * m.mla_stored_bytes_per_token + (w.prefix_reuse > 0 ? lc.snapshot_bytes : 0.0);
  const double writeback_bytes =
      new_prompt_tokens * m.mla_stored_bytes_per_token + lc.snapshots_per_request * lc.snapshot_bytes;
  lc.restore_bytes_per_request = restore_bytes;
  lc.writeback_bytes_per_request = writeback_bytes;
  // One decode step reads the resident weights (of a lookup-only embedding table, one row per
  // sequence), the experts the step's picks touch (at most all), every sequence's KV, and reads and
  // writes every sequence's KDA state.
  double experts_touched = 0;
  for (double pe : ExpertInclusion(wp.experts_per_layer, o.expert_zipf, wp.experts_per_token)) {
    experts_touched += 1.0 - std::pow(1.0 - pe, w.concurrency);
  }
  const double step_bytes = static_cast<double>(wp.resident_bytes - wp.lookup_embedding_bytes) +
                            w.concurrency * static_cast<double>(wp.embedding_row_bytes) +
                            experts_touched * static_cast<double>(expert_layer_bytes) +
                            w.concurrency * (static_cast<double>(m.sequence_tokens) * m.mla_bytes_per_token +
                                             2.0 * static_cast<double>(m.kda_state_bytes_per_sequence));
  lc.decode_step_bytes = step_bytes;
  lc.decode_step_s = step_bytes / hw.hbm_bandwidth();
  lc.decode_tokens_per_s = lc.decode_step_s > 0 ? w.concurrency / lc.decode_step_s : 0;
  lc.decode_step_with_stalls_s = lc.decode_step_s + ep.stall_s_per_token_batched * w.concurrency;
  lc.decode_tokens_per_s_with_stalls = lc.decode_step_with_stalls_s > 0 ? w.concurrency / lc.decode_step_with_stalls_s : 0;
  lc.decode_tokens_needed_per_s = w.rate_rps * static_cast<double>(w.decode_tokens);
  lc.weight_load_s = static_cast<double>(wp.total_bytes) / hw.nvme_read_bandwidth +
                     static_cast<double>(wp.resident_bytes) / hw.pcie_bandwidth();
  lc.kv_state_bytes_per_request = m.sequence_bytes;
  lc.router_flops_per_token = 2.0 * RouterParams(specs);
  lc.routing_flops_share =
      wp.active_params_per_token > 0 ? lc.router_flops_per_token / (2.0 * wp.active_params_per_token) : 0;
  lc.prefill_tokens_needed_per_s = w.rate_rps * (1.0 - w.prefix_reuse) * mean_context;
  lc.prefill_utilisation = lc.prefill_tokens_per_s > 0 ? lc.prefill_tokens_needed_per_s / lc.prefill_tokens_per_s : 0;
  const double expert_miss_bytes_per_token = ep.miss_bytes_per_token_batched;
  lc.offload_bytes_per_request = static_cast<std::uint64_t>(
      restore_bytes + writeback_bytes + expert_miss_bytes_per_token * static_cast<double>(w.decode_tokens));

  const double steps_needed_per_s = lc.decode_tokens_needed_per_s / w.concurrency;
  plan.bandwidth.push_back({"hbm", steps_needed_per_s * step_bytes, hw.hbm_bandwidth(),
                            "decode steps for --rate x --decode-tokens tokens/s at --concurrency"});
  plan.bandwidth.push_back({"pcie-h2d", w.rate_rps * restore_bytes + expert_miss_bytes_per_token * lc.decode_tokens_needed_per_s,
                            hw.pcie_bandwidth(), "prefix restores from host + expert-cache misses"});
  plan.bandwidth.push_back({"pcie-d2h", w.rate_rps * writeback_bytes, hw.pcie_bandwidth(),
                            "the prompt's new KV and its KDA snapshots written back to host"});
  // Expert misses come from NVMe when the routed experts do not all fit in host RAM (the stalls
  // above are charged at the NVMe rate then).
  const bool misses_from_nvme = wp.routed_expert_bytes > hw.host_bytes;
  plan.bandwidth.push_back(
      {"nvme-read",
       w.rate_rps * restore_bytes + (misses_from_nvme ? expert_miss_bytes_per_token * lc.decode_tokens_needed_per_s : 0.0),
       hw.nvme_read_bandwidth,
       misses_from_nvme ? "prefix restores if every reused prefix comes from NVMe + expert-cache misses, the routed "
                          "experts not fitting in host RAM"
                        : "prefix restores if every reused prefix comes from NVMe"});
  plan.bandwidth.push_back({"nvme-write", w.rate_rps * writeback_bytes, hw.nvme_write_bandwidth,
                            "write-back (KV and KDA snapshots) if every new block also goes to NVMe"});

  // ---- Where the workload does not fit ----
  std::vector<std::string>& warn = plan.warnings;
  if (!wp.resident_fits_hbm) {
    warn.push_back(fmt::format("resident weights {:.1f} GiB exceed the node's {:.1f} GiB of HBM: the model does not "
                               "fit; add GPUs (--hardware gpus). No HBM is left for the expert cache or KV, and the "
                               "prefill and decode rates are what the node would reach if the weights fitted",
                               Gib(wp.resident_bytes), Gib(hbm)));
  } else if (static_cast<std::uint64_t>(w.concurrency) > plan.tiers[0].sequences) {
    warn.push_back(fmt::format("--concurrency {} sequences do not fit in HBM: its {:.1f} GiB for KV/state hold {} "
                               "sequences of the workload; lower --concurrency, --context or --expert-cache, or "
                               "add GPUs (--hardware)",
                               w.concurrency, Gib(plan.tiers[0].kv_bytes), plan.tiers[0].sequences));
  }
  // Host RAM holds the routed experts first (what does not fit is read from NVMe); NVMe the checkpoint
  // and that spill. Either one full leaves its tier no room for KV.
  if (const TierPlan& h = plan.tiers[1]; h.kv_bytes == 0 && wp.routed_expert_bytes > 0) {
    const std::uint64_t spill = wp.routed_expert_bytes - h.other_bytes;
    warn.push_back(fmt::format("the host tier's {} is filled by the routed experts ({}{}), and no room is left for KV; "
                               "raise host_bytes (--hardware)",
                               FormatBytes(h.capacity_bytes), FormatBytes(wp.routed_expert_bytes),
                               spill > 0 ? fmt::format("; {} of them read from NVMe", FormatBytes(spill)) : ""));
  }
  if (const TierPlan& n = plan.tiers[2]; n.other_bytes > n.capacity_bytes) {
    warn.push_back(fmt::format("the nvme tier's {} cannot hold the {} ({}), and no room is left for KV; raise "
                               "nvme_bytes (--hardware)",
                               FormatBytes(n.capacity_bytes), n.holds, FormatBytes(n.other_bytes)));
  }
  for (const BandwidthLine& b : plan.bandwidth) {
    if (b.utilisation() > 1.0) {
      warn.push_back(fmt::format("link {} needs {:.0f}% of its bandwidth ({}); lower --rate or raise the "
                                 "link's bandwidth (--hardware)",
                                 b.link, 100.0 * b.utilisation(), b.what));
    }
  }
  if (lc.prefill_utilisation > 1.0) {
    warn.push_back(fmt::format("prefill needs {:.0f}% of the GPUs' compute (--rate x --context x (1 - "
                               "--prefix-reuse) = {:.0f} tokens/s, {:.0f} tokens/s available)",
                               100.0 * lc.prefill_utilisation, lc.prefill_tokens_needed_per_s,
                               lc.prefill_tokens_per_s));
  }
  if (lc.decode_tokens_needed_per_s > lc.decode_tokens_per_s_with_stalls && w.decode_tokens > 0) {
    warn.push_back(fmt::format("decode needs {:.0f} tokens/s (--rate x --decode-tokens) but --concurrency {} "
                               "decodes {:.0f} tokens/s with the expert-cache stalls",
                               lc.decode_tokens_needed_per_s, w.concurrency, lc.decode_tokens_per_s_with_stalls));
  }
  return plan;
}

}  // namespace terrace::plan
