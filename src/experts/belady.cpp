#include "src/experts/belady.h"

#include <iterator>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>

namespace terrace::experts {

std::uint64_t BeladyMisses::From(std::size_t first) const {
  std::uint64_t n = 0;
  for (std::size_t s = first; s < step_misses.size(); ++s) n += step_misses[s];
  return n;
}

BeladyMisses SimulateBelady(const RoutingTrace& trace, std::uint64_t capacity) {
  // The reference string: (step, expert key) per acquire, in acquire order.
  struct Ref {
    std::size_t step;
    std::uint64_t key;  // layer << 32 | expert
  };
  std::vector<Ref> refs;
  for (std::size_t s = 0; s < trace.steps.size(); ++s)
    for (std::size_t l = 0; l < trace.steps[s].size(); ++l)
      for (int e : trace.steps[s][l])  // ascending (RoutingTrace's contract)
        refs.push_back(Ref{s, (static_cast<std::uint64_t>(l) << 32) | static_cast<std::uint32_t>(e)});
  // next[i]: index of the next acquire of refs[i].key after i; kNever if none.
  constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> next(refs.size(), kNever);
  std::unordered_map<std::uint64_t, std::size_t> seen;
  for (std::size_t i = refs.size(); i-- > 0;) {
    auto [it, inserted] = seen.try_emplace(refs[i].key, i);
    if (!inserted) {
      next[i] = it->second;
      it->second = i;
    }
  }
  BeladyMisses out;
  out.step_misses.assign(trace.steps.size(), 0);
  // The cache: key -> its next acquire, and the same pairs ordered by next acquire.
  std::unordered_map<std::uint64_t, std::size_t> cached;
  std::set<std::pair<std::size_t, std::uint64_t>> by_next;
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const std::uint64_t key = refs[i].key;
    if (auto it = cached.find(key); it != cached.end()) {
      by_next.erase({it->second, key});
      it->second = next[i];
      by_next.emplace(next[i], key);
      continue;
    }
    ++out.step_misses[refs[i].step];
    if (capacity == 0) continue;
    if (cached.size() >= capacity) {
      const auto farthest = std::prev(by_next.end());
      cached.erase(farthest->second);
      by_next.erase(farthest);
    }
    cached.emplace(key, next[i]);
    by_next.emplace(next[i], key);
  }
  return out;
}

}  // namespace terrace::experts
