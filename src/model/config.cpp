#include "src/model/config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace terrace::model {
namespace {

using Json = nlohmann::json;

// Reads typed fields from one JSON object, naming "<source>: field '<prefix><key>'" in errors.
class FieldReader {
 public:
  FieldReader(const Json& obj, std::string_view source, std::string prefix)
      : obj_(obj), source_(source), prefix_(std::move(prefix)) {}

  Status Missing(std::string_view key) const {
    return Status::InvalidArgument(fmt::format("{}: required field '{}{}' is missing; add it to the config",
                                               source_, prefix_, key));
  }
  Status WrongType(std::string_view key, std::string_view want) const {
    return Status::InvalidArgument(fmt::format("{}: field '{}{}' must be {}", source_, prefix_, key, want));
  }
  const Json* Find(std::string_view key) const {
    const auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }

  // Required when `required`; otherwise `*out` keeps its value if the key is absent or null.
  Status Int(std::string_view key, int* out, bool required) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) return required ? Missing(key) : Status::Ok();
    if (!v->is_number_integer()) return WrongType(key, "an integer");
    const auto x = v->get<std::int64_t>();
    if (x < -(1 << 30) || x > (1 << 30)) return WrongType(key, "an integer within +-2^30");
    *out = static_cast<int>(x);
    return Status::Ok();
  }
  Status OptInt(std::string_view key, std::optional<int>* out) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) {
      out->reset();
      return Status::Ok();
    }
    int x = 0;
    TERRACE_RETURN_IF_ERROR(Int(key, &x, true));
    *out = x;
    return Status::Ok();
  }
  Status Float(std::string_view key, float* out, bool required) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) return required ? Missing(key) : Status::Ok();
    if (!v->is_number()) return WrongType(key, "a number");
    *out = static_cast<float>(v->get<double>());
    return Status::Ok();
  }
  Status OptFloat(std::string_view key, std::optional<float>* out) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) {
      out->reset();
      return Status::Ok();
    }
    float x = 0;
    TERRACE_RETURN_IF_ERROR(Float(key, &x, true));
    *out = x;
    return Status::Ok();
  }
  Status Bool(std::string_view key, bool* out) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) return Status::Ok();
    if (!v->is_boolean()) return WrongType(key, "true or false");
    *out = v->get<bool>();
    return Status::Ok();
  }
  Status String(std::string_view key, std::string* out) const {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) return Status::Ok();
    if (!v->is_string()) return WrongType(key, "a string");
    *out = v->get<std::string>();
    return Status::Ok();
  }
  // Absent: `*present` = false and `*out` untouched.
  Status IntList(std::string_view key, std::vector<int>* out, bool* present) const {
    const Json* v = Find(key);
    *present = v != nullptr && !v->is_null();
    if (!*present) return Status::Ok();
    if (!v->is_array()) return WrongType(key, "an array of integers");
    out->clear();
    for (const auto& x : *v) {
      if (!x.is_number_integer()) return WrongType(key, "an array of integers");
      const auto i = x.get<std::int64_t>();
      if (i < -(1 << 30) || i > (1 << 30)) return WrongType(key, "an array of integers within +-2^30");
      out->push_back(static_cast<int>(i));
    }
    return Status::Ok();
  }

 private:
  const Json& obj_;
  std::string_view source_;
  std::string prefix_;
};

Status Field(std::string_view field, std::string_view problem) {
  return Status::InvalidArgument(fmt::format("config field '{}' {}", field, problem));
}

Status CheckPositive(std::string_view field, std::int64_t v) {
  if (v <= 0) return Field(field, fmt::format("must be positive (got {})", v));
  return Status::Ok();
}

Status ParseInto(const Json& root, std::string_view source, ModelConfig* c) {
  const bool nested = root.contains("text_config") && root["text_config"].is_object();
  const Json& j = nested ? root["text_config"] : root;
  const std::string prefix = nested ? "text_config." : "";
  FieldReader r(j, source, prefix);

  TERRACE_RETURN_IF_ERROR(r.String("model_type", &c->model_type));
  TERRACE_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c->num_hidden_layers, true));
  TERRACE_RETURN_IF_ERROR(r.Int("hidden_size", &c->hidden_size, true));
  TERRACE_RETURN_IF_ERROR(r.Int("vocab_size", &c->vocab_size, true));
  TERRACE_RETURN_IF_ERROR(r.Float("rms_norm_eps", &c->rms_norm_eps, false));

  const Json* lin = r.Find("linear_attn_config");
  if (lin == nullptr || lin->is_null()) return r.Missing("linear_attn_config");
  if (!lin->is_object()) return r.WrongType("linear_attn_config", "an object");
  FieldReader k(*lin, source, prefix + "linear_attn_config.");
  TERRACE_RETURN_IF_ERROR(k.Int("num_heads", &c->kda.num_heads, true));
  TERRACE_RETURN_IF_ERROR(k.Int("head_dim", &c->kda.head_dim, true));
  TERRACE_RETURN_IF_ERROR(k.Int("short_conv_kernel_size", &c->kda.short_conv_kernel_size, false));
  TERRACE_RETURN_IF_ERROR(k.Bool("use_full_rank_gate", &c->kda.use_full_rank_gate));
  TERRACE_RETURN_IF_ERROR(k.OptFloat("gate_lower_bound", &c->kda.gate_lower_bound));
  bool have_full = false;
  bool have_kda = false;
  TERRACE_RETURN_IF_ERROR(k.IntList("full_attn_layers", &c->kda.full_attn_layers, &have_full));
  TERRACE_RETURN_IF_ERROR(k.IntList("kda_layers", &c->kda.kda_layers, &have_kda));
  if (!have_full) return k.Missing("full_attn_layers");
  if (!have_kda) {  // the complement of full_attn_layers
    c->kda.kda_layers.clear();
    for (int l = 1; l <= c->num_hidden_layers; ++l) {
      if (std::find(c->kda.full_attn_layers.begin(), c->kda.full_attn_layers.end(), l) ==
          c->kda.full_attn_layers.end()) {
        c->kda.kda_layers.push_back(l);
      }
    }
  }

  const bool any_mla = !c->kda.full_attn_layers.empty();
  TERRACE_RETURN_IF_ERROR(r.Int("num_attention_heads", &c->num_attention_heads, any_mla));
  TERRACE_RETURN_IF_ERROR(r.OptInt("q_lora_rank", &c->q_lora_rank));
  TERRACE_RETURN_IF_ERROR(r.Int("kv_lora_rank", &c->kv_lora_rank, any_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("qk_nope_head_dim", &c->qk_nope_head_dim, any_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("qk_rope_head_dim", &c->qk_rope_head_dim, any_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("v_head_dim", &c->v_head_dim, any_mla));
  // Feature switches absent from a config mean "off" (Kimi Linear's config predates them).
  c->mla_use_nope = true;
  c->mla_use_output_gate = false;
  c->latent_moe_use_norm = false;
  TERRACE_RETURN_IF_ERROR(r.Bool("mla_use_nope", &c->mla_use_nope));
  TERRACE_RETURN_IF_ERROR(r.Bool("mla_use_output_gate", &c->mla_use_output_gate));

  c->first_k_dense_replace = 0;
  TERRACE_RETURN_IF_ERROR(r.Int("first_k_dense_replace", &c->first_k_dense_replace, false));
  const bool any_moe = c->first_k_dense_replace < c->num_hidden_layers;
  TERRACE_RETURN_IF_ERROR(r.Int("num_experts", &c->num_experts, any_moe));
  TERRACE_RETURN_IF_ERROR(r.Int("num_experts_per_token", &c->num_experts_per_token, any_moe));
  c->num_shared_experts = 0;
  TERRACE_RETURN_IF_ERROR(r.Int("num_shared_experts", &c->num_shared_experts, false));
  TERRACE_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size, any_moe));
  c->routed_expert_hidden_size = c->hidden_size;
  TERRACE_RETURN_IF_ERROR(r.Int("routed_expert_hidden_size", &c->routed_expert_hidden_size, false));
  TERRACE_RETURN_IF_ERROR(r.Bool("latent_moe_use_norm", &c->latent_moe_use_norm));
  TERRACE_RETURN_IF_ERROR(r.Float("routed_scaling_factor", &c->routed_scaling_factor, false));
  TERRACE_RETURN_IF_ERROR(r.Int("intermediate_size", &c->intermediate_size, c->first_k_dense_replace > 0));
  c->shared_expert_intermediate_size = c->num_shared_experts * c->moe_intermediate_size;
  TERRACE_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c->shared_expert_intermediate_size, false));

  c->attn_res_block_size = 0;
  TERRACE_RETURN_IF_ERROR(r.Int("attn_res_block_size", &c->attn_res_block_size, false));
  TERRACE_RETURN_IF_ERROR(r.Float("activation_situ_beta", &c->activation_situ_beta, false));
  TERRACE_RETURN_IF_ERROR(r.Float("activation_situ_linear_beta", &c->activation_situ_linear_beta, false));
  return Status::Ok();
}

Status CheckLayerLists(const ModelConfig& c) {
  const int n = c.num_hidden_layers;
  std::vector<int> seen(static_cast<std::size_t>(n) + 1, 0);
  for (const auto* list : {&c.kda.full_attn_layers, &c.kda.kda_layers}) {
    const char* field = list == &c.kda.full_attn_layers ? "linear_attn_config.full_attn_layers"
                                                         : "linear_attn_config.kda_layers";
    for (int l : *list) {
      if (l < 1 || l > n) {
        return Field(field, fmt::format("holds layer {}, outside the 1-based range [1, {}]", l, n));
      }
      if (++seen[static_cast<std::size_t>(l)] > 1) {
        return Field(field, fmt::format("names layer {} more than once (across full_attn_layers and kda_layers)", l));
      }
    }
  }
  for (int l = 1; l <= n; ++l) {
    if (seen[static_cast<std::size_t>(l)] == 0) {
      return Field("linear_attn_config.kda_layers",
                   fmt::format("and full_attn_layers together miss layer {} (1-based); every layer must be in exactly one", l));
    }
  }
  return Status::Ok();
}

}  // namespace

bool ModelConfig::IsMlaLayer(int layer) const {
  return std::find(kda.full_attn_layers.begin(), kda.full_attn_layers.end(), layer + 1) != kda.full_attn_layers.end();
}

Status ValidateConfig(const ModelConfig& c) {
  constexpr int kMaxDim = 1 << 24;
  TERRACE_RETURN_IF_ERROR(CheckPositive("num_hidden_layers", c.num_hidden_layers));
  TERRACE_RETURN_IF_ERROR(CheckPositive("hidden_size", c.hidden_size));
  TERRACE_RETURN_IF_ERROR(CheckPositive("vocab_size", c.vocab_size));
  for (auto [field, v] : {std::pair<const char*, int>{"num_hidden_layers", c.num_hidden_layers},
                          {"hidden_size", c.hidden_size}, {"vocab_size", c.vocab_size}}) {
    if (v > kMaxDim) return Field(field, fmt::format("is {}, above the supported {}", v, kMaxDim));
  }
  if (!(c.rms_norm_eps > 0.0f)) return Field("rms_norm_eps", fmt::format("must be positive (got {})", c.rms_norm_eps));
  TERRACE_RETURN_IF_ERROR(CheckLayerLists(c));

  if (!c.kda.kda_layers.empty()) {
    TERRACE_RETURN_IF_ERROR(CheckPositive("linear_attn_config.num_heads", c.kda.num_heads));
    TERRACE_RETURN_IF_ERROR(CheckPositive("linear_attn_config.head_dim", c.kda.head_dim));
    TERRACE_RETURN_IF_ERROR(CheckPositive("linear_attn_config.short_conv_kernel_size", c.kda.short_conv_kernel_size));
    if (static_cast<std::int64_t>(c.kda.num_heads) * c.kda.head_dim > kMaxDim) {
      return Field("linear_attn_config.num_heads", "times head_dim is too large");
    }
  }
  if (c.kda.gate_lower_bound && !(*c.kda.gate_lower_bound < 0.0f)) {
    return Field("linear_attn_config.gate_lower_bound",
                 fmt::format("must be negative (a log-decay bound; got {}); use null for the unbounded gate",
                             *c.kda.gate_lower_bound));
  }

  if (!c.kda.full_attn_layers.empty()) {
    TERRACE_RETURN_IF_ERROR(CheckPositive("num_attention_heads", c.num_attention_heads));
    if (c.q_lora_rank) TERRACE_RETURN_IF_ERROR(CheckPositive("q_lora_rank", *c.q_lora_rank));
    TERRACE_RETURN_IF_ERROR(CheckPositive("kv_lora_rank", c.kv_lora_rank));
    if (c.qk_nope_head_dim < 0) return Field("qk_nope_head_dim", "must be >= 0");
    if (c.qk_rope_head_dim < 0) return Field("qk_rope_head_dim", "must be >= 0");
    TERRACE_RETURN_IF_ERROR(CheckPositive("qk_nope_head_dim + qk_rope_head_dim", c.QkHeadDim()));
    TERRACE_RETURN_IF_ERROR(CheckPositive("v_head_dim", c.v_head_dim));
    if (!c.mla_use_nope) {
      return Field("mla_use_nope", "is false, but Terrace implements only NoPE MLA (k_pe is not rotated)");
    }
  }

  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers) {
    return Field("first_k_dense_replace", fmt::format("must be in [0, num_hidden_layers = {}] (got {})",
                                                     c.num_hidden_layers, c.first_k_dense_replace));
  }
  if (c.first_k_dense_replace > 0) TERRACE_RETURN_IF_ERROR(CheckPositive("intermediate_size", c.intermediate_size));
  if (c.first_k_dense_replace < c.num_hidden_layers) {
    TERRACE_RETURN_IF_ERROR(CheckPositive("num_experts", c.num_experts));
    TERRACE_RETURN_IF_ERROR(CheckPositive("num_experts_per_token", c.num_experts_per_token));
    if (c.num_experts_per_token > c.num_experts) {
      return Field("num_experts_per_token", fmt::format("({}) exceeds num_experts ({})", c.num_experts_per_token,
                                                       c.num_experts));
    }
    TERRACE_RETURN_IF_ERROR(CheckPositive("moe_intermediate_size", c.moe_intermediate_size));
    TERRACE_RETURN_IF_ERROR(CheckPositive("routed_expert_hidden_size", c.routed_expert_hidden_size));
    if (c.moe_intermediate_size % 32 != 0) {
      return Field("moe_intermediate_size", fmt::format("({}) must be a multiple of 32 (MXFP4 blocks)", c.moe_intermediate_size));
    }
    if (c.routed_expert_hidden_size % 32 != 0) {
      return Field("routed_expert_hidden_size",
                   fmt::format("({}) must be a multiple of 32 (MXFP4 blocks); without a latent projection it equals hidden_size",
                               c.routed_expert_hidden_size));
    }
    if (c.num_shared_experts < 0) return Field("num_shared_experts", "must be >= 0");
    if (c.num_shared_experts > 0) {
      TERRACE_RETURN_IF_ERROR(CheckPositive("shared_expert_intermediate_size", c.shared_expert_intermediate_size));
    }
    if (!(c.routed_scaling_factor > 0.0f)) {
      return Field("routed_scaling_factor", fmt::format("must be positive (got {})", c.routed_scaling_factor));
    }
  }
  if (c.attn_res_block_size < 0) {
    return Field("attn_res_block_size", "must be >= 0 (0 means a plain residual stream)");
  }
  if (!(c.activation_situ_beta > 0.0f)) return Field("activation_situ_beta", "must be positive");
  if (!(c.activation_situ_linear_beta > 0.0f)) return Field("activation_situ_linear_beta", "must be positive");
  return Status::Ok();
}

Result<ModelConfig> ParseConfigJson(std::string_view json_text, std::string_view source) {
  Json root = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: not a well-formed JSON object; fix or regenerate the file", source));
  }
  ModelConfig c;
  try {
    TERRACE_RETURN_IF_ERROR(ParseInto(root, source, &c));
  } catch (const std::exception& e) {
    return Status::InvalidArgument(fmt::format("{}: cannot read config ({})", source, e.what()));
  }
  Status s = ValidateConfig(c);
  if (!s.ok()) return Status::InvalidArgument(fmt::format("{}: {}", source, s.message()));
  return c;
}

Result<ModelConfig> LoadConfig(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(fmt::format("cannot open config file '{}'", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IoError(fmt::format("cannot read config file '{}'", path.string()));
  return ParseConfigJson(text.str(), path.string());
}

namespace {
// A float as the shortest decimal that reads back to the same float ("1e-05", not 9.99999974738e-06).
double Pretty(float v) { return std::stod(fmt::format("{}", v)); }
}  // namespace

std::string ToConfigJson(const ModelConfig& c) {
  Json lin = {{"num_heads", c.kda.num_heads},
              {"head_dim", c.kda.head_dim},
              {"short_conv_kernel_size", c.kda.short_conv_kernel_size},
              {"use_full_rank_gate", c.kda.use_full_rank_gate},
              {"gate_lower_bound", c.kda.gate_lower_bound ? Json(Pretty(*c.kda.gate_lower_bound)) : Json(nullptr)},
              {"full_attn_layers", c.kda.full_attn_layers},
              {"kda_layers", c.kda.kda_layers}};
  Json j = {{"model_type", c.model_type},
            {"num_hidden_layers", c.num_hidden_layers},
            {"hidden_size", c.hidden_size},
            {"vocab_size", c.vocab_size},
            {"rms_norm_eps", Pretty(c.rms_norm_eps)},
            {"linear_attn_config", lin},
            {"num_attention_heads", c.num_attention_heads},
            {"q_lora_rank", c.q_lora_rank ? Json(*c.q_lora_rank) : Json(nullptr)},
            {"kv_lora_rank", c.kv_lora_rank},
            {"qk_nope_head_dim", c.qk_nope_head_dim},
            {"qk_rope_head_dim", c.qk_rope_head_dim},
            {"v_head_dim", c.v_head_dim},
            {"mla_use_nope", c.mla_use_nope},
            {"mla_use_output_gate", c.mla_use_output_gate},
            {"num_experts", c.num_experts},
            {"num_experts_per_token", c.num_experts_per_token},
            {"num_shared_experts", c.num_shared_experts},
            {"moe_intermediate_size", c.moe_intermediate_size},
            {"routed_expert_hidden_size", c.routed_expert_hidden_size},
            {"latent_moe_use_norm", c.latent_moe_use_norm},
            {"routed_scaling_factor", Pretty(c.routed_scaling_factor)},
            {"first_k_dense_replace", c.first_k_dense_replace},
            {"intermediate_size", c.intermediate_size},
            {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
            {"attn_res_block_size", c.attn_res_block_size},
            {"activation_situ_beta", Pretty(c.activation_situ_beta)},
            {"activation_situ_linear_beta", Pretty(c.activation_situ_linear_beta)}};
  return j.dump(2) + "\n";
}

}  // namespace terrace::model
