// Read path: unlocked fast reads, deduplicated locked fetches from slow tiers, promotion and moves.
#include <algorithm>
#include <thread>
#include <cstring>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
void StoreImpl::CountTransfer(bool direct, std::uint64_t bytes) {
  (direct ? direct_transfers_ : staged_transfers_).fetch_add(1, std::memory_order_relaxed);
  (direct ? direct_transfer_bytes_ : staged_transfer_bytes_).fetch_add(bytes, std::memory_order_relaxed);
}

Status ShortBuffer(const BlockKey& key, std::size_t have, std::uint64_t need) {
  return Status::InvalidArgument(
      fmt::format("buffer for block {} holds {} bytes; the block needs {} bytes", key.ToString(), have, need));
}

void StoreImpl::CountGet(int served_from) {
  for (int i = 0; i < served_from; ++i) slot(i).measured.Add(slot(i).measured.misses);
  if (served_from < slot_count()) slot(served_from).measured.Add(slot(served_from).measured.hits);
}

FastRead StoreImpl::PlanFastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result) {
  FastRead f;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      if (shared_mask_ != 0) return f;  // a shared tier may hold it: the locked path asks
      *result = MissLocked(key);
      CountMissIfNone(result->status());  // NotFound, or a lost key's Corruption
      f.answered = true;
      return f;
    }
    f.desc = it->second.desc;
    f.src = Fastest(it->second.mask);
  }
  if (out.size() < f.desc.size) {
    *result = ShortBuffer(key, out.size(), f.desc.size);
    f.answered = true;
    f.src = -1;
    return f;
  }
  if (f.src > promote_slot_) f.src = -1;
  return f;
}

bool StoreImpl::FinishFastGet(const BlockKey& key, const FastRead& f, const Status& read, const BlockDesc& got,
                              std::span<const std::byte> out, Result<BlockDesc>* result) {
  if (!read.ok() || !Verify(tier(f.src).caps(), f.desc, got, out)) return false;  // moved, replaced or bad: use the locked path
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      Policy(f.src).OnAccess(key);
      if (it->second.prefetched) {
        it->second.prefetched = false;
        prefetch_useful_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  CountGet(f.src);
  *result = got;
  return true;
}

bool StoreImpl::FastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result) {
  const FastRead f = PlanFastGet(key, out, result);
  if (f.answered) return true;
  if (f.src < 0) return false;
  BlockDesc got;
  const Status s = TimedTierGet(f.src, key, out, &got);
  return FinishFastGet(key, f, s, got, out, result);
}

Result<BlockDesc> StoreImpl::Get(const BlockKey& key, std::span<std::byte> out, const GetOptions& opts) {
  Result<BlockDesc> r = Status::NotFound("unset");
  if (FastGet(key, out, &r)) return r;
  DemandScope demand(*demand_);
  ReadOutcome o = FetchDedup(key, PromoteOnGetTarget(opts), /*by_prefetch=*/false, out);
  CountMissIfNone(o.desc.status());  // the fast path counted the directory's misses; these it left
  return std::move(o.desc);
}

ReadOutcome StoreImpl::FetchDedup(const BlockKey& key, std::optional<int> move_to, bool by_prefetch,
                                  std::span<std::byte> out) {
  auto ticket = inflight_.JoinOrLead(key, by_prefetch, /*wants_bytes=*/!out.empty());
  Fetch& f = *ticket.fetch;
  ReadOutcome o;
  if (!ticket.leader && f.leader == std::this_thread::get_id()) {
    // This thread leads that fetch and has not read it yet: a prefetch's on_item callback reading
    // a key of its own group that is still to come. Waiting would never end; read it here instead
    // (the lead re-checks the entry's version when it gets there).
    auto guard = key_locks_.Lock(key);
    return LockedRead(key, out, move_to ? MoveMode::kUp : MoveMode::kNone, move_to.value_or(0), by_prefetch);
  }
  if (!ticket.leader) {
    InflightTable::Wait(f);
    dedup_hits_.fetch_add(1, std::memory_order_relaxed);
    if (f.by_prefetch && !by_prefetch) {
      prefetch_late_.fetch_add(1, std::memory_order_relaxed);
      if (f.status.ok() && f.src >= 0) CountGet(f.src);  // the prefetch's read did not count it
    }
    o.leader = false;
    if (!f.status.ok()) {
      o.desc = f.status;
    } else if (!out.empty() && out.size() < f.desc.size) {
      o.desc = ShortBuffer(key, out.size(), f.desc.size);
    } else {
      o.desc = f.desc;
      // The leader filled f.bytes because this follower asked for them (CloseFetch).
      if (!out.empty()) std::memcpy(out.data(), f.bytes.data(), f.desc.size);
    }
    return o;
  }
  {
    auto guard = key_locks_.Lock(key);
    o = LockedRead(key, out, move_to ? MoveMode::kUp : MoveMode::kNone, move_to.value_or(0), by_prefetch);
    const bool delivered = o.desc.ok() && out.size() >= o.desc->size;
    CloseFetch(key, ticket.fetch, o, delivered ? out.first(o.desc->size) : std::span<std::byte>{}, by_prefetch);
  }
  InflightTable::Wake(f);
  if (o.desc.ok() && !out.empty() && out.size() < o.desc->size) o.desc = ShortBuffer(key, out.size(), o.desc->size);
  return o;
}

void StoreImpl::CloseFetch(const BlockKey& key, const std::shared_ptr<Fetch>& fetch, const ReadOutcome& o,
                           std::span<const std::byte> have, bool by_prefetch) {
  Fetch& f = *fetch;
  f.status = o.desc.status();
  f.src = o.src;
  if (o.desc.ok()) f.desc = *o.desc;
  if (inflight_.Close(key, fetch) == 0 || !f.status.ok()) return;
  if (have.size() >= f.desc.size) {
    f.bytes.assign(have.begin(), have.begin() + static_cast<std::ptrdiff_t>(f.desc.size));
    return;
  }
  // A move-only leader: read the block once more for the followers, from its fastest copy.
  f.bytes.resize(f.desc.size);
  ReadOutcome again = LockedRead(key, f.bytes, MoveMode::kNone, 0, by_prefetch);
  f.status = again.desc.status();
  if (again.desc.ok()) f.desc = *again.desc;
}

void StoreImpl::DropCopy(const BlockKey& key, int t) {
  (void)tier(t).Erase(key);  // the tier may have dropped it already
  corruptions_dropped_.fetch_add(1, std::memory_order_relaxed);
  slot(t).measured.Add(slot(t).measured.corruptions);
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  SetMaskLocked(key, it->second, static_cast<SlotMask>(it->second.mask & ~Bit(t)));
  SlotMask& lost = lost_[key];  // every copy dropped so far, until the key is put or erased again
  if (lost == 0) lost_order_.push_back(key);
  lost |= Bit(t);
  if (it->second.mask == 0) {
    entries_.erase(it);
  }
  while (lost_.size() > kMaxLost && !lost_order_.empty()) {
    lost_.erase(lost_order_.front());
    lost_order_.pop_front();
  }
}

void StoreImpl::ForgetCopy(const BlockKey& key, int t) {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  SetMaskLocked(key, it->second, static_cast<SlotMask>(it->second.mask & ~Bit(t)));
  if (it->second.mask == 0) entries_.erase(it);
}

std::string StoreImpl::LostTierNames(SlotMask mask) const {
  std::string names;
  for (int i = 0; i < slot_count(); ++i) {
    if (mask & Bit(i)) names += names.empty() ? SlotName(i) : fmt::format(", {}", SlotName(i));
  }
  return names;
}

Status StoreImpl::MissLocked(const BlockKey& key) const {
  auto it = lost_.find(key);
  if (it == lost_.end()) return Status::NotFound(fmt::format("block {} is not in the store", key.ToString()));
  return Status::Corruption(fmt::format(
      "block {} was stored, but its copy in tier {} failed its checksum and was dropped; no good copy is left; "
      "put the block again", key.ToString(), LostTierNames(it->second)));
}

Status StoreImpl::Miss(const BlockKey& key) const {
  MutexLock lock(&mu_);
  return MissLocked(key);
}

Status StoreImpl::ReadOut(int src, const BlockKey& key, const BlockDesc& desc, std::span<std::byte> out) {
  const TierCaps& caps = tier(src).caps();
  const bool transfer = src > promote_slot_ && !out.empty();  // from a slower tier to a caller
  BlockDesc got;
  if (!out.empty() && ReadsInPlace(caps, out, desc.size)) {
    Status s = TimedTierGet(src, key, out, &got);
    if (s.ok() && !Verify(caps, desc, got, out)) s = Status::Corruption("checksum mismatch");
    if (s.ok() && transfer) CountTransfer(/*direct=*/true, desc.size);
    return s;
  }
  BouncePool::Lease lease = bounce_.Acquire(desc.size);
  if (!lease.valid()) {
    return Status::OutOfCapacity(fmt::format("no memory for a {}-byte staging buffer to read block {} from tier {}",
                                             desc.size, key.ToString(), SlotName(src)));
  }
  const std::span<std::byte> buf = lease.bytes();
  Status s = TimedTierGet(src, key, buf, &got);
  if (s.ok() && !Verify(caps, desc, got, buf)) s = Status::Corruption("checksum mismatch");
  if (!s.ok() || out.empty()) return s;
  std::memcpy(out.data(), buf.data(), desc.size);
  if (transfer) CountTransfer(/*direct=*/false, desc.size);
  return s;
}

ReadOutcome StoreImpl::LockedRead(const BlockKey& key, std::span<std::byte> out, MoveMode mode, int target,
                                  bool by_prefetch, std::string dropped) {
  ReadOutcome result;
  SlotMask tried = 0;  // copies that failed with a non-corruption error
  Status last_error;
  bool asked_shared = false;
  bool reasked_shared = false;  // a shared copy failed: the shared tiers were asked once more
  for (;;) {
    BlockDesc desc;
    SlotMask mask = 0;
    bool known = false;
    {
      MutexLock lock(&mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        known = true;
        desc = it->second.desc;
        mask = it->second.mask;
      }
    }
    if (!known && (dropped.empty() || reasked_shared) && !asked_shared && shared_mask_ != 0) {
      asked_shared = true;
      if (AdoptFromShared(key)) continue;
    }
    if (mask == 0) {
      if (!dropped.empty()) {
        result.desc = Status::Corruption(fmt::format(
            "block {}: the copy in tier {} failed its checksum and was dropped; no good copy is left; "
            "put the block again", key.ToString(), dropped));
      } else {
        result.desc = Miss(key);
      }
      return result;
    }
    if (mode == MoveMode::kExact && (mask & Bit(target))) {
      result.desc = desc;
      return result;
    }
    int src = Fastest(static_cast<SlotMask>(mask & ~tried));
    if (src < 0) {
      result.desc = last_error;
      return result;
    }
    // A move goes through Transfer (direct where a route exists), which also hands the verified
    // bytes over to be copied into the caller's buffer; a plain read is ReadOut's. The block is
    // delivered only into a buffer that holds it.
    const std::span<std::byte> deliver = out.size() >= desc.size ? out.first(desc.size) : std::span<std::byte>{};
    const bool want_move = (mode == MoveMode::kUp && src > target) || mode == MoveMode::kExact;
    Status s;
    TransferOutcome moved;
    if (want_move) {
      moved = Transfer(src, target, key, desc, [&](std::span<const std::byte> b) {
        if (!deliver.empty()) std::memcpy(deliver.data(), b.data(), deliver.size());
      });
      s = moved.read;
    } else {
      // All of `out`, not only the block's bytes: its room past them lets an aligned tier read in place.
      s = ReadOut(src, key, desc, deliver.empty() ? deliver : out);
    }
    if ((s.IsCorruption() || s.IsNotFound()) && (shared_mask_ & Bit(src))) {
      // Another process may have replaced or erased its block there since this store adopted it:
      // forget the adopted copy (never erase it: it is not ours) and ask the shared tiers again,
      // once. A copy that still fails is reported, and left to its owner.
      ForgetCopy(key, src);
      if (!reasked_shared) {
        reasked_shared = true;
        asked_shared = false;
      } else if (s.IsCorruption()) {
        dropped += dropped.empty() ? SlotName(src) : fmt::format(", {}", SlotName(src));
      }
      continue;
    }
    if (s.IsCorruption() || s.IsNotFound()) {
      if (s.IsCorruption()) dropped += dropped.empty() ? SlotName(src) : fmt::format(", {}", SlotName(src));
      DropCopy(key, src);
      continue;
    }
    if (!s.ok()) {
      tried |= Bit(src);
      last_error = s.WithContext(fmt::format("get {} from tier {}", key.ToString(), SlotName(src)));
      continue;
    }
    result.desc = desc;
    CompleteLockedRead(key, src, mask, mode, target, by_prefetch, &result, [&] { return moved.write; });
    return result;
  }
}

void StoreImpl::CompleteLockedRead(const BlockKey& key, int src, SlotMask mask, MoveMode mode, int target,
                                   bool by_prefetch, ReadOutcome* result, const std::function<Status()>& place) {
  ReadOutcome& out = *result;
  out.src = src;
  if (!by_prefetch) CountGet(src);  // hits and misses count the caller's reads (Get, Acquire), not prefetches
  if (src > promote_slot_) lower_tier_reads_.fetch_add(1, std::memory_order_relaxed);

  bool want_move = (mode == MoveMode::kUp && src > target) || mode == MoveMode::kExact;
  if (want_move) {
    Status ms = place();
    if (!ms.ok()) {
      out.move_status = std::move(ms);
    } else {
      // The copies placement drops after the move (DroppedByMove: exclusive placement), less
      // those pinned: by a handle (its slot) or by Store::Pin (every slot).
      SlotMask remove = DroppedByMove(mask, target, LowestSlot(), options_.placement, options_.write_policy,
                                      /*keep_faster=*/mode == MoveMode::kUp);
      remove &= static_cast<SlotMask>(~shared_mask_);  // another process's copy stays where it put it
      if (remove != 0) {
        MutexLock lock(&mu_);
        auto it = entries_.find(key);
        remove = it == entries_.end() || it->second.pins > 0 ? SlotMask{0}
                                                             : static_cast<SlotMask>(remove & ~it->second.handle_mask);
      }
      for (int i = 0; i < slot_count(); ++i) {
        if (!(remove & Bit(i))) continue;
        Status es = tier(i).Erase(key);
        if (!es.ok() && !es.IsNotFound()) remove &= static_cast<SlotMask>(~Bit(i));
      }
      MutexLock lock(&mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        SetMaskLocked(key, it->second, static_cast<SlotMask>((it->second.mask | Bit(target)) & ~remove));
        if (by_prefetch) it->second.prefetched = true;
      }
      out.moved = true;
      if (target < src) promotions_.fetch_add(1, std::memory_order_relaxed);
      if (by_prefetch) prefetch_issued_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.mask & Bit(src)) Policy(src).OnAccess(key);
    if (!by_prefetch && it->second.prefetched) {
      it->second.prefetched = false;
      prefetch_useful_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

Status StoreImpl::MoveUp(const BlockKey& key, int target, bool by_prefetch) {
  // Result: the block is at or above target; NotFound: not in the directory.
  auto at_or_above = [&]() -> Result<bool> {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return MissLocked(key);
    return Fastest(it->second.mask) <= target;
  };
  Result<bool> done = at_or_above();
  if (!done.ok() && shared_mask_ == 0) return done.status();  // else the fetch asks the shared tiers
  if (done.ok() && *done) return Status::Ok();
  ReadOutcome o = FetchDedup(key, target, by_prefetch, {});
  if (!o.desc.ok()) return o.desc.status();
  if (o.leader) return o.move_status;
  TERRACE_ASSIGN_OR_RETURN(bool moved, at_or_above());  // we joined someone else's read; did it move?
  if (moved) return Status::Ok();
  auto guard = key_locks_.Lock(key);
  ReadOutcome o2 = LockedRead(key, {}, MoveMode::kUp, target, by_prefetch);
  return o2.desc.ok() ? o2.move_status : o2.desc.status();
}

Result<BlockHandle> StoreImpl::Acquire(const BlockKey& key, TierId where) {
  const int s = SlotOf(where);
  if (s < 0) {
    return Status::InvalidArgument(fmt::format("cannot acquire block {} in tier {}: the tier is not configured",
                                               key.ToString(), TierName(where)));
  }
  Tier& t = tier(s);
  const TierCaps& caps = t.caps();
  if (caps.memory == MemoryKind::kNone) {
    return Status::InvalidArgument(fmt::format(
        "cannot acquire block {} in tier {}: its bytes are not addressable; acquire into hbm or host",
        key.ToString(), SlotName(s)));
  }
  auto guard = key_locks_.Lock(key);
  for (int attempt = 0; attempt < slot_count() + 1; ++attempt) {
    ReadOutcome o = LockedRead(key, {}, MoveMode::kExact, s, /*by_prefetch=*/false);
    CountMissIfNone(o.desc.status());
    if (!o.desc.ok()) return o.desc.status();
    TERRACE_RETURN_IF_ERROR(o.move_status);
    const BlockDesc desc = *o.desc;
    TERRACE_RETURN_IF_ERROR(t.Pin(key));
    const std::byte* p = t.ResidentPtr(key);
    bool ok = p != nullptr;
    if (ok && caps.memory == MemoryKind::kHost) ok = Checksum({p, desc.size}) == desc.checksum;
    if (!ok) {
      (void)t.Unpin(key);
      DropCopy(key, s);
      continue;
    }
    if (o.src < 0) CountGet(s);  // already in tier s: LockedRead read nothing, so counted nothing
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return Status::Internal("entry vanished under its key lock");
    ++handles_[key][static_cast<std::size_t>(s)];
    it->second.handle_mask |= Bit(s);
    BlockHandle h;
    h.impl_ = this;
    h.key_ = key;
    h.desc_ = desc;
    h.data_ = p;
    h.memory_ = caps.memory;
    h.tier_ = where;
    h.slot_ = s;
    return h;
  }
  return Status::Corruption(fmt::format("block {}: every copy failed verification while acquiring it into tier {}",
                                        key.ToString(), SlotName(s)));
}

void StoreImpl::ReleaseHandle(const BlockKey& key, int s) {
  (void)tier(s).Unpin(key);
  MutexLock lock(&mu_);
  auto h = handles_.find(key);
  if (h == handles_.end() || h->second[static_cast<std::size_t>(s)] == 0) return;
  const bool last_here = --h->second[static_cast<std::size_t>(s)] == 0;
  if (last_here) {
    auto it = entries_.find(key);
    if (it != entries_.end()) it->second.handle_mask &= static_cast<SlotMask>(~Bit(s));
    if (std::all_of(h->second.begin(), h->second.end(), [](std::uint32_t n) { return n == 0; })) handles_.erase(h);
  }
}

}  // namespace terrace::store_internal
