// Write path: Put (placement, write-through, replacing stale copies), Erase, Pin, Lookup.
#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {

Result<int> StoreImpl::PutTarget(const BlockKey& key, const PutOptions& opts) const {
  // A kind no BlockKind names cannot be encoded in the NVMe tier's records: its recovery would
  // drop the block as malformed, so an acknowledged put would be lost.
  if (static_cast<unsigned>(key.kind) >= static_cast<unsigned>(kNumBlockKinds)) {
    return Status::InvalidArgument(fmt::format("put {}: block kind {} is not a BlockKind (kKv, kState, kExpert, "
                                               "kOther)",
                                               key.ToString(), static_cast<unsigned>(key.kind)));
  }
  const TierId want = opts.tier.value_or(options_.put_tier);
  const int target = SlotAtOrBelow(want);
  if (target < 0) {
    return Status::InvalidArgument(fmt::format("put {}: no tier at or below {} is configured; choose another "
                                               "PutOptions::tier or configure that tier",
                                               key.ToString(), TierName(want)));
  }
  return target;
}

Status StoreImpl::Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  TERRACE_ASSIGN_OR_RETURN(const int target, PutTarget(key, opts));
  const int through = WriteThroughSlot(target, LowestSlot(), options_.write_policy);  // -1: none
  const bool write_through = through >= 0;
  // A key the directory has no entry for, written to one tier (no write-through, no shared tier
  // that may hold an older copy): nothing to compare the checksum with before the write, so the
  // tier computes it while it copies (Tier::PutDescribing) and the bytes are read once.
  const bool may_describe_in_tier = !write_through && shared_mask_ == 0;
  std::optional<BlockDesc> early;
  if (!may_describe_in_tier) early = DescribeBlock(data, opts.codec);  // outside the key lock

  auto guard = key_locks_.Lock(key);
  if (may_describe_in_tier) {
    bool known;
    {
      MutexLock lock(&mu_);
      known = entries_.find(key) != entries_.end();
    }
    if (!known) {
      BlockDesc desc{data.size(), opts.codec, 0};
      TERRACE_RETURN_IF_ERROR(PlaceWith(target, key, desc.size, [&] {
        return TimedTierWrite(target, [&] { return tier(target).PutDescribing(key, &desc, data); });
      }, BusyVictims::kWait));
      return PublishPut(key, desc, 0, Bit(target));
    }
    early = DescribeBlock(data, opts.codec);
  }
  const BlockDesc desc = *early;
  SlotMask old_mask = 0;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      Entry& e = it->second;
      if (e.desc == desc && (!write_through || (e.mask & Bit(through)))) {
        Policy(Fastest(e.mask)).OnAccess(key);
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

  if (!write_through) {
    {
      // Room below may be held only by this key's previous version: it is demoted, not skipped.
      OwnCopiesEvictable own(this, key, Bit(target));
      TERRACE_RETURN_IF_ERROR(PlaceInTier(target, key, desc, data, BusyVictims::kWait));  // else nothing lost
    }
    return PublishPut(key, desc, CopiesOf(key), Bit(target));
  }
  return PutWritingThrough(key, desc, data, target, through, old_mask);
}

Status StoreImpl::PutWritingThrough(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data,
                                    int target, int through, SlotMask old_mask) {
  // A block the target can never hold is refused before the lowest tier's copy (the previous
  // version's durable copy) is replaced.
  TERRACE_RETURN_IF_ERROR(CheckBlockFits(target, key, desc.size));
  TERRACE_RETURN_IF_ERROR(PlaceInTier(through, key, desc, data, BusyVictims::kWait));
  Status s = PlaceInTier(target, key, desc, data, BusyVictims::kWait);
  if (s.ok()) return PublishPut(key, desc, old_mask, static_cast<SlotMask>(Bit(through) | Bit(target)));
  if (s.IsOutOfCapacity()) {
    // No room in the target (its blocks pinned or busy): the new version is whole and durable in
    // the lowest tier, so it is published there, as if evicted at once.
    Status published = PublishPut(key, desc, old_mask, Bit(through));
    if (published.ok()) puts_placed_lower_.fetch_add(1, std::memory_order_relaxed);
    return published;
  }
  // The target's write failed otherwise (an I/O error), and the lowest tier's copy of the previous
  // version is already replaced: remove every copy so no version the put did not finish is visible.
  const std::string left = RemoveEveryCopy(key, desc, old_mask, Bit(through));
  return s.WithContext(fmt::format("put {} failed after writing through to tier {}; {}", key.ToString(),
                                   SlotName(through), left));
}

SlotMask StoreImpl::EraseCopies(const BlockKey& key, SlotMask mask, Status* first_error, SlotMask* unsure) {
  SlotMask stuck = 0;
  for (int i = 0; i < slot_count(); ++i) {
    if (!(mask & Bit(i))) continue;
    Status es = tier(i).Erase(key);
    if (es.ok() || es.IsNotFound()) continue;
    slot(i).measured.Add(slot(i).measured.io_errors);
    // A tier may fail an erase it has already applied (the NVMe tier forgets the key, then its
    // commit fails): it no longer serves the copy, but a reopen may find it again.
    const bool served = !tier(i).Lookup(key).status().IsNotFound();
    if (served) {
      stuck |= Bit(i);
    } else if (unsure != nullptr) {
      *unsure |= Bit(i);
    }
    if (first_error->ok()) {
      *first_error = es.WithContext(fmt::format("the copy in tier {} {}", SlotName(i),
                                                served ? "could not be removed" : "was removed, but not durably"));
    }
  }
  return stuck;
}

SlotMask StoreImpl::KeepLeftoverLocked(const BlockKey& key, const BlockDesc& desc, SlotMask stuck_old,
                                       SlotMask stuck_new) {
  auto it = entries_.find(key);
  const bool keep_new = Slowest(stuck_new) > Slowest(stuck_old);
  const SlotMask kept = keep_new ? stuck_new : stuck_old;
  if (kept == 0) {
    if (it != entries_.end()) {
      SetMaskLocked(key, it->second, 0);
      entries_.erase(it);
    }
    return 0;
  }
  Entry& e = it != entries_.end() ? it->second : entries_[key];
  SetMaskLocked(key, e, 0);
  if (keep_new) {
    e.desc = desc;
    e.version = ++last_version_;
    e.prefetched = false;
    lost_.erase(key);
  }
  SetMaskLocked(key, e, kept);
  return kept;
}

std::string StoreImpl::RemoveEveryCopy(const BlockKey& key, const BlockDesc& desc, SlotMask old_mask,
                                       SlotMask new_mask) {
  Status err;
  const SlotMask stuck = EraseCopies(key, old_mask | new_mask, &err, nullptr);
  SlotMask kept;
  {
    MutexLock lock(&mu_);
    kept = KeepLeftoverLocked(key, desc, static_cast<SlotMask>(stuck & ~new_mask),
                              static_cast<SlotMask>(stuck & new_mask));
  }
  if (stuck == 0) return "the block and any previous version under this key were removed";
  const SlotMask other = static_cast<SlotMask>(stuck & ~kept);
  return fmt::format("not every copy could be removed ({}); the key reads the {} version, from tier {}{}",
                     err.ToString(), (kept & new_mask) ? "new" : "previous", LostTierNames(kept),
                     other != 0 ? fmt::format(", and the other version's copy stays in tier {}", LostTierNames(other))
                                : std::string());
}

Status StoreImpl::PublishPut(const BlockKey& key, const BlockDesc& desc, SlotMask old_mask, SlotMask new_mask) {
  Status err;
  SlotMask unsure = 0;
  const SlotMask stuck = EraseCopies(key, static_cast<SlotMask>(old_mask & ~new_mask), &err, &unsure);
  if (stuck != 0 || unsure != 0) {
    // The previous version stays in `stuck`, or may come back in `unsure` at a reopen (and another
    // process could read it, for a shared tier): undo the put rather than acknowledge a version the
    // tiers contradict.
    Status undo_err;
    const SlotMask left = EraseCopies(key, new_mask, &undo_err, nullptr);
    SlotMask kept;
    {
      MutexLock lock(&mu_);
      kept = KeepLeftoverLocked(key, desc, stuck, left);
    }
    const std::string reads =
        kept == 0 ? "the key reads nothing now (NotFound)"
                  : fmt::format("the key reads the {} version, from tier {}", (kept & left) ? "new" : "previous",
                                LostTierNames(kept));
    const std::string may_return =
        unsure == 0 ? std::string()
                    : fmt::format("; after a reopen tier {} may return the previous version", LostTierNames(unsure));
    if (left == 0) {
      // InvalidArgument (a read-only tier): no retry can succeed; the tier's own message says why.
      return err.WithContext(fmt::format("put {}: the previous version could not be removed, so the put was undone; "
                                         "{}{}{}",
                                         key.ToString(), reads, may_return,
                                         err.IsInvalidArgument() ? "" : "; retry the Put once the tier is healthy"));
    }
    return err.WithContext(fmt::format(
        "put {}: the previous version could not be removed, and undoing the put failed too ({}); {}, and the other "
        "version's copy stays in tier {}{} (after a reopen the version in the slowest tier is read); Erase the key or "
        "retry the Put once the tiers are healthy",
        key.ToString(), undo_err.ToString(), reads, LostTierNames(static_cast<SlotMask>((stuck | left) & ~kept)),
        may_return));
  }
  MutexLock lock(&mu_);
  Entry& e = entries_[key];
  SetMaskLocked(key, e, 0);
  e.desc = desc;
  SetMaskLocked(key, e, new_mask);
  e.version = ++last_version_;
  e.prefetched = false;
  lost_.erase(key);
  return Status::Ok();
}

Result<SlotMask> StoreImpl::ReplaceableMask(const BlockKey& key) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return SlotMask{0};
  if (it->second.AnyPin()) {
    return Status::InvalidArgument(fmt::format(
        "block {} is pinned (by Pin or a live BlockHandle) and cannot be replaced; Unpin it or "
        "release its handles first", key.ToString()));
  }
  return it->second.mask;
}

Status StoreImpl::Erase(const BlockKey& key) {
  auto guard = key_locks_.Lock(key);
  return EraseLocked(key);
}

Status StoreImpl::EraseLocked(const BlockKey& key) {
  SlotMask mask = 0;
  if (shared_mask_ != 0 && !InDirectory(key)) (void)AdoptFromShared(key);
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      // Erasing a lost block (its last copy was dropped as bad) forgets it: later reads say NotFound.
      if (lost_.erase(key) > 0) return Status::Ok();
      return Status::NotFound(fmt::format("erase: block {} is not in the store", key.ToString()));
    }
    if (it->second.AnyPin()) {
      return Status::InvalidArgument(fmt::format(
          "erase: block {} is pinned (by Pin or a live BlockHandle); Unpin it or release its handles first",
          key.ToString()));
    }
    mask = it->second.mask;
  }
  SlotMask remaining = mask;
  Status first_error;
  for (int i = 0; i < slot_count(); ++i) {
    if (!(mask & Bit(i))) continue;
    Status s = tier(i).Erase(key);
    if (s.ok() || s.IsNotFound()) {
      remaining &= static_cast<SlotMask>(~Bit(i));
    } else if (first_error.ok()) {
      first_error = s.WithContext(fmt::format("erase {}: the copy in tier {} could not be removed{}", key.ToString(),
                                              SlotName(i), s.IsInvalidArgument() ? "" : "; retry Erase"));
    }
  }
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    SetMaskLocked(key, it->second, remaining);
    if (remaining == 0) entries_.erase(it);
  }
  return first_error;
}

Status StoreImpl::Pin(const BlockKey& key) {
  auto guard = key_locks_.Lock(key);
  if (shared_mask_ != 0 && !InDirectory(key)) (void)AdoptFromShared(key);
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return Status::NotFound(fmt::format("pin: block {} is not in the store", key.ToString()));
  ++it->second.pins;
  return Status::Ok();
}

Status StoreImpl::Unpin(const BlockKey& key) {
  MutexLock lock(&mu_);
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
  std::vector<std::size_t> missed;  // for the shared tiers
  {
    MutexLock lock(&mu_);
    for (std::size_t i = 0; i < std::min(kAhead, keys.size()); ++i) entries_.prefetch(keys[i]);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i + kAhead < keys.size()) entries_.prefetch(keys[i + kAhead]);
      auto it = entries_.find(keys[i]);
      if (it == entries_.end() || it->second.mask == 0) {
        if (shared_mask_ != 0) missed.push_back(i);
        continue;
      }
      const int s = Fastest(it->second.mask);
      out[i].found = true;
      out[i].tier = slot(s).kind;
      out[i].slot = s;
      out[i].desc = it->second.desc;
    }
  }
  for (std::size_t i : missed) {  // outside mu_: a shared tier's Lookup may be a round trip
    for (int s = 0; s < slot_count() && !out[i].found; ++s) {
      if (!(shared_mask_ & Bit(s))) continue;
      Result<BlockDesc> d = tier(s).Lookup(keys[i]);
      if (!d.ok()) continue;
      out[i] = LookupResult{true, slot(s).kind, s, *d};
    }
  }
  return out;
}

bool StoreImpl::InDirectory(const BlockKey& key) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.mask != 0;
}

bool StoreImpl::Contains(const BlockKey& key) const {
  return InDirectory(key) || (shared_mask_ != 0 && Lookup({&key, 1})[0].found);
}

Status StoreImpl::Flush() {
  Status first;
  for (int i = 0; i < slot_count(); ++i) {
    Status s = tier(i).Flush();
    if (!s.ok() && first.ok()) first = s.WithContext(fmt::format("flush tier {}", SlotName(i)));
  }
  return first;
}

}  // namespace terrace::store_internal
