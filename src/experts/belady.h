// Belady's optimal replacement (MIN) over a recorded routing trace, offline: the fewest experts
// any demand-paged cache of a given size must load for a run (docs/experts.md, "The belady
// policy"). Used by `terrace bench experts` for its Belady bound. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "terrace/experts.h"

namespace terrace::experts {

struct BeladyMisses {
  std::vector<std::uint64_t> step_misses;  // [step] loads in that step
  // Misses in steps >= `first` (e.g. 1: the decode steps after a prefill at step 0).
  std::uint64_t From(std::size_t first) const;
};

// Replays `trace` as the forward pass acquires experts (step by step, layer by layer, each layer's
// experts in ascending order, one at a time) through a cache of `capacity` experts that starts
// empty: an acquire of an expert not cached is a miss and loads it; when the cache is full, the
// cached expert whose next acquire is farthest ahead (never again first) is evicted. No
// demand-paged policy misses less on the same trace and capacity (capacity 0: every acquire misses).
// When every step touches each expert at most once (true of any trace ExpertOffload records), every
// demand-paged cache misses exactly the distinct experts of step 0, so From(1) is also the fewest
// misses any demand-paged cache can have in the later steps.
BeladyMisses SimulateBelady(const RoutingTrace& trace, std::uint64_t capacity);

}  // namespace terrace::experts
