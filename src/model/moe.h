// Stable LatentMoE and the dense gated MLP (docs/model.md, "The math").
//   s = sigmoid(W_r x) (fp32); sel = top_k(s + e_score_correction_bias) (selection only; ties to the
//   lower expert id); w_e = s_e / sum_sel s * routed_scaling_factor (without the division when
//   moe_renormalize is false); z = W_down x (skipped when the latent width equals hidden);
//   y = sum_sel w_e W2_e act(W1_e z, W3_e z); y = RMSNorm(y) when latent_moe_use_norm;
//   out = W_up y (skipped likewise) + SharedMLP(x). act is SiTU-GLU or SiLU-GLU (hidden_act).
// Thread-safety: reentrant; the ExpertProvider must be thread-safe if shared.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "src/model/config.h"
#include "src/model/expert_provider.h"
#include "src/model/ops.h"
#include "src/model/tensor.h"
#include "terrace/model.h"
#include "terrace/status.h"

namespace terrace::model {

struct MoeWeights {
  Weight router;               // gate.weight [E, d]
  Tensor bias;                 // gate.e_score_correction_bias [E] (empty: zeros)
  Weight down, up;             // routed_expert_{down [latent, d], up [d, latent]}_proj (latent projection only)
  Tensor latent_norm;          // routed_expert_norm [latent] (latent_moe_use_norm only)
  Weight shared_gate, shared_up, shared_down;  // [Is, d], [Is, d], [d, Is]; empty: no shared experts
};

struct MoeDims {
  std::int64_t hidden = 0, latent = 0, experts = 0, top_k = 0, intermediate = 0;
  bool latent_norm = true;
  float scaling = 1.0f;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
  float rms_eps = 1e-5f;
  Activation act = Activation::kSitu;  // hidden_act
  bool renormalize = true;             // moe_renormalize
  bool HasLatentProjection() const { return latent != hidden; }
};

Status CheckMoeWeights(const MoeWeights& w, const MoeDims& dims, std::string_view where);

void Route(const MoeWeights& w, const MoeDims& dims, const float* x, std::int64_t tokens, Routing* routing);

// out [T, d] = the MoE layer applied to x [T, d]. Experts come from `experts` as (layer, e); the
// selection is passed to experts->Prefetch before any Acquire. routing (optional) receives the choice.
Status MoeForward(const MoeWeights& w, const MoeDims& dims, int layer, ExpertProvider* experts, const float* x,
                  std::int64_t tokens, float* out, Routing* routing = nullptr);

// act(g, u): SiTU-GLU (4 tanh(g/4) sigmoid(g)) (25 tanh(u/25)) with betas beta_g / beta_u, or
// SiLU-GLU g sigmoid(g) u.
float GluActivation(Activation act, float g, float u, float beta_g, float beta_u);

// g[i] = GluActivation(act, g[i], u[i], ...) for i < n; SiTU through ops::SituInPlace (vectorised,
// within 1e-6 of the scalar form), SiLU by the scalar loop (bit-for-bit GluActivation).
void GluActivationInPlace(Activation act, float* g, const float* u, std::int64_t n, float beta_g, float beta_u);

// out [T, d] (+)= W_down( act(W_gate x, W_up x) ), gate/up [I, d], down [d, I].
void GluMlp(const Weight& gate, const Weight& up, const Weight& down, Activation act, float beta_g, float beta_u,
            const float* x, std::int64_t tokens, float* out, bool accumulate);
// GluMlp with SiTU.
void SituGluMlp(const Weight& gate, const Weight& up, const Weight& down, float beta_g, float beta_u, const float* x,
                std::int64_t tokens, float* out, bool accumulate);

}  // namespace terrace::model
