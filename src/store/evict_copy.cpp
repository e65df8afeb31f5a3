// Store::EvictCopy: drop one tier's copy of a block that is also held by a lower tier (a clean
// eviction that never writes back and never removes the last copy).
#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace {

Status Store::EvictCopy(const BlockKey& key, TierId tier) { return impl_->EvictCopy(key, tier); }

namespace store_internal {

Status StoreImpl::EvictCopy(const BlockKey& key, TierId tier) {
  const int s = SlotOf(tier);
  if (s < 0) {
    return Status::InvalidArgument(
        fmt::format("evict {} from tier {}: the tier is not configured", key.ToString(), TierName(tier)));
  }
  auto guard = key_locks_.Lock(key);
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || !(it->second.mask & Bit(s))) {
      return Status::NotFound(fmt::format("evict {}: tier {} holds no copy of it", key.ToString(), SlotName(s)));
    }
    if (it->second.PinnedIn(s)) {
      return Status::InvalidArgument(fmt::format(
          "evict {} from tier {}: the block is pinned there (by Pin or a live BlockHandle); release it first",
          key.ToString(), SlotName(s)));
    }
    if (EvictRule(it->second.mask, s, LowestSlot()).action != EvictAction::kDrop) {
      return Status::InvalidArgument(fmt::format(
          "evict {} from tier {}: it is the lowest copy of the block; EvictCopy never drops the last copy "
          "(use Erase to remove the block)", key.ToString(), SlotName(s)));
    }
  }
  // EvictRule said kDrop (a copy exists below), so EvictLocked drops this one without a demotion write.
  return EvictLocked(s, key);
}

}  // namespace store_internal
}  // namespace terrace
