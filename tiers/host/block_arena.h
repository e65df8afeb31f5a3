// BlockArena: the thread-safe block index and space manager shared by the arena tiers (host, CUDA
// HBM). It owns no block memory: it hands out PageExtents in a chunked address space, and the tier
// turns an extent into an address and copies bytes itself, outside the arena's lock.
//
// Write protocol: BeginWrite (reserve an extent) -> copy bytes -> CommitWrite (publish; the previous
// block under the key, if any, is retired) or AbortWrite.
// Read protocol: BeginRead (takes a reference on the block's extent) -> copy -> EndRead. An extent
// replaced or erased while referenced is freed by the last EndRead, so a reader racing an overwrite
// or Erase copies the old block intact, never a mix.
// Pinned blocks cannot be erased or replaced (InvalidArgument) until every Pin is undone.
//
// Chunks are materialized lazily: when no free run fits and the arena is below capacity, the GrowFn
// is called (without the lock held; one grow at a time) to create chunk memory.
// Thread-safety: every method may be called concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory_resource>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "src/common/mutex.h"
#include "terrace/block.h"
#include "terrace/status.h"
#include "terrace/tier.h"
#include "tiers/host/page_allocator.h"

namespace terrace::tiers {

struct BlockArenaOptions {
  std::string tier_name;              // for messages ("host", "hbm")
  std::uint64_t capacity_bytes = 0;   // rounded down to whole pages
  std::uint64_t chunk_bytes = 0;      // growth unit; rounded down to whole pages; <= capacity
  std::uint64_t page_bytes = 4096;    // allocation unit (power of two)
};

class BlockArena {
 public:
  // Called with (chunk index, chunk bytes); must make that chunk's memory usable or fail.
  using GrowFn = std::function<Status(std::uint32_t chunk, std::uint64_t bytes)>;

  BlockArena(const BlockArenaOptions& options, GrowFn grow);
  BlockArena(const BlockArena&) = delete;
  BlockArena& operator=(const BlockArena&) = delete;

  struct Ticket {
    std::uint32_t slot = 0;
    PageExtent extent;
    BlockDesc desc;
  };

  Result<Ticket> BeginWrite(const BlockKey& key, const BlockDesc& desc);
  Status CommitWrite(const BlockKey& key, const Ticket& ticket);  // on error the ticket is aborted
  void AbortWrite(const Ticket& ticket);

  // Materializes chunks (calling the GrowFn, in chunk order) until at least min(bytes, capacity)
  // bytes of chunks exist; chunks that already exist are kept. For populating a tier at open.
  Status GrowTo(std::uint64_t bytes);

  Result<Ticket> BeginRead(const BlockKey& key);
  // drop_corrupt: the reader found the bytes failing their checksum; the block is removed from the
  // index unless pinned or already replaced.
  void EndRead(const BlockKey& key, const Ticket& ticket, bool drop_corrupt);
  // One ranged read (Tier::GetRangeBatch) under a read reference: NotFound if absent, CheckRange's
  // InvalidArgument for a range past the block's end or a short op.out; else `copy(ticket)` runs
  // with the reference held (it copies [op.offset, op.offset + length) of the ticket's extent into
  // op.out; skipped when length is 0) and, when it returns OK, op.desc is filled. Unverified: the
  // checksum covers the whole block. Status copy(const Ticket&).
  template <typename Copy>
  Status ReadRange(RangeOp& op, const Copy& copy) {
    TERRACE_ASSIGN_OR_RETURN(Ticket t, BeginRead(op.key));
    Status st = CheckRange(op, t.desc.size);
    if (st.ok() && op.length > 0) st = copy(t);
    EndRead(op.key, t, false);
    if (st.ok()) op.desc = t.desc;
    return st;
  }

  Result<BlockDesc> Lookup(const BlockKey& key) const;
  Status Erase(const BlockKey& key);
  Status Pin(const BlockKey& key);
  Status Unpin(const BlockKey& key);
  // Extent of a resident block; NotFound if absent.
  Result<PageExtent> Locate(const BlockKey& key) const;

  std::uint64_t used_bytes() const;       // live blocks' sizes summed, in bytes
  std::uint64_t allocated_bytes() const;  // pages held by live blocks, in bytes
  std::uint64_t block_count() const;
  std::uint64_t arena_bytes() const;  // bytes of the chunks materialized so far
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const;

  std::uint64_t page_bytes() const { return page_bytes_; }
  std::uint64_t chunk_bytes() const { return chunk_bytes_; }
  std::uint64_t capacity_bytes() const { return capacity_bytes_; }
  std::uint64_t max_block_bytes() const { return chunk_bytes_; }
  std::uint64_t ByteOffset(const PageExtent& e) const { return std::uint64_t{e.page} * page_bytes_; }
  bool CheckInvariants() const;  // allocator consistency (tests)

 private:
  struct Slot {
    PageExtent extent;
    std::uint32_t refs = 0;  // in-flight readers
    bool retired = false;    // no longer indexed; free when refs drops to 0
  };
  struct Entry {
    BlockDesc desc;
    std::uint32_t slot = 0;
    std::uint32_t pins = 0;
  };

  // Adds chunk alloc_.num_chunks() (growing_ must be false on entry; mu_ is released around the
  // GrowFn and held again on return). Fails with OutOfCapacity at capacity.
  Status GrowOne(std::string_view why) TERRACE_REQUIRES(mu_);
  std::uint32_t NewSlot(const PageExtent& e) TERRACE_REQUIRES(mu_);
  void ReleaseSlot(std::uint32_t slot) TERRACE_REQUIRES(mu_);  // frees extent + slot
  // Takes an indexed block out of the live totals; its slot is freed once no read holds it.
  void RetireEntry(const Entry& e) TERRACE_REQUIRES(mu_);
  std::uint32_t PagesFor(std::uint64_t bytes) const {
    return static_cast<std::uint32_t>((bytes + page_bytes_ - 1) / page_bytes_);
  }

  const std::string tier_name_;
  const std::uint64_t page_bytes_;
  const std::uint64_t chunk_bytes_;
  const std::uint64_t capacity_bytes_;
  const GrowFn grow_;

  mutable Mutex mu_;
  CondVar grow_done_;  // with mu_: growing_ became false
  bool growing_ TERRACE_GUARDED_BY(mu_) = false;
  PageAllocator alloc_ TERRACE_GUARDED_BY(mu_);
  std::vector<Slot> slots_ TERRACE_GUARDED_BY(mu_);
  std::vector<std::uint32_t> free_slots_ TERRACE_GUARDED_BY(mu_);
  std::pmr::unsynchronized_pool_resource pool_ TERRACE_GUARDED_BY(mu_);  // index nodes
  std::pmr::unordered_map<BlockKey, Entry> index_ TERRACE_GUARDED_BY(mu_);
  std::uint64_t used_pages_ TERRACE_GUARDED_BY(mu_) = 0;  // of the indexed blocks
  std::uint64_t used_bytes_ TERRACE_GUARDED_BY(mu_) = 0;  // the indexed blocks' sizes summed
};

}  // namespace terrace::tiers
