// Placement: writing a copy into a tier (evicting to make room), eviction with write-back
// demotion, and watermark-driven background demotion.
#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
thread_local const StoreImpl::OwnCopiesEvictable* StoreImpl::OwnCopiesEvictable::innermost_ = nullptr;

StoreImpl::OwnCopiesEvictable::OwnCopiesEvictable(const StoreImpl* store, const BlockKey& key, SlotMask keep)
    // Nor is it taken from a shared tier or the slot above one: its demotion would write the old
    // version into a tier other processes read, over a version one of them may have put there.
    : store_(store),
      key_(key),
      keep_(static_cast<SlotMask>(keep | store->shared_mask_ | (store->shared_mask_ >> 1))),
      outer_(innermost_) {
  innermost_ = this;
}

StoreImpl::OwnCopiesEvictable::~OwnCopiesEvictable() { innermost_ = outer_; }

bool StoreImpl::OwnCopiesEvictable::Allows(const StoreImpl* store, const BlockKey& key, int slot) {
  for (const OwnCopiesEvictable* o = innermost_; o != nullptr; o = o->outer_) {
    if (o->store_ == store && o->key_ == key) return !(o->keep_ & Bit(slot));
  }
  return false;
}

SlotMask StoreImpl::CopiesOf(const BlockKey& key) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it == entries_.end() ? SlotMask{0} : it->second.mask;
}

void StoreImpl::NoteTierRead(int t, std::uint64_t ns, const Status& s) {
  TierCounters& m = slot(t).measured;
  m.read_latency.Record(ns);
  if (s.IsIoError()) m.Add(m.io_errors);
}

Status StoreImpl::TimedTierGet(int t, const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  auto t0 = Clock::now();
  Status s = tier(t).Get(key, out, desc);
  NoteTierRead(t, NanosSince(t0), s);
  return s;
}

std::vector<Status> StoreImpl::TimedTierGetBatch(int t, std::span<GetOp> ops) {
  auto t0 = Clock::now();
  std::vector<Status> st = tier(t).GetBatch(ops);
  const std::uint64_t ns = NanosSince(t0);  // each op is charged the whole call: an upper bound
  for (const Status& s : st) NoteTierRead(t, ns, s);
  return st;
}

Status StoreImpl::TimedTierPut(int t, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) {
  return TimedTierWrite(t, [&] { return tier(t).Put(key, desc, data); });
}

void StoreImpl::SetMaskLocked(const BlockKey& key, Entry& e, SlotMask new_mask, int evicted_from) {
  for (int i = 0; i < slot_count(); ++i) {
    const SlotMask b = Bit(i);
    if ((e.mask & b) && !(new_mask & b)) Policy(i).OnErase(key, i == evicted_from);
    if (!(e.mask & b) && (new_mask & b)) Policy(i).OnInsert(key, e.desc.size);
  }
  e.mask = new_mask;
}

Status StoreImpl::PlaceInTier(int t, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data,
                              BusyVictims busy) {
  return PlaceWith(t, key, desc.size, [&] { return TimedTierPut(t, key, desc, data); }, busy);
}

Status StoreImpl::CheckBlockFits(int t, const BlockKey& key, std::uint64_t size) const {
  const TierCaps& caps = tier(t).caps();
  std::uint64_t limit = caps.capacity_bytes;
  if (caps.max_block_bytes != 0) limit = std::min(limit, caps.max_block_bytes);
  if (size <= limit) return Status::Ok();
  // Name the bound that refused it: a block cap below the capacity (a host tier's is one chunk of
  // its arena, HostTierOptions::chunk_bytes) is not raised by a larger capacity.
  std::string fix = "put it in a larger tier (PutOptions::tier) or raise the tier's capacity";
  if (caps.max_block_bytes != 0 && size > caps.max_block_bytes && caps.max_block_bytes < caps.capacity_bytes) {
    fix = caps.id == TierId::kHost
              ? fmt::format("raise the tier's HostTierOptions::chunk_bytes (its largest block is one chunk) to at "
                            "least {}, or put it in another tier (PutOptions::tier)",
                            (size + 4095) / 4096 * 4096)
              : "put it in another tier (PutOptions::tier): a larger capacity does not raise this tier's largest block";
  }
  return Status::OutOfCapacity(fmt::format("block {} ({} bytes) is larger than tier {} allows ({} bytes capacity, {} "
                                           "bytes max block); {}",
                                           key.ToString(), size, SlotName(t), caps.capacity_bytes,
                                           caps.max_block_bytes, fix));
}

Status StoreImpl::PlaceWith(int t, const BlockKey& key, std::uint64_t size, const std::function<Status()>& write,
                            BusyVictims busy) {
  const BlockDesc desc{size, Codec::kRaw, 0};  // only its size is used below
  Tier& dst = tier(t);
  const TierCaps& caps = dst.caps();
  TERRACE_RETURN_IF_ERROR(CheckBlockFits(t, key, size));
  std::uint64_t reclaim = 0;  // a copy of this key already in `t` is replaced in place
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && (it->second.mask & Bit(t))) reclaim = it->second.desc.size;
  }
  Status last;
  for (int attempt = 0; attempt < 256; ++attempt) {
    if (dst.allocated_bytes() + desc.size <= caps.capacity_bytes + reclaim) {
      Status s = write();
      if (s.ok()) {
        MaybeScheduleDemotion(t);
        return s;
      }
      if (!s.IsOutOfCapacity()) return s.WithContext(fmt::format("put {} into tier {}", key.ToString(), SlotName(t)));
      last = std::move(s);
    }
    Status es = EvictOne(t, busy);
    if (es.ok()) continue;
    if (!es.IsOutOfCapacity()) {
      return es.WithContext(fmt::format("making room in tier {} for {} ({} bytes): the victim could not be demoted",
                                        SlotName(t), key.ToString(), desc.size));
    }
    break;
  }
  return NoRoom(t, key, desc.size, last);
}

Status StoreImpl::NoRoom(int t, const BlockKey& key, std::uint64_t size, const Status& refused) const {
  const Tier& dst = tier(t);
  const TierCaps& caps = dst.caps();
  // What the blocks take counts, not their sizes: a tier that rounds blocks up (NVMe: to 4 KiB,
  // plus a descriptor) is full before its used_bytes reach capacity.
  const std::uint64_t used = dst.used_bytes();
  const TierStatsSnapshot stats = dst.Stats();
  const std::uint64_t taken = std::max(used, stats.allocated_bytes);
  const std::uint64_t free = stats.free_bytes.value_or(caps.capacity_bytes - std::min(taken, caps.capacity_bytes));
  const std::uint64_t align = std::max<std::uint64_t>(1, caps.io_alignment);
  // A tier with an io_alignment may add a unit per block (the NVMe tier's descriptor): counting it
  // errs towards "full", never towards a "fragmented" that is not so.
  const std::uint64_t need = (size + align - 1) / align * align + (align > 1 ? align : 0);
  const std::string occupancy = taken == used ? fmt::format("{} of {} bytes used", used, caps.capacity_bytes)
                                              : fmt::format("{} of {} bytes allocated to {} bytes of blocks", taken,
                                                            caps.capacity_bytes, used);
  const std::string lower = t < LowestSlot()
                                ? fmt::format("tier {} below is full of unevictable blocks", SlotName(t + 1))
                                : std::string("there is no lower tier to demote to");
  // `reclaim` (the key's old copy) is left out: a tier may write the new copy before it frees the
  // old one (the NVMe tier always does), so only free space proves the tier could have taken it.
  const std::string_view rule = options_.lowest_tier_evicts
                                    ? "this cache drops a block's last copy only from its lowest tier, never a pinned, "
                                      "busy or shared one, nor the version a put replaces"
                                    : "the store never drops the last copy of a block";
  if (!refused.ok() && need <= free) {
    // The bytes fit by count but the tier refused them: its free space is in pieces too small.
    return Status::OutOfCapacity(fmt::format(
        "tier {} has room for {} ({} bytes) by count ({}) but refused it: its free space is fragmented "
        "(tier said: {}); no block could be evicted to make a long enough free run: resident blocks are pinned "
        "or busy, or {}; {}. Erase or unpin blocks, use smaller blocks, or add capacity",
        SlotName(t), key.ToString(), size, occupancy, refused.message(), lower, rule));
  }
  return Status::OutOfCapacity(fmt::format(
      "tier {} is full ({}) and no block can be evicted to fit {} ({} bytes): resident blocks are pinned or busy, "
      "or {}; {}. Erase or unpin blocks, or add capacity{}",
      SlotName(t), occupancy, key.ToString(), size, lower, rule,
      refused.ok() ? "" : fmt::format(" (tier said: {})", refused.message())));
}

Status StoreImpl::EvictOne(int t, BusyVictims when_busy) {
  std::vector<BlockKey> skip;            // failed for this call
  std::vector<BlockKey> busy;            // locked by someone else right now
  std::vector<KeyLocks::Seen> busy_seen;  // their stripes' release counts before the TryLock
  Status demote_error;                   // the first hard error a victim's demotion hit
  bool waited_out = false;               // kWait: no busy victim was released within the wait
  for (int round = 0; round < 64; ++round) {
    std::optional<BlockKey> victim;
    {
      MutexLock lock(&mu_);
      victim = Policy(t).PickVictim([&](const BlockKey& k) {
        if (std::find(skip.begin(), skip.end(), k) != skip.end()) return false;
        if (std::find(busy.begin(), busy.end(), k) != busy.end()) return false;
        // This thread's operation is on it, unless it is a put's previous version (OwnCopiesEvictable).
        if (key_locks_.LockedByThisThread(k) && !OwnCopiesEvictable::Allows(this, k, t)) return false;
        mu_.AssertHeld();  // PickVictim calls the predicate synchronously, under the lock above
        auto it = entries_.find(k);
        return it != entries_.end() && !it->second.PinnedIn(t);
      });
    }
    if (!victim) {
      if (busy.empty()) break;
      if (when_busy == BusyVictims::kWait) {
        if (key_locks_.WaitForRelease(busy_seen, kBusyVictimWait)) return Status::Ok();
        waited_out = true;
        break;
      }
      busy.clear();  // others may finish soon: look again
      busy_seen.clear();
      std::this_thread::yield();
      continue;
    }
    // A victim on a stripe this thread holds (for another key) is already excluded from others.
    const bool ours = key_locks_.HeldByThisThread(*victim);
    const KeyLocks::Seen seen = key_locks_.Observe(*victim);
    const std::optional<KeyLocks::Guard> guard = ours ? std::nullopt : key_locks_.TryLock(*victim);
    if (!ours && !guard) {
      busy.push_back(*victim);
      busy_seen.push_back(seen);
      continue;
    }
    Status s = EvictLocked(t, *victim);
    if (s.ok()) return s;
    // OutOfCapacity (no room below, the victim pinned) and NotFound (it moved) try the next victim;
    // anything else, e.g. a read-only tier below refusing the demotion, is what the caller is told.
    if (demote_error.ok() && !s.IsOutOfCapacity() && !s.IsNotFound()) demote_error = s;
    skip.push_back(*victim);
  }
  if (!demote_error.ok()) return demote_error;
  if (waited_out) {
    return Status::OutOfCapacity(fmt::format("every evictable block in tier {} stayed busy (locked by other "
                                             "threads) for {} ms",
                                             SlotName(t), kBusyVictimWait.count()));
  }
  return Status::OutOfCapacity(fmt::format("no evictable block in tier {}", SlotName(t)));
}

void StoreImpl::RefreshIoRegions(int from, int to) {
  // Host memory to host memory: plain copies. NVMe (io_uring fixed buffers) and a CUDA tier (page-
  // locked for DMA) register the source's memory.
  if (tier(to).caps().memory == MemoryKind::kHost) return;
  // A device tier would page-lock memory its owner asked to keep pageable (TierCaps::pageable).
  if (tier(to).caps().memory == MemoryKind::kDevice && tier(from).caps().pageable) return;
  MutexLock lock(&regions_mu_);
  std::vector<std::span<std::byte>> regions = tier(from).IoRegions();
  if (regions.size() == RegisteredRegions(from)) return;  // regions only grow
  RegisteredRegions(from) = regions.size();  // on failure too: retry only when the tier grows
  Status s = tier(to).RegisterIoRegions(regions);
  if (!s.ok()) {
    regions_log_.Log(*logger_, LogLevel::kWarning, "store",
                     fmt::format("tier {} memory not registered with tier {} ({}); its transfers use plain, "
                                 "unregistered I/O",
                                 SlotName(from), SlotName(to), s.ToString()));
  }
}

Status StoreImpl::EvictLocked(int t, const BlockKey& key) {
  BlockDesc desc;
  SlotMask mask = 0;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || !(it->second.mask & Bit(t))) return Status::NotFound("victim moved");
    if (it->second.PinnedIn(t))
      return Status::OutOfCapacity(fmt::format("block {} is pinned in tier {}", key.ToString(), SlotName(t)));
    desc = it->second.desc;
    mask = it->second.mask;
  }
  std::optional<int> placed;
  const EvictDecision rule = EvictRule(mask, t, LowestSlot());
  // The last copy at or below t: a cache drops it (the block is gone unless a faster tier holds it).
  // Never the previous version a Put of this thread is replacing (it must survive that Put's
  // failure), nor a copy in a shared tier (other processes' blocks live there).
  if (rule.action == EvictAction::kLastCopy &&
      (!options_.lowest_tier_evicts || OwnCopiesEvictable::Allows(this, key, t) || (shared_mask_ & Bit(t)) != 0))
    return Status::OutOfCapacity("no lower tier");
  if (rule.action == EvictAction::kWriteBack) {  // the only copy at or below t: write it back first
    const int lower = rule.write_back_to;
    Status s = DemoteCopy(t, lower, key, desc);
    if (s.IsCorruption()) {  // the copy is lost anyway; dropping it frees the space
      DropCopy(key, t);
      return Status::Ok();
    }
    TERRACE_RETURN_IF_ERROR(s);
    placed = lower;
    demotions_.fetch_add(1, std::memory_order_relaxed);
  }
  Status es = tier(t).Erase(key);
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return Status::Internal("victim entry vanished under its key lock");
  SlotMask new_mask = static_cast<SlotMask>(it->second.mask | (placed ? Bit(*placed) : 0));
  if (es.ok() || es.IsNotFound()) new_mask &= static_cast<SlotMask>(~Bit(t));
  SetMaskLocked(key, it->second, new_mask, t);
  if (new_mask == 0) {  // lowest_tier_evicts dropped the block's only copy: gone (NotFound), not lost
    entries_.erase(it);
    lost_.erase(key);
    dropped_blocks_.fetch_add(1, std::memory_order_relaxed);
  }
  if (!es.ok() && !es.IsNotFound()) return es;
  slot(t).measured.Add(slot(t).measured.evictions);
  evictions_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

void StoreImpl::MaybeScheduleDemotion(int t) {
  if (stopping_.load(std::memory_order_acquire) || t == LowestSlot()) return;
  const Tier& src = tier(t);
  auto cap = static_cast<double>(src.caps().capacity_bytes);
  if (static_cast<double>(src.allocated_bytes()) <= options_.high_watermark * cap) return;
  if (slot(t).demotion_scheduled.exchange(true)) return;
  demotion_lane_.Post([this, t, cap] {
    const Tier& tr = tier(t);
    while (!stopping_.load(std::memory_order_acquire) &&
           static_cast<double>(tr.allocated_bytes()) > options_.low_watermark * cap) {
      if (!EvictOne(t).ok()) break;
    }
    slot(t).demotion_scheduled.store(false);
  });
}

}  // namespace terrace::store_internal
