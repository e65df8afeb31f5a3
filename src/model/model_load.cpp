// Model::Load: reads every dense weight through the WeightSource and converts it to fp32 once.
#include <cmath>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "src/model/model.h"
#include "src/model/names.h"

namespace terrace::model {
namespace {

class Loader {
 public:
  explicit Loader(const WeightSource& src) : src_(src) {}
  // Reads `name` as fp32 and checks its shape (empty `shape`: any shape, flattened when numel matches `numel`).
  Result<Tensor> Get(const std::string& name, std::vector<std::int64_t> shape) const {
    TERRACE_ASSIGN_OR_RETURN(TensorView view, src_.Get(name));
    if (view.shape != shape) {
      if (!(name.ends_with("A_log") && shape.size() == 1 && IsPerHeadVectorShape(view.shape, shape[0])))
        return Status::InvalidArgument(fmt::format("tensor '{}' has shape {}, expected {}; the checkpoint does not match "
                                                   "its config.json",
                                                   name, ShapeString(view.shape), ShapeString(shape)));
    }
    TERRACE_ASSIGN_OR_RETURN(Tensor t, ToFloat(view, name));
    TERRACE_RETURN_IF_ERROR(CheckFinite(t, name));
    return t;
  }
  // Get, keeping a BF16 tensor's bits too (Weight::bf16: what decode's GEMV reads).
  Result<Weight> GetWeight(const std::string& name, std::vector<std::int64_t> shape) const {
    TERRACE_ASSIGN_OR_RETURN(Tensor t, Get(name, std::move(shape)));
    Weight w(std::move(t));
    TERRACE_ASSIGN_OR_RETURN(TensorView view, src_.Get(name));
    if (view.dtype == DType::kBF16 && view.data.size() == w.data.size() * 2) {
      w.bf16.resize(w.data.size());
      std::memcpy(w.bf16.data(), view.data.data(), view.data.size());  // little-endian, as safetensors stores it
    }
    return w;
  }

 private:
  const WeightSource& src_;
};

Status LoadKda(const Loader& ld, const ModelConfig& c, int l, KdaWeights* w) {
  const std::int64_t d = c.hidden_size, H = c.kda.num_heads, K = c.kda.head_dim, C = H * K;
  const auto a = [l](std::string_view s) { return AttnTensorName(l, s); };
  TERRACE_ASSIGN_OR_RETURN(w->q_proj, ld.GetWeight(a("q_proj.weight"), {C, d}));
  TERRACE_ASSIGN_OR_RETURN(w->k_proj, ld.GetWeight(a("k_proj.weight"), {C, d}));
  TERRACE_ASSIGN_OR_RETURN(w->v_proj, ld.GetWeight(a("v_proj.weight"), {C, d}));
  const std::int64_t kern = c.kda.short_conv_kernel_size;
  TERRACE_ASSIGN_OR_RETURN(w->q_conv, ld.Get(a("q_conv1d.weight"), {C, 1, kern}));
  TERRACE_ASSIGN_OR_RETURN(w->k_conv, ld.Get(a("k_conv1d.weight"), {C, 1, kern}));
  TERRACE_ASSIGN_OR_RETURN(w->v_conv, ld.Get(a("v_conv1d.weight"), {C, 1, kern}));
  TERRACE_ASSIGN_OR_RETURN(w->f_a, ld.GetWeight(a("f_a_proj.weight"), {K, d}));
  TERRACE_ASSIGN_OR_RETURN(w->f_b, ld.GetWeight(a("f_b_proj.weight"), {C, K}));
  TERRACE_ASSIGN_OR_RETURN(w->b_proj, ld.GetWeight(a("b_proj.weight"), {H, d}));
  TERRACE_ASSIGN_OR_RETURN(w->a_log, ld.Get(a("A_log"), {H}));
  TERRACE_ASSIGN_OR_RETURN(w->dt_bias, ld.Get(a("dt_bias"), {C}));
  if (c.kda.use_full_rank_gate) {
    TERRACE_ASSIGN_OR_RETURN(w->g_proj, ld.GetWeight(a("g_proj.weight"), {C, d}));
  } else {
    TERRACE_ASSIGN_OR_RETURN(w->g_a, ld.GetWeight(a("g_a_proj.weight"), {K, d}));
    TERRACE_ASSIGN_OR_RETURN(w->g_b, ld.GetWeight(a("g_b_proj.weight"), {C, K}));
  }
  TERRACE_ASSIGN_OR_RETURN(w->o_norm, ld.Get(a("o_norm.weight"), {K}));
  TERRACE_ASSIGN_OR_RETURN(w->o_proj, ld.GetWeight(a("o_proj.weight"), {d, C}));
  return Status::Ok();
}

Status LoadMla(const Loader& ld, const ModelConfig& c, const MlaDims& m, int l, MlaWeights* w) {
  const std::int64_t d = c.hidden_size, H = m.heads;
  const auto a = [l](std::string_view s) { return AttnTensorName(l, s); };
  if (m.q_lora > 0) {
    TERRACE_ASSIGN_OR_RETURN(w->q_a, ld.GetWeight(a("q_a_proj.weight"), {m.q_lora, d}));
    TERRACE_ASSIGN_OR_RETURN(w->q_a_norm, ld.Get(a("q_a_layernorm.weight"), {m.q_lora}));
    TERRACE_ASSIGN_OR_RETURN(w->q_b, ld.GetWeight(a("q_b_proj.weight"), {H * m.QkDim(), m.q_lora}));
  } else {
    TERRACE_ASSIGN_OR_RETURN(w->q_proj, ld.GetWeight(a("q_proj.weight"), {H * m.QkDim(), d}));
  }
  TERRACE_ASSIGN_OR_RETURN(w->kv_a, ld.GetWeight(a("kv_a_proj_with_mqa.weight"), {m.CacheWidth(), d}));
  TERRACE_ASSIGN_OR_RETURN(w->kv_a_norm, ld.Get(a("kv_a_layernorm.weight"), {m.kv_lora}));
  TERRACE_ASSIGN_OR_RETURN(w->kv_b, ld.Get(a("kv_b_proj.weight"), {H * (m.nope + m.v), m.kv_lora}));
  TERRACE_ASSIGN_OR_RETURN(w->o_proj, ld.GetWeight(a("o_proj.weight"), {d, H * m.v}));
  if (m.output_gate) {
    TERRACE_ASSIGN_OR_RETURN(w->g_proj, ld.GetWeight(a("g_proj.weight"), {H * m.v, d}));
  }
  return Status::Ok();
}

Status LoadMoe(const Loader& ld, const ModelConfig& c, const MoeDims& m, int l, MoeWeights* w) {
  const std::int64_t d = c.hidden_size;
  const auto a = [l](std::string_view s) { return MoeTensorName(l, s); };
  TERRACE_ASSIGN_OR_RETURN(w->router, ld.GetWeight(a("gate.weight"), {m.experts, d}));
  // Required (names.cpp expects it): a missing bias must not route as a zero one.
  TERRACE_ASSIGN_OR_RETURN(w->bias, ld.Get(a("gate.e_score_correction_bias"), {m.experts}));
  if (m.HasLatentProjection()) {
    TERRACE_ASSIGN_OR_RETURN(w->down, ld.GetWeight(a("routed_expert_down_proj.weight"), {m.latent, d}));
    TERRACE_ASSIGN_OR_RETURN(w->up, ld.GetWeight(a("routed_expert_up_proj.weight"), {d, m.latent}));
  }
  if (m.latent_norm) {
    TERRACE_ASSIGN_OR_RETURN(w->latent_norm, ld.Get(a("routed_expert_norm.weight"), {m.latent}));
  }
  if (c.num_shared_experts > 0) {
    const std::int64_t is = c.shared_expert_intermediate_size > 0
                                ? c.shared_expert_intermediate_size
                                : static_cast<std::int64_t>(c.num_shared_experts) * c.moe_intermediate_size;
    TERRACE_ASSIGN_OR_RETURN(w->shared_gate, ld.GetWeight(a("shared_experts.gate_proj.weight"), {is, d}));
    TERRACE_ASSIGN_OR_RETURN(w->shared_up, ld.GetWeight(a("shared_experts.up_proj.weight"), {is, d}));
    TERRACE_ASSIGN_OR_RETURN(w->shared_down, ld.GetWeight(a("shared_experts.down_proj.weight"), {d, is}));
  }
  return Status::Ok();
}

}  // namespace

Model::Model() = default;
Model::~Model() = default;
const LayerWeights& Model::layer(int l) const { return *layers_[static_cast<std::size_t>(l)]; }

KdaDims Model::kda_dims() const {
  KdaDims k;
  k.hidden = config_.hidden_size;
  k.heads = config_.kda.num_heads;
  k.head_dim = config_.kda.head_dim;
  k.kernel = config_.kda.short_conv_kernel_size;
  k.gate_lower_bound = config_.kda.gate_lower_bound;
  k.full_rank_gate = config_.kda.use_full_rank_gate;
  k.rms_eps = config_.rms_norm_eps;
  return k;
}

MlaDims Model::mla_dims() const {
  MlaDims m;
  m.hidden = config_.hidden_size;
  m.heads = config_.num_attention_heads;
  m.q_lora = config_.q_lora_rank.value_or(0);
  m.kv_lora = config_.kv_lora_rank;
  m.nope = config_.qk_nope_head_dim;
  m.rope = config_.qk_rope_head_dim;
  m.v = config_.v_head_dim;
  m.output_gate = config_.mla_use_output_gate;
  m.rms_eps = config_.MlaLatentNormEps();
  return m;
}

MoeDims Model::moe_dims() const {
  MoeDims m;
  m.hidden = config_.hidden_size;
  m.latent = config_.routed_expert_hidden_size;
  m.experts = config_.num_experts;
  m.top_k = config_.num_experts_per_token;
  m.intermediate = config_.moe_intermediate_size;
  m.latent_norm = config_.latent_moe_use_norm;
  m.scaling = config_.routed_scaling_factor;
  m.situ_beta = config_.activation_situ_beta;
  m.situ_linear_beta = config_.activation_situ_linear_beta;
  m.act = config_.hidden_act;
  m.renormalize = config_.moe_renormalize;
  m.rms_eps = config_.rms_norm_eps;
  return m;
}

Result<std::unique_ptr<Model>> Model::Load(const ModelConfig& config, const WeightSource& source,
                                           std::shared_ptr<ExpertProvider> experts) {
  try {
    return LoadImpl(config, source, std::move(experts));
  } catch (const std::bad_alloc&) {
    return Status::OutOfCapacity(fmt::format("not enough memory to load the model ({} layers, hidden {}, {} experts) "
                                             "as fp32; the reference forward pass keeps every weight in memory",
                                             config.num_hidden_layers, config.hidden_size, config.num_experts));
  }
}

Result<std::unique_ptr<Model>> Model::LoadImpl(const ModelConfig& config, const WeightSource& source,
                                               std::shared_ptr<ExpertProvider> experts) {
  TERRACE_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<Model> m(new Model());
  m->config_ = config;
  const Loader ld(source);
  const std::int64_t d = config.hidden_size, V = config.vocab_size;
  TERRACE_ASSIGN_OR_RETURN(m->embed_, ld.Get(std::string(kEmbed), {V, d}));
  TERRACE_ASSIGN_OR_RETURN(m->final_norm_, ld.Get(std::string(kFinalNorm), {d}));
  {
    TERRACE_ASSIGN_OR_RETURN(Weight head,
                             ld.GetWeight(std::string(config.tie_word_embeddings ? kEmbed : kLmHead), {V, d}));
    m->lm_head_bf16_ = std::move(head.bf16);
    m->lm_head_ = std::move(static_cast<Tensor&>(head));
  }
  const bool attn_res = config.attn_res_block_size > 0;
  if (attn_res) {
    TERRACE_ASSIGN_OR_RETURN(m->out_res_w_, ld.Get(std::string(kOutputAttnResProj), {1, d}));
    TERRACE_ASSIGN_OR_RETURN(m->out_res_n_, ld.Get(std::string(kOutputAttnResNorm), {d}));
  }
  const MlaDims mla = m->mla_dims();
  const MoeDims moe = m->moe_dims();
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    LayerWeights lw;
    lw.is_mla = config.IsMlaLayer(l);
    lw.dense = config.IsDenseLayer(l);
    TERRACE_ASSIGN_OR_RETURN(lw.input_norm, ld.Get(LayerTensorName(l, "input_layernorm.weight"), {d}));
    TERRACE_ASSIGN_OR_RETURN(lw.post_norm, ld.Get(LayerTensorName(l, "post_attention_layernorm.weight"), {d}));
    if (attn_res) {
      TERRACE_ASSIGN_OR_RETURN(lw.attn_res_w, ld.Get(LayerTensorName(l, "self_attention_res_proj.weight"), {1, d}));
      TERRACE_ASSIGN_OR_RETURN(lw.attn_res_n, ld.Get(LayerTensorName(l, "self_attention_res_norm.weight"), {d}));
      TERRACE_ASSIGN_OR_RETURN(lw.mlp_res_w, ld.Get(LayerTensorName(l, "mlp_res_proj.weight"), {1, d}));
      TERRACE_ASSIGN_OR_RETURN(lw.mlp_res_n, ld.Get(LayerTensorName(l, "mlp_res_norm.weight"), {d}));
    }
    if (lw.is_mla) {
      TERRACE_RETURN_IF_ERROR(LoadMla(ld, config, mla, l, &lw.mla));
    } else {
      TERRACE_RETURN_IF_ERROR(LoadKda(ld, config, l, &lw.kda));
    }
    if (lw.dense) {
      const std::int64_t I = config.intermediate_size;
      TERRACE_ASSIGN_OR_RETURN(lw.mlp_gate, ld.GetWeight(DenseMlpTensorName(l, "gate_proj"), {I, d}));
      TERRACE_ASSIGN_OR_RETURN(lw.mlp_up, ld.GetWeight(DenseMlpTensorName(l, "up_proj"), {I, d}));
      TERRACE_ASSIGN_OR_RETURN(lw.mlp_down, ld.GetWeight(DenseMlpTensorName(l, "down_proj"), {d, I}));
    } else {
      TERRACE_RETURN_IF_ERROR(LoadMoe(ld, config, moe, l, &lw.moe));
    }
    m->layers_.push_back(std::make_unique<LayerWeights>(std::move(lw)));
  }
  if (experts) {
    m->experts_ = std::move(experts);
  } else {
    TERRACE_ASSIGN_OR_RETURN(auto resident, ResidentExpertProvider::Create(source, config));
    m->experts_ = std::move(resident);
  }
  return m;
}

}  // namespace terrace::model
