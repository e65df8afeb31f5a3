// Stable LatentMoE (model-notes section 5) and the dense SiTU-GLU MLP.
//   s = sigmoid(W_r x) (fp32); sel = top_k(s + e_score_correction_bias) (selection only; ties to the
//   lower expert id); w_e = s_e / sum_sel s * routed_scaling_factor; z = W_down x (skipped when the
//   latent width equals hidden); y = sum_sel w_e W2_e SiTU(W1_e z, W3_e z); y = RMSNorm(y) when
//   latent_moe_use_norm; out = W_up y (skipped likewise) + SharedMLP(x).
// Thread-safety: reentrant; the ExpertProvider must be thread-safe if shared.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "src/model/expert_provider.h"
#include "src/model/tensor.h"
#include "terrace/status.h"

namespace terrace::model {

struct MoeWeights {
  Tensor router;               // gate.weight [E, d]
  Tensor bias;                 // gate.e_score_correction_bias [E] (empty: zeros)
  Tensor down, up;             // routed_expert_{down [latent, d], up [d, latent]}_proj (latent projection only)
  Tensor latent_norm;          // routed_expert_norm [latent] (latent_moe_use_norm only)
  Tensor shared_gate, shared_up, shared_down;  // [Is, d], [Is, d], [d, Is]; empty: no shared experts
};

struct MoeDims {
  std::int64_t hidden = 0, latent = 0, experts = 0, top_k = 0, intermediate = 0;
  bool latent_norm = true;
  float scaling = 1.0f;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
  float rms_eps = 1e-5f;
  bool HasLatentProjection() const { return latent != hidden; }
};

// The router's choice for T tokens: ids and weights [T, top_k], ids by decreasing biased score.
struct Routing {
  std::int64_t top_k = 0;
  std::vector<int> ids;
  std::vector<float> weights;
};

Status CheckMoeWeights(const MoeWeights& w, const MoeDims& dims, std::string_view where);

void Route(const MoeWeights& w, const MoeDims& dims, const float* x, std::int64_t tokens, Routing* routing);

// out [T, d] = the MoE layer applied to x [T, d]. Experts come from `experts` as (layer, e); the
// selection is passed to experts->Prefetch before any Acquire. routing (optional) receives the choice.
Status MoeForward(const MoeWeights& w, const MoeDims& dims, int layer, ExpertProvider* experts, const float* x,
                  std::int64_t tokens, float* out, Routing* routing = nullptr);

// out [T, d] (+)= W_down( SiTU(W_gate x, W_up x) ), gate/up [I, d], down [d, I].
void SituGluMlp(const Tensor& gate, const Tensor& up, const Tensor& down, float beta_g, float beta_u, const float* x,
                std::int64_t tokens, float* out, bool accumulate);

}  // namespace terrace::model
