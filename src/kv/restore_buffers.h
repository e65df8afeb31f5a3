// Internal: the buffers a restore reads raw blocks into and decodes KDA snapshots into, kept by
// the PrefixCache between restores (docs/prefix-cache.md, "Restore", "Buffers"), so a serving
// process's restores write into memory it already faulted in instead of fresh pages.
//
// Thread-safety: RestoreBufferPool's methods may be called concurrently; a RestoreBuffers set
// belongs to one restore between Take and Give.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "terrace/kv_layout.h"

namespace terrace::kv {

// Raw blocks start at this alignment inside a buffer (the NVMe tier's direct-I/O unit).
inline constexpr std::uint64_t kRawAlign = kSubRangeAlign;
// Window buffers the reader and decoder share: one being read, one being decoded, one spare.
inline constexpr std::size_t kWindowBuffers = 3;

// An uninitialised, kRawAlign-aligned byte buffer (a read overwrites it; zero-filling it first
// would only add page faults and a memset to the restore). Ensure keeps the memory when it is
// already large enough.
struct RawBuffer {
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{kRawAlign}); }
  };
  std::unique_ptr<std::byte[], Free> data;
  std::uint64_t size = 0;  // bytes `data` holds (0 after a move from it)
  RawBuffer() = default;
  RawBuffer(RawBuffer&& o) noexcept : data(std::move(o.data)), size(std::exchange(o.size, 0)) {}
  RawBuffer& operator=(RawBuffer&& o) noexcept {
    data = std::move(o.data);
    size = std::exchange(o.size, 0);
    return *this;
  }
  void Ensure(std::uint64_t n) {
    if (size >= n) return;
    data.reset(static_cast<std::byte*>(::operator new[](n, std::align_val_t{kRawAlign})));
    size = n;
  }
};

// One restore's reusable buffers: the KV window buffers, the snapshots' raw blocks, and each KDA
// layer's decoded recurrent and conv state (index j of KvLayout::kda_layers()).
struct RestoreBuffers {
  std::array<RawBuffer, kWindowBuffers> windows;
  RawBuffer snapshots;
  std::vector<std::vector<float>> recurrent, conv;
};

// Up to kMaxPooled sets kept for later restores (more concurrent restores allocate their own,
// dropped when they end). Memory held: about three KV windows (<= 3 x 4 MiB plus a block each),
// the boundary's snapshot blocks and their decoded floats, per set.
class RestoreBufferPool {
 public:
  static constexpr std::size_t kMaxPooled = 2;
  // A pooled set (the most recently returned) or a new, empty one.
  std::unique_ptr<RestoreBuffers> Take() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return std::make_unique<RestoreBuffers>();
    auto b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void Give(std::unique_ptr<RestoreBuffers> b) {
    std::lock_guard lock(mu_);
    if (b && free_.size() < kMaxPooled) free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<RestoreBuffers>> free_;  // (mu_)
};

}  // namespace terrace::kv
