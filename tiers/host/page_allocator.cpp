#include "tiers/host/page_allocator.h"

#include <bit>
#include <cassert>

namespace terrace::tiers {

int PageAllocator::ClassOf(std::uint32_t pages) {
  assert(pages > 0);
  if (pages < 4) return static_cast<int>(pages) - 1;
  int msb = 31 - std::countl_zero(pages);  // >= 2
  int sub = static_cast<int>((pages >> (msb - 2)) & 3u);
  return 3 + (msb - 2) * 4 + sub;
}

std::uint32_t PageAllocator::ClassFloor(int cls) {
  if (cls < 3) return static_cast<std::uint32_t>(cls) + 1;
  int msb = (cls - 3) / 4 + 2;
  std::uint32_t sub = static_cast<std::uint32_t>((cls - 3) % 4);
  return (4u + sub) << (msb - 2);
}

PageAllocator::PageAllocator(std::uint32_t pages_per_chunk, std::uint32_t max_chunks)
    : pages_per_chunk_(pages_per_chunk), max_chunks_(max_chunks), heads_(kClasses, kNil) {
  assert(pages_per_chunk > 0);
  assert(static_cast<std::uint64_t>(pages_per_chunk) * max_chunks < kNil);
  chunks_.reserve(max_chunks);
}

void PageAllocator::SetRun(std::uint32_t g, std::uint32_t len, bool is_free) {
  std::uint32_t tag = len | (is_free ? kFreeBit : 0u);
  Meta(g).len = tag;
  Meta(g + len - 1).len = tag;
}

void PageAllocator::PushFree(std::uint32_t g, std::uint32_t len) {
  SetRun(g, len, true);
  int c = ClassOf(len);
  PageMeta& m = Meta(g);
  m.prev = kNil;
  m.next = heads_[c];
  if (m.next != kNil) Meta(m.next).prev = g;
  heads_[c] = g;
  nonempty_.set(c);
  free_pages_ += len;
}

void PageAllocator::RemoveFree(std::uint32_t g, std::uint32_t len) {
  int c = ClassOf(len);
  PageMeta& m = Meta(g);
  if (m.prev != kNil) {
    Meta(m.prev).next = m.next;
  } else {
    heads_[c] = m.next;
    if (m.next == kNil) nonempty_.reset(c);
  }
  if (m.next != kNil) Meta(m.next).prev = m.prev;
  m.prev = m.next = kNil;
  free_pages_ -= len;
}

void PageAllocator::AddChunk(std::uint32_t pages) {
  assert(chunks_.size() < max_chunks_ && pages > 0 && pages <= pages_per_chunk_);
  chunks_.emplace_back(pages);
  total_pages_ += pages;
  PushFree(Global(num_chunks() - 1, 0), pages);
}

std::optional<PageExtent> PageAllocator::Allocate(std::uint32_t pages) {
  if (pages == 0) return PageExtent{0, 0, 0};
  if (pages > pages_per_chunk_) return std::nullopt;
  int exact = ClassOf(pages);
  std::uint32_t g = kNil;
  // A run in the exact class may or may not be long enough; try its head first (good fit).
  if (heads_[exact] != kNil && (Meta(heads_[exact]).len & ~kFreeBit) >= pages) g = heads_[exact];
  if (g == kNil) {
    int c = ClassFloor(exact) == pages ? exact : exact + 1;
    for (; c < kClasses; ++c) {
      if (nonempty_.test(c)) break;
    }
    if (c < kClasses) {
      g = heads_[c];
    } else {
      // Nearly full: only the exact class may still hold a long-enough run; scan it (first fit).
      for (std::uint32_t r = heads_[exact]; r != kNil; r = Meta(r).next) {
        if ((Meta(r).len & ~kFreeBit) >= pages) {
          g = r;
          break;
        }
      }
      if (g == kNil) return std::nullopt;
    }
  }
  std::uint32_t len = Meta(g).len & ~kFreeBit;
  RemoveFree(g, len);
  SetRun(g, pages, false);
  if (len > pages) PushFree(g + pages, len - pages);
  return PageExtent{g / pages_per_chunk_, g % pages_per_chunk_, pages};
}

void PageAllocator::Free(const PageExtent& e) {
  if (e.pages == 0) return;
  std::uint32_t g = Global(e.chunk, e.page);
  std::uint32_t len = e.pages;
  assert((Meta(g).len & ~kFreeBit) == len && !(Meta(g).len & kFreeBit));
  const std::uint32_t chunk_pages = static_cast<std::uint32_t>(chunks_[e.chunk].size());
  if (e.page > 0) {  // coalesce left
    std::uint32_t left_tag = Meta(g - 1).len;
    if (left_tag & kFreeBit) {
      std::uint32_t left_len = left_tag & ~kFreeBit;
      RemoveFree(g - left_len, left_len);
      g -= left_len;
      len += left_len;
    }
  }
  std::uint32_t end_page = g % pages_per_chunk_ + len;
  if (end_page < chunk_pages) {  // coalesce right
    std::uint32_t right_tag = Meta(g + len).len;
    if (right_tag & kFreeBit) {
      std::uint32_t right_len = right_tag & ~kFreeBit;
      RemoveFree(g + len, right_len);
      len += right_len;
    }
  }
  PushFree(g, len);
}

std::uint32_t PageAllocator::largest_free_run() const {
  for (int c = kClasses - 1; c >= 0; --c) {
    if (!nonempty_.test(c)) continue;
    std::uint32_t best = 0;
    for (std::uint32_t g = heads_[c]; g != kNil; g = Meta(g).next) {
      std::uint32_t len = Meta(g).len & ~kFreeBit;
      if (len > best) best = len;
    }
    return best;
  }
  return 0;
}

bool PageAllocator::CheckInvariants() const {
  std::uint64_t free_seen = 0;
  for (std::uint32_t c = 0; c < num_chunks(); ++c) {
    const auto& meta = chunks_[c];
    std::uint32_t p = 0;
    bool prev_free = false;
    while (p < meta.size()) {
      std::uint32_t tag = meta[p].len;
      std::uint32_t len = tag & ~kFreeBit;
      bool is_free = tag & kFreeBit;
      if (len == 0 || p + len > meta.size() || meta[p + len - 1].len != tag) return false;
      if (is_free && prev_free) return false;  // two adjacent free runs: missed coalescing
      if (is_free) free_seen += len;
      prev_free = is_free;
      p += len;
    }
  }
  if (free_seen != free_pages_) return false;
  std::uint64_t listed = 0;
  for (int c = 0; c < kClasses; ++c) {
    if (nonempty_.test(c) != (heads_[c] != kNil)) return false;
    std::uint32_t prev = kNil;
    for (std::uint32_t g = heads_[c]; g != kNil; g = Meta(g).next) {
      const PageMeta& m = Meta(g);
      if (!(m.len & kFreeBit) || ClassOf(m.len & ~kFreeBit) != c || m.prev != prev) return false;
      listed += m.len & ~kFreeBit;
      prev = g;
    }
  }
  return listed == free_pages_;
}

}  // namespace terrace::tiers
