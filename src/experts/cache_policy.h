// Fast-tier expert cache policies behind one interface: a score per resident expert, lowest
// evicted first. Internal to src/experts. Thread-safety: none (called under ExpertOffload's mutex).
#pragma once

#include <cstdint>
#include <memory>

#include "terrace/experts.h"

namespace terrace::experts {

// What a policy may look at for one resident, unpinned expert.
struct CacheEntryView {
  int layer = 0, expert = 0;
  std::uint64_t bytes = 0;
  std::uint64_t last_use = 0;   // logical clock of the last acquire (or of landing, if never used)
  std::uint64_t uses = 0;       // acquires since it entered the cache history (kept across evictions)
  std::int64_t wanted = -1;     // ordinal (step * layers + layer) of its nearest predicted use; -1: none
  double wanted_confidence = 0;
  // belady only: the position of its next acquire in the known future, ordinal * experts + expert
  // (a layer acquires its experts in ascending order); kNeverUsed: not again; -1: no known future.
  std::int64_t next_use = -1;
  static constexpr std::int64_t kNeverUsed = INT64_MAX;
};

struct CacheContext {
  std::int64_t now = 0;         // the current ordinal
  int num_layers = 0;
  int window = 2;               // layers ahead that are protected (utility)
  std::uint64_t steps = 0;      // forward steps seen
  double seconds_per_byte = 0;  // reload cost of one byte from the home tier into the fast tier
};

class CachePolicy {
 public:
  virtual ~CachePolicy() = default;
  virtual CachePolicyKind kind() const = 0;
  // Lower is evicted first (EvictsBefore: ties to the least recently used). Must be a pure function
  // of its arguments.
  virtual double Score(const CacheEntryView& e, const CacheContext& ctx) const = 0;
  // True when a prefetch may evict only an expert that scores below the one it brings in (the
  // score is a value of keeping it: utility, belady); false when scores only order victims.
  virtual bool PrefetchMustOutscore() const { return false; }
};

std::unique_ptr<CachePolicy> MakeCachePolicy(CachePolicyKind kind);

// The eviction order: `a` (scored `score_a`) goes before `b` (scored `score_b`) when it scores lower;
// equal scores go to the least recently used (then to the caller's slot order).
inline bool EvictsBefore(double score_a, const CacheEntryView& a, double score_b, const CacheEntryView& b) {
  return score_a < score_b || (score_a == score_b && a.last_use < b.last_use);
}

// The utility policy's estimate that `e` is used within the next ctx.window layers (exposed for
// tests): its prediction's confidence when one falls in the window, else its per-step use rate
// (Laplace-smoothed), halved when its layer does not run within the window.
double UseProbability(const CacheEntryView& e, const CacheContext& ctx);

}  // namespace terrace::experts
