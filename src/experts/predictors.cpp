// The predictors: none, lookahead (the next layers' routers on the current hidden state, or with
// Block AttnRes on the mix those routers will read, as far as it is known after this layer; at
// token start the first MoE layers' routers on the embedding),
// statistical (online transition counts) and oracle (a recorded trace of the same run).
#include <algorithm>
#include <limits>
#include <numeric>

#include "terrace/experts.h"

namespace terrace::experts {
namespace {

std::vector<int> Distinct(std::span<const int> ids) {
  std::vector<int> v(ids.begin(), ids.end());
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

double Precision(const std::vector<int>& predicted, std::span<const int> actual_sorted) {
  if (predicted.empty()) return 0.0;
  std::size_t tp = 0;
  for (int e : predicted) tp += std::binary_search(actual_sorted.begin(), actual_sorted.end(), e) ? 1 : 0;
  return static_cast<double>(tp) / static_cast<double>(predicted.size());
}

}  // namespace

double LookaheadOptions::RankThreshold(double share) const {
  if (busy_rank_precision <= 0 || busy_rank_precision <= min_rank_precision) return min_rank_precision;
  const double t = std::clamp((share - kBusyGateFrom) / (1.0 - kBusyGateFrom), 0.0, 1.0);
  return min_rank_precision + t * (busy_rank_precision - min_rank_precision);
}

namespace {

class NonePredictor final : public Predictor {
 public:
  std::string_view name() const override { return "none"; }
};

// Running precision per distance j gates the depth (LookaheadOptions::min_confidence).
class LookaheadPredictor final : public Predictor {
 public:
  LookaheadPredictor(const model::Model& model, const LookaheadOptions& o)
      : model_(model), options_(o), confidence_(static_cast<std::size_t>(std::max(o.depth, 1)) + 1, 1.0) {}
  std::string_view name() const override { return "lookahead"; }

  void OnLayerEnd(std::int64_t step, int layer, std::span<const float> hidden, std::int64_t tokens,
                  std::vector<Prediction>* out) override {
    const model::ModelConfig& c = model_.config();
    // Block AttnRes: the bank and partial sum of this very hook (the forward pass publishes them
    // while on_layer_end runs); without them (a call from outside the hook) the plain form.
    const model::AttnResView* attn_res = c.attn_res_block_size > 0 ? model::Model::CurrentAttnResView() : nullptr;
    if (attn_res && (attn_res->model != &model_ || attn_res->layer != layer || attn_res->tokens != tokens ||
                     attn_res->partial.data() != hidden.data() || attn_res->partial.size() != hidden.size()))
      attn_res = nullptr;
    // Distance j counts MoE layers: a dense layer in between is not one of the depth.
    for (int target = layer + 1, j = 1; j <= options_.depth && target < c.num_hidden_layers; ++target) {
      if (c.IsDenseLayer(target)) continue;
      const double conf = confidence_[static_cast<std::size_t>(j)];
      if (j > 1 && conf < options_.min_confidence && step % 8 != 0) break;
      auto r = attn_res ? model_.PredictRoutingAttnRes(target, *attn_res) : model_.PredictRouting(target, hidden, tokens);
      if (!r.ok()) break;
      // Nearer than any earlier prediction of this target (from the embedding or an earlier layer).
      Prediction p{step, target, {}, conf, options_.supersede, options_.provisional && j > 1};
      Emit(std::move(p), *r, j, out);
      ++j;
    }
  }

  // From the embedding: the first embedding_depth MoE layers, each gated by its own precision.
  void OnTokenStart(std::int64_t step, std::span<const float> embedding, std::int64_t tokens,
                    std::vector<Prediction>* out) override {
    // On a Block AttnRes model the mix over the bank [embedding] is the embedding itself:
    // PredictRoutingAttnRes from the layer -1 view equals PredictRouting on the embedding bit for
    // bit (include/terrace/model.h), so one call serves both kinds of model.
    const model::ModelConfig& c = model_.config();
    int j = 0;
    for (int target = 0; target < c.num_hidden_layers && j < options_.embedding_depth; ++target) {
      if (c.IsDenseLayer(target)) continue;
      const double conf = embedding_confidence_[static_cast<std::size_t>(j)];
      if (conf < options_.min_confidence && step % 8 != 0) break;
      auto r = model_.PredictRouting(target, embedding, tokens);
      if (!r.ok()) break;
      Emit(Prediction{step, target, {}, conf}, *r, -1 - j, out);
      ++j;
    }
  }

  void OnLoadBusyShare(double share) override { threshold_ = options_.RankThreshold(share); }

  void OnRouting(std::int64_t step, int layer, std::span<const int> experts, std::vector<Prediction>*) override {
    for (auto it = issued_.begin(); it != issued_.end();) {
      if (it->step == step && it->layer == layer) {
        double& c = it->distance < 0 ? embedding_confidence_[static_cast<std::size_t>(-1 - it->distance)]
                                     : confidence_[static_cast<std::size_t>(it->distance)];
        c = 0.8 * c + 0.2 * Precision(it->experts, experts);
        // Every candidate's rank is scored, also those left out of the prediction (so a rank can
        // come back once its precision recovers).
        std::vector<double>& rp = RankPrecision(it->distance);
        for (std::size_t k = 0; k < it->experts.size(); ++k) {
          const std::size_t rank = static_cast<std::size_t>(it->ranks[k]);
          if (rank >= rp.size()) continue;
          const bool used = std::binary_search(experts.begin(), experts.end(), it->experts[k]);
          rp[rank] = 0.9 * rp[rank] + 0.1 * (used ? 1.0 : 0.0);
        }
        it = issued_.erase(it);
      } else if (it->step < step) {
        it = issued_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  struct Issued {
    std::int64_t step;
    int layer, distance;  // distance -1 - j: the embedding's j-th target
    std::vector<int> experts;  // every candidate (the router's top-k), ascending
    std::vector<int> ranks;    // [k]: experts[k]'s best rank in its token's top-k (0: the highest score)
  };

  // The running precision of each top-k rank of predictions made at `distance` (as in Issued).
  std::vector<double>& RankPrecision(int distance) {
    const std::size_t slot = distance < 0 ? static_cast<std::size_t>(options_.depth + 1 + (-1 - distance))
                                          : static_cast<std::size_t>(distance);
    if (rank_precision_.size() <= slot) rank_precision_.resize(slot + 1);
    std::vector<double>& v = rank_precision_[slot];
    if (v.empty()) v.assign(static_cast<std::size_t>(std::max<std::int64_t>(model_.config().num_experts_per_token, 1)), 1.0);
    return v;
  }

  // Records the candidates of `r` (the router's choice at `distance`) and emits `p` with those
  // whose rank's running precision is >= the threshold (min_rank_precision, raised with the
  // drive's busy share by busy_rank_precision; all of them every 8th step, and when
  // min_rank_precision is 0); nothing when none passes.
  void Emit(Prediction p, const model::Routing& r, int distance, std::vector<Prediction>* out) {
    Issued is{p.step, p.layer, distance, Distinct(r.ids), {}};
    is.ranks.assign(is.experts.size(), std::numeric_limits<int>::max());
    const std::int64_t k = std::max<std::int64_t>(r.top_k, 1);
    for (std::size_t i = 0; i < r.ids.size(); ++i) {
      const auto pos = std::lower_bound(is.experts.begin(), is.experts.end(), r.ids[i]) - is.experts.begin();
      int& rank = is.ranks[static_cast<std::size_t>(pos)];
      rank = std::min(rank, static_cast<int>(static_cast<std::int64_t>(i) % k));
    }
    const std::vector<double>& rp = RankPrecision(distance);
    const bool filter = threshold_ > 0 && p.step % 8 != 0;
    for (std::size_t i = 0; i < is.experts.size(); ++i) {
      const std::size_t rank = static_cast<std::size_t>(is.ranks[i]);
      if (!filter || rank >= rp.size() || rp[rank] >= threshold_) p.experts.push_back(is.experts[i]);
    }
    issued_.push_back(std::move(is));
    if (!p.experts.empty()) out->push_back(std::move(p));
  }
  const model::Model& model_;
  LookaheadOptions options_;
  double threshold_ = options_.min_rank_precision;  // the rank gate's, at the last busy share
  std::vector<double> confidence_;  // [distance]
  std::vector<double> embedding_confidence_ =
      std::vector<double>(static_cast<std::size_t>(std::max(options_.embedding_depth, 0)) + 1, 1.0);  // [j]
  std::vector<Issued> issued_;
  // [distance 1..depth, then depth + 1 + j for the embedding's j-th target][rank]
  std::vector<std::vector<double>> rank_precision_;
};

// counts_[l][a * E + b]: times expert b of layer `next(l)` followed expert a of layer l in one step;
// token_[l][a * E + b]: times expert b of layer l followed expert a of layer l in the previous step.
class StatisticalPredictor final : public Predictor {
 public:
  StatisticalPredictor(const model::ModelConfig& c, int depth)
      : L_(c.num_hidden_layers), E_(c.num_experts), depth_(std::max(depth, 1)),
        layer_(static_cast<std::size_t>(L_)), token_(static_cast<std::size_t>(L_)),
        freq_(static_cast<std::size_t>(L_)), last_(static_cast<std::size_t>(L_)), moe_(static_cast<std::size_t>(L_)) {
    for (int l = 0; l < L_; ++l) {
      moe_[static_cast<std::size_t>(l)] = !c.IsDenseLayer(l) && E_ > 0;
      if (!moe_[static_cast<std::size_t>(l)]) continue;
      layer_[static_cast<std::size_t>(l)].assign(static_cast<std::size_t>(E_ * E_), 0);
      token_[static_cast<std::size_t>(l)].assign(static_cast<std::size_t>(E_ * E_), 0);
      freq_[static_cast<std::size_t>(l)].assign(static_cast<std::size_t>(E_), 0);
    }
  }
  std::string_view name() const override { return "statistical"; }

  void OnRouting(std::int64_t step, int layer, std::span<const int> experts, std::vector<Prediction>* out) override {
    if (layer < 0 || layer >= L_ || !moe_[static_cast<std::size_t>(layer)]) return;
    const std::size_t l = static_cast<std::size_t>(layer);
    // Precision of what we predicted for this layer feeds the confidence we attach.
    for (auto it = issued_.begin(); it != issued_.end();) {
      if (it->first == step * L_ + layer) {
        confidence_ = 0.8 * confidence_ + 0.2 * Precision(it->second, experts);
        it = issued_.erase(it);
      } else if (it->first < step * L_ + layer) {
        it = issued_.erase(it);
      } else {
        ++it;
      }
    }
    // Learn: previous MoE layer of this step -> this layer; this layer last step -> now.
    if (prev_step_ == step && prev_layer_ >= 0) {
      auto& m = layer_[static_cast<std::size_t>(prev_layer_)];
      for (int a : last_[static_cast<std::size_t>(prev_layer_)])
        for (int b : experts) ++m[static_cast<std::size_t>(a * E_ + b)];
    }
    if (last_step_of_[l] == step - 1) {
      auto& m = token_[l];
      for (int a : last_[l])
        for (int b : experts) ++m[static_cast<std::size_t>(a * E_ + b)];
    }
    for (int b : experts) ++freq_[l][static_cast<std::size_t>(b)];
    last_[l].assign(experts.begin(), experts.end());
    last_step_of_[l] = step;
    prev_step_ = step;
    prev_layer_ = layer;

    // Predict the next depth_ MoE layers (wrapping into the next step with token counts only).
    std::vector<int> from(experts.begin(), experts.end());
    std::int64_t ord = step * L_ + layer;
    int from_layer = layer;
    for (int j = 0; j < depth_; ++j) {
      std::int64_t o = ord + 1;
      while (!moe_[static_cast<std::size_t>(o % L_)]) ++o;
      if (o - (step * L_ + layer) > L_) break;
      const int target = static_cast<int>(o % L_);
      const std::int64_t tstep = o / L_;
      std::vector<double> score(static_cast<std::size_t>(E_), 0.0);
      const auto& f = freq_[static_cast<std::size_t>(target)];
      const double ftot = std::max<double>(1.0, std::accumulate(f.begin(), f.end(), 0.0));
      for (int b = 0; b < E_; ++b) score[static_cast<std::size_t>(b)] = 1e-3 * f[static_cast<std::size_t>(b)] / ftot;
      if (tstep == step && from_layer >= 0) {
        AddRows(layer_[static_cast<std::size_t>(from_layer)], from, &score);
      }
      if (last_step_of_[static_cast<std::size_t>(target)] == tstep - 1) {
        AddRows(token_[static_cast<std::size_t>(target)], last_[static_cast<std::size_t>(target)], &score);
      }
      const std::size_t m = std::min<std::size_t>(std::max<std::size_t>(experts.size(), 1), static_cast<std::size_t>(E_));
      std::vector<int> order(static_cast<std::size_t>(E_));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(m), order.end(), [&](int a, int b) {
        return score[static_cast<std::size_t>(a)] > score[static_cast<std::size_t>(b)] ||
               (score[static_cast<std::size_t>(a)] == score[static_cast<std::size_t>(b)] && a < b);
      });
      std::vector<int> pick;
      for (std::size_t i = 0; i < m; ++i)
        if (score[static_cast<std::size_t>(order[i])] > 0) pick.push_back(order[i]);
      std::sort(pick.begin(), pick.end());
      if (pick.empty()) break;
      issued_.emplace_back(o, pick);
      out->push_back(Prediction{tstep, target, pick, confidence_});
      from = pick;
      from_layer = tstep == step ? target : -1;
      ord = o;
    }
  }

 private:
  void AddRows(const std::vector<std::uint32_t>& m, const std::vector<int>& rows, std::vector<double>* score) const {
    for (int a : rows) {
      double tot = 0;
      for (int b = 0; b < E_; ++b) tot += m[static_cast<std::size_t>(a * E_ + b)];
      if (tot == 0) continue;
      for (int b = 0; b < E_; ++b) (*score)[static_cast<std::size_t>(b)] += m[static_cast<std::size_t>(a * E_ + b)] / tot;
    }
  }

  int L_, E_, depth_;
  std::vector<std::vector<std::uint32_t>> layer_, token_, freq_;
  std::vector<std::vector<int>> last_;
  std::vector<std::int64_t> last_step_of_ = std::vector<std::int64_t>(static_cast<std::size_t>(L_), -2);
  std::vector<bool> moe_;
  std::int64_t prev_step_ = -1;
  int prev_layer_ = -1;
  double confidence_ = 0.5;
  std::vector<std::pair<std::int64_t, std::vector<int>>> issued_;  // ordinal -> predicted
};

// The MoE layers are those the trace routes in some step; depth counts them, across step
// boundaries: after a step's last MoE layer come the next step's first.
class OraclePredictor final : public Predictor {
 public:
  OraclePredictor(std::shared_ptr<const RoutingTrace> trace, int depth) : trace_(std::move(trace)), depth_(depth) {
    if (!trace_ || trace_->num_layers <= 0) return;
    moe_.assign(static_cast<std::size_t>(trace_->num_layers), false);
    for (const auto& step : trace_->steps)
      for (std::size_t l = 0; l < step.size() && l < moe_.size(); ++l) moe_[l] = moe_[l] || !step[l].empty();
  }
  std::string_view name() const override { return "oracle"; }
  std::shared_ptr<const RoutingTrace> known_future() const override { return trace_; }
  void OnRouting(std::int64_t step, int layer, std::span<const int>, std::vector<Prediction>* out) override {
    PredictAfter(Ordinal(step, layer), out);
  }
  // Before layer 0 of `step`: its first MoE layers, which no routing of this step precedes.
  void OnTokenStart(std::int64_t step, std::span<const float>, std::int64_t, std::vector<Prediction>* out) override {
    PredictAfter(Ordinal(step, 0) - 1, out);
  }

 private:
  std::int64_t Ordinal(std::int64_t step, int layer) const { return step * static_cast<std::int64_t>(moe_.size()) + layer; }
  // The recorded experts of the next depth_ MoE layers after ordinal `from` (step x layers + layer),
  // as far as the trace reaches.
  void PredictAfter(std::int64_t from, std::vector<Prediction>* out) const {
    if (moe_.empty()) return;
    const auto L = static_cast<std::int64_t>(moe_.size());
    const auto steps = static_cast<std::int64_t>(trace_->steps.size());
    int found = 0;
    for (std::int64_t o = from + 1; found < depth_ && o / L < steps; ++o) {
      const auto t = static_cast<std::size_t>(o % L);
      if (!moe_[t]) continue;
      ++found;
      const auto& layers = trace_->steps[static_cast<std::size_t>(o / L)];
      if (t < layers.size() && !layers[t].empty()) out->push_back(Prediction{o / L, static_cast<int>(t), layers[t], 1.0});
    }
  }
  std::shared_ptr<const RoutingTrace> trace_;
  int depth_;
  std::vector<bool> moe_;  // [layer]: routed in some step of the trace
};

}  // namespace

std::unique_ptr<Predictor> MakeNonePredictor() { return std::make_unique<NonePredictor>(); }
std::unique_ptr<Predictor> MakeLookaheadPredictor(const model::Model& model, const LookaheadOptions& options) {
  return std::make_unique<LookaheadPredictor>(model, options);
}
std::unique_ptr<Predictor> MakeStatisticalPredictor(const model::ModelConfig& config, int depth) {
  return std::make_unique<StatisticalPredictor>(config, depth);
}
std::unique_ptr<Predictor> MakeOraclePredictor(std::shared_ptr<const RoutingTrace> trace, int depth) {
  return std::make_unique<OraclePredictor>(std::move(trace), depth);
}

}  // namespace terrace::experts
