// PredictionScorer: precision and recall of predictions against the routing that followed.
#include <algorithm>

#include "terrace/experts.h"

namespace terrace::experts {

namespace {
// part / whole; nullopt when whole is 0 (the ratio is undefined).
std::optional<double> Ratio(std::uint64_t part, std::uint64_t whole) {
  if (whole == 0) return std::nullopt;
  return static_cast<double>(part) / static_cast<double>(whole);
}
}  // namespace

std::optional<double> PredictionCounts::precision_if_defined() const {
  return Ratio(true_positive, true_positive + false_positive);
}

std::optional<double> PredictionCounts::recall_if_defined() const {
  return Ratio(true_positive, true_positive + false_negative);
}

PredictionScorer::PredictionScorer(int num_layers) : layers_(static_cast<std::size_t>(std::max(num_layers, 0))) {}

void PredictionScorer::Predict(const Prediction& p) {
  if (p.layer < 0 || p.layer >= num_layers() || p.experts.empty()) return;
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& s) { return s.first == p.step; });
  if (it == pending_.end()) {
    pending_.emplace_back(p.step, std::vector<std::vector<int>>(layers_.size()));
    it = pending_.end() - 1;
  }
  std::vector<int>& set = it->second[static_cast<std::size_t>(p.layer)];
  set.insert(set.end(), p.experts.begin(), p.experts.end());
  std::sort(set.begin(), set.end());
  set.erase(std::unique(set.begin(), set.end()), set.end());
}

void PredictionScorer::Observe(std::int64_t step, int layer, std::span<const int> actual_in) {
  if (layer < 0 || layer >= num_layers()) return;
  std::vector<int> actual(actual_in.begin(), actual_in.end());
  std::sort(actual.begin(), actual.end());
  actual.erase(std::unique(actual.begin(), actual.end()), actual.end());
  std::vector<int> predicted;
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& s) { return s.first == step; });
  if (it != pending_.end()) predicted = std::move(it->second[static_cast<std::size_t>(layer)]);
  std::vector<int> both;
  std::set_intersection(predicted.begin(), predicted.end(), actual.begin(), actual.end(), std::back_inserter(both));
  PredictionCounts& c = layers_[static_cast<std::size_t>(layer)];
  c.true_positive += both.size();
  c.false_positive += predicted.size() - both.size();
  c.false_negative += actual.size() - both.size();
  // Steps before this one can receive no more routing: forget them.
  std::erase_if(pending_, [&](const auto& s) { return s.first < step; });
}

PredictionCounts PredictionScorer::total() const {
  PredictionCounts t;
  for (const auto& c : layers_) {
    t.true_positive += c.true_positive;
    t.false_positive += c.false_positive;
    t.false_negative += c.false_negative;
  }
  return t;
}

}  // namespace terrace::experts
