// Write path: Put (placement, write-through, replacing stale copies), Erase, Pin, Lookup.
#include <algorithm>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {

Status StoreImpl::Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  const BlockDesc desc = DescribeBlock(data, opts.codec);
  TierId want = opts.tier.value_or(options_.put_tier);
  std::optional<TierId> target;
  for (int i = Idx(want); i < kNumTiers && !target; ++i) {
    if (tiers_[i]) target = TierAt(i);
  }
  if (!target) {
    return Status::InvalidArgument(fmt::format("put {}: no tier at or below {} is configured; choose another "
                                               "PutOptions::tier or configure that tier",
                                               key.ToString(), TierName(want)));
  }
  const TierId lowest = LowestPresent();
  const bool write_through = options_.write_policy == WritePolicy::kWriteThrough && lowest != *target;

  auto guard = key_locks_.Lock(key);
  std::uint8_t old_mask = 0;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      Entry& e = it->second;
      if (e.desc == desc && (!write_through || (e.mask & Bit(lowest)))) {
        policies_[Fastest(e.mask)]->OnAccess(key);
        put_dedup_hits_.fetch_add(1, std::memory_order_relaxed);
        return Status::Ok();
      }
      if (e.AnyPin()) {
        return Status::InvalidArgument(fmt::format(
            "block {} is pinned (by Pin or a live BlockHandle) and cannot be replaced; Unpin it or "
            "release its handles first", key.ToString()));
      }
      old_mask = e.mask;
    }
  }

  std::uint8_t new_mask = 0;
  if (write_through) {
    TERRACE_RETURN_IF_ERROR(PlaceInTier(lowest, key, desc, data));
    new_mask |= Bit(lowest);
  }
  Status s = PlaceInTier(*target, key, desc, data);
  if (!s.ok()) {
    if (!write_through) return s;  // nothing changed
    // The new bytes already reached the lowest tier: remove every copy so none of them is visible.
    for (int i = 0; i < kNumTiers; ++i) {
      if ((old_mask | new_mask) & Bit(TierAt(i))) (void)tiers_[i]->Erase(key);
    }
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      SetMaskLocked(key, it->second, 0);
      entries_.erase(it);
    }
    return s.WithContext(fmt::format("put {} failed after writing through to tier {}; the block and any "
                                     "previous version under this key were removed", key.ToString(),
                                     TierName(lowest)));
  }
  new_mask |= Bit(*target);
  for (int i = 0; i < kNumTiers; ++i) {  // stale copies of the previous version
    if (!(old_mask & ~new_mask & Bit(TierAt(i)))) continue;
    Status es = tiers_[i]->Erase(key);
    if (!es.ok() && !es.IsNotFound()) measured_[i].Add(measured_[i].io_errors);
  }
  std::lock_guard lock(mu_);
  Entry& e = entries_[key];
  SetMaskLocked(key, e, 0);
  e.desc = desc;
  SetMaskLocked(key, e, new_mask);
  e.version = ++last_version_;
  e.prefetched = false;
  return Status::Ok();
}

Status StoreImpl::Erase(const BlockKey& key) {
  auto guard = key_locks_.Lock(key);
  return EraseLocked(key);
}

Status StoreImpl::EraseLocked(const BlockKey& key) {
  std::uint8_t mask = 0;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return Status::NotFound(fmt::format("erase: block {} is not in the store", key.ToString()));
    if (it->second.AnyPin()) {
      return Status::InvalidArgument(fmt::format(
          "erase: block {} is pinned (by Pin or a live BlockHandle); Unpin it or release its handles first",
          key.ToString()));
    }
    mask = it->second.mask;
  }
  std::uint8_t remaining = mask;
  Status first_error;
  for (int i = 0; i < kNumTiers; ++i) {
    if (!(mask & Bit(TierAt(i)))) continue;
    Status s = tiers_[i]->Erase(key);
    if (s.ok() || s.IsNotFound()) {
      remaining &= static_cast<std::uint8_t>(~Bit(TierAt(i)));
    } else if (first_error.ok()) {
      first_error = s.WithContext(fmt::format("erase {}: the copy in tier {} could not be removed; retry Erase",
                                              key.ToString(), TierName(TierAt(i))));
    }
  }
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    SetMaskLocked(key, it->second, remaining);
    if (remaining == 0) entries_.erase(it);
  }
  return first_error;
}

Status StoreImpl::Pin(const BlockKey& key) {
  auto guard = key_locks_.Lock(key);
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return Status::NotFound(fmt::format("pin: block {} is not in the store", key.ToString()));
  ++it->second.pins;
  return Status::Ok();
}

Status StoreImpl::Unpin(const BlockKey& key) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return Status::NotFound(fmt::format("unpin: block {} is not in the store", key.ToString()));
  if (it->second.pins == 0) {
    return Status::InvalidArgument(fmt::format("unpin: block {} is not pinned (every Pin was already undone)",
                                               key.ToString()));
  }
  --it->second.pins;
  return Status::Ok();
}

std::vector<LookupResult> StoreImpl::Lookup(std::span<const BlockKey> keys) const {
  std::vector<LookupResult> out(keys.size());
  // Prefetch the directory slots a few keys ahead: with a million resident keys nearly every probe
  // misses the cache, and overlapping the misses is what makes a batch faster than single calls.
  constexpr std::size_t kAhead = 8;
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < std::min(kAhead, keys.size()); ++i) entries_.prefetch(keys[i]);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i + kAhead < keys.size()) entries_.prefetch(keys[i + kAhead]);
    auto it = entries_.find(keys[i]);
    if (it == entries_.end() || it->second.mask == 0) continue;
    out[i].found = true;
    out[i].tier = TierAt(Fastest(it->second.mask));
    out[i].desc = it->second.desc;
  }
  return out;
}

bool StoreImpl::Contains(const BlockKey& key) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.mask != 0;
}

Status StoreImpl::Flush() {
  Status first;
  for (int i = 0; i < kNumTiers; ++i) {
    if (!tiers_[i]) continue;
    Status s = tiers_[i]->Flush();
    if (!s.ok() && first.ok()) first = s.WithContext(fmt::format("flush tier {}", TierName(TierAt(i))));
  }
  return first;
}

}  // namespace terrace::store_internal
