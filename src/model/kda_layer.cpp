// The KDA mixer: projections, causal short conv + SiLU, L2 norm, gates, core, gated RMSNorm output.
#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "src/model/kda.h"
#include "src/model/names.h"
#include "src/model/ops.h"
#include "src/model/short_conv.h"
#include "src/model/vec_math.h"

namespace terrace::model {
namespace {

Status CheckShape(const Tensor& t, std::initializer_list<std::int64_t> want, std::string_view where,
                  std::string_view name) {
  if (t.shape != std::vector<std::int64_t>(want)) {
    return Status::InvalidArgument(fmt::format("{}{}: expected shape {}, got {}; check the checkpoint against "
                                               "config.json",
                                               where, name, ShapeString(std::vector<std::int64_t>(want)),
                                               ShapeString(t.shape)));
  }
  return Status::Ok();
}

}  // namespace

Status CheckKdaWeights(const KdaWeights& w, const KdaDims& dims, std::string_view where) {
  const std::int64_t d = dims.hidden, H = dims.heads, K = dims.head_dim;
  TERRACE_RETURN_IF_ERROR(CheckShape(w.q_proj, {H * K, d}, where, "q_proj.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.k_proj, {H * K, d}, where, "k_proj.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.v_proj, {H * K, d}, where, "v_proj.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.q_conv, {H * K, 1, dims.kernel}, where, "q_conv1d.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.k_conv, {H * K, 1, dims.kernel}, where, "k_conv1d.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.v_conv, {H * K, 1, dims.kernel}, where, "v_conv1d.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.f_a, {K, d}, where, "f_a_proj.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.f_b, {H * K, K}, where, "f_b_proj.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.b_proj, {H, d}, where, "b_proj.weight"));
  if (!IsPerHeadVectorShape(w.a_log.shape, H))
    return Status::InvalidArgument(fmt::format("{}A_log: expected a vector of at least {} values (one per head), got "
                                               "shape {}", where, H, ShapeString(w.a_log.shape)));
  if (w.dt_bias.numel() != H * K && w.dt_bias.numel() != H)
    return Status::InvalidArgument(fmt::format("{}dt_bias: expected {} values (heads x head_dim) or {}, got {}", where,
                                               H * K, H, w.dt_bias.numel()));
  if (dims.full_rank_gate) {
    TERRACE_RETURN_IF_ERROR(CheckShape(w.g_proj, {H * K, d}, where, "g_proj.weight"));
  } else {
    TERRACE_RETURN_IF_ERROR(CheckShape(w.g_a, {K, d}, where, "g_a_proj.weight"));
    TERRACE_RETURN_IF_ERROR(CheckShape(w.g_b, {H * K, K}, where, "g_b_proj.weight"));
  }
  TERRACE_RETURN_IF_ERROR(CheckShape(w.o_norm, {K}, where, "o_norm.weight"));
  TERRACE_RETURN_IF_ERROR(CheckShape(w.o_proj, {d, H * K}, where, "o_proj.weight"));
  return Status::Ok();
}

void KdaForward(const KdaWeights& w, const KdaDims& dims, const float* x, std::int64_t T,
                std::span<float> recurrent, std::span<float> conv, bool chunked, float* out) {
  const std::int64_t d = dims.hidden, H = dims.heads, K = dims.head_dim, C = H * K;
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  std::vector<float> q(n(T * C)), k(n(T * C)), v(n(T * C)), g(n(T * C)), beta(n(T * H)), o(n(T * C));
  std::vector<float> low(n(T * K)), gate(n(T * C));
  ops::Linear(x, T, d, w.q_proj, C, q.data());
  ops::Linear(x, T, d, w.k_proj, C, k.data());
  ops::Linear(x, T, d, w.v_proj, C, v.data());
  const std::int64_t width = 3 * C;
  ShortConvSilu(q.data(), T, C, w.q_conv.ptr(), dims.kernel, conv.data(), width, 0);
  ShortConvSilu(k.data(), T, C, w.k_conv.ptr(), dims.kernel, conv.data(), width, C);
  ShortConvSilu(v.data(), T, C, w.v_conv.ptr(), dims.kernel, conv.data(), width, 2 * C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  for (std::int64_t r = 0; r < T * H; ++r) {
    ops::L2NormalizeInPlace(&q[n(r * K)], K);
    ops::L2NormalizeInPlace(&k[n(r * K)], K);
    for (std::int64_t i = 0; i < K; ++i) q[n(r * K + i)] *= scale;
  }
  ops::Linear(x, T, d, w.b_proj, H, beta.data());
  ops::SigmoidInPlace(beta.data(), T * H);
  // Decay gate: raw = f_b(f_a(x)); bounded lb * sigmoid(exp(A) (raw + dt)) or -exp(A) softplus(raw + dt).
  ops::Linear(x, T, d, w.f_a, K, low.data());
  ops::Linear(low.data(), T, K, w.f_b, C, g.data());
  const bool per_channel_dt = w.dt_bias.numel() == C;
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      const float a = std::exp(w.a_log.data[n(h)]);
      for (std::int64_t i = 0; i < K; ++i) {
        float& gi = g[n(t * C + h * K + i)];
        const float z = gi + w.dt_bias.data[n(per_channel_dt ? h * K + i : h)];
        gi = dims.gate_lower_bound ? a * z : -a * ops::Softplus(z);
      }
    }
  }
  if (dims.gate_lower_bound) {  // g = lb * sigmoid(a z)
    ops::SigmoidInPlace(g.data(), T * C);
    for (float& gi : g) gi *= *dims.gate_lower_bound;
  }
  KdaCoreArgs args{q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, K, K};
  if (chunked) {
    KdaChunked(args, recurrent.data(), o.data());
  } else {
    KdaRecurrent(args, recurrent.data(), o.data());
  }
  ops::RmsNorm(o.data(), T * H, K, w.o_norm.ptr(), dims.rms_eps, o.data());
  if (dims.full_rank_gate) {
    ops::Linear(x, T, d, w.g_proj, C, gate.data());
  } else {
    ops::Linear(x, T, d, w.g_a, K, low.data());
    ops::Linear(low.data(), T, K, w.g_b, C, gate.data());
  }
  ops::MulSigmoidInPlace(o.data(), gate.data(), T * C);
  ops::Linear(o.data(), T, C, w.o_proj, d, out);
}

}  // namespace terrace::model
