#include "src/model/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "src/model/ops.h"
#include "src/model/vec_math.h"

namespace terrace::model {
namespace {

// Causal softmax over row i of scores [T, N] (ld N): columns > past + i are masked out.
void CausalSoftmax(float* scores, std::int64_t T, std::int64_t N, std::int64_t past, float scale) {
  for (std::int64_t i = 0; i < T; ++i) {
    float* row = scores + i * N;
    const std::int64_t visible = past + i + 1;
    for (std::int64_t j = 0; j < visible; ++j) row[j] *= scale;
    ops::SoftmaxInPlace(row, visible);
    for (std::int64_t j = visible; j < N; ++j) row[j] = 0.0f;
  }
}

}  // namespace

std::vector<std::int64_t> TopPositions(std::span<const float> row, int k) {
  std::vector<std::int64_t> idx(row.size());
  std::iota(idx.begin(), idx.end(), std::int64_t{0});
  const std::size_t kk = std::min(idx.size(), static_cast<std::size_t>(std::max(k, 0)));
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(kk), idx.end(),
                    [&row](std::int64_t a, std::int64_t b) {
                      const float va = row[static_cast<std::size_t>(a)], vb = row[static_cast<std::size_t>(b)];
                      return va > vb || (va == vb && a < b);
                    });
  idx.resize(kk);
  return idx;
}

Status CheckMlaWeights(const MlaWeights& w, const MlaDims& m, std::string_view where) {
  const std::int64_t d = m.hidden, H = m.heads;
  if (m.q_lora > 0) {
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.q_a, {m.q_lora, d}, where, "q_a_proj.weight"));
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.q_a_norm, {m.q_lora}, where, "q_a_layernorm.weight"));
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.q_b, {H * m.QkDim(), m.q_lora}, where, "q_b_proj.weight"));
  } else {
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.q_proj, {H * m.QkDim(), d}, where, "q_proj.weight"));
  }
  TERRACE_RETURN_IF_ERROR(ExpectShape(w.kv_a, {m.CacheWidth(), d}, where, "kv_a_proj_with_mqa.weight"));
  TERRACE_RETURN_IF_ERROR(ExpectShape(w.kv_a_norm, {m.kv_lora}, where, "kv_a_layernorm.weight"));
  TERRACE_RETURN_IF_ERROR(ExpectShape(w.kv_b, {H * (m.nope + m.v), m.kv_lora}, where, "kv_b_proj.weight"));
  TERRACE_RETURN_IF_ERROR(ExpectShape(w.o_proj, {d, H * m.v}, where, "o_proj.weight"));
  if (m.output_gate) TERRACE_RETURN_IF_ERROR(ExpectShape(w.g_proj, {H * m.v, d}, where, "g_proj.weight"));
  return Status::Ok();
}

void MlaForward(const MlaWeights& w, const MlaDims& m, const float* x, std::int64_t T, std::vector<float>* cache,
                bool absorbed, float* out, const MlaAttentionProbe* probe) {
  const bool probing = probe != nullptr && *probe;
  const std::int64_t d = m.hidden, H = m.heads, W = m.CacheWidth(), R = m.kv_lora, QK = m.QkDim();
  const std::int64_t NV = m.nope + m.v;
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  // Queries [T, H*QK].
  std::vector<float> q(n(T * H * QK));
  if (m.q_lora > 0) {
    std::vector<float> cq(n(T * m.q_lora));
    ops::Linear(x, T, d, w.q_a, m.q_lora, cq.data());
    ops::RmsNorm(cq.data(), T, m.q_lora, w.q_a_norm.ptr(), m.rms_eps, cq.data());
    ops::Linear(cq.data(), T, m.q_lora, w.q_b, H * QK, q.data());
  } else {
    ops::Linear(x, T, d, w.q_proj, H * QK, q.data());
  }
  // New latents: [c_KV | k_pe], c_KV RMS-normalised, appended to the cache.
  const std::int64_t past = static_cast<std::int64_t>(cache->size()) / W;
  cache->resize(n((past + T) * W));
  float* fresh = cache->data() + past * W;
  ops::Linear(x, T, d, w.kv_a, W, fresh);
  for (std::int64_t t = 0; t < T; ++t) ops::RmsNorm(fresh + t * W, 1, R, w.kv_a_norm.ptr(), m.rms_eps, fresh + t * W);
  const std::int64_t N = past + T;
  const float* C = cache->data();  // c_KV at column 0, k_pe at column R, leading dimension W
  const float scale = 1.0f / std::sqrt(static_cast<float>(QK));

  std::vector<float> o(n(T * H * m.v)), scores(n(T * N));
  if (!absorbed) {
    std::vector<float> kv(n(N * H * NV));  // [N, H, nope + v]
    ops::Gemm(false, true, N, H * NV, R, 1.0f, C, W, w.kv_b.ptr(), R, 0.0f, kv.data(), H * NV);
    for (std::int64_t h = 0; h < H; ++h) {
      ops::Gemm(false, true, T, N, m.nope, 1.0f, &q[n(h * QK)], H * QK, &kv[n(h * NV)], H * NV, 0.0f, scores.data(), N);
      ops::Gemm(false, true, T, N, m.rope, 1.0f, &q[n(h * QK + m.nope)], H * QK, C + R, W, 1.0f, scores.data(), N);
      CausalSoftmax(scores.data(), T, N, past, scale);
      if (probing) (*probe)(h, std::span<const float>(scores.data(), n(T * N)), T, N);
      ops::Gemm(false, false, T, m.v, N, 1.0f, scores.data(), N, &kv[n(h * NV + m.nope)], H * NV, 0.0f,
                &o[n(h * m.v)], H * m.v);
    }
  } else {
    std::vector<float> qabs(n(T * R)), ctx(n(T * R));
    for (std::int64_t h = 0; h < H; ++h) {
      const float* w_uk = w.kv_b.ptr() + h * NV * R;        // [nope, R]
      const float* w_uv = w.kv_b.ptr() + (h * NV + m.nope) * R;  // [v, R]
      ops::Gemm(false, false, T, R, m.nope, 1.0f, &q[n(h * QK)], H * QK, w_uk, R, 0.0f, qabs.data(), R);
      ops::Gemm(false, true, T, N, R, 1.0f, qabs.data(), R, C, W, 0.0f, scores.data(), N);
      ops::Gemm(false, true, T, N, m.rope, 1.0f, &q[n(h * QK + m.nope)], H * QK, C + R, W, 1.0f, scores.data(), N);
      CausalSoftmax(scores.data(), T, N, past, scale);
      if (probing) (*probe)(h, std::span<const float>(scores.data(), n(T * N)), T, N);
      ops::Gemm(false, false, T, R, N, 1.0f, scores.data(), N, C, W, 0.0f, ctx.data(), R);
      ops::Gemm(false, true, T, m.v, R, 1.0f, ctx.data(), R, w_uv, R, 0.0f, &o[n(h * m.v)], H * m.v);
    }
  }
  if (m.output_gate) {
    std::vector<float> gate(o.size());
    ops::Linear(x, T, d, w.g_proj, H * m.v, gate.data());
    ops::MulSigmoidInPlace(o.data(), gate.data(), static_cast<std::int64_t>(o.size()));
  }
  ops::Linear(o.data(), T, H * m.v, w.o_proj, d, out);
}

}  // namespace terrace::model
