// PageAllocator: a segregated-fit page-run allocator (TLSF-style) over one or more fixed-size
// chunks of an address space it does not own. Shared by the host tier (pinned host chunks) and the
// CUDA HBM tier (one device arena).
//
// - Unit: pages of `page_bytes`. A block of n pages gets a contiguous run of exactly n pages inside
//   one chunk (runs never cross chunks); there is no rounding beyond the page.
// - Free runs are kept in size-class lists: 1, 2, 3 pages, then 4 * 2^k * {1, 1.25, 1.5, 1.75}.
//   Allocate(n) takes the head of the first non-empty class whose every run is >= n pages (O(1) via a
//   bitmap), splits off the remainder; only when no such class has a run does it scan the exact
//   class's list (first fit), so Allocate fails only if no free run of n pages exists at all.
//   Free coalesces with both neighbours (boundary tags), so free
//   space never splinters permanently and fragmentation does not grow over a long run.
// - Metadata: 12 bytes per page, allocated once when a chunk is added; Allocate/Free never allocate.
// - Thread-safety: none; the owner serializes calls.
#pragma once

#include <bitset>
#include <cstdint>
#include <optional>
#include <vector>

namespace terrace::tiers {

struct PageExtent {
  std::uint32_t chunk = 0;
  std::uint32_t page = 0;   // first page inside the chunk
  std::uint32_t pages = 0;  // 0 for an empty block (no memory)
};

class PageAllocator {
 public:
  // `pages_per_chunk`: the largest chunk; `max_chunks`: the most chunks that may be added.
  // Precondition: pages_per_chunk * max_chunks < 2^32 - 1 (pick a larger page for huge arenas).
  PageAllocator(std::uint32_t pages_per_chunk, std::uint32_t max_chunks);

  // Adds chunk number num_chunks() holding `pages` (<= pages_per_chunk) free pages.
  void AddChunk(std::uint32_t pages);
  std::uint32_t num_chunks() const { return static_cast<std::uint32_t>(chunks_.size()); }
  std::uint32_t max_chunks() const { return max_chunks_; }

  // nullopt when no free run of `pages` exists in the chunks added so far. pages == 0 always succeeds.
  std::optional<PageExtent> Allocate(std::uint32_t pages);
  // Precondition: `e` came from Allocate and was not freed since.
  void Free(const PageExtent& e);

  std::uint64_t total_pages() const { return total_pages_; }  // in added chunks
  std::uint64_t free_pages() const { return free_pages_; }
  std::uint32_t largest_free_run() const;  // O(classes + one list); for diagnostics
  // Verifies the free lists and boundary tags; returns false on any inconsistency (tests).
  bool CheckInvariants() const;

  static int ClassOf(std::uint32_t pages);           // class whose range holds `pages`
  static std::uint32_t ClassFloor(int cls);          // smallest run length in class `cls`
  static constexpr int kClasses = 3 + 30 * 4;

 private:
  static constexpr std::uint32_t kNil = 0xffffffffu;
  static constexpr std::uint32_t kFreeBit = 0x80000000u;
  struct PageMeta {
    std::uint32_t len = 0;  // at the first and last page of a run: run length | kFreeBit if free
    std::uint32_t prev = kNil, next = kNil;  // free-list links (global page ids), first page only
  };

  std::uint32_t Global(std::uint32_t chunk, std::uint32_t page) const { return chunk * pages_per_chunk_ + page; }
  PageMeta& Meta(std::uint32_t g) { return chunks_[g / pages_per_chunk_][g % pages_per_chunk_]; }
  const PageMeta& Meta(std::uint32_t g) const { return chunks_[g / pages_per_chunk_][g % pages_per_chunk_]; }
  void SetRun(std::uint32_t g, std::uint32_t len, bool is_free);
  void PushFree(std::uint32_t g, std::uint32_t len);
  void RemoveFree(std::uint32_t g, std::uint32_t len);

  std::uint32_t pages_per_chunk_;
  std::uint32_t max_chunks_;
  std::vector<std::vector<PageMeta>> chunks_;
  std::vector<std::uint32_t> heads_;  // per class: first free run (global page id) or kNil
  std::bitset<kClasses> nonempty_;
  std::uint64_t total_pages_ = 0;
  std::uint64_t free_pages_ = 0;
};

}  // namespace terrace::tiers
