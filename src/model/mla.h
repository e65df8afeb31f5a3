// Gated Multi-head Latent Attention with NoPE (docs/model.md, "MLA"), in the naive form (keys and
// values expanded per head from the latent cache) and the absorbed form (queries mapped into the
// latent space; values expanded after the softmax). Both give the same result.
//
// The per-token cache of one MLA layer is exactly [c_KV (kv_lora, RMS-normalised) | k_pe (rope)],
// row-major [tokens, kv_lora + rope] fp32. Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "src/model/ops.h"
#include "src/model/tensor.h"
#include "terrace/status.h"

namespace terrace::model {

struct MlaWeights {              // linear weights are [out, in]
  Weight q_a, q_b;               // q_lora path: [q_lora, d], [H*(nope+rope), q_lora]
  Tensor q_a_norm;               // q_lora path: [q_lora]
  Weight q_proj;                 // plain path (q_lora_rank null): [H*(nope+rope), d]
  Weight kv_a;                   // kv_a_proj_with_mqa [kv_lora + rope, d]
  Tensor kv_a_norm;              // [kv_lora]
  Tensor kv_b;                   // [H*(nope+v), kv_lora], per head k_nope rows first
  Weight o_proj;                 // [d, H*v]
  Weight g_proj;                 // output gate [H*v, d] (mla_use_output_gate)
};

struct MlaDims {
  std::int64_t hidden = 0, heads = 0, q_lora = 0;  // q_lora 0: plain q_proj
  std::int64_t kv_lora = 0, nope = 0, rope = 0, v = 0;
  bool output_gate = true;
  float rms_eps = 1e-5f;
  std::int64_t CacheWidth() const { return kv_lora + rope; }
  std::int64_t QkDim() const { return nope + rope; }
};

Status CheckMlaWeights(const MlaWeights& w, const MlaDims& dims, std::string_view where);

// A read-only view of one head's attention probabilities: `probs` is [tokens, positions] row-major
// (positions = the cache rows after this call's append); row i is token i of the call, at absolute
// position positions - tokens + i, and holds the softmax over positions [0, positions - tokens + i]
// (later columns are 0). Valid only during the call; runs on the forward pass's thread.
using MlaAttentionProbe =
    std::function<void(std::int64_t head, std::span<const float> probs, std::int64_t tokens, std::int64_t positions)>;

// The k largest entries of one probability row (k clipped to its length), largest first; equal
// values in increasing position order.
std::vector<std::int64_t> TopPositions(std::span<const float> row, int k);

// Runs the mixer on x [T, hidden] (the normed layer input). Appends T rows to *cache (the sequence's
// latents so far, [N, CacheWidth()]); token i of x attends causally to cache rows [0, N_before + i].
// out is [T, hidden]. absorbed picks the absorbed form (decode) over the naive form (prefill).
// probe (may be null or empty: no cost) sees every head's probabilities once, before they are used.
void MlaForward(const MlaWeights& w, const MlaDims& dims, const float* x, std::int64_t tokens,
                std::vector<float>* cache, bool absorbed, float* out, const MlaAttentionProbe* probe = nullptr);

}  // namespace terrace::model
