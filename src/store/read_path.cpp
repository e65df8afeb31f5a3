// Read path: unlocked fast reads, deduplicated locked fetches from slow tiers, promotion and moves.
#include <cstring>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
void StoreImpl::CountGet(TierId served_from, std::uint8_t present_mask) {
  for (int i = 0; i < Idx(served_from); ++i) {
    if (present_mask & Bit(TierAt(i))) measured_[i].Add(measured_[i].misses);
  }
  measured_[Idx(served_from)].Add(measured_[Idx(served_from)].hits);
}

bool StoreImpl::FastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result) {
  BlockDesc desc;
  std::uint8_t mask = 0;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      for (int i = 0; i < kNumTiers; ++i) {
        if (tiers_[i]) measured_[i].Add(measured_[i].misses);
      }
      *result = Status::NotFound(fmt::format("block {} is not in the store", key.ToString()));
      return true;
    }
    desc = it->second.desc;
    mask = it->second.mask;
  }
  if (out.size() < desc.size) {
    *result = Status::InvalidArgument(fmt::format("buffer for block {} holds {} bytes; the block needs {} bytes",
                                                  key.ToString(), out.size(), desc.size));
    return true;
  }
  int src = Fastest(mask);
  if (src < 0 || src > Idx(promote_tier_)) return false;
  BlockDesc got;
  Status s = TimedTierGet(TierAt(src), key, out, &got);
  if (!s.ok() || !Verify(tiers_[src]->caps(), desc, got, out)) return false;  // moved, replaced or bad: use the locked path
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      policies_[src]->OnAccess(key);
      if (it->second.prefetched) {
        it->second.prefetched = false;
        prefetch_useful_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  CountGet(TierAt(src), present_mask_);
  measured_[src].Add(measured_[src].bytes_read, desc.size);
  *result = got;
  return true;
}

Result<BlockDesc> StoreImpl::Get(const BlockKey& key, std::span<std::byte> out) {
  Result<BlockDesc> r = Status::NotFound("unset");
  if (FastGet(key, out, &r)) return r;
  DemandScope demand(demand_mu_, demand_cv_, demand_active_);
  ReadOutcome o = FetchDedup(key, PromoteOnGetTarget(), /*by_prefetch=*/false, out);
  return std::move(o.desc);
}

ReadOutcome StoreImpl::FetchDedup(const BlockKey& key, std::optional<TierId> move_to, bool by_prefetch,
                                  std::span<std::byte> out) {
  auto ticket = inflight_.JoinOrLead(key, by_prefetch);
  Fetch& f = *ticket.fetch;
  ReadOutcome o;
  if (!ticket.leader) {
    InflightTable::Wait(f);
    dedup_hits_.fetch_add(1, std::memory_order_relaxed);
    if (f.by_prefetch && !by_prefetch) prefetch_late_.fetch_add(1, std::memory_order_relaxed);
    o.leader = false;
    if (!f.status.ok()) {
      o.desc = f.status;
    } else {
      o.desc = f.desc;
    }
  } else {
    {
      auto guard = key_locks_.Lock(key);
      o = LockedRead(key, &f.bytes, move_to ? MoveMode::kUp : MoveMode::kNone, move_to.value_or(TierId::kHost),
                     by_prefetch);
    }
    o.leader = true;
    f.status = o.desc.status();
    if (o.desc.ok()) f.desc = *o.desc;
  }
  if (o.desc.ok() && !out.empty()) {
    if (out.size() < f.desc.size) {
      o.desc = Status::InvalidArgument(fmt::format("buffer for block {} holds {} bytes; the block needs {} bytes",
                                                   key.ToString(), out.size(), f.desc.size));
    } else {
      std::memcpy(out.data(), f.bytes.data(), f.desc.size);
    }
  }
  if (ticket.leader) inflight_.Finish(key, ticket.fetch);
  return o;
}

void StoreImpl::DropCopy(const BlockKey& key, TierId t) {
  (void)tiers_[Idx(t)]->Erase(key);  // the tier may have dropped it already
  corruptions_dropped_.fetch_add(1, std::memory_order_relaxed);
  measured_[Idx(t)].Add(measured_[Idx(t)].corruptions);
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  SetMaskLocked(key, it->second, static_cast<std::uint8_t>(it->second.mask & ~Bit(t)));
  if (it->second.mask == 0) entries_.erase(it);
}

ReadOutcome StoreImpl::LockedRead(const BlockKey& key, std::vector<std::byte>* buf, MoveMode mode, TierId target,
                                  bool by_prefetch, std::string dropped) {
  ReadOutcome out;
  std::uint8_t tried = 0;  // copies that failed with a non-corruption error
  Status last_error;
  for (;;) {
    BlockDesc desc;
    std::uint8_t mask = 0;
    {
      std::lock_guard lock(mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        desc = it->second.desc;
        mask = it->second.mask;
      }
    }
    if (mask == 0) {
      if (!dropped.empty()) {
        out.desc = Status::Corruption(fmt::format(
            "block {}: the copy in tier {} failed its checksum and was dropped; no good copy is left; "
            "put the block again", key.ToString(), dropped));
      } else {
        out.desc = Status::NotFound(fmt::format("block {} is not in the store", key.ToString()));
      }
      return out;
    }
    if (mode == MoveMode::kExact && (mask & Bit(target))) {
      out.desc = desc;
      return out;
    }
    int src = Fastest(static_cast<std::uint8_t>(mask & ~tried));
    if (src < 0) {
      out.desc = last_error;
      return out;
    }
    buf->resize(desc.size);
    BlockDesc got;
    Status s = TimedTierGet(TierAt(src), key, *buf, &got);
    if (s.ok() && !Verify(tiers_[src]->caps(), desc, got, *buf)) s = Status::Corruption("checksum mismatch");
    if (s.IsCorruption() || s.IsNotFound()) {
      if (s.IsCorruption()) dropped += dropped.empty() ? std::string(TierName(TierAt(src)))
                                                       : fmt::format(", {}", TierName(TierAt(src)));
      DropCopy(key, TierAt(src));
      continue;
    }
    if (!s.ok()) {
      tried |= Bit(TierAt(src));
      last_error = s.WithContext(fmt::format("get {} from tier {}", key.ToString(), TierName(TierAt(src))));
      continue;
    }
    out.desc = desc;
    CompleteLockedRead(key, desc, *buf, src, mask, mode, target, by_prefetch, &out);
    return out;
  }
}

void StoreImpl::CompleteLockedRead(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> bytes,
                                   int src, std::uint8_t mask, MoveMode mode, TierId target, bool by_prefetch,
                                   ReadOutcome* result) {
  ReadOutcome& out = *result;
  CountGet(TierAt(src), present_mask_);
  measured_[src].Add(measured_[src].bytes_read, desc.size);
  if (src > Idx(promote_tier_)) lower_tier_reads_.fetch_add(1, std::memory_order_relaxed);

  bool want_move = (mode == MoveMode::kUp && src > Idx(target)) || mode == MoveMode::kExact;
  if (want_move) {
    Status ms = PlaceInTier(target, key, desc, bytes);
    if (!ms.ok()) {
      out.move_status = std::move(ms);
    } else {
      // Exclusive placement: the moved block leaves its other copies (but the lowest tier keeps
      // its copy under write-through, and copies pinned by a handle stay).
      std::uint8_t remove = 0;
      if (options_.placement == Placement::kExclusive) {
        std::lock_guard lock(mu_);
        auto it = entries_.find(key);
        for (int i = 0; it != entries_.end() && i < kNumTiers; ++i) {
          if (i == Idx(target) || !(mask & Bit(TierAt(i)))) continue;
          if (mode == MoveMode::kUp && i < Idx(target)) continue;
          if (options_.write_policy == WritePolicy::kWriteThrough && TierAt(i) == LowestPresent()) continue;
          if (it->second.handle_pins[i] > 0) continue;
          remove |= Bit(TierAt(i));
        }
      }
      for (int i = 0; i < kNumTiers; ++i) {
        if (!(remove & Bit(TierAt(i)))) continue;
        Status es = tiers_[i]->Erase(key);
        if (!es.ok() && !es.IsNotFound()) remove &= static_cast<std::uint8_t>(~Bit(TierAt(i)));
      }
      std::lock_guard lock(mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        SetMaskLocked(key, it->second, static_cast<std::uint8_t>((it->second.mask | Bit(target)) & ~remove));
        if (by_prefetch) it->second.prefetched = true;
      }
      out.moved = true;
      if (Idx(target) < src) promotions_.fetch_add(1, std::memory_order_relaxed);
      if (by_prefetch) prefetch_issued_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.mask & Bit(TierAt(src))) policies_[src]->OnAccess(key);
    if (!by_prefetch && it->second.prefetched) {
      it->second.prefetched = false;
      prefetch_useful_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

Status StoreImpl::MoveUp(const BlockKey& key, TierId target, bool by_prefetch) {
  if (!tiers_[Idx(target)]) {
    return Status::InvalidArgument(fmt::format("cannot move block {} to tier {}: the tier is not configured",
                                               key.ToString(), TierName(target)));
  }
  auto at_or_above = [&]() -> Result<bool> {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return Status::NotFound(fmt::format("block {} is not in the store", key.ToString()));
    return Fastest(it->second.mask) <= Idx(target);
  };
  TERRACE_ASSIGN_OR_RETURN(bool done, at_or_above());
  if (done) return Status::Ok();
  ReadOutcome o = FetchDedup(key, target, by_prefetch, {});
  if (!o.desc.ok()) return o.desc.status();
  if (o.leader) return o.move_status;
  TERRACE_ASSIGN_OR_RETURN(done, at_or_above());  // we joined someone else's read; did it move?
  if (done) return Status::Ok();
  auto guard = key_locks_.Lock(key);
  std::vector<std::byte> buf;
  ReadOutcome o2 = LockedRead(key, &buf, MoveMode::kUp, target, by_prefetch);
  return o2.desc.ok() ? o2.move_status : o2.desc.status();
}

Result<BlockHandle> StoreImpl::Acquire(const BlockKey& key, TierId where) {
  if (!tiers_[Idx(where)]) {
    return Status::InvalidArgument(fmt::format("cannot acquire block {} in tier {}: the tier is not configured",
                                               key.ToString(), TierName(where)));
  }
  const TierCaps& caps = tiers_[Idx(where)]->caps();
  if (caps.memory == MemoryKind::kNone) {
    return Status::InvalidArgument(fmt::format(
        "cannot acquire block {} in tier {}: its bytes are not addressable; acquire into hbm or host",
        key.ToString(), TierName(where)));
  }
  auto guard = key_locks_.Lock(key);
  for (int attempt = 0; attempt < kNumTiers + 1; ++attempt) {
    std::vector<std::byte> buf;
    ReadOutcome o = LockedRead(key, &buf, MoveMode::kExact, where, /*by_prefetch=*/false);
    if (!o.desc.ok()) return o.desc.status();
    TERRACE_RETURN_IF_ERROR(o.move_status);
    const BlockDesc desc = *o.desc;
    Tier& tier = *tiers_[Idx(where)];
    TERRACE_RETURN_IF_ERROR(tier.Pin(key));
    const std::byte* p = tier.ResidentPtr(key);
    bool ok = p != nullptr;
    if (ok && caps.memory == MemoryKind::kHost) ok = Checksum({p, desc.size}) == desc.checksum;
    if (!ok) {
      (void)tier.Unpin(key);
      DropCopy(key, where);
      continue;
    }
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return Status::Internal("entry vanished under its key lock");
    ++it->second.handle_pins[Idx(where)];
    BlockHandle h;
    h.impl_ = this;
    h.key_ = key;
    h.desc_ = desc;
    h.data_ = p;
    h.memory_ = caps.memory;
    h.tier_ = where;
    return h;
  }
  return Status::Corruption(fmt::format("block {}: every copy failed verification while acquiring it into tier {}",
                                        key.ToString(), TierName(where)));
}

void StoreImpl::ReleaseHandle(const BlockKey& key, TierId t) {
  (void)tiers_[Idx(t)]->Unpin(key);
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.handle_pins[Idx(t)] > 0) --it->second.handle_pins[Idx(t)];
}

}  // namespace terrace::store_internal
