// Model::Forward: the decoder stack wired through Block Attention Residuals (docs/model.md, "The math").
#include "src/model/model.h"

#include <algorithm>
#include <cmath>
#include <new>

#include <fmt/format.h>

#include "src/model/attnres.h"
#include "src/model/ops.h"

namespace terrace::model {
namespace {

using Rows = std::vector<float>;

// AttnRes over bank + [prefix] into out.
void Mix(const std::vector<Rows>& bank, const Rows& prefix, std::int64_t T, std::int64_t d, const Tensor& w,
         const Tensor& n, Rows* out, Profile* profile) {
  ScopedPhase timer(profile, Phase::kAttnRes);
  std::vector<const float*> sources;
  for (const auto& b : bank) sources.push_back(b.data());
  sources.push_back(prefix.data());
  out->resize(prefix.size());
  AttnResMix(sources, T, d, w.ptr(), n.ptr(), out->data());
}

// The AttnResView of the innermost forward-pass hook running on this thread (Model::CurrentAttnResView).
thread_local const AttnResView* t_attn_res_view = nullptr;

// Publishes `bank` and `partial` as this thread's AttnResView while it lives (a nested pass restores
// the outer view when it ends). `spans` holds the bank's views; nothing is copied.
class ScopedAttnResView {
 public:
  ScopedAttnResView(const Model* m, int layer, std::int64_t T, const std::vector<Rows>& bank,
                    std::span<const float> partial, std::vector<std::span<const float>>* spans)
      : prev_(t_attn_res_view) {
    spans->clear();
    for (const auto& b : bank) spans->emplace_back(b);
    view_ = AttnResView{m, layer, T, *spans, partial};
    t_attn_res_view = &view_;
  }
  // Publishes a view built by the caller (its spans must outlive this object).
  explicit ScopedAttnResView(const AttnResView& view) : prev_(t_attn_res_view), view_(view) {
    t_attn_res_view = &view_;
  }
  ~ScopedAttnResView() { t_attn_res_view = prev_; }
  ScopedAttnResView(const ScopedAttnResView&) = delete;
  ScopedAttnResView& operator=(const ScopedAttnResView&) = delete;

 private:
  const AttnResView* prev_;
  AttnResView view_;
};

}  // namespace

const AttnResView* Model::CurrentAttnResView() { return t_attn_res_view; }

Status Model::RunLayer(int l, std::int64_t T, const float* normed, SequenceState* state, const ForwardOptions& o,
                       float* out) const {
  const LayerWeights& w = layer(l);
  LayerState& s = state->layer(l);
  if (w.is_mla) {
    ScopedPhase timer(o.profile, Phase::kMla);
    if (o.on_mla_attention) {
      const MlaAttentionProbe probe = [&o, l](std::int64_t head, std::span<const float> probs, std::int64_t tokens,
                                              std::int64_t positions) {
        o.on_mla_attention(l, head, probs, tokens, positions);
      };
      MlaForward(w.mla, mla_dims(), normed, T, &s.latents, o.absorbed_mla, out, &probe);
    } else {
      MlaForward(w.mla, mla_dims(), normed, T, &s.latents, o.absorbed_mla, out);
    }
  } else {
    ScopedPhase timer(o.profile, Phase::kKda);
    KdaForward(w.kda, kda_dims(), normed, T, s.recurrent, s.conv, o.chunked_kda, out);
  }
  s.tokens += T;
  return Status::Ok();
}

Status Model::RunFfn(int l, std::int64_t T, const float* normed, const ForwardOptions& o, float* out) const {
  const LayerWeights& w = layer(l);
  ScopedPhase timer(o.profile, Phase::kMoe);
  if (w.dense) {
    GluMlp(w.mlp_gate, w.mlp_up, w.mlp_down, config_.hidden_act, config_.activation_situ_beta,
           config_.activation_situ_linear_beta, normed, T, out, false);
    return Status::Ok();
  }
  Routing routing;
  TERRACE_RETURN_IF_ERROR(MoeForward(w.moe, moe_dims(), l, experts_.get(), normed, T, out, &routing));
  if (o.on_routing) o.on_routing(l, routing);
  return Status::Ok();
}

Result<Tensor> Model::Forward(std::span<const int> tokens, SequenceState* state, const ForwardOptions& o) const {
  try {
    TERRACE_ASSIGN_OR_RETURN(Tensor logits, ForwardImpl(tokens, state, o));
    for (std::size_t i = 0; i < logits.data.size(); ++i) {
      if (!std::isfinite(logits.data[i])) {
        const std::int64_t V = config_.vocab_size;
        const std::int64_t row = static_cast<std::int64_t>(i) / V;
        return Status::Corruption(fmt::format(
            "the logits are not finite ({} at prompt position {}, token id {}): the model's weights overflow fp32; "
            "the output is withheld (check the model with 'terrace model inspect')",
            std::isnan(logits.data[i]) ? "NaN" : "infinity",
            row + (o.all_logits ? 0 : static_cast<std::int64_t>(tokens.size()) - 1), static_cast<std::int64_t>(i) % V));
      }
    }
    return logits;
  } catch (const std::bad_alloc&) {
    return Status::OutOfCapacity(fmt::format("not enough memory for a forward pass over {} tokens; pass fewer tokens "
                                             "at a time", tokens.size()));
  }
}

Result<Routing> Model::PredictRouting(int l, std::span<const float> hidden, std::int64_t T) const {
  if (l < 0 || l >= config_.num_hidden_layers)
    return Status::InvalidArgument(
        fmt::format("PredictRouting: layer {} is out of range [0, {})", l, config_.num_hidden_layers));
  const LayerWeights& w = layer(l);
  if (w.dense)
    return Status::InvalidArgument(fmt::format("PredictRouting: layer {} is a dense layer (no router)", l));
  const std::int64_t d = config_.hidden_size;
  if (T < 1 || static_cast<std::int64_t>(hidden.size()) != T * d)
    return Status::InvalidArgument(fmt::format("PredictRouting: {} values for {} tokens of hidden size {} (expected {})",
                                               hidden.size(), T, d, T * d));
  Rows normed(hidden.size());
  ops::RmsNorm(hidden.data(), T, d, w.post_norm.ptr(), config_.rms_norm_eps, normed.data());
  Routing r;
  Route(w.moe, moe_dims(), normed.data(), T, &r);
  return r;
}

Result<Routing> Model::PredictRoutingAttnRes(int target, const AttnResView& v) const {
  const int bs = config_.attn_res_block_size;
  if (bs <= 0)
    return Status::InvalidArgument("PredictRoutingAttnRes: the model has no Block AttnRes (attn_res_block_size 0); "
                                   "use PredictRouting");
  if (v.model != this)
    return Status::InvalidArgument("PredictRoutingAttnRes: the view is of another model's forward pass");
  if (target < 0 || target >= config_.num_hidden_layers)
    return Status::InvalidArgument(
        fmt::format("PredictRoutingAttnRes: layer {} is out of range [0, {})", target, config_.num_hidden_layers));
  if (v.layer < -1 || v.layer > target)
    return Status::InvalidArgument(
        fmt::format("PredictRoutingAttnRes: the view is of layer {}, after target layer {}", v.layer, target));
  const LayerWeights& w = layer(target);
  if (w.dense)
    return Status::InvalidArgument(fmt::format("PredictRoutingAttnRes: layer {} is a dense layer (no router)", target));
  const std::int64_t d = config_.hidden_size, T = v.tokens;
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(T, 0) * d);
  // Layer -1 (on_embedding): the bank is [embedding] and there is no partial sum yet.
  const bool at_embedding = v.layer == -1;
  if (at_embedding && (v.bank.size() != 1 || !v.partial.empty()))
    return Status::InvalidArgument(fmt::format(
        "PredictRoutingAttnRes: a layer -1 (embedding) view has a bank of one block and no partial sum (got {} "
        "blocks and {} values)", v.bank.size(), v.partial.size()));
  bool sizes_ok = T >= 1 && (at_embedding || v.partial.size() == n) && !v.bank.empty();
  for (const auto& b : v.bank) sizes_ok = sizes_ok && b.size() == n;
  if (!sizes_ok)
    return Status::InvalidArgument(fmt::format(
        "PredictRoutingAttnRes: the view's bank ({} blocks) and partial sum ({} values) do not all hold {} tokens of "
        "hidden size {}", v.bank.size(), v.partial.size(), T, d));
  std::vector<const float*> sources;
  sources.reserve(v.bank.size() + static_cast<std::size_t>(target - v.layer) + 1);
  for (const auto& b : v.bank) sources.push_back(b.data());
  // Replay the bank pushes of layers v.layer + 1 .. target; their own updates are unknown (taken as zero).
  // Layer 0's push (k = 0) is already in a layer -1 view's bank, and there is no partial sum to push.
  const float* partial = at_embedding ? nullptr : v.partial.data();
  for (int k = v.layer + 1; k <= target; ++k) {
    if (k % bs != 0) continue;
    if (partial) sources.push_back(partial);
    partial = nullptr;
  }
  if (partial) sources.push_back(partial);
  Rows h(n), normed(n);
  AttnResMix(sources, T, d, w.mlp_res_w.ptr(), w.mlp_res_n.ptr(), h.data());
  ops::RmsNorm(h.data(), T, d, w.post_norm.ptr(), config_.rms_norm_eps, normed.data());
  Routing r;
  Route(w.moe, moe_dims(), normed.data(), T, &r);
  return r;
}

Result<Tensor> Model::ForwardImpl(std::span<const int> tokens, SequenceState* state, const ForwardOptions& o) const {
  const std::int64_t T = static_cast<std::int64_t>(tokens.size()), d = config_.hidden_size;
  if (T == 0) return Status::InvalidArgument("no input tokens; pass at least one token id");
  if (state->num_layers() != config_.num_hidden_layers)
    return Status::InvalidArgument(fmt::format("the sequence state has {} layers but the model has {}; create it with "
                                               "SequenceState::ForConfig(model.config())",
                                               state->num_layers(), config_.num_hidden_layers));
  for (std::int64_t t = 0; t < T; ++t) {
    const int id = tokens[static_cast<std::size_t>(t)];
    if (id < 0 || id >= config_.vocab_size)
      return Status::InvalidArgument(
          fmt::format("token id {} at position {} is outside the vocabulary [0, {})", id, t, config_.vocab_size));
  }
  const auto n = static_cast<std::size_t>(T * d);
  Rows hidden(n), prefix, h, normed(n), a(n), f(n);
  {
    ScopedPhase timer(o.profile, Phase::kOther);
    for (std::int64_t t = 0; t < T; ++t)
      std::copy_n(embed_.ptr() + static_cast<std::int64_t>(tokens[static_cast<std::size_t>(t)]) * d, d, &hidden[static_cast<std::size_t>(t * d)]);
  }
  const int bs = config_.attn_res_block_size;
  std::vector<Rows> bank;  // per forward pass only (docs/model.md, "Block Attention Residuals")
  bank.reserve(static_cast<std::size_t>(config_.AttnResBankBlocks()));
  std::vector<std::span<const float>> bank_spans;  // the hooks' AttnResView::bank
  if (o.on_embedding) {
    if (bs > 0) {
      // Layer 0 pushes the embedding into the bank first thing: publish the bank as [embedding].
      bank_spans.assign(1, std::span<const float>(hidden));
      const AttnResView view{this, -1, T, bank_spans, {}};
      ScopedAttnResView scoped(view);
      o.on_embedding(hidden, T);
    } else {
      o.on_embedding(hidden, T);
    }
  }
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    const LayerWeights& w = layer(l);
    if (o.on_layer_begin) TERRACE_RETURN_IF_ERROR(o.on_layer_begin(l, T));
    if (bs > 0) {
      prefix = hidden;
      bool has_prefix = true;
      if (bank.empty()) {
        h = prefix;
      } else {
        Mix(bank, prefix, T, d, w.attn_res_w, w.attn_res_n, &h, o.profile);
      }
      if (l % bs == 0) {
        bank.push_back(prefix);
        has_prefix = false;
      }
      {
        ScopedPhase timer(o.profile, Phase::kOther);
        ops::RmsNorm(h.data(), T, d, w.input_norm.ptr(), config_.rms_norm_eps, normed.data());
      }
      TERRACE_RETURN_IF_ERROR(RunLayer(l, T, normed.data(), state, o, a.data()));
      if (has_prefix) {
        for (std::size_t i = 0; i < n; ++i) prefix[i] += a[i];
      } else {
        prefix = a;
      }
      Mix(bank, prefix, T, d, w.mlp_res_w, w.mlp_res_n, &h, o.profile);
      if (o.on_ffn_input) {
        ScopedAttnResView view(this, l, T, bank, prefix, &bank_spans);
        o.on_ffn_input(l, h, T);
      }
      {
        ScopedPhase timer(o.profile, Phase::kOther);
        ops::RmsNorm(h.data(), T, d, w.post_norm.ptr(), config_.rms_norm_eps, normed.data());
      }
      TERRACE_RETURN_IF_ERROR(RunFfn(l, T, normed.data(), o, f.data()));
      for (std::size_t i = 0; i < n; ++i) hidden[i] = prefix[i] + f[i];
      if (o.on_layer_end) {
        ScopedAttnResView view(this, l, T, bank, hidden, &bank_spans);
        o.on_layer_end(l, hidden, T);
      }
    } else {
      {
        ScopedPhase timer(o.profile, Phase::kOther);
        ops::RmsNorm(hidden.data(), T, d, w.input_norm.ptr(), config_.rms_norm_eps, normed.data());
      }
      TERRACE_RETURN_IF_ERROR(RunLayer(l, T, normed.data(), state, o, a.data()));
      for (std::size_t i = 0; i < n; ++i) hidden[i] += a[i];
      if (o.on_ffn_input) o.on_ffn_input(l, hidden, T);
      {
        ScopedPhase timer(o.profile, Phase::kOther);
        ops::RmsNorm(hidden.data(), T, d, w.post_norm.ptr(), config_.rms_norm_eps, normed.data());
      }
      TERRACE_RETURN_IF_ERROR(RunFfn(l, T, normed.data(), o, f.data()));
      for (std::size_t i = 0; i < n; ++i) hidden[i] += f[i];
      if (o.on_layer_end) o.on_layer_end(l, hidden, T);
    }
  }
  if (bs > 0) {
    Mix(bank, hidden, T, d, out_res_w_, out_res_n_, &h, o.profile);
  } else {
    h = hidden;
  }
  ScopedPhase timer(o.profile, Phase::kOther);
  const std::int64_t first = o.all_logits ? 0 : T - 1;
  const std::int64_t rows = T - first;
  ops::RmsNorm(h.data() + first * d, rows, d, final_norm_.ptr(), config_.rms_norm_eps, normed.data());
  Tensor logits({rows, static_cast<std::int64_t>(config_.vocab_size)});
  if (rows == 1 && !lm_head_bf16_.empty()) {
    ops::Bf16Gemv(normed.data(), d, lm_head_bf16_.data(), config_.vocab_size, logits.ptr(), false);
  } else {
    ops::Linear(normed.data(), rows, d, lm_head_.ptr(), config_.vocab_size, logits.ptr());
  }
  return logits;
}

}  // namespace terrace::model
