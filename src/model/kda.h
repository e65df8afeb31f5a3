// Kimi Delta Attention (docs/model.md, "KDA"): the recurrence in its recurrent and chunkwise forms,
// and the full KDA mixer (projections, short conv, gates, gated per-head RMSNorm output).
//
// Layouts (one sequence, fp32, row-major): q, k, g [T, H, K]; v, o [T, H, V]; beta [T, H];
// state [H, K, V]. Per token and head, in this order:
//   S = diag(exp(g_t)) S;  S += (beta_t k_t) outer (v_t - S^T k_t);  o_t = S^T q_t
// q is used as given (any d_k^-0.5 scale is the caller's). Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "src/model/ops.h"
#include "src/model/tensor.h"
#include "terrace/status.h"

namespace terrace::model {

struct KdaCoreArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;     // log-decay, <= 0 in practice
  const float* beta = nullptr;
  std::int64_t tokens = 0, heads = 0, key_dim = 0, value_dim = 0;
};

// Token-by-token recurrence. state [H, K, V] is read and updated in place; o is [T, H, V].
void KdaRecurrent(const KdaCoreArgs& args, float* state, float* o);

// The same result computed chunk by chunk (Kimi Linear tech report eqs. 2-9): cumulative log-decay
// inside a chunk, WY/UT representation through a unit-lower-triangular solve, pseudo-values,
// inter-chunk state passing plus intra-chunk attention. chunk >= 1 (default 64).
void KdaChunked(const KdaCoreArgs& args, float* state, float* o, std::int64_t chunk = 64);

// One KDA layer's weights as fp32 (converted at load). Linear weights are [out, in].
struct KdaWeights {
  Weight q_proj, k_proj, v_proj;   // [H*K, d], [H*K, d], [H*V, d]
  Tensor q_conv, k_conv, v_conv;   // [channels, 1, kernel]
  Weight f_a, f_b;                 // gate low rank: [K, d], [H*K, K]
  Weight b_proj;                   // [H, d]
  Tensor a_log;                    // [H] (or longer; the first H values are used)
  Tensor dt_bias;                  // [H*K] (or [H], broadcast over K)
  Weight g_proj;                   // full-rank output gate [H*V, d]
  Weight g_a, g_b;                 // low-rank output gate [V, d], [H*V, V] (use_full_rank_gate = false)
  Tensor o_norm;                   // [V]
  Weight o_proj;                   // [d, H*V]
};

struct KdaDims {
  std::int64_t hidden = 0, heads = 0, head_dim = 0, kernel = 4;
  std::optional<float> gate_lower_bound;  // set: K3's bounded gate; unset: Kimi Linear's
  bool full_rank_gate = true;
  float rms_eps = 1e-5f;
  std::int64_t Channels() const { return 3 * heads * head_dim; }      // q | k | v conv channels
  std::int64_t ConvStateSize() const { return (kernel - 1) * Channels(); }
  std::int64_t RecurrentStateSize() const { return heads * head_dim * head_dim; }
};

// Checks every tensor's shape against dims; InvalidArgument naming the tensor (prefixed by `where`).
Status CheckKdaWeights(const KdaWeights& w, const KdaDims& dims, std::string_view where);

// Runs the mixer on x [T, hidden] (the normed layer input), continuing the sequence whose state is
// `recurrent` [H, K, V] and `conv` [kernel-1, 3*H*K] (oldest row first; both updated in place).
// out is [T, hidden]. chunked selects the chunkwise core (prefill) over the recurrent one (decode).
void KdaForward(const KdaWeights& w, const KdaDims& dims, const float* x, std::int64_t tokens,
                std::span<float> recurrent, std::span<float> conv, bool chunked, float* out);

}  // namespace terrace::model
