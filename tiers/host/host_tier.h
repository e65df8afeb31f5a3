// HostTier: blocks in (pinned) host RAM.
//
// Memory: an arena grown lazily in HostTierOptions::chunk_bytes chunks up to capacity_bytes; each
// chunk is pinned when it is added (see pinned_memory.h). With HostTierOptions::huge_pages (off by
// default; and THP "always" or "madvise"), mmap'ed chunks are 2 MiB-aligned and advised MADV_HUGEPAGE. With
// HostTierOptions::prefault, adding a chunk only maps it (locked on fault) and a background
// Prefaulter faults its pages in ahead of the puts (one touch per huge page; it jumps ahead of a
// put that overtook it); without, pinning faults the whole chunk on the putting thread. HostTierOptions::populate
// kBackground / kAtOpen materialize the first populate_bytes of chunks at Create and fault them in
// on the prefaulter (from open, in allocation order) or before Create returns. A refused pin is logged once per tier (a
// warning to HostTierOptions::logger) and shown in Stats().detail, never fatal. Blocks are page-aligned runs of 4 KiB pages (BlockArena /
// PageAllocator): a block uses ceil(size / 4 KiB) pages, at most one chunk.
//
// Contract beyond terrace/tier.h:
// - Get verifies the XXH3-64 checksum while it copies (fused, from cache) on every call: host memory
//   is not trusted blindly, and a failing block is dropped (unless pinned) and reported as Corruption.
//   A destination of at least stream_get_bytes() (one Get's buffer, or a GetBatch's together) is
//   written with streaming stores (HostTierOptions::stream_get_min_bytes).
//   Put trusts desc.checksum (the caller computed it with DescribeBlock); desc.size must equal
//   data.size().
// - Put on a pinned key returns InvalidArgument (a resident pointer to it may be in use).
// - ResidentPtr is a host pointer, valid while the block is pinned; memory is MemoryKind::kHost.
// - used_bytes is the live blocks' sizes summed; allocated_bytes (and Stats().allocated_bytes)
//   counts their whole pages; max_block_bytes is min(chunk_bytes, capacity).
// Thread-safety: all methods; copies run outside the index lock, so puts and gets scale.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "src/common/mutex.h"
#include "terrace/options.h"
#include "terrace/tier.h"
#include "tiers/host/block_arena.h"
#include "tiers/host/pinned_memory.h"
#include "tiers/host/prefaulter.h"

namespace terrace {

class HostTier final : public Tier {
 public:
  // `name` names the tier in error messages ("host"; the emulated HBM tier passes its own).
  // Unavailable when the prefault thread (prefault, or populate kBackground) cannot be started.
  // InvalidArgument when capacity_bytes exceeds MaxCapacityBytes(chunk_bytes).
  static Result<std::unique_ptr<HostTier>> Create(const HostTierOptions& options, std::string_view name = "host");
  // The largest capacity_bytes Create accepts with chunks of `chunk_bytes` (>= 4 KiB): at most
  // 1,000,000 chunks, and every 4 KiB page numbered by the arena's 32-bit page ids.
  static std::uint64_t MaxCapacityBytes(std::uint64_t chunk_bytes);
  ~HostTier() override;

  const TierCaps& caps() const override { return caps_; }
  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override;
  // Hashes while it copies (tiers::CopyForPutAndChecksum): one read of `data`.
  Status PutDescribing(const BlockKey& key, BlockDesc* desc, std::span<const std::byte> data) override;
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override;
  // Get of each op; streams the copies when the ops' buffers together reach stream_get_bytes().
  std::vector<Status> GetBatch(std::span<GetOp> ops) override;
  // Copies each range straight from the arena (memcpy, under the block's read reference, so a
  // racing overwrite or Erase leaves the bytes intact until the copy is done); no checksum, no
  // whole-block copy. Counted in Stats() hits / misses / bytes_read (the range's length).
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override;
  // The destination size from which gets stream (HostTierOptions::stream_get_min_bytes resolved;
  // UINT64_MAX: never).
  std::uint64_t stream_get_bytes() const { return stream_get_bytes_; }
  Result<BlockDesc> Lookup(const BlockKey& key) const override { return arena_.Lookup(key); }
  Status Erase(const BlockKey& key) override;
  // Reserve hands out the block's page-aligned arena extent (whole pages); Commit publishes it.
  Result<Reservation> Reserve(const BlockKey& key, const BlockDesc& desc) override;
  Status Commit(const BlockKey& key, const BlockDesc& desc, const Reservation& r) override;
  void Abort(const Reservation& r) override;
  Status Pin(const BlockKey& key) override { return arena_.Pin(key); }
  Status Unpin(const BlockKey& key) override { return arena_.Unpin(key); }
  const std::byte* ResidentPtr(const BlockKey& key) const override;
  std::uint64_t used_bytes() const override { return arena_.used_bytes(); }
  std::uint64_t allocated_bytes() const override { return arena_.allocated_bytes(); }
  std::uint64_t block_count() const override { return arena_.block_count(); }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override {
    arena_.ForEach(fn);
  }
  TierStatsSnapshot Stats() const override;

  // The arena chunks materialized so far (for io_uring buffer registration). A chunk, once listed,
  // stays mapped at the same address until the tier is destroyed; more may appear later.
  std::vector<iovec> Regions() const;
  std::vector<std::span<std::byte>> IoRegions() const override;
  // Bytes of arena chunks materialized so far (<= capacity).
  std::uint64_t arena_bytes() const { return arena_.arena_bytes(); }
  // "pinned: yes (cudaHostAlloc)", "pinned: no (mlock refused)", ...; empty until a chunk exists.
  std::string PinSummary() const;
  // "huge pages: yes (THP madvise; 512 of 512 MiB faulted in as huge pages)", "huge pages: no
  // (THP never)", "huge pages: no (HostTierOptions::huge_pages off)", ... Reads /proc/self/smaps
  // when huge pages were advised (tiers::AnonHugeBytes): for stats, not data paths.
  std::string HugePageSummary() const;
  // Bytes of the arena's chunks backed by transparent huge pages now (tiers::AnonHugeBytes); tests.
  std::uint64_t huge_page_bytes() const;
  // True when new mmap'ed chunks are advised MADV_HUGEPAGE (HostTierOptions::huge_pages and THP
  // "always" or "madvise").
  bool huge_pages_advised() const { return huge_pages_; }
  // Allocator consistency check, for tests.
  bool CheckInvariants() const { return arena_.CheckInvariants(); }
  // Blocks until the chunks added so far have been faulted in ahead (no-op without a prefaulter); tests.
  void WaitForPrefault() const;
  // Puts whose copy used streaming stores (tiers/host/stream_copy.h) so far; tests.
  std::uint64_t streamed_puts() const { return streamed_puts_.load(std::memory_order_relaxed); }
  // Gets copied out with streaming stores (stream_get_bytes()).
  std::uint64_t streamed_gets() const { return streamed_gets_.load(std::memory_order_relaxed); }
  // Nanoseconds Create spent populating (HostPopulate::kAtOpen: faulting; kBackground: mapping only).
  std::uint64_t open_populate_ns() const { return open_populate_ns_; }

 private:
  HostTier(const HostTierOptions& options, std::string_view name);
  Status Grow(std::uint32_t chunk, std::uint64_t bytes);
  std::byte* Address(const tiers::PageExtent& e) const;
  // The put copies. Streaming stores only into pages known to be faulted in: into a page the
  // kernel has just zeroed (its lines still in cache) they are slower than memcpy's cached stores.
  bool FaultedIn(const tiers::PageExtent& e) const;
  void NoteWritten(const tiers::PageExtent& e);
  void CopyIn(const tiers::PageExtent& e, const std::byte* src, std::size_t n);
  std::uint64_t CopyInAndChecksum(const tiers::PageExtent& e, const std::byte* src, std::size_t n);

  // Get with the copy chosen by the caller: `stream` writes `out` with streaming stores.
  Status GetInto(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc, bool stream);

  const HostTierOptions options_;
  const std::string name_;  // in error messages
  std::uint64_t stream_get_bytes_ = UINT64_MAX;
  const std::shared_ptr<Logger> logger_;  // options_.logger or stderr; never null
  LogOnce pin_refusal_log_;               // a refused pin is logged for the first chunk only
  TierCaps caps_;
  // Chunk base addresses, sized for every possible chunk at construction; entry i is written once,
  // before chunk i is handed to the allocator (which publishes it under the arena lock).
  std::vector<std::byte*> bases_;
  // Per chunk: bytes from its start known to be faulted in (the whole chunk when it was populated
  // or locked before first use; else the end of the furthest put so far). A hint for the copy
  // only (pages below it that no put wrote are merely slower to stream into), never for data.
  std::unique_ptr<std::atomic<std::uint64_t>[]> faulted_;
  std::atomic<std::uint64_t> streamed_puts_{0};
  std::atomic<std::uint64_t> streamed_gets_{0};
  mutable Mutex chunks_mu_;
  std::vector<tiers::HostChunk> chunks_ TERRACE_GUARDED_BY(chunks_mu_);
  // Null without HostTierOptions::prefault or populate kBackground. Destroyed before the chunks are unmapped.
  std::unique_ptr<tiers::Prefaulter> prefaulter_;
  tiers::BlockArena arena_;
  bool huge_pages_ = false;              // chunks are advised MADV_HUGEPAGE; set by the constructor
  std::string huge_note_;                // why (not), for HugePageSummary; set by the constructor
  std::uint32_t populate_chunks_ = 0;   // chunks [0, n) are populated at open; set by the constructor
  std::uint64_t open_populate_ns_ = 0;  // written by Create before the tier is shared
  mutable TierCounters counters_;
};

}  // namespace terrace
