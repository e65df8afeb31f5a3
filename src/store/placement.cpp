// Placement: writing a copy into a tier (evicting to make room), eviction with write-back
// demotion, and watermark-driven background demotion.
#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {

std::optional<TierId> StoreImpl::LowerPresent(TierId t) const {
  for (int i = Idx(t) + 1; i < kNumTiers; ++i) {
    if (tiers_[i]) return TierAt(i);
  }
  return std::nullopt;
}

TierId StoreImpl::LowestPresent() const {
  for (int i = kNumTiers - 1; i >= 0; --i) {
    if (tiers_[i]) return TierAt(i);
  }
  return TierId::kHost;  // unreachable: Init() requires a tier
}

Status StoreImpl::TimedTierGet(TierId t, const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  auto t0 = Clock::now();
  Status s = tiers_[Idx(t)]->Get(key, out, desc);
  measured_[Idx(t)].read_latency.Record(NanosSince(t0));
  if (s.IsIoError()) measured_[Idx(t)].Add(measured_[Idx(t)].io_errors);
  return s;
}

Status StoreImpl::TimedTierPut(TierId t, const BlockKey& key, const BlockDesc& desc,
                               std::span<const std::byte> data) {
  auto t0 = Clock::now();
  Status s = tiers_[Idx(t)]->Put(key, desc, data);
  measured_[Idx(t)].write_latency.Record(NanosSince(t0));
  if (s.IsIoError()) measured_[Idx(t)].Add(measured_[Idx(t)].io_errors);
  return s;
}

void StoreImpl::SetMaskLocked(const BlockKey& key, Entry& e, std::uint8_t new_mask, int evicted_from) {
  for (int i = 0; i < kNumTiers; ++i) {
    std::uint8_t b = Bit(TierAt(i));
    if ((e.mask & b) && !(new_mask & b)) policies_[i]->OnErase(key, i == evicted_from);
    if (!(e.mask & b) && (new_mask & b)) policies_[i]->OnInsert(key, e.desc.size);
  }
  e.mask = new_mask;
}

Status StoreImpl::PlaceInTier(TierId t, const BlockKey& key, const BlockDesc& desc,
                              std::span<const std::byte> data) {
  Tier& tier = *tiers_[Idx(t)];
  const TierCaps& caps = tier.caps();
  std::uint64_t limit = caps.capacity_bytes;
  if (caps.max_block_bytes != 0) limit = std::min(limit, caps.max_block_bytes);
  if (desc.size > limit) {
    return Status::OutOfCapacity(fmt::format(
        "block {} ({} bytes) is larger than tier {} allows ({} bytes capacity, {} bytes max block); "
        "put it in a larger tier (PutOptions::tier) or raise the tier's capacity",
        key.ToString(), desc.size, TierName(t), caps.capacity_bytes, caps.max_block_bytes));
  }
  std::uint64_t reclaim = 0;  // a copy of this key already in `t` is replaced in place
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && (it->second.mask & Bit(t))) reclaim = it->second.desc.size;
  }
  Status last;
  for (int attempt = 0; attempt < 256; ++attempt) {
    if (tier.used_bytes() + desc.size <= caps.capacity_bytes + reclaim) {
      Status s = TimedTierPut(t, key, desc, data);
      if (s.ok()) {
        measured_[Idx(t)].Add(measured_[Idx(t)].puts);
        measured_[Idx(t)].Add(measured_[Idx(t)].bytes_written, desc.size);
        MaybeScheduleDemotion(t);
        return s;
      }
      if (!s.IsOutOfCapacity()) return s.WithContext(fmt::format("put {} into tier {}", key.ToString(), TierName(t)));
      last = std::move(s);
    }
    Status es = EvictOne(t);
    if (es.ok()) continue;
    if (!es.IsOutOfCapacity()) {
      return es.WithContext(fmt::format("making room in tier {} for {} ({} bytes): the victim could not be demoted",
                                        TierName(t), key.ToString(), desc.size));
    }
    break;
  }
  std::string lower = LowerPresent(t) ? fmt::format("tier {} below is full of unevictable blocks",
                                                    TierName(*LowerPresent(t)))
                                      : std::string("there is no lower tier to demote to");
  return Status::OutOfCapacity(fmt::format(
      "tier {} is full ({} of {} bytes used) and no block can be evicted to fit {} ({} bytes): "
      "resident blocks are pinned or busy, or {}; the store never drops the last copy of a block. "
      "Erase or unpin blocks, or add capacity{}",
      TierName(t), tier.used_bytes(), caps.capacity_bytes, key.ToString(), desc.size, lower,
      last.ok() ? "" : fmt::format(" (tier said: {})", last.message())));
}

Status StoreImpl::EvictOne(TierId t) {
  std::vector<BlockKey> skip;  // failed for this call
  std::vector<BlockKey> busy;  // locked by someone else right now
  Status demote_error;         // the first hard error a victim's demotion hit
  for (int round = 0; round < 64; ++round) {
    std::optional<BlockKey> victim;
    {
      std::lock_guard lock(mu_);
      victim = policies_[Idx(t)]->PickVictim([&](const BlockKey& k) {
        if (std::find(skip.begin(), skip.end(), k) != skip.end()) return false;
        if (std::find(busy.begin(), busy.end(), k) != busy.end()) return false;
        if (key_locks_.HeldByThisThread(k)) return false;
        auto it = entries_.find(k);
        return it != entries_.end() && !it->second.PinnedIn(t);
      });
    }
    if (!victim) {
      if (busy.empty()) break;
      busy.clear();  // others may finish soon: look again
      std::this_thread::yield();
      continue;
    }
    auto guard = key_locks_.TryLock(*victim);
    if (!guard) {
      busy.push_back(*victim);
      continue;
    }
    Status s = EvictLocked(t, *victim);
    if (s.ok()) return s;
    if (demote_error.ok() && !s.IsOutOfCapacity() && !s.IsNotFound() && !s.IsInvalidArgument()) demote_error = s;
    skip.push_back(*victim);
  }
  if (!demote_error.ok()) return demote_error;
  return Status::OutOfCapacity(fmt::format("no evictable block in tier {}", TierName(t)));
}

Status StoreImpl::DemoteCopy(TierId from, TierId to, const BlockKey& key, const BlockDesc& desc) {
  Tier& src = *tiers_[Idx(from)];
  // Host-addressable bytes go to the lower tier straight from where they live (no staging copy;
  // the lower tier reads them as registered fixed buffers when it can). Pinned in the tier for
  // the duration; hashed first, since no Get verified them.
  if (src.caps().memory == MemoryKind::kHost && src.Pin(key).ok()) {
    const std::byte* p = src.ResidentPtr(key);
    Status s;
    if (p == nullptr) {
      // not resident after all (a tier that pins without a pointer): the copying path below
    } else if (Checksum({p, desc.size}) != desc.checksum) {
      measured_[Idx(from)].Add(measured_[Idx(from)].corruptions);
      s = Status::Corruption(fmt::format("block {} failed its checksum in tier {} while being demoted",
                                         key.ToString(), TierName(from)));
    } else {
      RefreshIoRegions(from, to);
      s = PlaceInTier(to, key, desc, {p, desc.size});
    }
    (void)src.Unpin(key);
    if (p != nullptr) return s;
  }
  std::vector<std::byte> buf(desc.size);
  BlockDesc got;
  Status s = TimedTierGet(from, key, buf, &got);
  if (s.ok() && !Verify(src.caps(), desc, got, buf)) s = Status::Corruption("checksum mismatch while demoting");
  if (!s.ok()) return s;
  return PlaceInTier(to, key, desc, buf);
}

void StoreImpl::RefreshIoRegions(TierId from, TierId to) {
  if (tiers_[Idx(to)]->caps().memory != MemoryKind::kNone) return;  // memory-to-memory: plain copies
  std::lock_guard lock(regions_mu_);
  std::vector<std::span<std::byte>> regions = tiers_[Idx(from)]->IoRegions();
  if (regions.size() == registered_regions_[Idx(from)]) return;  // regions only grow
  registered_regions_[Idx(from)] = regions.size();  // on failure too: retry only when the tier grows
  Status s = tiers_[Idx(to)]->RegisterIoRegions(regions);
  if (!s.ok()) {
    regions_log_.Log(*logger_, LogLevel::kWarning, "store",
                     fmt::format("tier {} memory not registered with tier {} ({}); demotions are staged",
                                 TierName(from), TierName(to), s.ToString()));
  }
}

Status StoreImpl::EvictLocked(TierId t, const BlockKey& key) {
  BlockDesc desc;
  std::uint8_t mask = 0;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || !(it->second.mask & Bit(t))) return Status::NotFound("victim moved");
    if (it->second.PinnedIn(t)) return Status::InvalidArgument("victim pinned");
    desc = it->second.desc;
    mask = it->second.mask;
  }
  std::uint8_t below = 0;
  for (int i = Idx(t) + 1; i < kNumTiers; ++i) below |= Bit(TierAt(i));
  std::optional<TierId> placed;
  if (!(mask & below)) {  // the only copy at or below t: write it back first
    auto lower = LowerPresent(t);
    if (!lower) return Status::OutOfCapacity("no lower tier");
    Status s = DemoteCopy(t, *lower, key, desc);
    if (s.IsCorruption()) {  // the copy is lost anyway; dropping it frees the space
      DropCopy(key, t);
      return Status::Ok();
    }
    TERRACE_RETURN_IF_ERROR(s);
    placed = lower;
    demotions_.fetch_add(1, std::memory_order_relaxed);
  }
  Status es = tiers_[Idx(t)]->Erase(key);
  std::lock_guard lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return Status::Internal("victim entry vanished under its key lock");
  std::uint8_t new_mask = it->second.mask | (placed ? Bit(*placed) : 0);
  if (es.ok() || es.IsNotFound()) new_mask &= static_cast<std::uint8_t>(~Bit(t));
  SetMaskLocked(key, it->second, new_mask, Idx(t));
  if (!es.ok() && !es.IsNotFound()) return es;
  measured_[Idx(t)].Add(measured_[Idx(t)].evictions);
  evictions_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

void StoreImpl::MaybeScheduleDemotion(TierId t) {
  if (stopping_.load(std::memory_order_acquire) || !LowerPresent(t)) return;
  const Tier& tier = *tiers_[Idx(t)];
  auto cap = static_cast<double>(tier.caps().capacity_bytes);
  if (static_cast<double>(tier.used_bytes()) <= options_.high_watermark * cap) return;
  if (demotion_scheduled_[Idx(t)].exchange(true)) return;
  pool_.Post([this, t, cap] {
    const Tier& tr = *tiers_[Idx(t)];
    while (!stopping_.load(std::memory_order_acquire) &&
           static_cast<double>(tr.used_bytes()) > options_.low_watermark * cap) {
      if (!EvictOne(t).ok()) break;
    }
    demotion_scheduled_[Idx(t)].store(false);
  });
}

}  // namespace terrace::store_internal
