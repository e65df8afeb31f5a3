// Store::EvictCopy: drop one tier's copy of a block that is also held by a lower tier (a clean
// eviction that never writes back and never removes the last copy).
#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace {

Status Store::EvictCopy(const BlockKey& key, TierId tier) { return impl_->EvictCopy(key, tier); }

namespace store_internal {

Status StoreImpl::EvictCopy(const BlockKey& key, TierId tier) {
  if (!tiers_[Idx(tier)]) {
    return Status::InvalidArgument(
        fmt::format("evict {} from tier {}: the tier is not configured", key.ToString(), TierName(tier)));
  }
  auto guard = key_locks_.Lock(key);
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || !(it->second.mask & Bit(tier))) {
      return Status::NotFound(fmt::format("evict {}: tier {} holds no copy of it", key.ToString(), TierName(tier)));
    }
    if (it->second.PinnedIn(tier)) {
      return Status::InvalidArgument(fmt::format(
          "evict {} from tier {}: the block is pinned there (by Pin or a live BlockHandle); release it first",
          key.ToString(), TierName(tier)));
    }
    std::uint8_t below = 0;
    for (int i = Idx(tier) + 1; i < kNumTiers; ++i) below |= Bit(TierAt(i));
    if (!(it->second.mask & below)) {
      return Status::InvalidArgument(fmt::format(
          "evict {} from tier {}: it is the lowest copy of the block; EvictCopy never drops the last copy "
          "(use Erase to remove the block)", key.ToString(), TierName(tier)));
    }
  }
  // A copy exists below, so EvictLocked drops this one without a demotion write.
  return EvictLocked(tier, key);
}

}  // namespace store_internal
}  // namespace terrace
