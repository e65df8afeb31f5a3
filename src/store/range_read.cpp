// Store::GetRanges: parts of blocks from each key's fastest copy, moving nothing. The directory
// names the copy; the read itself runs without the store's locks (a tier keeps a block it is
// reading readable, or answers NotFound once it is gone), so a copy that moved between the two
// (demoted, evicted, replaced in another tier) is looked up again; after kRangeRounds - 1 such
// misses the item is read under its key's lock, as Get reads, so a key present throughout is never
// answered NotFound. A key the directory does not know is asked of the shared tiers
// (TierCaps::shared) first, as Get does.
#include <algorithm>
#include <utility>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
namespace {

// Lookups per item: a copy can move between the directory lookup and the tier's read; after
// kRangeRounds - 1 misses in a row the item is read under its key's lock, where it cannot move.
constexpr int kRangeRounds = 3;

}  // namespace

std::vector<Status> StoreImpl::GetRanges(std::span<Store::GetRangeItem> items) {
  std::vector<Status> st(items.size());
  std::vector<std::size_t> pending(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) pending[i] = i;
  for (int round = 0; round + 1 < kRangeRounds && !pending.empty(); ++round) {
    pending = RangeRound(items, pending, /*adopt_shared=*/round == 0, st);
  }
  for (std::size_t i : pending) {  // the copy kept moving: the answer now is the key's, as Get's
    auto guard = key_locks_.Lock(items[i].key);
    (void)RangeRound(items, {&i, 1}, /*adopt_shared=*/false, st);
  }
  // A read found counted its hit (RangeRound); one whose key has no readable copy, a miss.
  for (const Status& s : st) CountMissIfNone(s);
  return st;
}

std::vector<std::size_t> StoreImpl::RangeRound(std::span<Store::GetRangeItem> items,
                                               std::span<const std::size_t> pending, bool adopt_shared,
                                               std::vector<Status>& st) {
  std::vector<std::pair<int, std::size_t>> plan;  // (source slot, item), fastest copy first
  plan.reserve(pending.size());
  std::vector<std::size_t> unknown;  // not in the directory: a shared tier may hold them
  {
    MutexLock lock(&mu_);
    for (std::size_t i : pending) {
      const Store::GetRangeItem& it = items[i];
      auto e = entries_.find(it.key);
      if (e == entries_.end() || e->second.mask == 0) {
        st[i] = MissLocked(it.key);
        if (shared_mask_ != 0 && adopt_shared && st[i].IsNotFound()) unknown.push_back(i);
        continue;
      }
      st[i] = CheckRange(RangeOp{it.key, it.offset, it.length, it.out, {}}, e->second.desc.size);
      if (st[i].ok()) plan.emplace_back(Fastest(e->second.mask), i);
    }
  }
  std::vector<std::size_t> moved;  // answered NotFound by the tier the directory named, or adopted
  // Keys another process put into a shared tier: entered into the directory (under their stripe,
  // outside mu_: a shared tier's Lookup may be a round trip) and read in the next round.
  for (std::size_t i : unknown) {
    auto guard = key_locks_.Lock(items[i].key);
    if (InDirectory(items[i].key) || AdoptFromShared(items[i].key)) moved.push_back(i);
  }
  std::stable_sort(plan.begin(), plan.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<RangeOp> ops;
  for (std::size_t g = 0; g < plan.size();) {
    const int src = plan[g].first;
    std::size_t end = g;
    ops.clear();
    for (; end < plan.size() && plan[end].first == src; ++end) {
      const Store::GetRangeItem& it = items[plan[end].second];
      ops.push_back(RangeOp{it.key, it.offset, it.length, it.out, {}});
    }
    const auto t0 = Clock::now();
    std::vector<Status> res = tier(src).GetRangeBatch(ops);
    const std::uint64_t ns = NanosSince(t0);  // each op is charged the whole call, as TimedTierGetBatch does
    std::uint64_t ok = 0, bytes = 0;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const std::size_t i = plan[g + k].second;
      NoteTierRead(src, ns, res[k]);
      if (res[k].IsNotFound()) moved.push_back(i);
      st[i] = std::move(res[k]);
      if (!st[i].ok()) continue;
      items[i].desc = ops[k].desc;
      items[i].tier = slot(src).kind;
      CountGet(src);
      ++ok;
      bytes += ops[k].length;
    }
    range_reads_.fetch_add(ok, std::memory_order_relaxed);
    range_read_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    g = end;
  }
  return moved;
}

}  // namespace terrace::store_internal
