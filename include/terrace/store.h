// terrace::Store: the tiered block store (HBM -> pinned host RAM -> NVMe) embedders use.
//
// Thread-safety: every Store method may be called concurrently from any thread. Operations on one
// key are linearizable: a reader sees the old or the new block of a concurrent Put, never a mix.
//
// Movement rules:
// - Put places a block in put_tier (or PutOptions::tier; if that tier is absent, the nearest
//   present tier below it) and removes the key's copies elsewhere. Write-through also writes the
//   lowest present tier first. Putting the bytes already stored is a no-op (put_dedup_hits).
// - A write-through Put from a host buffer whose target tier has no room (OutOfCapacity after the
//   lowest tier's write: its blocks pinned or busy) returns OK with the block in the lowest tier
//   only, as if evicted at once (StoreStats::puts_placed_lower). A block larger than the target
//   tier can ever hold is refused before anything is written. A Put from device memory (kDevice)
//   writes its target tier first, so when that tier has no room it returns OutOfCapacity and
//   stores the block nowhere: it is not placed lower and the key's previous version stays.
// - A failed Put leaves the store as it was, except a write-through Put whose target-tier write
//   fails otherwise (an I/O error) after its lowest-tier write replaced the previous version there:
//   then every copy of the key is removed and the Status says so. (A Put from
//   device memory writes the lowest tier last: when that write fails, the new version is removed
//   and the previous one kept, except its copy in the target tier, which the Put had replaced.)
// - Get reads the fastest copy and verifies its checksum. A mismatch is re-read under the key's
//   lock (so a concurrent replacement is not mistaken for damage); a copy that still fails is
//   dropped and the next copy is tried; with no good copy left Get returns Corruption naming the
//   key and tier - and so do later reads of the key (Get, GetBatch, Prefetch), until it is put or
//   erased again: NotFound means "never stored", Corruption "stored but lost". With promote_on_get, a block read from below put_tier is copied up to put_tier;
//   exclusive placement then removes the lower copy, except the lowest tier's copy under
//   write-through, copies pinned by a handle, and every copy of a block pinned with Pin (the
//   extra copy stays after the unpin until the block is evicted, put or erased).
// - Eviction from a tier demotes (write-back) the victim into the next lower present tier before
//   removing it; a victim that already has a copy below is simply dropped. The store never drops
//   the last copy of a block to make room (unless StoreOptions::lowest_tier_evicts: a cache): when
//   the lowest present tier is full (or there is none
//   below), a Put that needs the space fails with OutOfCapacity and leaves the store unchanged; if
//   a demotion write fails, the Put fails with that error and the victim stays where it was.
//   The key's own previous version is a victim like any other outside the tier a write-back Put
//   writes: when only it holds the room a demotion needs, it is demoted in turn (so it survives
//   a Put that then fails, and is readable from the lower tier) and removed once the Put succeeds.
// - Pinned blocks (Pin, live BlockHandles) are never evicted, demoted, moved out of their tier or
//   erased, and a Put of other bytes under a pinned key is refused (InvalidArgument); the same bytes
//   again are a dedup no-op.
// - Background demotion (on the store's thread pool) starts when a tier passes high_watermark and
//   stops at low_watermark; a Put that finds its tier full evicts synchronously just enough.
//   When every evictable block is busy (being demoted or written by another thread), the Put
//   waits for one of them to be released and looks again; it fails OutOfCapacity only when none
//   is released within 2 s (e.g. two Puts each holding the other's only victim).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "terrace/block.h"
#include "terrace/future.h"
#include "terrace/options.h"
#include "terrace/stats.h"
#include "terrace/status.h"
#include "terrace/tier.h"

namespace terrace {

class Store;
namespace store_internal {
class StoreImpl;
}

struct PutOptions {
  Codec codec = Codec::kRaw;
  std::optional<TierId> tier;  // default: StoreOptions::put_tier
};

// Per-call read options (Get, GetBatch with host buffers).
struct GetOptions {
  // Whether a block read from below put_tier is copied up to put_tier (a promotion) or read
  // straight into the caller's buffer and left where it is. Unset: StoreOptions::promote_on_get.
  // A read that will not repeat soon (a one-off restore, a scan) passes false and skips the
  // promotion's copy; a hot key's read passes true even in a store that does not promote.
  std::optional<bool> promote;
};

// A caller's buffer and the memory it is in (BufferKind, terrace/tier.h). The plain-span Put and
// Get mean kHost.
struct BufferRef {
  std::span<std::byte> bytes;
  BufferKind kind = BufferKind::kHost;
};
struct ConstBufferRef {
  std::span<const std::byte> bytes;
  BufferKind kind = BufferKind::kHost;
};

struct LookupResult {
  bool found = false;
  TierId tier = TierId::kHost;  // kind of the fastest tier holding the block (valid when found)
  int slot = -1;                // that tier's position in the store's tier list (StoreStats::slots)
  BlockDesc desc;
};

// Prefetch priority. kDemand runs like a Get; kHigh and kLow are speculative: they wait while
// demand fetches are in flight, and kHigh items are started before kLow ones.
enum class Priority : std::uint8_t { kDemand = 0, kHigh = 1, kLow = 2 };

using Clock = std::chrono::steady_clock;

// Options of the Prefetch overload that reports each key as it finishes.
struct PrefetchOptions {
  Priority priority = Priority::kHigh;
  // Items not started when it passes complete TimedOut.
  Clock::time_point deadline = Clock::time_point::max();
  // Called once per key, with the key's index in `keys` and its Status (the same one the Future's
  // vector holds), as soon as that key is done: OK means the block is in the target tier or a
  // faster one (a prefetch only moves blocks up; it may be evicted again at any time, like any
  // unpinned copy). Runs on the store thread that finished
  // the key, or on the calling thread inside Prefetch for keys that fail at once; before the
  // Future completes; with no store lock held, so it may call Store methods (a Get of a key of the
  // same prefetch that is still to load reads it at once rather than waiting on the prefetch's own
  // thread, which is running the callback). It must not block for
  // long (it delays the store's other prefetch items) and must not throw. Empty: not called.
  std::function<void(std::size_t index, const Status& status)> on_item;
};

// A move-only handle to a block resident in an addressable tier. While it lives the block is
// pinned in that tier, so data() stays valid. It must not outlive its Store (the Store's
// destructor logs an error naming how many handles are still live, and asserts in debug builds).
class BlockHandle {
 public:
  BlockHandle() = default;
  ~BlockHandle();
  BlockHandle(BlockHandle&& other) noexcept;
  BlockHandle& operator=(BlockHandle&& other) noexcept;
  BlockHandle(const BlockHandle&) = delete;
  BlockHandle& operator=(const BlockHandle&) = delete;

  bool valid() const { return impl_ != nullptr; }
  // The block's bytes; device memory when memory_kind() == kDevice.
  const std::byte* data() const { return data_; }
  std::uint64_t size() const { return desc_.size; }
  const BlockDesc& desc() const { return desc_; }
  const BlockKey& key() const { return key_; }
  MemoryKind memory_kind() const { return memory_; }
  TierId tier() const { return tier_; }  // the kind of the tier holding it
  // Unpins now; the handle becomes invalid.
  void Release();

 private:
  friend class store_internal::StoreImpl;
  store_internal::StoreImpl* impl_ = nullptr;
  BlockKey key_;
  BlockDesc desc_;
  const std::byte* data_ = nullptr;
  MemoryKind memory_ = MemoryKind::kNone;
  TierId tier_ = TierId::kHost;
  int slot_ = -1;
};

// Store-level statistics. Per-tier snapshots come from the tiers, except: hits = Gets served from
// that tier, misses = Gets that found no copy there, and the latency percentiles, which the store
// measures around its own calls into the tier.
struct StoreStats {
  // Every tier slot, fastest first; name = the slot's name ("hbm", "host", "nvme", "nvme-2", ...).
  std::vector<TierStatsSnapshot> slots;
  // The standard view, index = TierId: the first slot of each kind (the same snapshot as in slots).
  std::array<bool, kNumTiers> present{};
  std::array<TierStatsSnapshot, kNumTiers> tiers{};
  std::uint64_t blocks = 0;               // distinct keys stored
  std::uint64_t promotions = 0;           // copies moved/copied to a faster tier
  std::uint64_t demotions = 0;            // victims written to a slower tier on eviction
  std::uint64_t evictions = 0;            // copies removed to make room (demoted or clean)
  std::uint64_t dropped_blocks = 0;       // blocks whose last copy was evicted (lowest_tier_evicts)
  std::string eviction_policy;            // "lru" or "s3fifo"
  std::uint64_t dedup_hits = 0;           // fetches that joined an in-flight read of the same key
  std::uint64_t lower_tier_reads = 0;     // reads issued below put_tier (after dedup)
  std::uint64_t range_reads = 0, range_read_bytes = 0;  // GetRanges items answered OK, and their lengths
  std::uint64_t put_dedup_hits = 0;       // Puts of bytes identical to the stored block (skipped)
  // Write-through Puts from host buffers acknowledged with the block in the lowest tier only: their
  // target tier had no room (its blocks pinned or busy), so the block is where an eviction would
  // have put it. (A device-memory Put in that case fails with OutOfCapacity; it is not counted.)
  std::uint64_t puts_placed_lower = 0;
  std::uint64_t prefetch_issued = 0;      // prefetch items that moved a block
  std::uint64_t prefetch_useful = 0;      // prefetched blocks later read by a Get
  std::uint64_t prefetch_late = 0;        // Gets that waited on an in-flight prefetch of their key
  std::uint64_t corruptions_dropped = 0;  // copies dropped because they failed checksum
  // Blocks moved between tiers (promotions, prefetches, demotions), and blocks read from a tier
  // below the promotion tier into a Get's / GetBatch's buffer without moving (promote_on_get off).
  // Direct: from one tier's memory into another's, or into the caller's buffer, with no copy in
  // the store (a demotion written from the host arena, an NVMe read landing in a host reservation
  // or in the caller's aligned buffer). Staged: through a store-side buffer and a copy (an NVMe
  // read into a bounce buffer, then into an unaligned caller buffer). The copy of a promoted block
  // from the host arena into the Get's buffer is not counted (a delivery, like a host-tier hit).
  std::uint64_t direct_transfers = 0, direct_transfer_bytes = 0;
  std::uint64_t staged_transfers = 0, staged_transfer_bytes = 0;
  // Device-buffer Gets (Get / GetBatch into BufferKind::kDevice): blocks copied out of the device
  // tier into the caller's device memory (device to device; a block brought into that tier first
  // is also counted above as a transfer).
  std::uint64_t device_copies = 0, device_copy_bytes = 0;
  // The store's staging (bounce) buffers allocated so far, by the memory they are in:
  // registered with CUDA (cudaHostRegister: host <-> HBM copies from them are DMA; only in CUDA
  // builds with a device present), mlock'ed, or pageable (mlock refused). bounce_memory names the
  // kind: "cuda-registered", "mlock", "pageable", "mixed", or "none" (none allocated yet).
  std::uint64_t bounce_cuda_registered = 0, bounce_locked = 0, bounce_pageable = 0;
  std::string bounce_memory;
};

class Store {
 public:
  // Builds the tiers `options` names (tier_list, or the standard HBM per hbm.mode, host, NVMe when
  // nvme.path is set) and recovers any blocks the tiers already hold. Unavailable when the OS
  // refuses one of the store's (or a tier's) threads (thread or address-space limit); the tiers
  // are closed again.
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  // Uses the given tiers, an ordered list fastest first (1 to kMaxTierSlots, none null); each
  // slot is named after caps().name as StoreOptions::tier_list names them. Capacities come from
  // the tiers; the tier options in `options` are ignored. Unavailable as for Open.
  static Result<std::unique_ptr<Store>> OpenWithTiers(const StoreOptions& options,
                                                      std::vector<std::unique_ptr<Tier>> tiers);
  // The standard configuration: index = TierId, null = absent; caps().id must match the index.
  static Result<std::unique_ptr<Store>> OpenWithTiers(const StoreOptions& options,
                                                      std::array<std::unique_ptr<Tier>, kNumTiers> tiers);
  // Closes the store; work in flight finishes first. Queued GetAsync / PutAsync calls still run
  // and complete with their outcome; prefetch items not yet started complete Cancelled ("the
  // store is closing"), and so do GetAsync, PutAsync and Prefetch called while it closes (from
  // callbacks on the store's threads, which may still call Store methods until it returns).
  // Returns once every Future of the store is complete, its threads are joined and its tiers
  // closed. Run on one of the store's own threads (the last owner released inside a completion
  // callback), it returns at once instead, and the store closes on a thread of its own once that
  // callback has returned; other callbacks must not use this Store after that. Program exit
  // (returning from main, std::exit) waits for such closes, so what the NVMe tier acknowledged is
  // committed as by a close on the caller's thread (blocks only in memory tiers are not written
  // down: they go with the process); std::exit or return from main must then not
  // run on a thread of the store being closed (it would wait for itself).
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  Status Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts = {});
  // Copies the block into `out`; InvalidArgument (naming the size needed) if `out` is too small.
  // May overwrite `out`'s bytes past the block's size, up to out.size() and within the size
  // rounded up to the tiers' io_alignment (4 KiB for NVMe): a buffer aligned to that with such
  // room lets a read from NVMe that moves nothing land in it directly, with no staging copy.
  Result<BlockDesc> Get(const BlockKey& key, std::span<std::byte> out, const GetOptions& opts = {});
  // Buffers with a memory kind. kHost / kPinnedHost: as the span forms. kDevice: the block goes
  // to and from device memory without a host bounce. A device Put lands in its tier (put_tier or
  // opts.tier) only if that tier takes device buffers (TierCaps::device_buffers: the HBM tier),
  // else InvalidArgument; the tier computes the checksum. A device Get first brings the block into
  // the first tier that takes device buffers (like Acquire; InvalidArgument if there is none) and
  // copies it from there. Write-through copies a device Put down to the lowest tier afterwards; a
  // device Put whose tier has no room returns OutOfCapacity and stores the block nowhere (not placed
  // lower, unlike a host-buffer write-through Put).
  // Streams: the tier copies on CUDA streams of its own, created non-blocking, which wait for
  // none of the caller's streams (the legacy default stream included). The caller's writes to a
  // device Put's buffer must be complete before the call (cudaStreamSynchronize or
  // cudaEventSynchronize on the stream that wrote it): bytes a kernel has not yet written would be
  // stored as they are, with a checksum that matches them, and read back as valid ever after. Put
  // and Get return once their copies are complete (the tier synchronises its own stream): the
  // caller may then reuse Put's buffer and read Get's from any stream; until the call returns,
  // nothing may read or write either buffer.
  Status Put(const BlockKey& key, ConstBufferRef data, const PutOptions& opts = {});
  Result<BlockDesc> Get(const BlockKey& key, BufferRef out);
  // Ensures a copy in `where` (an addressable tier), pins it there while the handle lives.
  Result<BlockHandle> Acquire(const BlockKey& key, TierId where = TierId::kHost);
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) const;
  bool Contains(const BlockKey& key) const;
  // Removes every copy. NotFound if absent (a lost block - see Get - is forgotten: OK); InvalidArgument
  // while pinned.
  Status Erase(const BlockKey& key);
  // Drops the copy in `tier` only, and only when a lower tier also holds the block (a clean
  // eviction: nothing is written back, the last copy is never dropped). NotFound if `tier` holds
  // no copy; InvalidArgument while the copy is pinned or when no lower copy exists.
  Status EvictCopy(const BlockKey& key, TierId tier);
  // Pins nest; a pinned block is never evicted or erased.
  Status Pin(const BlockKey& key);
  Status Unpin(const BlockKey& key);

  struct PutItem {
    BlockKey key;
    std::span<const std::byte> data;
    PutOptions opts;
  };
  struct GetItem {
    BlockKey key;
    std::span<std::byte> out;
    BlockDesc desc;  // filled on success
  };
  // A GetBatch item whose buffer has a memory kind (BufferRef).
  struct GetRefItem {
    BlockKey key;
    BufferRef out;
    BlockDesc desc;  // filled on success
  };
  // One Status per item, in order, each as the single-key call would return it. GetBatch hands
  // every block found only on NVMe to the tier in one batch (the reads share its I/O queue), so a
  // batch of small blocks is several times faster than the same Gets one by one; it may overwrite
  // an item's bytes past the block's size (up to out.size()): with buffers laid out as
  // read_gap_bytes() says, blocks adjacent on disk are read as one request. PutBatch and
  // EraseBatch run the items one after another.
  std::vector<Status> PutBatch(std::span<const PutItem> items);
  std::vector<Status> GetBatch(std::span<GetItem> items, const GetOptions& opts = {});
  // GetBatch with buffers of any kind, one Status per item as Get(key, BufferRef) would return it.
  // kHost / kPinnedHost items go through the span form above (as one batch). kDevice items: every
  // block found only on NVMe is read in one tier batch (staged through the store's bounce
  // buffers), placed in the first tier that takes device buffers, then copied device to device
  // into `out`; blocks in a memory tier are moved there (direct from the host arena) and copied
  // the same way. Checksums are verified on every path; a corrupt or missing block is an error
  // for its item only. InvalidArgument for every kDevice item when no tier takes device buffers.
  std::vector<Status> GetBatch(std::span<GetRefItem> items);
  std::vector<Status> EraseBatch(std::span<const BlockKey> keys);

  // A ranged read (GetRanges): bytes [offset, offset + length) of a block.
  struct GetRangeItem {
    BlockKey key;
    std::uint64_t offset = 0, length = 0;
    std::span<std::byte> out;     // at least length bytes
    BlockDesc desc;               // filled on success: the whole block's descriptor
    TierId tier = TierId::kHost;  // filled on success: the kind of tier the range came from
  };
  // Reads each item's range from the fastest copy of its block (Tier::GetRangeBatch, one tier
  // call per source tier), moving nothing: no promotion, no change to eviction order. NOT
  // verified: a block's checksum covers all of it, so the caller checks each range against a
  // checksum of its own and, on a mismatch, reads the whole block with Get (which verifies it,
  // drops a damaged copy and tries the next). One Status per item: NotFound / Corruption for a
  // missing or lost key as Get says them (a key only a shared tier holds is looked up there and
  // adopted, as Get does), InvalidArgument naming the key when the range passes the block's end or `out` is
  // short. A range at a multiple of the tiers' io_alignment, read into memory aligned to it with
  // room for its length rounded up, goes from NVMe with no staging copy (the bytes of `out` past
  // `length`, up to that rounding, may be overwritten).
  std::vector<Status> GetRanges(std::span<GetRangeItem> items);

  // Moves blocks up to `target` in the background; one Status per key, in order. Items not
  // started when `deadline` passes get TimedOut; after Future::cancel() they get Cancelled.
  // The Future completes when every key is done. A kDemand prefetch counts as demand from this
  // call until its last key is done: speculative (kHigh, kLow) items not yet started wait for it,
  // as they do for a Get; speculative items start at most kSpeculativeGroup at a time, so a demand
  // arriving during a large speculative prefetch waits for at most that many reads.
  Future<std::vector<Status>> Prefetch(std::span<const BlockKey> keys, TierId target,
                                       Priority priority = Priority::kHigh,
                                       Clock::time_point deadline = Clock::time_point::max());
  // The same, also reporting each key as soon as it is done (PrefetchOptions::on_item), so a
  // caller can use the first blocks of a batch while the rest still load.
  Future<std::vector<Status>> Prefetch(std::span<const BlockKey> keys, TierId target,
                                       const PrefetchOptions& options);
  // Speculative prefetch items one store thread starts together (one batched tier read).
  static constexpr std::size_t kSpeculativeGroup = 8;
  // Async forms run on the store's thread pool. The caller keeps `out` / `data` alive until the
  // Future is ready.
  Future<Result<BlockDesc>> GetAsync(const BlockKey& key, std::span<std::byte> out);
  Future<Status> PutAsync(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts = {});

  // Durability barrier over every tier: returns once every tier's writes so far are as durable as
  // that tier makes them (the NVMe tier's group commit). It moves no block between tiers: a block
  // whose only copy is in a memory tier (a write-back put into host not yet demoted) is still not
  // on NVMe afterwards (docs/errors.md; use write-through or put_tier kNvme for such blocks).
  Status Flush();

  StoreStats Stats() const;
  // Prometheus text exposition format (version 0.0.4).
  std::string PrometheusText() const;

  const StoreOptions& options() const;
  // True when some slot is of kind `id`.
  bool HasTier(TierId id) const;
  // The largest TierCaps::read_gap_bytes of the tiers: a GetBatch whose buffers lie one after the
  // other, each block's slot its size rounded up to the tiers' io_alignment plus this many bytes
  // (and each out covering its whole slot), lets every tier read blocks adjacent on its medium
  // as one request. 0 when no tier merges reads.
  std::uint32_t read_gap_bytes() const;

 private:
  explicit Store(std::unique_ptr<store_internal::StoreImpl> impl);
  std::unique_ptr<store_internal::StoreImpl> impl_;
};

}  // namespace terrace
