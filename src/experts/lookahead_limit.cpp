#include "src/experts/lookahead_limit.h"

#include <algorithm>
#include <cmath>

namespace terrace::experts {

Result<LookaheadLimit> MeasureLookaheadLimit(const model::Model& m, const std::vector<int>& prompt, int decode) {
  const model::ModelConfig& c = m.config();
  const int L = c.num_hidden_layers;
  std::vector<std::vector<float>> after(static_cast<std::size_t>(L));  // hidden leaving layer l, this step
  std::vector<double> tp_la(static_cast<std::size_t>(L), 0), tp_true(static_cast<std::size_t>(L), 0),
      tp_emb(static_cast<std::size_t>(L), 0),
      routed(static_cast<std::size_t>(L), 0), ratio_sum(static_cast<std::size_t>(L), 0), ratio_n(static_cast<std::size_t>(L), 0),
      layer_sum(static_cast<std::size_t>(L), 0);
  std::vector<std::vector<int>> pred_la(static_cast<std::size_t>(L)), pred_true(static_cast<std::size_t>(L)),
      pred_emb(static_cast<std::size_t>(L));
  bool measuring = false;
  Status failed;
  auto distinct = [](std::vector<int> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  };
  model::ForwardOptions o;
  o.on_embedding = [&](std::span<const float> h, std::int64_t T) {
    if (!measuring) return;
    // With AttnRes too: the mix over [embedding] is the embedding (PredictRoutingAttnRes from the
    // layer -1 view equals this bit for bit, include/terrace/model.h).
    for (int l = 0; l < L; ++l) {
      if (c.IsDenseLayer(l)) continue;
      auto r = m.PredictRouting(l, h, T);
      if (!r.ok()) {
        failed = r.status();
        return;
      }
      pred_emb[static_cast<std::size_t>(l)] = distinct(r->ids);
    }
  };
  o.on_layer_end = [&](int l, std::span<const float> h, std::int64_t T) {
    if (measuring && l > 0 && !c.IsDenseLayer(l)) {
      const auto& prev = after[static_cast<std::size_t>(l - 1)];
      double du = 0, hn = 0;
      for (std::size_t i = 0; i < h.size() && i < prev.size(); ++i) {
        du += (h[i] - prev[i]) * static_cast<double>(h[i] - prev[i]);
        hn += static_cast<double>(prev[i]) * prev[i];
      }
      layer_sum[static_cast<std::size_t>(l)] += hn > 0 ? std::sqrt(du / hn) : 0;
    }
    after[static_cast<std::size_t>(l)].assign(h.begin(), h.end());
    // The lookahead prediction for the next layer, formed as the predictor forms it: on a Block
    // AttnRes model from the bank and partial sum the forward pass publishes, else from h.
    const int next = l + 1;
    if (!measuring || next >= L || c.IsDenseLayer(next)) return;
    const model::AttnResView* view = model::Model::CurrentAttnResView();
    auto la = (c.attn_res_block_size > 0 && view != nullptr) ? m.PredictRoutingAttnRes(next, *view)
                                                             : m.PredictRouting(next, h, T);
    if (!la.ok()) {
      failed = la.status();
      return;
    }
    pred_la[static_cast<std::size_t>(next)] = distinct(la->ids);
  };
  o.on_ffn_input = [&](int l, std::span<const float> h, std::int64_t T) {
    if (!measuring || l == 0 || c.IsDenseLayer(l)) return;
    const auto& prev = after[static_cast<std::size_t>(l - 1)];
    auto tr = m.PredictRouting(l, h, T);
    if (!tr.ok()) {
      failed = tr.status();
      return;
    }
    pred_true[static_cast<std::size_t>(l)] = distinct(tr->ids);
    double du = 0, hn = 0;
    for (std::size_t i = 0; i < h.size() && i < prev.size(); ++i) {
      du += (h[i] - prev[i]) * static_cast<double>(h[i] - prev[i]);
      hn += static_cast<double>(prev[i]) * prev[i];
    }
    ratio_sum[static_cast<std::size_t>(l)] += hn > 0 ? std::sqrt(du / hn) : 0;
    ratio_n[static_cast<std::size_t>(l)] += 1;
  };
  o.on_routing = [&](int l, const model::Routing& r) {
    if (!measuring || l == 0) return;
    const std::vector<int> actual = distinct(r.ids);
    auto hits = [&](const std::vector<int>& p) {
      double n = 0;
      for (int e : actual) n += std::binary_search(p.begin(), p.end(), e) ? 1 : 0;
      return n;
    };
    tp_la[static_cast<std::size_t>(l)] += hits(pred_la[static_cast<std::size_t>(l)]);
    tp_true[static_cast<std::size_t>(l)] += hits(pred_true[static_cast<std::size_t>(l)]);
    tp_emb[static_cast<std::size_t>(l)] += hits(pred_emb[static_cast<std::size_t>(l)]);
    routed[static_cast<std::size_t>(l)] += static_cast<double>(actual.size());
  };
  model::Session s(m);
  s.set_hooks(o);
  TERRACE_RETURN_IF_ERROR(s.Prefill(prompt).status());
  measuring = true;
  for (int i = 0; i < decode; ++i) TERRACE_RETURN_IF_ERROR(s.Decode(model::Argmax(s.last_logits())).status());
  TERRACE_RETURN_IF_ERROR(failed);
  LookaheadLimit out;
  for (int l = 1; l < L; ++l) {
    if (c.IsDenseLayer(l) || routed[static_cast<std::size_t>(l)] == 0) continue;
    out.layers.push_back(l);
    out.recall_lookahead.push_back(tp_la[static_cast<std::size_t>(l)] / routed[static_cast<std::size_t>(l)]);
    out.recall_true_input.push_back(tp_true[static_cast<std::size_t>(l)] / routed[static_cast<std::size_t>(l)]);
    out.recall_embedding.push_back(tp_emb[static_cast<std::size_t>(l)] / routed[static_cast<std::size_t>(l)]);
    out.update_ratio.push_back(ratio_sum[static_cast<std::size_t>(l)] / std::max(ratio_n[static_cast<std::size_t>(l)], 1.0));
    out.layer_update_ratio.push_back(layer_sum[static_cast<std::size_t>(l)] / std::max(ratio_n[static_cast<std::size_t>(l)], 1.0));
  }
  return out;
}

}  // namespace terrace::experts
