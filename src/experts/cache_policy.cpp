#include "src/experts/cache_policy.h"

#include <algorithm>
#include <limits>

namespace terrace::experts {
namespace {

class LruPolicy final : public CachePolicy {
 public:
  CachePolicyKind kind() const override { return CachePolicyKind::kLru; }
  double Score(const CacheEntryView& e, const CacheContext&) const override { return static_cast<double>(e.last_use); }
};

class LfuPolicy final : public CachePolicy {
 public:
  CachePolicyKind kind() const override { return CachePolicyKind::kLfu; }
  // Uses (exact below 2^53); EvictsBefore breaks ties by recency.
  double Score(const CacheEntryView& e, const CacheContext&) const override { return static_cast<double>(e.uses); }
};

class UtilityPolicy final : public CachePolicy {
 public:
  CachePolicyKind kind() const override { return CachePolicyKind::kUtility; }
  // P(use within window) x reload cost (seconds); recency breaks ties.
  double Score(const CacheEntryView& e, const CacheContext& ctx) const override {
    const double cost = static_cast<double>(e.bytes) * std::max(ctx.seconds_per_byte, 1e-15);
    return UseProbability(e, ctx) * cost * (1.0 + static_cast<double>(e.last_use) * 0x1p-52);
  }
  bool PrefetchMustOutscore() const override { return true; }
};

// Belady's replacement: the farther the next use, the lower the score; never used again, lowest
// (ties: EvictsBefore's least recently used). Without a known future (next_use -1, the pass that records the
// trace) it scores as lru.
class BeladyPolicy final : public CachePolicy {
 public:
  CachePolicyKind kind() const override { return CachePolicyKind::kBelady; }
  double Score(const CacheEntryView& e, const CacheContext&) const override {
    if (e.next_use < 0) return static_cast<double>(e.last_use);
    if (e.next_use == CacheEntryView::kNeverUsed) return -std::numeric_limits<double>::infinity();
    return -static_cast<double>(e.next_use);
  }
  bool PrefetchMustOutscore() const override { return true; }
};

}  // namespace

double UseProbability(const CacheEntryView& e, const CacheContext& ctx) {
  if (e.wanted >= ctx.now && e.wanted <= ctx.now + ctx.window) return std::clamp(e.wanted_confidence, 0.0, 1.0);
  const double rate = (static_cast<double>(e.uses) + 1.0) / (static_cast<double>(ctx.steps) + 2.0);
  double p = std::min(rate, 1.0);
  // Layers between now and this expert's next turn (its layer in this step or the next one).
  const std::int64_t L = std::max(ctx.num_layers, 1);
  const std::int64_t cur = ((ctx.now % L) + L) % L;
  const std::int64_t distance = (e.layer - cur + L) % L;
  if (distance > ctx.window) p *= 0.5;
  return p;
}

std::unique_ptr<CachePolicy> MakeCachePolicy(CachePolicyKind kind) {
  switch (kind) {
    case CachePolicyKind::kLfu: return std::make_unique<LfuPolicy>();
    case CachePolicyKind::kUtility: return std::make_unique<UtilityPolicy>();
    case CachePolicyKind::kBelady: return std::make_unique<BeladyPolicy>();
    case CachePolicyKind::kLru: break;
  }
  return std::make_unique<LruPolicy>();
}

}  // namespace terrace::experts
