#include "src/model/moe.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "src/model/mxfp4_matmul.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

// The provider's expert matches the layer: w1/w3 [I, latent], w2 [latent, I], in its format.
Status CheckExpert(const ExpertWeights& w, std::int64_t latent, int layer, int expert) {
  bool ok = false;
  std::int64_t I = 0;
  if (w.format == ExpertFormat::kMxfp4) {
    I = w.q1.rows;
    ok = w.q1.packed && w.q2.packed && w.q3.packed && w.q1.scales && w.q2.scales && w.q3.scales &&
         w.q1.cols == latent && w.q3.rows == I && w.q3.cols == latent && w.q2.rows == latent && w.q2.cols == I && I > 0;
  } else {
    ok = w.w1.shape.size() == 2 && w.w2.shape.size() == 2 && w.w3.shape.size() == 2;
    if (ok) {
      I = w.w1.dim(0);
      ok = w.w1.dim(1) == latent && w.w3.dim(0) == I && w.w3.dim(1) == latent && w.w2.dim(0) == latent &&
           w.w2.dim(1) == I && I > 0;
    }
  }
  if (ok) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "the expert provider returned expert {} of layer {} with inconsistent shapes (latent must be {}: w1/w3 "
      "[I, {}], w2 [{}, I])",
      expert, layer, latent, latent, latent));
}

}  // namespace

Status CheckMoeWeights(const MoeWeights& w, const MoeDims& m, std::string_view where) {
  if (m.top_k < 1 || m.top_k > m.experts)
    return Status::InvalidArgument(fmt::format("{}num_experts_per_token {} must be in [1, num_experts = {}]", where,
                                               m.top_k, m.experts));
  TERRACE_RETURN_IF_ERROR(ExpectShape(w.router, {m.experts, m.hidden}, where, "gate.weight"));
  if (!w.bias.data.empty()) TERRACE_RETURN_IF_ERROR(ExpectShape(w.bias, {m.experts}, where, "gate.e_score_correction_bias"));
  if (m.HasLatentProjection()) {
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.down, {m.latent, m.hidden}, where, "routed_expert_down_proj.weight"));
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.up, {m.hidden, m.latent}, where, "routed_expert_up_proj.weight"));
  }
  if (m.latent_norm) TERRACE_RETURN_IF_ERROR(ExpectShape(w.latent_norm, {m.latent}, where, "routed_expert_norm.weight"));
  if (!w.shared_gate.data.empty()) {
    const std::int64_t is = w.shared_gate.shape.empty() ? 0 : w.shared_gate.dim(0);
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.shared_gate, {is, m.hidden}, where, "shared_experts.gate_proj.weight"));
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.shared_up, {is, m.hidden}, where, "shared_experts.up_proj.weight"));
    TERRACE_RETURN_IF_ERROR(ExpectShape(w.shared_down, {m.hidden, is}, where, "shared_experts.down_proj.weight"));
  }
  return Status::Ok();
}

void Route(const MoeWeights& w, const MoeDims& m, const float* x, std::int64_t T, Routing* r) {
  const std::int64_t E = m.experts, k = m.top_k;
  std::vector<float> s(static_cast<std::size_t>(T * E));
  ops::Linear(x, T, m.hidden, w.router, E, s.data());
  r->top_k = k;
  r->ids.assign(static_cast<std::size_t>(T * k), 0);
  r->weights.assign(static_cast<std::size_t>(T * k), 0.0f);
  std::vector<int> order(static_cast<std::size_t>(E));
  std::vector<float> biased(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    float* st = &s[static_cast<std::size_t>(t * E)];
    for (std::int64_t e = 0; e < E; ++e) {
      st[e] = ops::Sigmoid(st[e]);
      biased[static_cast<std::size_t>(e)] = st[e] + (w.bias.data.empty() ? 0.0f : w.bias.data[static_cast<std::size_t>(e)]);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      const float sa = biased[static_cast<std::size_t>(a)], sb = biased[static_cast<std::size_t>(b)];
      return sa > sb || (sa == sb && a < b);
    });
    float sum = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) sum += st[order[static_cast<std::size_t>(j)]];
    if (!m.renormalize) sum = 1.0f;
    for (std::int64_t j = 0; j < k; ++j) {
      const int e = order[static_cast<std::size_t>(j)];
      r->ids[static_cast<std::size_t>(t * k + j)] = e;
      r->weights[static_cast<std::size_t>(t * k + j)] = st[e] / sum * m.scaling;
    }
  }
}

float GluActivation(Activation act, float g, float u, float beta_g, float beta_u) {
  return act == Activation::kSilu ? ops::Silu(g) * u : ops::Situ(g, u, beta_g, beta_u);
}

void GluActivationInPlace(Activation act, float* g, const float* u, std::int64_t n, float beta_g, float beta_u) {
  if (act == Activation::kSitu) {
    ops::SituInPlace(g, u, n, beta_g, beta_u);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) g[i] = GluActivation(act, g[i], u[i], beta_g, beta_u);
}

void GluMlp(const Weight& gate, const Weight& up, const Weight& down, Activation act, float beta_g, float beta_u,
            const float* x, std::int64_t T, float* out, bool accumulate) {
  const std::int64_t I = gate.dim(0), d = gate.dim(1);
  std::vector<float> g(static_cast<std::size_t>(T * I)), u(g.size());
  ops::Linear(x, T, d, gate, I, g.data());
  ops::Linear(x, T, d, up, I, u.data());
  GluActivationInPlace(act, g.data(), u.data(), static_cast<std::int64_t>(g.size()), beta_g, beta_u);
  ops::Linear(g.data(), T, I, down, down.dim(0), out, accumulate);
}

void SituGluMlp(const Weight& gate, const Weight& up, const Weight& down, float beta_g, float beta_u, const float* x,
                std::int64_t T, float* out, bool accumulate) {
  GluMlp(gate, up, down, Activation::kSitu, beta_g, beta_u, x, T, out, accumulate);
}

Status MoeForward(const MoeWeights& w, const MoeDims& m, int layer, ExpertProvider* experts, const float* x,
                  std::int64_t T, float* out, Routing* routing) {
  Routing local;
  Routing& r = routing ? *routing : local;
  Route(w, m, x, T, &r);
  const std::int64_t k = m.top_k, L = m.latent, d = m.hidden;
  // Tokens per expert, in token order.
  std::vector<std::vector<std::int64_t>> slots(static_cast<std::size_t>(m.experts));
  for (std::int64_t i = 0; i < T * k; ++i) slots[static_cast<std::size_t>(r.ids[static_cast<std::size_t>(i)])].push_back(i);
  std::vector<int> selected;
  for (int e = 0; e < static_cast<int>(m.experts); ++e)
    if (!slots[static_cast<std::size_t>(e)].empty()) selected.push_back(e);
  experts->Prefetch(layer, selected);

  std::vector<float> zbuf;
  const float* z = x;
  if (m.HasLatentProjection()) {
    zbuf.resize(static_cast<std::size_t>(T * L));
    ops::Linear(x, T, d, w.down, L, zbuf.data());
    z = zbuf.data();
  }
  std::vector<float> y(static_cast<std::size_t>(T * L), 0.0f), zin, g, u, ye;
  for (int e : selected) {
    const auto& slot = slots[static_cast<std::size_t>(e)];
    const std::int64_t n = static_cast<std::int64_t>(slot.size());
    TERRACE_ASSIGN_OR_RETURN(const ExpertWeights* ew, experts->Acquire(layer, e));
    if (Status st = CheckExpert(*ew, L, layer, e); !st.ok()) {
      experts->Release(layer, e);
      return st;
    }
    const std::int64_t I = ew->intermediate();
    zin.resize(static_cast<std::size_t>(n * L));
    for (std::int64_t i = 0; i < n; ++i)
      std::copy_n(z + (slot[static_cast<std::size_t>(i)] / k) * L, L, &zin[static_cast<std::size_t>(i * L)]);
    g.resize(static_cast<std::size_t>(n * I));
    u.resize(g.size());
    ye.resize(static_cast<std::size_t>(n * L));
    if (ew->format == ExpertFormat::kMxfp4) {
      Mxfp4Linear(ew->q1, zin.data(), n, g.data());
      Mxfp4Linear(ew->q3, zin.data(), n, u.data());
    } else {
      ops::Linear(zin.data(), n, L, ew->w1.ptr(), I, g.data());
      ops::Linear(zin.data(), n, L, ew->w3.ptr(), I, u.data());
    }
    GluActivationInPlace(m.act, g.data(), u.data(), static_cast<std::int64_t>(g.size()), m.situ_beta, m.situ_linear_beta);
    if (ew->format == ExpertFormat::kMxfp4) {
      Mxfp4Linear(ew->q2, g.data(), n, ye.data());
    } else {
      ops::Linear(g.data(), n, I, ew->w2.ptr(), L, ye.data());
    }
    experts->Release(layer, e);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t s = slot[static_cast<std::size_t>(i)];
      const float wt = r.weights[static_cast<std::size_t>(s)];
      float* yt = &y[static_cast<std::size_t>((s / k) * L)];
      const float* src = &ye[static_cast<std::size_t>(i * L)];
      for (std::int64_t j = 0; j < L; ++j) yt[j] += wt * src[j];
    }
  }
  if (m.latent_norm) ops::RmsNorm(y.data(), T, L, w.latent_norm.ptr(), m.rms_eps, y.data());
  if (m.HasLatentProjection()) {
    ops::Linear(y.data(), T, L, w.up, d, out);
  } else {
    std::copy(y.begin(), y.end(), out);
  }
  if (!w.shared_gate.data.empty())
    GluMlp(w.shared_gate, w.shared_up, w.shared_down, m.act, m.situ_beta, m.situ_linear_beta, x, T, out, true);
  return Status::Ok();
}

}  // namespace terrace::model
