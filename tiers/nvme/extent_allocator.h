// Free-space map of the data file: best-fit over free extents, coalesced on free.
//
// Extents are byte ranges whose offset and length are multiples of the unit (4 KiB). Best fit
// (smallest free extent that fits, lowest offset on ties) plus immediate coalescing of neighbours
// keeps fragmentation bounded: freeing everything always yields one extent again.
// Thread-safety: none; the owner serializes access.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <utility>

namespace terrace::nvme {

struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  // bytes, multiple of the unit
};

class ExtentAllocator {
 public:
  // Manages [begin, end); both multiples of `unit`. Everything starts free.
  ExtentAllocator(std::uint64_t begin, std::uint64_t end, std::uint64_t unit);

  // Rebuilds the map with `used` (sorted by offset, non-overlapping, in range) allocated.
  void ResetWithUsed(std::span<const Extent> used);

  // `bytes` is rounded up to the unit. nullopt if no free extent is large enough.
  std::optional<std::uint64_t> Allocate(std::uint64_t bytes);
  // Returns a range obtained from Allocate (same byte count). Coalesces with neighbours.
  void Free(std::uint64_t offset, std::uint64_t bytes);

  std::uint64_t free_bytes() const { return free_bytes_; }
  std::uint64_t total_bytes() const { return end_ - begin_; }
  std::uint64_t largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }
  std::size_t free_extents() const { return by_offset_.size(); }
  // For tests: visits free extents in offset order.
  template <typename Fn>
  void ForEachFree(Fn&& fn) const {
    for (const auto& [off, len] : by_offset_) fn(Extent{off, len});
  }

 private:
  std::uint64_t Round(std::uint64_t bytes) const { return (bytes + unit_ - 1) / unit_ * unit_; }
  void Insert(std::uint64_t off, std::uint64_t len);
  void Remove(std::map<std::uint64_t, std::uint64_t>::iterator it);

  std::uint64_t begin_, end_, unit_;
  std::uint64_t free_bytes_ = 0;
  std::map<std::uint64_t, std::uint64_t> by_offset_;            // offset -> length
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;   // (length, offset)
};

}  // namespace terrace::nvme
