// StoreImpl: the state behind terrace::Store. Internal; see include/terrace/store.h for the rules.
//
// Locking (acquire in this order; never block on a key lock while holding mu_):
//   1. key_locks_ stripe of the key an operation is about (blocking), then victims' stripes with
//      TryLock only.
//   2. mu_ guards the directory (entries_) and the eviction policies; held only for short
//      bookkeeping, never across tier I/O.
// Every change to an entry's mask (which tiers hold a copy) happens with the key's stripe held.
// Gets of a copy at or above put_tier take no key lock: tiers replace blocks atomically and the
// store re-verifies checksums; any anomaly retries on the locked slow path.
#pragma once

#include <array>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "src/common/key_map.h"
#include "src/store/eviction_policy.h"
#include "src/store/inflight.h"
#include "src/store/key_locks.h"
#include "src/store/thread_pool.h"
#include "terrace/store.h"

namespace terrace::store_internal {

inline std::uint8_t Bit(TierId t) { return static_cast<std::uint8_t>(1u << static_cast<unsigned>(t)); }
inline TierId TierAt(int i) { return static_cast<TierId>(i); }
inline int Idx(TierId t) { return static_cast<int>(t); }
// Index of the fastest tier in `mask`, or -1 when the mask is empty.
inline int Fastest(std::uint8_t mask) {
  for (int i = 0; i < kNumTiers; ++i) {
    if (mask & Bit(TierAt(i))) return i;
  }
  return -1;
}

inline std::uint64_t NanosSince(Clock::time_point t0) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// True when a tier's answer (`got`, `bytes`) is the block the directory describes (`want`). A tier
// whose Get verifies its own output (TierCaps::verifies_gets) has already hashed `bytes` against
// got.checksum, so comparing descriptors suffices; any other tier's bytes are hashed here.
inline bool Verify(const TierCaps& caps, const BlockDesc& want, const BlockDesc& got, std::span<const std::byte> bytes) {
  if (got.size != want.size || got.checksum != want.checksum || bytes.size() < want.size) return false;
  return caps.verifies_gets || Checksum(bytes.first(want.size)) == want.checksum;
}

struct Entry {
  BlockDesc desc;
  std::uint8_t mask = 0;                               // bit i: tier i holds a current copy
  std::uint32_t pins = 0;                              // Store::Pin count (all tiers)
  std::array<std::uint32_t, kNumTiers> handle_pins{};  // live BlockHandles per tier
  std::uint64_t version = 0;                           // store-unique, new on every Put that writes
  bool prefetched = false;                             // brought up by Prefetch, not read since
  bool PinnedIn(TierId t) const { return pins > 0 || handle_pins[Idx(t)] > 0; }
  bool AnyPin() const { return pins > 0 || handle_pins[0] + handle_pins[1] + handle_pins[2] > 0; }
};

// How a locked read moves the block it reads.
enum class MoveMode : std::uint8_t {
  kNone,   // read only
  kUp,     // copy into target if the fastest copy is below it
  kExact,  // make sure target holds a copy (from wherever it is)
};

struct ReadOutcome {
  Result<BlockDesc> desc = Status::NotFound("unset");
  Status move_status;  // OK when no move was needed or it succeeded
  bool moved = false;
  bool leader = true;  // false: the result came from another caller's in-flight read
};

struct PrefetchJob;

// One key of a BulkFetch.
struct BulkItem {
  BlockKey key;
  std::span<std::byte> out;  // destination (at least the block's size); empty: read for a move only
  bool handled = false;      // false: finish it on the single-key path
  Status status;             // when handled: the read's outcome (with a move: the move's)
  BlockDesc desc;            // when handled and OK
};

// Counts a demand fetch for as long as it lives (speculative prefetch yields to it).
class DemandScope final {
 public:
  DemandScope(std::mutex& mu, std::condition_variable& cv, int& n) : mu_(mu), cv_(cv), n_(n) {
    std::lock_guard lock(mu_);
    ++n_;
  }
  ~DemandScope() {
    {
      std::lock_guard lock(mu_);
      --n_;
    }
    cv_.notify_all();
  }
  DemandScope(const DemandScope&) = delete;
  DemandScope& operator=(const DemandScope&) = delete;

 private:
  std::mutex& mu_;
  std::condition_variable& cv_;
  int& n_;
};

class StoreImpl {
 public:
  StoreImpl(const StoreOptions& options, std::array<std::unique_ptr<Tier>, kNumTiers> tiers);
  ~StoreImpl();
  Status Init();  // validates tiers, recovers the directory from what they hold

  Status Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts);
  Result<BlockDesc> Get(const BlockKey& key, std::span<std::byte> out);
  Result<BlockHandle> Acquire(const BlockKey& key, TierId where);
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) const;
  bool Contains(const BlockKey& key) const;
  Status Erase(const BlockKey& key);
  Status EvictCopy(const BlockKey& key, TierId tier);  // evict_copy.cpp
  Status Pin(const BlockKey& key);
  Status Unpin(const BlockKey& key);
  void ReleaseHandle(const BlockKey& key, TierId tier);
  Status Flush();

  std::vector<Status> GetBatch(std::span<Store::GetItem> items);
  Future<std::vector<Status>> Prefetch(std::span<const BlockKey> keys, TierId target, Priority priority,
                                       Clock::time_point deadline);
  Future<Result<BlockDesc>> GetAsync(const BlockKey& key, std::span<std::byte> out);
  Future<Status> PutAsync(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts);

  StoreStats Stats() const;
  std::string PrometheusText() const;

  const StoreOptions& options() const { return options_; }
  bool HasTier(TierId t) const { return tiers_[Idx(t)] != nullptr; }

 private:
  // Where a Get from a lower tier moves the block: put_tier (or the nearest tier below it), or
  // nowhere when promote_on_get is off.
  std::optional<TierId> PromoteOnGetTarget() const {
    return options_.promote_on_get ? std::optional(promote_tier_) : std::nullopt;
  }

  // read_path.cpp
  bool FastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result);
  // Deduplicated, locked fetch; with move_to, also moves the block (kUp semantics).
  // Copies the block into `out` when it is non-empty.
  ReadOutcome FetchDedup(const BlockKey& key, std::optional<TierId> move_to, bool by_prefetch,
                         std::span<std::byte> out);
  // Caller holds key's stripe. Reads the fastest good copy into *buf (dropping bad copies) and
  // moves it per `mode`. `dropped` names tiers whose copy the caller already dropped as corrupt.
  ReadOutcome LockedRead(const BlockKey& key, std::vector<std::byte>* buf, MoveMode mode, TierId target,
                         bool by_prefetch, std::string dropped = {});
  // Caller holds key's stripe; `bytes` is the verified block just read from tier `src` while the
  // entry's mask was `mask`. Counts the read, moves the block per `mode`, updates the policies.
  void CompleteLockedRead(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> bytes, int src,
                          std::uint8_t mask, MoveMode mode, TierId target, bool by_prefetch, ReadOutcome* out);
  Status MoveUp(const BlockKey& key, TierId target, bool by_prefetch);
  // Caller holds key's stripe; removes the copy in `t` (already found bad) and records why.
  void DropCopy(const BlockKey& key, TierId t);
  void CountGet(TierId served_from, std::uint8_t present_mask);

  // batch_read.cpp
  // Reads the items held only in non-addressable tiers (NVMe) with one tier GetBatch per source
  // tier (so the reads share the I/O queue), then, one key at a time under its stripe, verifies,
  // counts and moves each like a deduplicating FetchDedup leader would (move_to: kUp to that tier).
  // Items it leaves unhandled (in memory tiers, already being fetched by another caller, missing,
  // buffer too small) are the caller's to finish on the single-key path. `still_wanted(i)`, if
  // given, is asked after the read: a non-OK answer becomes item i's status and nothing moves.
  void BulkFetch(std::span<BulkItem> items, std::optional<TierId> move_to, bool by_prefetch,
                 const std::function<Status(std::size_t)>& still_wanted = {});

  // write_path.cpp
  Status EraseLocked(const BlockKey& key);

  // placement.cpp
  Status PlaceInTier(TierId t, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data);
  // Frees one copy from `t` (demoting it if needed). OutOfCapacity when nothing is evictable, or
  // the error a victim's demotion hit.
  Status EvictOne(TierId t);
  Status EvictLocked(TierId t, const BlockKey& key);
  void MaybeScheduleDemotion(TierId t);
  // Caller holds key's stripe: writes the copy in `from` (described by `desc`) into `to`.
  // Corruption: the copy in `from` failed its checksum (nothing was written).
  Status DemoteCopy(TierId from, TierId to, const BlockKey& key, const BlockDesc& desc);
  // Registers `from`'s memory regions with `to` for direct I/O, again whenever `from` has grown.
  void RefreshIoRegions(TierId from, TierId to);
  std::optional<TierId> LowerPresent(TierId t) const;
  TierId LowestPresent() const;
  Status TimedTierGet(TierId t, const BlockKey& key, std::span<std::byte> out, BlockDesc* desc);
  Status TimedTierPut(TierId t, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data);
  // REQUIRES(mu_): sets e's mask to new_mask, telling the policies; `evicted_from` is the tier a
  // policy eviction removed the copy from, if any.
  void SetMaskLocked(const BlockKey& key, Entry& e, std::uint8_t new_mask, int evicted_from = -1);

  // prefetch.cpp
  using PrefetchItem = std::pair<std::shared_ptr<PrefetchJob>, std::size_t>;  // job, key index
  static constexpr std::size_t kPrefetchGroup = 64;  // items per drainer pass (one batched read)
  void EnqueuePrefetch(const std::shared_ptr<PrefetchJob>& job);
  void DrainPrefetch();
  Status PrefetchCheck(const PrefetchJob& job, std::size_t i) const;  // OK: item i may still start
  void RunPrefetchGroup(std::span<PrefetchItem> group);

  friend class ::terrace::BlockHandle;

  StoreOptions options_;
  const std::shared_ptr<Logger> logger_;  // options_.logger or stderr; never null
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers_;  // immutable after construction
  TierId promote_tier_ = TierId::kHost;  // put_tier, or the nearest present tier below it (Init)
  std::uint8_t present_mask_ = 0;        // tiers configured (Init)

  mutable std::mutex mu_;
  KeyMap<Entry> entries_;  // GUARDED_BY(mu_); no reference into it survives an insert
  std::uint64_t last_version_ = 0;  // GUARDED_BY(mu_): Entry::version source (unique across erase + re-put)
  std::array<std::unique_ptr<EvictionPolicy>, kNumTiers> policies_;         // GUARDED_BY(mu_)

  KeyLocks key_locks_;
  InflightTable inflight_;

  // Store-measured per-tier counters: hits, misses, evictions, read/write latency.
  mutable std::array<TierCounters, kNumTiers> measured_;
  std::atomic<std::uint64_t> promotions_{0}, demotions_{0}, evictions_{0}, dedup_hits_{0},
      lower_tier_reads_{0}, put_dedup_hits_{0}, prefetch_issued_{0}, prefetch_useful_{0},
      prefetch_late_{0}, corruptions_dropped_{0};

  // Demand fetches in progress; speculative prefetch waits while this is non-zero.
  std::mutex demand_mu_;
  std::condition_variable demand_cv_;
  int demand_active_ = 0;  // GUARDED_BY(demand_mu_)

  std::array<std::atomic<bool>, kNumTiers> demotion_scheduled_{};
  std::atomic<bool> stopping_{false};

  std::mutex prefetch_mu_;
  std::array<std::deque<PrefetchItem>, 3> prefetch_queues_;  // GUARDED_BY(prefetch_mu_), by Priority
  unsigned prefetch_drainers_ = 0;  // GUARDED_BY(prefetch_mu_)

  std::mutex regions_mu_;
  std::array<std::size_t, kNumTiers> registered_regions_{};  // GUARDED_BY(regions_mu_): by source tier
  LogOnce regions_log_;  // "memory not registered" is logged for the first failure only

  ThreadPool pool_;  // last member: joined first on destruction
};

}  // namespace terrace::store_internal
