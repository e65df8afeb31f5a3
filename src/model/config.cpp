#include "src/model/config.h"

#include <cstdint>

#include <limits>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/json_unique.h"

namespace terrace::model {
namespace {

using Json = nlohmann::json;

// Sane limits: far above every real model, far below what would exhaust memory or overflow int64
// sizes. docs/model-format.md section 2 lists them.
constexpr std::int64_t kMaxLayers = 1024;
constexpr std::int64_t kMaxHidden = 65536;
constexpr std::int64_t kMaxVocab = 1 << 24;
constexpr std::int64_t kMaxHeads = 1024;
constexpr std::int64_t kMaxHeadDim = 1024;
constexpr std::int64_t kMaxConvKernel = 64;
constexpr std::int64_t kMaxRank = 65536;          // q_lora_rank, kv_lora_rank, routed_expert_hidden_size
constexpr std::int64_t kMaxExperts = 65536;
constexpr std::int64_t kMaxTopK = 1024;
constexpr std::int64_t kMaxIntermediate = 1 << 20;
constexpr double kMinGateLowerBound = -100.0;
constexpr std::int64_t kMaxImpliedTensors = 1'000'000;  // K3 ships 497,220

// Keys known not to change the forward pass: generation defaults, token ids, dtype and loading hints,
// bookkeeping, training-only switches, and position settings (Terrace's MLA is NoPE: no rotation).
const std::set<std::string, std::less<>>& HarmlessKeys() {
  static const std::set<std::string, std::less<>> keys = {
      "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "architectures", "auto_map",
      "transformers_version", "torch_dtype", "dtype", "use_bfloat16", "torchscript", "return_dict",
      "output_attentions", "output_hidden_states", "output_scores", "output_router_logits", "return_dict_in_generate",
      "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
      "initializer_range", "attention_dropout", "hidden_dropout", "router_aux_loss_coef", "aux_loss_alpha",
      "max_position_embeddings", "model_max_length", "rope_theta", "rope_scaling", "rope_parameters",
      "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
      "is_decoder", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
      "chunk_size_feed_forward", "pruned_heads", "tf_legacy_loss", "pretraining_tp", "head_dim",
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
      "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
      "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "forced_bos_token_id",
      "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
      "begin_suppress_tokens", "num_nextn_predict_layers",
      // multimodal wrappers (K3): the vision side, which the language model never reads
      "vision_config", "ignore_index", "image_placeholder", "media_placeholder_token_id", "image_token_index",
  };
  return keys;
}

// One JSON object of the config: typed reads that record which keys were used, so the caller can
// then refuse every key it neither used nor knows to be harmless. Errors name "<source>: field
// '<prefix><key>'".
class FieldReader {
 public:
  FieldReader(const Json& obj, std::string_view source, std::string prefix)
      : obj_(obj), source_(source), prefix_(std::move(prefix)) {}

  // A required field that is absent, or present as null (which reads as absent for optional fields).
  Status Missing(std::string_view key) const {
    const auto it = obj_.find(key);
    const bool null = it != obj_.end() && it->is_null();
    return Status::InvalidArgument(fmt::format("{}: required field '{}{}' is {}; {} the config", source_, prefix_,
                                               key, null ? "null" : "missing", null ? "give it a value in" : "add it to"));
  }
  Status Bad(std::string_view key, std::string_view what) const {
    return Status::InvalidArgument(fmt::format("{}: field '{}{}' {}", source_, prefix_, key, what));
  }
  Status WrongType(std::string_view key, std::string_view want) const { return Bad(key, "must be " + std::string(want)); }

  // The value of `key` (or of the first alias present), nullptr when absent or null. Two spellings
  // present with different values are an error.
  Result<const Json*> Take(std::string_view key, std::initializer_list<std::string_view> aliases = {}) {
    const Json* found = nullptr;
    std::string_view found_key;
    auto look = [&](std::string_view k) -> Status {
      const auto it = obj_.find(k);
      if (it == obj_.end()) return Status::Ok();
      used_.insert(std::string(k));
      if (it->is_null()) return Status::Ok();
      if (found != nullptr && *found != *it) {
        return Status::InvalidArgument(fmt::format("{}: fields '{}{}' and '{}{}' are two names for one setting but "
                                                   "disagree ({} vs {}); keep one",
                                                   source_, prefix_, found_key, prefix_, k,
                                                   found->dump(-1, ' ', false, Json::error_handler_t::replace),
                                                   it->dump(-1, ' ', false, Json::error_handler_t::replace)));
      }
      found = &*it;
      found_key = k;
      return Status::Ok();
    };
    TERRACE_RETURN_IF_ERROR(look(key));
    for (std::string_view a : aliases) TERRACE_RETURN_IF_ERROR(look(a));
    last_key_ = found ? found_key : key;
    return found;
  }
  std::string_view last_key() const { return last_key_; }

  // Absent or null: `*out` keeps its value (an error when `required`).
  Status Int(std::string_view key, int* out, bool required, std::initializer_list<std::string_view> aliases = {}) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key, aliases));
    if (v == nullptr) return required ? Missing(key) : Status::Ok();
    return ToInt(last_key_, *v, out);
  }
  Status OptInt(std::string_view key, std::optional<int>* out) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key));
    if (v == nullptr) {
      if (obj_.contains(key)) out->reset();  // explicit null
      return Status::Ok();
    }
    int x = 0;
    TERRACE_RETURN_IF_ERROR(ToInt(key, *v, &x));
    *out = x;
    return Status::Ok();
  }
  Status Double(std::string_view key, double* out, bool required) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key));
    if (v == nullptr) return required ? Missing(key) : Status::Ok();
    if (!v->is_number()) return WrongType(key, "a number");
    *out = v->get<double>();
    if (!std::isfinite(*out)) return Bad(key, "must be a finite number");
    return Status::Ok();
  }
  Status Bool(std::string_view key, bool* out, std::initializer_list<std::string_view> aliases = {}) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key, aliases));
    if (v == nullptr) return Status::Ok();
    if (!v->is_boolean()) return WrongType(last_key_, "true or false");
    *out = v->get<bool>();
    return Status::Ok();
  }
  Status String(std::string_view key, std::string* out) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key));
    if (v == nullptr) return Status::Ok();
    if (!v->is_string()) return WrongType(key, "a string");
    *out = v->get<std::string>();
    return Status::Ok();
  }
  // Absent: `*present` = false and `*out` untouched.
  Status IntList(std::string_view key, std::vector<int>* out, bool* present) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key));
    *present = v != nullptr;
    if (!*present) return Status::Ok();
    if (!v->is_array()) return WrongType(key, "an array of integers");
    out->clear();
    for (const auto& x : *v) {
      int i = 0;
      if (!x.is_number_integer()) return WrongType(key, "an array of integers");
      TERRACE_RETURN_IF_ERROR(ToInt(key, x, &i));
      out->push_back(i);
    }
    return Status::Ok();
  }
  Status StringList(std::string_view key, std::vector<std::string>* out, bool* present) {
    TERRACE_ASSIGN_OR_RETURN(const Json* v, Take(key));
    *present = v != nullptr;
    if (!*present) return Status::Ok();
    if (!v->is_array()) return WrongType(key, "an array of strings");
    out->clear();
    for (const auto& x : *v) {
      if (!x.is_string()) return WrongType(key, "an array of strings");
      out->push_back(x.get<std::string>());
    }
    return Status::Ok();
  }
  void MarkUsed(std::string_view key) { used_.insert(std::string(key)); }

  // Sorts every key of the object into keys->read / keys->ignored; a key neither used nor harmless
  // is refused. `sub_objects`: keys whose objects were walked separately (already recorded).
  Status Finish(ConfigKeys* keys, const std::set<std::string, std::less<>>& harmless) const {
    for (const auto& [k, v] : obj_.items()) {
      const std::string path = prefix_ + k;
      if (used_.count(k)) {
        if (keys) keys->read.push_back(path);
      } else if (harmless.count(k)) {
        if (keys) keys->ignored.push_back(path);
      } else {
        return Status::InvalidArgument(fmt::format(
            "{}: field '{}' is not one Terrace knows, so it cannot tell whether it changes the computation; "
            "remove it if it is harmless (the known fields are listed in docs/model-format.md)",
            source_, path));
      }
    }
    return Status::Ok();
  }

 private:
  Status ToInt(std::string_view key, const Json& v, int* out) const {
    if (v.is_number_float() && std::isfinite(v.get<double>()) && std::abs(v.get<double>()) > (1 << 30) &&
        v.get<double>() == std::floor(v.get<double>())) {
      return WrongType(key, "an integer within +-2^30");  // an integer past int64 parses as a float
    }
    if (!v.is_number_integer()) return WrongType(key, "an integer");
    const auto x = v.is_number_unsigned() ? static_cast<std::int64_t>(std::min<std::uint64_t>(v.get<std::uint64_t>(), 1ull << 40))
                                          : v.get<std::int64_t>();
    if (x < -(1 << 30) || x > (1 << 30)) return WrongType(key, "an integer within +-2^30");
    *out = static_cast<int>(x);
    return Status::Ok();
  }

  const Json& obj_;
  std::string_view source_;
  std::string prefix_;
  std::set<std::string, std::less<>> used_;
  std::string_view last_key_;
};

// `s` for a message: JSON-escaped (control characters), each byte that is not UTF-8 as U+FFFD.
std::string PrintableText(const std::string& s) {
  const std::string quoted = Json(s).dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
  return quoted.substr(1, quoted.size() - 2);
}

Status Field(std::string_view field, std::string_view problem) {
  return Status::InvalidArgument(fmt::format("config field '{}' {}", field, problem));
}

Status CheckPositive(std::string_view field, std::int64_t v) {
  if (v <= 0) return Field(field, fmt::format("must be positive (got {})", v));
  return Status::Ok();
}

Status CheckRange(std::string_view field, std::int64_t v, std::int64_t lo, std::int64_t hi) {
  if (v < lo || v > hi) return Field(field, fmt::format("is {}, outside the supported range [{}, {}]", v, lo, hi));
  return Status::Ok();
}

// A float setting: finite, in (lo, hi] (lo excluded), reported in the file's own terms.
Status CheckFloat(std::string_view field, double v, double lo, double hi) {
  if (!(v > lo && v <= hi)) return Field(field, fmt::format("is {}, outside the supported range ({}, {}]", v, lo, hi));
  return Status::Ok();
}

Result<Activation> ParseActivation(FieldReader& r, std::string_view value) {
  if (value == "silu" || value == "swish") return Activation::kSilu;
  if (value == "situ") return Activation::kSitu;
  return r.Bad("hidden_act", fmt::format("is '{}', an activation Terrace does not implement; it implements 'silu' "
                                         "(also spelt 'swish') and 'situ'",
                                         value));
}

// Reads `key` as a float into *out after checking its range on the double value (1e300 must not
// become inf silently).
Status ReadFloat(FieldReader& r, std::string_view key, float* out, double lo, double hi) {
  double v = *out;
  TERRACE_RETURN_IF_ERROR(r.Double(key, &v, false));
  if (!(v > lo && v <= hi)) return r.Bad(key, fmt::format("is {}, outside the supported range ({}, {}]", v, lo, hi));
  *out = static_cast<float>(v);
  return Status::Ok();
}

// A SiTU constant; when `required`, an absent one is refused: no default is safe to guess.
Status ReadSituBeta(FieldReader& r, std::string_view key, float* out, bool required) {
  TERRACE_ASSIGN_OR_RETURN(const Json* v, r.Take(key));
  if (v == nullptr && required) {
    return r.Bad(key, "is missing; a kimi_linear config with hidden_act 'situ' must state it (transformers' "
                      "KimiLinearConfig versions disagree on its default); write the value the checkpoint was "
                      "trained with");
  }
  return ReadFloat(r, key, out, 0.0, kMaxSituBeta);
}

// The quantisation of the routed experts is read from the tensors themselves (weight_packed /
// weight_scale U8 = MXFP4); a quantization_config (`q`, nullptr when absent) describing any other
// scheme would be misread, so it is refused.
Status CheckQuantizationConfig(const FieldReader& r, const Json* q) {
  if (q == nullptr) return Status::Ok();
  const std::string method = q->is_object() && q->contains("quant_method") && (*q)["quant_method"].is_string()
                                 ? (*q)["quant_method"].get<std::string>() : "";
  const std::string format = q->is_object() && q->contains("format") && (*q)["format"].is_string()
                                 ? (*q)["format"].get<std::string>() : "";
  if (method != "compressed-tensors" || format != "mxfp4-pack-quantized") {
    return r.Bad("quantization_config", fmt::format("describes quant_method '{}' format '{}'; Terrace reads only "
                                                    "compressed-tensors 'mxfp4-pack-quantized' routed experts",
                                                    method, format));
  }
  return Status::Ok();
}

// Settings Terrace implements for one value only: anything else is refused, never ignored.
Status ReadFixedSettings(FieldReader& r, const ModelConfig& c) {
  std::string s;
  TERRACE_RETURN_IF_ERROR(r.String("moe_router_activation_func", &s));
  if (!s.empty() && s != "sigmoid") {
    return r.Bad("moe_router_activation_func", fmt::format("is '{}'; Terrace's router implements only 'sigmoid'", s));
  }
  s.clear();
  TERRACE_RETURN_IF_ERROR(r.String("topk_method", &s));
  if (!s.empty() && s != "noaux_tc") {
    return r.Bad("topk_method", fmt::format("is '{}'; Terrace implements only 'noaux_tc' (sigmoid scores, "
                                            "e_score_correction_bias for the selection)", s));
  }
  s.clear();
  TERRACE_RETURN_IF_ERROR(r.String("scoring_func", &s));
  if (!s.empty() && s != "sigmoid") return r.Bad("scoring_func", fmt::format("is '{}'; only 'sigmoid' is implemented", s));
  int groups = 1, topk_groups = 1;
  TERRACE_RETURN_IF_ERROR(r.Int("num_expert_group", &groups, false, {"n_group"}));
  TERRACE_RETURN_IF_ERROR(r.Int("topk_group", &topk_groups, false));
  bool grouped = true;
  TERRACE_RETURN_IF_ERROR(r.Bool("use_grouped_topk", &grouped));
  if (grouped && groups != topk_groups) {
    return r.Bad("num_expert_group", fmt::format("is {} with topk_group {}: group-limited routing is not implemented "
                                                 "(only num_expert_group == topk_group, i.e. plain top-k)",
                                                 groups, topk_groups));
  }
  int freq = 1;
  TERRACE_RETURN_IF_ERROR(r.Int("moe_layer_freq", &freq, false));
  if (freq != 1) {
    return r.Bad("moe_layer_freq", fmt::format("is {}; Terrace implements only 1 (every layer from "
                                               "first_k_dense_replace on is MoE)", freq));
  }
  int kv_heads = c.num_attention_heads;
  TERRACE_RETURN_IF_ERROR(r.Int("num_key_value_heads", &kv_heads, false));
  if (kv_heads != c.num_attention_heads && !c.kda.full_attn_layers.empty()) {
    return r.Bad("num_key_value_heads", fmt::format("is {} but num_attention_heads is {}; MLA expands keys and values "
                                                    "for every head, so they must be equal",
                                                    kv_heads, c.num_attention_heads));
  }
  int qk = c.QkHeadDim();  // transformers writes the derived sum
  TERRACE_RETURN_IF_ERROR(r.Int("qk_head_dim", &qk, false));
  if (qk != c.QkHeadDim()) {
    return r.Bad("qk_head_dim", fmt::format("is {} but qk_nope_head_dim + qk_rope_head_dim is {}", qk, c.QkHeadDim()));
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    bool bias = false;
    TERRACE_RETURN_IF_ERROR(r.Bool(key, &bias));
    if (bias) return r.Bad(key, "is true; Terrace's projections have no bias terms");
  }
  TERRACE_ASSIGN_OR_RETURN(const Json* q, r.Take("quantization_config"));
  return CheckQuantizationConfig(r, q);
}

// transformers' KimiLinearConfig spells the layer kinds as lists of strings.
Status ReadLayerTypes(FieldReader& r, ModelConfig* c, bool* have_layers) {
  std::vector<std::string> types;
  bool present = false;
  TERRACE_RETURN_IF_ERROR(r.StringList("layer_types", &types, &present));
  if (present) {
    if (static_cast<int>(types.size()) != c->num_hidden_layers) {
      return r.Bad("layer_types", fmt::format("has {} entries for {} layers", types.size(), c->num_hidden_layers));
    }
    std::vector<int> full, kda;
    for (std::size_t i = 0; i < types.size(); ++i) {
      if (types[i] == "full_attention") {
        full.push_back(static_cast<int>(i) + 1);
      } else if (types[i] == "linear_attention") {
        kda.push_back(static_cast<int>(i) + 1);
      } else {
        return r.Bad("layer_types", fmt::format("entry {} is '{}'; expected 'full_attention' or 'linear_attention'", i,
                                                types[i]));
      }
    }
    if (*have_layers && (full != c->kda.full_attn_layers || kda != c->kda.kda_layers)) {
      return r.Bad("layer_types", "disagrees with linear_attn_config.full_attn_layers / kda_layers; keep one");
    }
    c->kda.full_attn_layers = std::move(full);
    c->kda.kda_layers = std::move(kda);
    *have_layers = true;
  }
  TERRACE_RETURN_IF_ERROR(r.StringList("mlp_layer_types", &types, &present));
  if (present) {
    if (static_cast<int>(types.size()) != c->num_hidden_layers) {
      return r.Bad("mlp_layer_types", fmt::format("has {} entries for {} layers", types.size(), c->num_hidden_layers));
    }
    int dense = 0;
    while (dense < static_cast<int>(types.size()) && types[static_cast<std::size_t>(dense)] == "dense") ++dense;
    for (std::size_t i = static_cast<std::size_t>(dense); i < types.size(); ++i) {
      if (types[i] != "sparse") {
        return r.Bad("mlp_layer_types", fmt::format("entry {} is '{}'; Terrace implements dense layers first, then "
                                                    "'sparse' (MoE) layers", i, types[i]));
      }
    }
    c->first_k_dense_replace = dense;
  }
  return Status::Ok();
}

// The wrapper around a text_config (`text`): its model_type, when given, must be K3's, and its
// quantization_config may only repeat text_config's (the one Terrace reads).
Status CheckWrapper(FieldReader& w, const Json& text) {
  std::string type;
  TERRACE_RETURN_IF_ERROR(w.String("model_type", &type));
  if (!type.empty() && type != "kimi_k3") {
    return w.Bad("model_type", fmt::format("is '{}'; a config with a text_config is read only as a 'kimi_k3' "
                                           "wrapper (K3's layout); write 'kimi_k3', or move the language model's "
                                           "keys to the top level", type));
  }
  TERRACE_ASSIGN_OR_RETURN(const Json* q, w.Take("quantization_config"));
  if (q == nullptr) return Status::Ok();
  const auto inner = text.find("quantization_config");
  if (inner == text.end() || inner->is_null()) {
    return w.Bad("quantization_config", "sits outside text_config; Terrace reads it only inside text_config");
  }
  TERRACE_RETURN_IF_ERROR(CheckQuantizationConfig(w, q));
  if (*q != *inner) {
    return w.Bad("quantization_config", "differs from text_config.quantization_config; keep one, or make them equal");
  }
  return Status::Ok();
}

Status ParseInto(const Json& root, std::string_view source, ModelConfig* c, ConfigKeys* keys) {
  const bool nested = root.contains("text_config") && root["text_config"].is_object();
  const Json& j = nested ? root["text_config"] : root;
  const std::string prefix = nested ? "text_config." : "";
  FieldReader r(j, source, prefix);

  TERRACE_RETURN_IF_ERROR(r.String("model_type", &c->model_type));
  if (c->model_type != "kimi_k3" && c->model_type != "kimi_linear") {
    return r.Bad("model_type", fmt::format("is '{}', a model Terrace does not implement (it implements 'kimi_k3' and "
                                           "'kimi_linear')", c->model_type));
  }
  // K3 ships its language model as text_config {"model_type": "kimi_linear"} inside a "kimi_k3"
  // wrapper; it is read with K3's rules (and called kimi_k3), a bare kimi_linear config with Kimi
  // Linear's.
  const auto root_type = root.find("model_type");
  if (nested && root_type != root.end() && *root_type == "kimi_k3") c->model_type = "kimi_k3";
  const bool kimi_linear = c->model_type == "kimi_linear";
  // Defaults for absent keys: Terrace's own (K3-style) files state every switch; transformers'
  // KimiLinearConfig leaves out keys equal to its defaults when it saves, so those defaults apply
  // to kimi_linear files (docs/model-format.md section 2).
  if (kimi_linear) {
    c->vocab_size = 163840;
    c->hidden_size = 2304;
    c->num_hidden_layers = 27;
    c->intermediate_size = 9216;
    c->moe_intermediate_size = 1024;
    c->num_attention_heads = 32;
    c->num_shared_experts = 1;
    c->routed_scaling_factor = 2.446f;
    c->kv_lora_rank = 512;
    c->q_lora_rank.reset();
    c->qk_rope_head_dim = 64;
    c->qk_nope_head_dim = 128;
    c->v_head_dim = 128;
    c->num_experts_per_token = 8;
    c->num_experts = 256;
    c->moe_renormalize = true;
    c->hidden_act = Activation::kSilu;
    c->first_k_dense_replace = 1;
    c->kda.num_heads = 32;
    c->kda.head_dim = 128;
    c->kda.short_conv_kernel_size = 4;
    c->kda.use_full_rank_gate = false;
  } else {
    c->first_k_dense_replace = 0;
    c->num_shared_experts = 0;
  }
  c->kda.gate_lower_bound.reset();
  c->mla_use_nope = true;
  c->mla_use_output_gate = false;
  c->latent_moe_use_norm = false;
  c->attn_res_block_size = 0;
  const bool defaults = kimi_linear;  // required keys may be absent when a default exists

  TERRACE_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c->num_hidden_layers, !defaults));
  TERRACE_RETURN_IF_ERROR(r.Int("hidden_size", &c->hidden_size, !defaults));
  TERRACE_RETURN_IF_ERROR(r.Int("vocab_size", &c->vocab_size, !defaults));
  {
    double eps = c->rms_norm_eps;
    TERRACE_RETURN_IF_ERROR(r.Double("rms_norm_eps", &eps, false));
    if (!(eps > 0.0 && eps <= kMaxRmsEps)) {
      return r.Bad("rms_norm_eps", fmt::format("is {}, outside the supported range (0, {}]", eps, kMaxRmsEps));
    }
    c->rms_norm_eps = static_cast<float>(eps);
    if (!(c->rms_norm_eps > 0.0f)) return r.Bad("rms_norm_eps", fmt::format("is {}, which rounds to 0 as a float", eps));
  }
  std::string act;
  TERRACE_RETURN_IF_ERROR(r.String("hidden_act", &act));
  if (!act.empty()) {
    TERRACE_ASSIGN_OR_RETURN(c->hidden_act, ParseActivation(r, act));
  }

  // KDA: K3 / Kimi Linear checkpoints nest it in "linear_attn_config"; transformers' KimiLinearConfig
  // writes flat linear_* keys and layer_types.
  bool have_full = false, have_kda = false;
  TERRACE_RETURN_IF_ERROR(r.Int("linear_num_heads", &c->kda.num_heads, false));
  TERRACE_RETURN_IF_ERROR(r.Int("linear_head_dim", &c->kda.head_dim, false));
  TERRACE_RETURN_IF_ERROR(r.Int("linear_conv_kernel_dim", &c->kda.short_conv_kernel_size, false));
  // The flat spelling and the nested one of a setting must agree when both are given.
  struct Spelling {
    const char* flat;
    const char* nested;
    int* value;
    int flat_value;
  };
  const std::array<Spelling, 3> spellings = {{
      {"linear_num_heads", "num_heads", &c->kda.num_heads, c->kda.num_heads},
      {"linear_head_dim", "head_dim", &c->kda.head_dim, c->kda.head_dim},
      {"linear_conv_kernel_dim", "short_conv_kernel_size", &c->kda.short_conv_kernel_size,
       c->kda.short_conv_kernel_size},
  }};
  TERRACE_ASSIGN_OR_RETURN(const Json* lin, r.Take("linear_attn_config"));
  if (lin == nullptr && !kimi_linear) return r.Missing("linear_attn_config");
  if (lin != nullptr) {
    if (!lin->is_object()) return r.WrongType("linear_attn_config", "an object");
    FieldReader k(*lin, source, prefix + "linear_attn_config.");
    TERRACE_RETURN_IF_ERROR(k.Int("num_heads", &c->kda.num_heads, !defaults));
    TERRACE_RETURN_IF_ERROR(k.Int("head_dim", &c->kda.head_dim, !defaults));
    TERRACE_RETURN_IF_ERROR(k.Int("short_conv_kernel_size", &c->kda.short_conv_kernel_size, false));
    TERRACE_RETURN_IF_ERROR(k.Bool("use_full_rank_gate", &c->kda.use_full_rank_gate));
    {
      TERRACE_ASSIGN_OR_RETURN(const Json* lb, k.Take("gate_lower_bound"));
      if (lb != nullptr) {
        if (!lb->is_number()) return k.WrongType("gate_lower_bound", "a number or null");
        const double v = lb->get<double>();
        if (!(v >= kMinGateLowerBound && v < 0.0)) {
          return k.Bad("gate_lower_bound", fmt::format("is {}; a log-decay bound must be in [{}, 0); use null for the "
                                                       "unbounded gate", v, kMinGateLowerBound));
        }
        c->kda.gate_lower_bound = static_cast<float>(v);
      }
    }
    TERRACE_RETURN_IF_ERROR(k.IntList("full_attn_layers", &c->kda.full_attn_layers, &have_full));
    TERRACE_RETURN_IF_ERROR(k.IntList("kda_layers", &c->kda.kda_layers, &have_kda));
    TERRACE_RETURN_IF_ERROR(k.Finish(keys, {}));
    for (const Spelling& sp : spellings) {
      const bool flat_given = j.contains(sp.flat) && !j[sp.flat].is_null();  // null: absent (transformers' to_dict)
      if (flat_given && lin->contains(sp.nested) && !(*lin)[sp.nested].is_null() && *sp.value != sp.flat_value) {
        return r.Bad(sp.flat, fmt::format("is {} but linear_attn_config.{} is {}; the two spellings of one setting "
                                          "must agree: keep one",
                                          sp.flat_value, sp.nested, *sp.value));
      }
    }
  }
  if (have_full != have_kda) {  // one list given: the other is its complement (1-based layers)
    const std::vector<int>& given = have_full ? c->kda.full_attn_layers : c->kda.kda_layers;
    std::vector<int> rest;
    for (int l = 1; l <= c->num_hidden_layers; ++l) {
      if (std::find(given.begin(), given.end(), l) == given.end()) rest.push_back(l);
    }
    (have_full ? c->kda.kda_layers : c->kda.full_attn_layers) = std::move(rest);
  }
  bool have_layers = have_full || have_kda;
  TERRACE_RETURN_IF_ERROR(r.Int("first_k_dense_replace", &c->first_k_dense_replace, false));
  const int dense_from_key = c->first_k_dense_replace;
  TERRACE_RETURN_IF_ERROR(ReadLayerTypes(r, c, &have_layers));
  if (j.contains("first_k_dense_replace") && j.contains("mlp_layer_types") && dense_from_key != c->first_k_dense_replace) {
    return r.Bad("mlp_layer_types", fmt::format("has {} dense layers but first_k_dense_replace is {}; keep one",
                                                c->first_k_dense_replace, dense_from_key));
  }
  if (!have_layers) {
    if (!kimi_linear) return Status::InvalidArgument(fmt::format(
        "{}: required field '{}linear_attn_config.full_attn_layers' is missing; add it to the config", source, prefix));
    // transformers' KimiLinearConfig default: full attention at 0-based layers 4, 8, ... (not layer 0).
    c->kda.full_attn_layers.clear();
    c->kda.kda_layers.clear();
    for (int i = 0; i < c->num_hidden_layers; ++i) {
      ((i > 0 && i % 4 == 0) ? c->kda.full_attn_layers : c->kda.kda_layers).push_back(i + 1);
    }
  }

  const bool any_mla = !c->kda.full_attn_layers.empty();
  const bool need_mla = any_mla && !defaults;
  TERRACE_RETURN_IF_ERROR(r.Int("num_attention_heads", &c->num_attention_heads, need_mla));
  TERRACE_RETURN_IF_ERROR(r.OptInt("q_lora_rank", &c->q_lora_rank));
  TERRACE_RETURN_IF_ERROR(r.Int("kv_lora_rank", &c->kv_lora_rank, need_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("qk_nope_head_dim", &c->qk_nope_head_dim, need_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("qk_rope_head_dim", &c->qk_rope_head_dim, need_mla));
  TERRACE_RETURN_IF_ERROR(r.Int("v_head_dim", &c->v_head_dim, need_mla));
  TERRACE_RETURN_IF_ERROR(r.Bool("mla_use_nope", &c->mla_use_nope));
  TERRACE_RETURN_IF_ERROR(r.Bool("mla_use_output_gate", &c->mla_use_output_gate));

  const bool any_moe = c->first_k_dense_replace < c->num_hidden_layers;
  const bool need_moe = any_moe && !defaults;
  TERRACE_RETURN_IF_ERROR(r.Int("num_experts", &c->num_experts, need_moe, {"num_local_experts", "n_routed_experts"}));
  TERRACE_RETURN_IF_ERROR(
      r.Int("num_experts_per_token", &c->num_experts_per_token, need_moe, {"num_experts_per_tok"}));
  TERRACE_RETURN_IF_ERROR(r.Int("num_shared_experts", &c->num_shared_experts, false, {"n_shared_experts"}));
  TERRACE_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size, need_moe));
  c->routed_expert_hidden_size = c->hidden_size;
  TERRACE_RETURN_IF_ERROR(r.Int("routed_expert_hidden_size", &c->routed_expert_hidden_size, false));
  TERRACE_RETURN_IF_ERROR(r.Bool("latent_moe_use_norm", &c->latent_moe_use_norm));
  TERRACE_RETURN_IF_ERROR(r.Bool("moe_renormalize", &c->moe_renormalize, {"norm_topk_prob"}));
  TERRACE_RETURN_IF_ERROR(ReadFloat(r, "routed_scaling_factor", &c->routed_scaling_factor, 0.0, kMaxScaling));
  TERRACE_RETURN_IF_ERROR(
      r.Int("intermediate_size", &c->intermediate_size, c->first_k_dense_replace > 0 && !defaults));
  // The default, saturated so absurd inputs reach the range checks below instead of overflowing.
  c->shared_expert_intermediate_size = static_cast<int>(
      std::clamp<std::int64_t>(std::int64_t{c->num_shared_experts} * c->moe_intermediate_size,
                               std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  TERRACE_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c->shared_expert_intermediate_size, false));

  TERRACE_RETURN_IF_ERROR(r.Int("attn_res_block_size", &c->attn_res_block_size, false));
  // K3's SiTU constants (4, 25) are its own; a Kimi Linear file using situ must state them, since
  // transformers' KimiLinearConfig versions default them differently.
  const bool need_betas = kimi_linear && c->hidden_act == Activation::kSitu;
  TERRACE_RETURN_IF_ERROR(ReadSituBeta(r, "activation_situ_beta", &c->activation_situ_beta, need_betas));
  TERRACE_RETURN_IF_ERROR(ReadSituBeta(r, "activation_situ_linear_beta", &c->activation_situ_linear_beta, need_betas));
  TERRACE_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c->tie_word_embeddings));
  TERRACE_RETURN_IF_ERROR(ReadFixedSettings(r, *c));
  if (nested) {
    // The wrapper's own tie_word_embeddings (K3 states it at both levels) must agree.
    const auto it = root.find("tie_word_embeddings");
    if (it != root.end() && it->is_boolean() && it->get<bool>() != c->tie_word_embeddings) {
      return Status::InvalidArgument(fmt::format("{}: fields 'tie_word_embeddings' and 'text_config.tie_word_embeddings' "
                                                 "disagree; keep one", source));
    }
  }

  TERRACE_RETURN_IF_ERROR(r.Finish(keys, HarmlessKeys()));
  if (nested) {
    // The wrapper's keys: the language model reads only text_config; the rest (vision tower,
    // placeholders, generation settings) is reported as ignored, except settings that change the
    // language model, which must not hide there.
    FieldReader w(root, source, "");
    w.MarkUsed("text_config");
    w.MarkUsed("tie_word_embeddings");
    TERRACE_RETURN_IF_ERROR(CheckWrapper(w, j));
    TERRACE_RETURN_IF_ERROR(w.Finish(keys, HarmlessKeys()));
  }
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

std::string_view ActivationName(Activation a) { return a == Activation::kSilu ? "silu" : "situ"; }

Status ValidateConfig(const ModelConfig& c) {
  // The parser refuses any other model_type; a config built in code is held to the same (the name
  // reaches ToConfigJson, the model id and the expert manifests, where only these are meant).
  if (c.model_type != "kimi_k3" && c.model_type != "kimi_linear") {
    return Field("model_type", fmt::format("is '{}', a model Terrace does not implement; set it to 'kimi_k3' or "
                                           "'kimi_linear'",
                                           PrintableText(c.model_type)));
  }
  TERRACE_RETURN_IF_ERROR(CheckRange("num_hidden_layers", c.num_hidden_layers, 1, kMaxLayers));
  TERRACE_RETURN_IF_ERROR(CheckRange("hidden_size", c.hidden_size, 1, kMaxHidden));
  TERRACE_RETURN_IF_ERROR(CheckRange("vocab_size", c.vocab_size, 1, kMaxVocab));
  TERRACE_RETURN_IF_ERROR(CheckFloat("rms_norm_eps", c.rms_norm_eps, 0.0, kMaxRmsEps));
  TERRACE_RETURN_IF_ERROR(CheckLayerLists(c));
  std::int64_t tensors = 2 + 3;  // embed, lm_head, norm, output AttnRes

  if (!c.kda.kda_layers.empty()) {
    TERRACE_RETURN_IF_ERROR(CheckRange("linear_attn_config.num_heads", c.kda.num_heads, 1, kMaxHeads));
    TERRACE_RETURN_IF_ERROR(CheckRange("linear_attn_config.head_dim", c.kda.head_dim, 1, kMaxHeadDim));
    TERRACE_RETURN_IF_ERROR(
        CheckRange("linear_attn_config.short_conv_kernel_size", c.kda.short_conv_kernel_size, 1, kMaxConvKernel));
  }
  if (c.kda.gate_lower_bound && !(*c.kda.gate_lower_bound < 0.0f && *c.kda.gate_lower_bound >= kMinGateLowerBound)) {
    return Field("linear_attn_config.gate_lower_bound",
                 fmt::format("must be in [{}, 0) (a log-decay bound; got {}); use null for the unbounded gate",
                             kMinGateLowerBound, *c.kda.gate_lower_bound));
  }

  if (!c.kda.full_attn_layers.empty()) {
    TERRACE_RETURN_IF_ERROR(CheckRange("num_attention_heads", c.num_attention_heads, 1, kMaxHeads));
    if (c.q_lora_rank) TERRACE_RETURN_IF_ERROR(CheckRange("q_lora_rank", *c.q_lora_rank, 1, kMaxRank));
    TERRACE_RETURN_IF_ERROR(CheckRange("kv_lora_rank", c.kv_lora_rank, 1, kMaxRank));
    TERRACE_RETURN_IF_ERROR(CheckRange("qk_nope_head_dim", c.qk_nope_head_dim, 0, kMaxHeadDim));
    TERRACE_RETURN_IF_ERROR(CheckRange("qk_rope_head_dim", c.qk_rope_head_dim, 0, kMaxHeadDim));
    TERRACE_RETURN_IF_ERROR(CheckPositive("qk_nope_head_dim + qk_rope_head_dim", c.QkHeadDim()));
    TERRACE_RETURN_IF_ERROR(CheckRange("v_head_dim", c.v_head_dim, 1, kMaxHeadDim));
    if (!c.mla_use_nope) {
      return Field("mla_use_nope", "is false, but Terrace implements only NoPE MLA (k_pe is not rotated)");
    }
  }

  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers) {
    return Field("first_k_dense_replace", fmt::format("must be in [0, num_hidden_layers = {}] (got {})",
                                                     c.num_hidden_layers, c.first_k_dense_replace));
  }
  if (c.first_k_dense_replace > 0) {
    TERRACE_RETURN_IF_ERROR(CheckRange("intermediate_size", c.intermediate_size, 1, kMaxIntermediate));
  }
  if (c.first_k_dense_replace < c.num_hidden_layers) {
    TERRACE_RETURN_IF_ERROR(CheckRange("num_experts", c.num_experts, 1, kMaxExperts));
    TERRACE_RETURN_IF_ERROR(CheckRange("num_experts_per_token", c.num_experts_per_token, 1, kMaxTopK));
    if (c.num_experts_per_token > c.num_experts) {
      return Field("num_experts_per_token", fmt::format("({}) exceeds num_experts ({})", c.num_experts_per_token,
                                                       c.num_experts));
    }
    TERRACE_RETURN_IF_ERROR(CheckRange("moe_intermediate_size", c.moe_intermediate_size, 1, kMaxIntermediate));
    TERRACE_RETURN_IF_ERROR(CheckRange("routed_expert_hidden_size", c.routed_expert_hidden_size, 1, kMaxRank));
    TERRACE_RETURN_IF_ERROR(CheckRange("num_shared_experts", c.num_shared_experts, 0, kMaxTopK));
    if (c.num_shared_experts > 0) {
      TERRACE_RETURN_IF_ERROR(
          CheckRange("shared_expert_intermediate_size", c.shared_expert_intermediate_size, 1, kMaxIntermediate));
    }
    TERRACE_RETURN_IF_ERROR(CheckFloat("routed_scaling_factor", c.routed_scaling_factor, 0.0, kMaxScaling));
    tensors += static_cast<std::int64_t>(c.num_hidden_layers - c.first_k_dense_replace) * (12 + 6 * std::int64_t{c.num_experts});
  }
  tensors += std::int64_t{c.num_hidden_layers} * 30;
  if (tensors > kMaxImpliedTensors) {
    return Field("num_experts", fmt::format("({}) over {} MoE layers implies {} tensors, more than the supported {}",
                                            c.num_experts, c.num_hidden_layers - c.first_k_dense_replace, tensors,
                                            kMaxImpliedTensors));
  }
  TERRACE_RETURN_IF_ERROR(CheckRange("attn_res_block_size", c.attn_res_block_size, 0, c.num_hidden_layers));
  TERRACE_RETURN_IF_ERROR(CheckFloat("activation_situ_beta", c.activation_situ_beta, 0.0, kMaxSituBeta));
  TERRACE_RETURN_IF_ERROR(CheckFloat("activation_situ_linear_beta", c.activation_situ_linear_beta, 0.0, kMaxSituBeta));
  return Status::Ok();
}

Result<ModelConfig> ParseConfigJson(std::string_view json_text, std::string_view source, ConfigKeys* keys) {
  Result<Json> parsed = ParseJsonUniqueKeys(json_text);
  if (!parsed.ok()) {
    return Status::InvalidArgument(fmt::format("{}: {}; fix or regenerate the file", source, parsed.status().message()));
  }
  Json root = std::move(*parsed);
  if (!root.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: not a JSON object; fix or regenerate the file", source));
  }
  ModelConfig c;
  ConfigKeys local;
  try {
    TERRACE_RETURN_IF_ERROR(ParseInto(root, source, &c, &local));
  } catch (const std::exception& e) {
    return Status::InvalidArgument(fmt::format("{}: cannot read config ({})", source, e.what()));
  }
  Status s = ValidateConfig(c);
  if (!s.ok()) return Status::InvalidArgument(fmt::format("{}: {}", source, s.message()));
  if (keys != nullptr) *keys = std::move(local);
  return c;
}

Result<ModelConfig> LoadConfig(const std::filesystem::path& path, ConfigKeys* keys) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
    return Status::InvalidArgument(fmt::format("config file '{}' is not a regular file", path.string()));
  }
  // Over the cap it is the wrong file (or a damaged one): say so, instead of reading it all (an
  // 8 GB sparse file read under a memory limit failed as "not valid JSON ... unexpected end of input").
  auto too_large = [&](std::string size) {
    return Status::InvalidArgument(fmt::format("config file '{}' is {} bytes, over the limit of {} bytes for a "
                                               "config.json (a real one is a few KiB); check the path, or fix or "
                                               "regenerate the file",
                                               path.string(), size, kMaxConfigJsonBytes));
  };
  if (const std::uintmax_t size = std::filesystem::file_size(path, ec); !ec && size > kMaxConfigJsonBytes) {
    return too_large(std::to_string(size));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(fmt::format("cannot open config file '{}'", path.string()));
  // At most one byte past the cap: a file that grew after the size check is refused too.
  std::string text;
  std::array<char, 64 * 1024> buf;
  while (text.size() <= kMaxConfigJsonBytes && (in.read(buf.data(), buf.size()) || in.gcount() > 0)) {
    text.append(buf.data(), static_cast<std::size_t>(in.gcount()));
  }
  if (in.bad()) return Status::IoError(fmt::format("cannot read config file '{}'", path.string()));
  if (text.size() > kMaxConfigJsonBytes) return too_large("more than " + std::to_string(kMaxConfigJsonBytes));
  return ParseConfigJson(text, path.string(), keys);
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
            {"activation_situ_linear_beta", Pretty(c.activation_situ_linear_beta)},
            {"hidden_act", std::string(ActivationName(c.hidden_act))},
            {"moe_renormalize", c.moe_renormalize},
            {"tie_word_embeddings", c.tie_word_embeddings}};
  return j.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
}

}  // namespace terrace::model
