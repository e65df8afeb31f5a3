#include "src/model/names.h"

#include <charconv>
#include <functional>
#include <set>

#include <fmt/format.h>

namespace terrace::model {
namespace {

using Shape = std::vector<std::int64_t>;

class SpecList {
 public:
  SpecList(std::vector<TensorSpec>* out, int layer, Component component)
      : out_(out), layer_(layer), component_(component) {}
  void Set(Component component) { component_ = component; }
  void Add(std::string name, Shape shape, DType dtype = DType::kBF16) {
    out_->push_back(TensorSpec{std::move(name), dtype, std::move(shape), component_, layer_, -1, false});
  }
  void AddExpert(int expert, std::string name, Shape shape) {
    out_->push_back(TensorSpec{std::move(name), DType::kU8, std::move(shape), component_, layer_, expert, true});
  }
  void AddFloatExpert(int expert, std::string name, Shape shape) {
    out_->push_back(TensorSpec{std::move(name), DType::kBF16, std::move(shape), component_, layer_, expert, false});
  }

 private:
  std::vector<TensorSpec>* out_;
  int layer_;
  Component component_;
};

void AddKda(const ModelConfig& c, int l, SpecList& s) {
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t h = c.kda.num_heads;
  const std::int64_t d = c.kda.head_dim;
  const std::int64_t hd = h * d;
  const std::int64_t kernel = c.kda.short_conv_kernel_size;
  for (const char* p : {"q", "k", "v"}) s.Add(AttnTensorName(l, fmt::format("{}_proj.weight", p)), {hd, hidden});
  for (const char* p : {"q", "k", "v"}) s.Add(AttnTensorName(l, fmt::format("{}_conv1d.weight", p)), {hd, 1, kernel});
  s.Add(AttnTensorName(l, "f_a_proj.weight"), {d, hidden});
  s.Add(AttnTensorName(l, "f_b_proj.weight"), {hd, d});
  s.Add(AttnTensorName(l, "b_proj.weight"), {h, hidden});
  s.Add(AttnTensorName(l, "A_log"), {h}, DType::kF32);
  s.Add(AttnTensorName(l, "dt_bias"), {hd}, DType::kF32);
  if (c.kda.use_full_rank_gate) {
    s.Add(AttnTensorName(l, "g_proj.weight"), {hd, hidden});
  } else {
    s.Add(AttnTensorName(l, "g_a_proj.weight"), {d, hidden});
    s.Add(AttnTensorName(l, "g_b_proj.weight"), {hd, d});
  }
  s.Add(AttnTensorName(l, "o_norm.weight"), {d});
  s.Add(AttnTensorName(l, "o_proj.weight"), {hidden, hd});
}

void AddMla(const ModelConfig& c, int l, SpecList& s) {
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t h = c.num_attention_heads;
  const std::int64_t qk = c.QkHeadDim();
  if (c.q_lora_rank) {
    const std::int64_t r = *c.q_lora_rank;
    s.Add(AttnTensorName(l, "q_a_proj.weight"), {r, hidden});
    s.Add(AttnTensorName(l, "q_a_layernorm.weight"), {r});
    s.Add(AttnTensorName(l, "q_b_proj.weight"), {h * qk, r});
  } else {
    s.Add(AttnTensorName(l, "q_proj.weight"), {h * qk, hidden});
  }
  s.Add(AttnTensorName(l, "kv_a_proj_with_mqa.weight"), {c.kv_lora_rank + c.qk_rope_head_dim, hidden});
  s.Add(AttnTensorName(l, "kv_a_layernorm.weight"), {c.kv_lora_rank});
  s.Add(AttnTensorName(l, "kv_b_proj.weight"), {h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  s.Add(AttnTensorName(l, "o_proj.weight"), {hidden, h * c.v_head_dim});
  if (c.mla_use_output_gate) s.Add(AttnTensorName(l, "g_proj.weight"), {h * c.v_head_dim, hidden});
}

void AddMoe(const ModelConfig& c, int l, SpecList& s, ExpertFormat format) {
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t e = c.num_experts;
  const std::int64_t latent = c.routed_expert_hidden_size;
  const std::int64_t inter = c.moe_intermediate_size;
  s.Set(Component::kMoeRouting);
  s.Add(MoeTensorName(l, "gate.weight"), {e, hidden});
  s.Add(MoeTensorName(l, "gate.e_score_correction_bias"), {e}, DType::kF32);
  if (c.HasLatentProjection()) {
    s.Add(MoeTensorName(l, "routed_expert_down_proj.weight"), {latent, hidden});
    s.Add(MoeTensorName(l, "routed_expert_up_proj.weight"), {hidden, latent});
  }
  if (c.latent_moe_use_norm) s.Add(MoeTensorName(l, "routed_expert_norm.weight"), {latent});
  s.Set(Component::kRoutedExperts);
  for (int x = 0; x < c.num_experts && format == ExpertFormat::kF32; ++x) {
    s.AddFloatExpert(x, ExpertTensorName(l, x, "w1", "weight"), {inter, latent});
    s.AddFloatExpert(x, ExpertTensorName(l, x, "w2", "weight"), {latent, inter});
    s.AddFloatExpert(x, ExpertTensorName(l, x, "w3", "weight"), {inter, latent});
  }
  for (int x = 0; x < c.num_experts && format == ExpertFormat::kMxfp4; ++x) {
    for (const char* w : {"w1", "w3"}) {
      s.AddExpert(x, ExpertTensorName(l, x, w, "weight_packed"), {inter, latent / 2});
      s.AddExpert(x, ExpertTensorName(l, x, w, "weight_scale"), {inter, latent / 32});
    }
    s.AddExpert(x, ExpertTensorName(l, x, "w2", "weight_packed"), {latent, inter / 2});
    s.AddExpert(x, ExpertTensorName(l, x, "w2", "weight_scale"), {latent, inter / 32});
  }
  if (c.num_shared_experts > 0) {
    const std::int64_t si = c.shared_expert_intermediate_size;
    s.Set(Component::kSharedExperts);
    s.Add(MoeTensorName(l, "shared_experts.gate_proj.weight"), {si, hidden});
    s.Add(MoeTensorName(l, "shared_experts.up_proj.weight"), {si, hidden});
    s.Add(MoeTensorName(l, "shared_experts.down_proj.weight"), {hidden, si});
  }
}

constexpr std::size_t kMaxListedProblems = 200;

// A config setting that decides whether some tensors are used: `flip` turns the setting the
// other way (to a value that implies the tensors this config leaves out); `key` and `value` say
// in config.json's words what the config has now.
struct Switch {
  std::string key;
  std::string value;
  std::function<void(ModelConfig&)> flip;
};

std::vector<Switch> SwitchesOf(const ModelConfig& c) {
  auto on_off = [](bool b) { return std::string(b ? "true" : "false"); };
  std::vector<Switch> out;
  out.push_back({"mla_use_output_gate", on_off(c.mla_use_output_gate),
                 [](ModelConfig& v) { v.mla_use_output_gate = !v.mla_use_output_gate; }});
  out.push_back({"latent_moe_use_norm", on_off(c.latent_moe_use_norm),
                 [](ModelConfig& v) { v.latent_moe_use_norm = !v.latent_moe_use_norm; }});
  out.push_back({"attn_res_block_size", std::to_string(c.attn_res_block_size),
                 [](ModelConfig& v) { v.attn_res_block_size = v.attn_res_block_size > 0 ? 0 : 1; }});
  out.push_back({"num_shared_experts", std::to_string(c.num_shared_experts), [](ModelConfig& v) {
                   v.num_shared_experts = v.num_shared_experts > 0 ? 0 : 1;
                   v.shared_expert_intermediate_size = v.moe_intermediate_size;
                 }});
  out.push_back({"tie_word_embeddings", on_off(c.tie_word_embeddings),
                 [](ModelConfig& v) { v.tie_word_embeddings = !v.tie_word_embeddings; }});
  out.push_back({"routed_expert_hidden_size", std::to_string(c.routed_expert_hidden_size), [](ModelConfig& v) {
                   v.routed_expert_hidden_size = v.HasLatentProjection() ? v.hidden_size : v.hidden_size + 1;
                 }});
  out.push_back({"linear_attn_config.use_full_rank_gate", on_off(c.kda.use_full_rank_gate),
                 [](ModelConfig& v) { v.kda.use_full_rank_gate = !v.kda.use_full_rank_gate; }});
  out.push_back({"q_lora_rank", c.q_lora_rank ? std::to_string(*c.q_lora_rank) : std::string("null"),
                 [](ModelConfig& v) {
                   if (v.q_lora_rank) {
                     v.q_lora_rank.reset();
                   } else {
                     v.q_lora_rank = 1;
                   }
                 }});
  return out;
}

constexpr std::string_view kLanguageModelPrefix = "language_model.";

// True for a tensor of a multi-token-prediction layer: a layer past num_hidden_layers that holds
// an `eh_proj` (the MTP projection; DeepSeek-V3-style checkpoints append such layers, whose output
// never feeds the next-token logits). A plain extra decoder layer is not one.
bool IsMtpLayerTensor(const WeightSource& source, const ModelConfig& c, std::string_view name) {
  const std::string layers = fmt::format("{}layers.", kModelPrefix);
  if (!name.starts_with(layers)) return false;
  int layer = 0;
  const char* p = name.data() + layers.size();
  const char* end = name.data() + name.size();
  const auto [next, ec] = std::from_chars(p, end, layer);
  if (ec != std::errc() || next == end || *next != '.') return false;
  return layer >= c.num_hidden_layers && source.Has(LayerTensorName(layer, "eh_proj.weight"));
}

// Tensors in `source` that `config` does not use (a model run would ignore them and compute
// something other than the checkpoint's model): `by_setting`, one line per config setting that
// would use them (naming the setting, its value and the first such tensor); `other`, one line per
// remaining tensor.
struct UnusedTensors {
  std::vector<std::string> by_setting, other;
};

// `specs`: ExpectedTensors(c, format), which the caller has already listed.
UnusedTensors FindUnusedTensors(const WeightSource& source, const ModelConfig& c, ExpertFormat format,
                                const std::vector<TensorSpec>& specs) {
  std::set<std::string_view, std::less<>> expected;
  for (const TensorSpec& spec : specs) expected.insert(spec.name);
  std::set<std::string, std::less<>> unused;
  for (const std::string& name : source.Names()) {
    if (!expected.contains(name)) unused.insert(name);
  }
  UnusedTensors problems;
  for (const Switch& sw : SwitchesOf(c)) {
    if (unused.empty()) break;
    ModelConfig flipped = c;
    sw.flip(flipped);
    std::vector<std::string> implied;
    for (const TensorSpec& spec : ExpectedTensors(flipped, format)) {
      if (unused.erase(spec.name) > 0) implied.push_back(spec.name);
    }
    if (implied.empty()) continue;
    problems.by_setting.push_back(fmt::format(
        "tensor '{}'{} is in the checkpoint, but config.json's {} = {} leaves it unused (the model would compute "
        "without it); set {} to match the checkpoint",
        implied.front(), implied.size() > 1 ? fmt::format(" (and {} more like it)", implied.size() - 1) : "", sw.key,
        sw.value, sw.key));
  }
  for (const std::string& name : unused) {
    if (problems.other.size() >= kMaxListedProblems) break;
    if (!name.starts_with(kLanguageModelPrefix)) continue;  // a K3 wrapper's vision tower and projector
    if (IsMtpLayerTensor(source, c, name)) continue;
    problems.other.push_back(fmt::format("tensor '{}' is in the checkpoint, but config.json does not imply it (the "
                                         "model would ignore it); check config.json, or remove the tensor",
                                         name));
  }
  return problems;
}

bool IsFloatDType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

}  // namespace

std::string LayerPrefix(int layer) { return fmt::format("{}layers.{}.", kModelPrefix, layer); }
std::string LayerTensorName(int layer, std::string_view suffix) { return LayerPrefix(layer).append(suffix); }
std::string AttnTensorName(int layer, std::string_view suffix) {
  return fmt::format("{}self_attn.{}", LayerPrefix(layer), suffix);
}
std::string MoeTensorName(int layer, std::string_view suffix) {
  return fmt::format("{}block_sparse_moe.{}", LayerPrefix(layer), suffix);
}
std::string ExpertTensorName(int layer, int expert, std::string_view proj, std::string_view kind) {
  return fmt::format("{}block_sparse_moe.experts.{}.{}.{}", LayerPrefix(layer), expert, proj, kind);
}
std::string DenseMlpTensorName(int layer, std::string_view proj) {
  return fmt::format("{}mlp.{}.weight", LayerPrefix(layer), proj);
}

std::string_view ComponentName(Component c) {
  switch (c) {
    case Component::kAttention: return "attention";
    case Component::kRoutedExperts: return "routed_experts";
    case Component::kMoeRouting: return "moe_routing";
    case Component::kSharedExperts: return "shared_experts";
    case Component::kDenseMlp: return "dense_mlp";
    case Component::kEmbeddings: return "embeddings";
    case Component::kNormsOther: return "norms_other";
  }
  return "unknown";
}

std::int64_t TensorSpec::params() const {
  if (!mxfp4) return NumElements(shape);
  if (name.ends_with("weight_scale")) return 0;
  return 2 * NumElements(shape);
}

std::uint64_t TensorSpec::bytes() const { return static_cast<std::uint64_t>(NumElements(shape)) * DTypeSize(dtype); }

bool IsPerHeadVectorShape(const std::vector<std::int64_t>& stored, std::int64_t heads) {
  int above_one = 0;
  std::int64_t length = 1;
  for (std::int64_t d : stored) {
    if (d <= 0) return false;
    if (d > 1) ++above_one;
    length *= d;
  }
  return above_one <= 1 && length >= heads;
}

ExpertFormat DetectExpertFormat(const WeightSource& source, const ModelConfig& c) {
  const int l = c.first_k_dense_replace;
  if (l >= c.num_hidden_layers) return ExpertFormat::kMxfp4;
  if (!source.Has(ExpertTensorName(l, 0, "w1", "weight_packed")) && source.Has(ExpertTensorName(l, 0, "w1", "weight"))) {
    return ExpertFormat::kF32;
  }
  return ExpertFormat::kMxfp4;
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c, ExpertFormat format) {
  std::vector<TensorSpec> out;
  const std::int64_t hidden = c.hidden_size;
  SpecList model(&out, -1, Component::kEmbeddings);
  model.Add(std::string(kEmbed), {c.vocab_size, hidden});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    SpecList s(&out, l, Component::kNormsOther);
    s.Add(LayerTensorName(l, "input_layernorm.weight"), {hidden});
    s.Add(LayerTensorName(l, "post_attention_layernorm.weight"), {hidden});
    if (c.attn_res_block_size > 0) {
      s.Add(LayerTensorName(l, "self_attention_res_proj.weight"), {1, hidden});
      s.Add(LayerTensorName(l, "self_attention_res_norm.weight"), {hidden});
      s.Add(LayerTensorName(l, "mlp_res_proj.weight"), {1, hidden});
      s.Add(LayerTensorName(l, "mlp_res_norm.weight"), {hidden});
    }
    s.Set(Component::kAttention);
    if (c.IsMlaLayer(l)) {
      AddMla(c, l, s);
    } else {
      AddKda(c, l, s);
    }
    if (c.IsDenseLayer(l)) {
      s.Set(Component::kDenseMlp);
      s.Add(DenseMlpTensorName(l, "gate_proj"), {c.intermediate_size, hidden});
      s.Add(DenseMlpTensorName(l, "up_proj"), {c.intermediate_size, hidden});
      s.Add(DenseMlpTensorName(l, "down_proj"), {hidden, c.intermediate_size});
    } else {
      AddMoe(c, l, s, format);
    }
  }
  model.Set(Component::kNormsOther);
  model.Add(std::string(kFinalNorm), {hidden});
  if (c.attn_res_block_size > 0) {
    model.Add(std::string(kOutputAttnResProj), {1, hidden});
    model.Add(std::string(kOutputAttnResNorm), {hidden});
  }
  model.Set(Component::kEmbeddings);
  if (!c.tie_word_embeddings) model.Add(std::string(kLmHead), {c.vocab_size, hidden});
  return out;
}

std::vector<std::string> CheckConfigAgainstTensors(const WeightSource& source, const ModelConfig& c) {
  std::vector<std::string> problems;
  // `name`'s dim `axis` must be `want`; `what` says which config keys make `want`.
  auto dim = [&](const std::string& name, std::size_t axis, std::int64_t want, std::string_view what) {
    auto view = source.Get(name);
    if (!view.ok()) return;
    if (view->shape.size() <= axis || view->shape[axis] != want) {
      problems.push_back(fmt::format("config.json says {} = {}, but tensor '{}' has shape {}", what, want, name,
                                     ShapeString(view->shape)));
    }
  };
  dim(std::string(kEmbed), 0, c.vocab_size, "vocab_size");
  dim(std::string(kEmbed), 1, c.hidden_size, "hidden_size");
  if (!source.Has(LayerTensorName(c.num_hidden_layers - 1, "input_layernorm.weight")) &&
      source.Has(LayerTensorName(0, "input_layernorm.weight"))) {
    problems.push_back(fmt::format("config.json says num_hidden_layers = {}, but there is no tensor '{}'",
                                   c.num_hidden_layers, LayerTensorName(c.num_hidden_layers - 1, "input_layernorm.weight")));
  }
  int first_kda = -1, first_mla = -1;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.IsMlaLayer(l) && first_mla < 0) first_mla = l;
    if (!c.IsMlaLayer(l) && first_kda < 0) first_kda = l;
  }
  if (first_kda >= 0) {
    dim(AttnTensorName(first_kda, "b_proj.weight"), 0, c.kda.num_heads, "linear_attn_config.num_heads");
    dim(AttnTensorName(first_kda, "f_a_proj.weight"), 0, c.kda.head_dim, "linear_attn_config.head_dim");
    dim(AttnTensorName(first_kda, "q_conv1d.weight"), 2, c.kda.short_conv_kernel_size,
        "linear_attn_config.short_conv_kernel_size");
  }
  if (first_mla >= 0) {
    dim(AttnTensorName(first_mla, "kv_a_layernorm.weight"), 0, c.kv_lora_rank, "kv_lora_rank");
    dim(AttnTensorName(first_mla, "kv_a_proj_with_mqa.weight"), 0, c.kv_lora_rank + c.qk_rope_head_dim,
        "kv_lora_rank + qk_rope_head_dim");
    dim(AttnTensorName(first_mla, "kv_b_proj.weight"), 0,
        std::int64_t{c.num_attention_heads} * (c.qk_nope_head_dim + c.v_head_dim),
        "num_attention_heads x (qk_nope_head_dim + v_head_dim)");
    if (c.q_lora_rank) {
      dim(AttnTensorName(first_mla, "q_a_proj.weight"), 0, *c.q_lora_rank, "q_lora_rank");
      if (!source.Has(AttnTensorName(first_mla, "q_a_proj.weight")) && source.Has(AttnTensorName(first_mla, "q_proj.weight"))) {
        problems.push_back(fmt::format("config.json says q_lora_rank = {}, but layer {} has a plain q_proj (q_lora_rank "
                                       "null)", *c.q_lora_rank, first_mla));
      }
    } else if (!source.Has(AttnTensorName(first_mla, "q_proj.weight")) &&
               source.Has(AttnTensorName(first_mla, "q_a_proj.weight"))) {
      problems.push_back(fmt::format("config.json says q_lora_rank = null, but layer {} has q_a_proj/q_b_proj", first_mla));
    }
  }
  if (c.first_k_dense_replace > 0) dim(DenseMlpTensorName(0, "gate_proj"), 0, c.intermediate_size, "intermediate_size");
  const int moe = c.first_k_dense_replace;
  if (moe < c.num_hidden_layers) {
    dim(MoeTensorName(moe, "gate.weight"), 0, c.num_experts, "num_experts");
    const bool packed = DetectExpertFormat(source, c) == ExpertFormat::kMxfp4;
    const std::string last = ExpertTensorName(moe, c.num_experts - 1, "w1", packed ? "weight_packed" : "weight");
    if (source.Has(ExpertTensorName(moe, 0, "w1", packed ? "weight_packed" : "weight")) && !source.Has(last)) {
      problems.push_back(fmt::format("config.json says num_experts = {}, but there is no tensor '{}'", c.num_experts, last));
    }
    dim(ExpertTensorName(moe, 0, "w1", packed ? "weight_packed" : "weight"), 0, c.moe_intermediate_size,
        "moe_intermediate_size");
    if (c.num_shared_experts > 0) {
      dim(MoeTensorName(moe, "shared_experts.gate_proj.weight"), 0, c.shared_expert_intermediate_size,
          "shared_expert_intermediate_size (num_shared_experts x moe_intermediate_size unless given)");
    }
  }
  return problems;
}

std::vector<std::string> FindWeightProblems(const WeightSource& source, const ModelConfig& config) {
  // The config's dimensions first: when one is wrong, most tensors below are "wrong" and this says why.
  std::vector<std::string> problems = CheckConfigAgainstTensors(source, config);
  // Then the settings that leave tensors unused: a switched-off setting also explains many
  // wrong shapes (routed_expert_hidden_size) or missing tensors below.
  const ExpertFormat format = DetectExpertFormat(source, config);
  const std::vector<TensorSpec> specs = ExpectedTensors(config, format);
  UnusedTensors unused = FindUnusedTensors(source, config, format, specs);
  for (std::string& p : unused.by_setting) problems.push_back(std::move(p));
  std::size_t more = 0;
  for (const TensorSpec& spec : specs) {
    if (problems.size() >= kMaxListedProblems) {  // the count goes on, the list stops
      if (!source.Has(spec.name)) ++more;
      continue;
    }
    auto view = source.Get(spec.name);
    if (!view.ok()) {
      problems.push_back(fmt::format("tensor '{}' is missing (expected {} {})", spec.name, DTypeName(spec.dtype),
                                     ShapeString(spec.shape)));
      continue;
    }
    const bool reshape_ok = spec.name.ends_with(".A_log") && IsPerHeadVectorShape(view->shape, NumElements(spec.shape));
    if (view->shape != spec.shape && !reshape_ok) {
      problems.push_back(fmt::format("tensor '{}' has shape {}, expected {}", spec.name, ShapeString(view->shape),
                                     ShapeString(spec.shape)));
    }
    const bool dtype_ok = spec.mxfp4 ? view->dtype == DType::kU8 : IsFloatDType(view->dtype);
    if (!dtype_ok) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected {}", spec.name, DTypeName(view->dtype),
                                     spec.mxfp4 ? "U8 (MXFP4)" : "F32, BF16 or F16"));
    }
  }
  if (more > 0) problems.push_back(fmt::format("... and at least {} more missing tensors", more));
  for (std::string& p : unused.other) {
    if (problems.size() >= kMaxListedProblems) break;
    problems.push_back(std::move(p));
  }
  return problems;
}

Status ValidateWeights(const WeightSource& source, const ModelConfig& config) {
  const std::vector<std::string> problems = FindWeightProblems(source, config);
  if (problems.empty()) return Status::Ok();
  return Status::InvalidArgument(fmt::format("{}{}; the checkpoint does not match its config.json", problems.front(),
                                             problems.size() > 1 ? fmt::format(" (and {} more problems)", problems.size() - 1) : ""));
}

}  // namespace terrace::model
