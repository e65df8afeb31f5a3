// K3 checkpoint tensor names, and the list of every tensor a ModelConfig implies.
// ExpectedTensors is the single source of truth: weights_init writes it, inspect groups by it, the
// loader validates against it. Naming rule: every tensor lives under "language_model.model." except
// the output head, "language_model.lm_head.weight" (as K3 ships it). Full table: docs/model-format.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/config.h"
#include "src/model/tensor.h"
#include "src/model/weight_source.h"
#include "terrace/status.h"

namespace terrace::model {

inline constexpr std::string_view kModelPrefix = "language_model.model.";
inline constexpr std::string_view kEmbed = "language_model.model.embed_tokens.weight";
inline constexpr std::string_view kFinalNorm = "language_model.model.norm.weight";
inline constexpr std::string_view kLmHead = "language_model.lm_head.weight";
inline constexpr std::string_view kOutputAttnResProj = "language_model.model.output_attn_res_proj.weight";
inline constexpr std::string_view kOutputAttnResNorm = "language_model.model.output_attn_res_norm.weight";

// "language_model.model.layers.{layer}." (0-based layer).
std::string LayerPrefix(int layer);
// LayerPrefix(layer) + suffix, e.g. LayerTensorName(3, "input_layernorm.weight").
std::string LayerTensorName(int layer, std::string_view suffix);
// Mixer (KDA or MLA) tensors: LayerPrefix + "self_attn." + suffix, e.g. AttnTensorName(0, "q_proj.weight").
std::string AttnTensorName(int layer, std::string_view suffix);
// MoE tensors: LayerPrefix + "block_sparse_moe." + suffix, e.g. MoeTensorName(1, "gate.weight").
std::string MoeTensorName(int layer, std::string_view suffix);
// Routed expert: ExpertTensorName(1, 5, "w1", "weight_packed") ->
// "language_model.model.layers.1.block_sparse_moe.experts.5.w1.weight_packed".
std::string ExpertTensorName(int layer, int expert, std::string_view proj, std::string_view kind);
// Dense MLP (layers < first_k_dense_replace): LayerPrefix + "mlp." + proj + ".weight".
std::string DenseMlpTensorName(int layer, std::string_view proj);

// What a tensor belongs to, for inspect's totals and the planner.
enum class Component : std::uint8_t {
  kAttention,      // KDA / MLA projections, convs, gates, per-head norms
  kRoutedExperts,  // experts.E.w{1,2,3} (MXFP4)
  kMoeRouting,     // router gate + bias, latent down/up projections, latent norm
  kSharedExperts,
  kDenseMlp,
  kEmbeddings,     // embed_tokens, lm_head
  kNormsOther,     // layer norms, AttnRes pseudo-queries and norms, final norm
};
std::string_view ComponentName(Component c);  // "attention", "routed_experts", ...
inline constexpr int kNumComponents = 7;

struct TensorSpec {
  std::string name;
  DType dtype = DType::kBF16;  // the dtype Terrace writes (K3: routed experts U8, A_log/dt_bias/bias F32, else BF16)
  std::vector<std::int64_t> shape;
  Component component = Component::kNormsOther;
  int layer = -1;   // 0-based, -1 for model-level tensors
  int expert = -1;  // routed expert index, -1 otherwise
  bool mxfp4 = false;  // a weight_packed / weight_scale tensor: must be U8
  std::int64_t params() const;  // logical parameter count (a packed byte holds 2; scales count 0)
  std::uint64_t bytes() const;  // stored size: elements x DTypeSize(dtype)
};

// Whether a stored KDA `A_log` of shape `stored` can stand for the [heads] vector: one vector of at
// least `heads` values, with any number of size-1 dimensions around it ([H], [1, 1, H, 1] as
// transformers writes it, K3's padded [128] for 96 heads); its first `heads` values are used. A shape
// with two dimensions above 1 (a per-channel [H, dk]) is not a per-head vector and is refused.
bool IsPerHeadVectorShape(const std::vector<std::int64_t>& stored, std::int64_t heads);

// How a checkpoint stores its routed experts (the public ExpertFormat, terrace/model_weights.h):
// kMxfp4 (experts.E.wN.weight_packed + weight_scale, U8; K3) or kF32, plain float matrices
// (experts.E.wN.weight, F32/BF16/F16; Kimi Linear, transformers), read as fp32.
// The format of `source`'s routed experts, judged by expert 0 of the first MoE layer (kMxfp4 when
// the config has no MoE layer or the tensor is absent).
ExpertFormat DetectExpertFormat(const WeightSource& source, const ModelConfig& config);

// Every tensor `config` implies, in a fixed order: embeddings, layer by layer, then the output
// tensors (final norm, output AttnRes, lm_head unless tie_word_embeddings). Routed experts are
// listed in `experts` format.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config, ExpertFormat experts = ExpertFormat::kMxfp4);

// Checks that `source` holds every expected tensor (experts in the format DetectExpertFormat finds)
// with the expected shape, and a compatible dtype (U8 for MXFP4 tensors; F32, BF16 or F16 for the
// rest). A_log may carry any shape with at least H elements. Before listing tensors it checks each
// config dimension against one tensor that carries it (CheckConfigAgainstTensors), so an absurd
// value is reported as such instead of as millions of missing tensors.
// InvalidArgument naming the tensor, the expected and the actual shape/dtype (first problem only;
// see FindWeightProblems for all).
Status ValidateWeights(const WeightSource& source, const ModelConfig& config);
// Every problem (missing, wrong shape, wrong dtype, and tensors the config leaves unused: a
// checkpoint holding a tensor its config.json switches off, such as an MLA output gate with
// mla_use_output_gate false, would otherwise run as a different model), one line each; empty when
// all is well. A setting that would use such tensors is named in the line.
std::vector<std::string> FindWeightProblems(const WeightSource& source, const ModelConfig& config);
// The config's dimensions against the tensors that carry them (embed_tokens: vocab_size and
// hidden_size; the first MoE router: num_experts; ...): one line per mismatch, naming the config
// key, its value, the tensor and its shape.
std::vector<std::string> CheckConfigAgainstTensors(const WeightSource& source, const ModelConfig& config);

}  // namespace terrace::model
