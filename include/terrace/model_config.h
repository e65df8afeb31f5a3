// Public model API (docs/model.md, "Public API"). ModelConfig: the K3-style architecture hyper-
// parameters, read from an HF-style config.json (top level, or nested under "text_config") or taken
// from a named preset. Field names follow K3 / Kimi Linear's config.json; every key and its rule:
// docs/model-format.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::model {

// The activation of every gated MLP (dense layers, shared experts, routed experts):
// out = W_down(act(W_gate x, W_up x)).
enum class Activation : std::uint8_t {
  kSitu,  // "situ": (b_g tanh(g / b_g) sigmoid(g)) * (b_u tanh(u / b_u)) (K3)
  kSilu,  // "silu" / "swish": g sigmoid(g) * u (SwiGLU; Kimi Linear)
};
std::string_view ActivationName(Activation a);  // "situ", "silu"

struct KdaConfig {                    // "linear_attn_config"
  int num_heads = 0;
  int head_dim = 0;                   // d_k == d_v
  int short_conv_kernel_size = 4;
  bool use_full_rank_gate = true;     // K3: output gate W_g is d -> H*d_v; false: low rank (Kimi Linear)
  std::optional<float> gate_lower_bound;  // K3: -5 (bounded gate); unset: Kimi Linear's unbounded gate
  std::vector<int> full_attn_layers;  // 1-based, as in config.json
  std::vector<int> kda_layers;        // 1-based
};

struct ModelConfig {
  std::string model_type = "kimi_k3";
  int num_hidden_layers = 0;
  int hidden_size = 0;
  int vocab_size = 0;
  float rms_norm_eps = 1e-5f;
  KdaConfig kda;

  // MLA
  int num_attention_heads = 0;
  std::optional<int> q_lora_rank;     // nullopt: plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  bool mla_use_nope = true;
  bool mla_use_output_gate = true;

  // MoE
  int num_experts = 0;
  int num_experts_per_token = 0;
  int num_shared_experts = 0;
  int moe_intermediate_size = 0;      // per routed expert
  int routed_expert_hidden_size = 0;  // the latent width (K3: 3584); == hidden_size means no latent projection
  bool latent_moe_use_norm = true;
  float routed_scaling_factor = 1.0f;
  int first_k_dense_replace = 1;      // layers [0, k) use a dense MLP
  int intermediate_size = 0;          // dense MLP intermediate
  int shared_expert_intermediate_size = 0;  // fused shared experts: num_shared_experts * moe_intermediate_size unless given

  int attn_res_block_size = 0;        // transformer layers per AttnRes block
  float activation_situ_beta = 4.0f;         // SiTU gate: beta * tanh(g / beta) * sigmoid(g)
  float activation_situ_linear_beta = 25.0f; // SiTU linear: beta * tanh(u / beta)
  Activation hidden_act = Activation::kSitu;  // "hidden_act"; default by model_type (kimi_linear: silu)
  bool moe_renormalize = true;        // routing weights s_e / sum_sel s (false: s_e), then * scaling
  bool tie_word_embeddings = false;   // lm_head = embed_tokens (no lm_head tensor)

  // Derived helpers (0-based layer index).
  bool IsMlaLayer(int layer) const;
  bool IsKdaLayer(int layer) const { return !IsMlaLayer(layer); }
  bool IsDenseLayer(int layer) const { return layer < first_k_dense_replace; }
  // The layers with a routed MoE (not IsDenseLayer); whether they have experts is num_experts'.
  int NumMoeLayers() const {
    int n = 0;
    for (int l = 0; l < num_hidden_layers; ++l) n += IsDenseLayer(l) ? 0 : 1;
    return n;
  }
  // Whether any layer routes to experts: num_experts > 0 and at least one MoE layer.
  bool HasRoutedExperts() const { return num_experts > 0 && NumMoeLayers() > 0; }
  int MlaCacheWidth() const { return kv_lora_rank + qk_rope_head_dim; }  // values per token per MLA layer
  int QkHeadDim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool HasLatentProjection() const { return routed_expert_hidden_size != hidden_size; }
  // Block Attention Residuals: the completed block vectors the bank holds by the last layer (one per
  // attn_res_block_size layers, the last block possibly short); the mix also reads the running
  // partial sum, so it has AttnResBankBlocks() + 1 sources at most. 0 without AttnRes.
  int AttnResBankBlocks() const {
    return attn_res_block_size > 0 ? (num_hidden_layers + attn_res_block_size - 1) / attn_res_block_size : 0;
  }
  // eps of MLA's q_a_layernorm / kv_a_layernorm: Kimi Linear's code constructs them with the RMSNorm
  // default 1e-6, K3's with rms_norm_eps.
  float MlaLatentNormEps() const { return model_type == "kimi_linear" ? 1e-6f : rms_norm_eps; }
};

// What ParseConfigJson made of each key of the file (dotted paths, e.g. "text_config.hidden_size",
// in file order): `read` keys are honoured; `ignored` keys are known not to change the computation
// (generation defaults, token ids, dtype hints, rope settings under NoPE, ...).
struct ConfigKeys {
  std::vector<std::string> read;
  std::vector<std::string> ignored;
};

// Parses config.json text. Every key must be known: one Terrace honours, or one it knows to be
// harmless (listed in `keys` as ignored). A key Terrace does not know, a value it does not implement
// (hidden_act "gelu", moe_router_activation_func "softmax", ...), a missing required field or an
// inconsistent or out-of-range one yields InvalidArgument naming the key and `source` (the file path).
Result<ModelConfig> ParseConfigJson(std::string_view json_text, std::string_view source = "config.json",
                                    ConfigKeys* keys = nullptr);
// The largest config.json Terrace reads (LoadConfig, and the CLI's --model / --config before it):
// a real one is a few KiB, so a larger file is the wrong file or a damaged one, never read whole.
inline constexpr std::uint64_t kMaxConfigJsonBytes = 16ull << 20;
// Reads and parses the config file at `path`: ParseConfigJson's errors, NotFound when it cannot be
// opened, InvalidArgument when it is not a regular file or is over kMaxConfigJsonBytes (naming its
// size), IoError when reading it fails.
Result<ModelConfig> LoadConfig(const std::filesystem::path& path, ConfigKeys* keys = nullptr);
// Checks the invariants every consumer relies on (layer lists cover every layer exactly once, top-k
// <= experts, ...) and the sane ranges of docs/model-format.md section 2 (dimensions, eps, scaling
// factors, and the total size the config implies), so no consumer allocates from an absurd value.
// ParseConfigJson calls it.
Status ValidateConfig(const ModelConfig& config);
// Serialises back to config.json: the canonical text hashed into the model id (docs/keys.md, "Model
// id": sorted keys, 2-space indent, a final newline; KDA fields under linear_attn_config; defaults
// filled; unset optional values null; no aliases and no quantization_config).
std::string ToConfigJson(const ModelConfig& config);

// Presets: "k3-toy", "k3-small", "moe-bench" (the expert-offload benchmark's model), "moe-bench-plain"
// (the same without Block AttnRes, for judging lookahead), "kimi-k3",
// "kimi-linear-48b".
Result<ModelConfig> Preset(std::string_view name);
std::vector<std::string> PresetNames();
// True for presets whose random checkpoint draws its routed experts as uniform random MXFP4 codes
// (InitOptions::random_expert_codes) because quantising gigabytes of normals would take minutes.
bool PresetUsesRandomExpertCodes(std::string_view name);

}  // namespace terrace::model
