#include "tiers/nvme/extent_allocator.h"

#include <cassert>

namespace terrace::nvme {

ExtentAllocator::ExtentAllocator(std::uint64_t begin, std::uint64_t end, std::uint64_t unit)
    : begin_(begin), end_(end), unit_(unit) {
  if (end_ > begin_) Insert(begin_, end_ - begin_);
}

void ExtentAllocator::ResetWithUsed(std::span<const Extent> used) {
  by_offset_.clear();
  by_size_.clear();
  free_bytes_ = 0;
  std::uint64_t cursor = begin_;
  for (const Extent& e : used) {
    std::uint64_t len = Round(e.length);
    assert(e.offset >= cursor && e.offset + len <= end_);
    if (e.offset > cursor) Insert(cursor, e.offset - cursor);
    cursor = e.offset + len;
  }
  if (end_ > cursor) Insert(cursor, end_ - cursor);
}

void ExtentAllocator::Insert(std::uint64_t off, std::uint64_t len) {
  by_offset_.emplace(off, len);
  by_size_.emplace(len, off);
  free_bytes_ += len;
}

void ExtentAllocator::Remove(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

std::optional<std::uint64_t> ExtentAllocator::Allocate(std::uint64_t bytes) {
  std::uint64_t need = Round(bytes == 0 ? 1 : bytes);
  auto fit = by_size_.lower_bound({need, 0});
  if (fit == by_size_.end()) return std::nullopt;
  auto [len, off] = *fit;
  Remove(by_offset_.find(off));
  if (len > need) Insert(off + need, len - need);
  return off;
}

void ExtentAllocator::Free(std::uint64_t offset, std::uint64_t bytes) {
  std::uint64_t len = Round(bytes == 0 ? 1 : bytes);
  assert(offset >= begin_ && offset + len <= end_);
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= offset);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      len += prev->second;
      Remove(prev);
    }
  }
  next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end()) {
    assert(offset + len <= next->first);
    if (offset + len == next->first) {
      len += next->second;
      Remove(next);
    }
  }
  Insert(offset, len);
}

}  // namespace terrace::nvme
