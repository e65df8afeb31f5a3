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

#include "src/common/aligned_buffer.h"
#include "terrace/kv_layout.h"

namespace terrace::kv {

// Raw blocks start at this alignment inside a buffer (the NVMe tier's direct-I/O unit).
inline constexpr std::uint64_t kRawAlign = kSubRangeAlign;
// Window buffers the readers and the decoder share: one per reader being read, one being decoded,
// and three read and waiting for the decoder, so the reads run on while a window's decode is
// slow (the decoder shares the CPU with the forward pass's first layers).
inline constexpr std::size_t kWindowBuffers = 6;

// Uninitialised raw-block memory (a read overwrites it; zero-filling it first would only add page
// faults and a memset to the restore), kept across restores: EnsureRaw keeps it when its room is
// already large enough, and throws std::bad_alloc when it cannot get the room.
using RawBuffer = AlignedBuffer;
static_assert(kRawAlign == AlignedBuffer::kDefaultAlignment);

inline void EnsureRaw(RawBuffer& buf, std::uint64_t bytes) {
  if (!buf.Ensure(static_cast<std::size_t>(bytes), kRawAlign)) throw std::bad_alloc();
}

// One restore's reusable buffers: the KV window buffers, the snapshots' raw blocks, and each KDA
// layer's decoded recurrent and conv state (index j of KvLayout::kda_layers()).
struct RestoreBuffers {
  std::array<RawBuffer, kWindowBuffers> windows;
  RawBuffer snapshots;
  std::vector<std::vector<float>> recurrent, conv;
};

// Up to kMaxPooled sets kept for later restores (more concurrent restores allocate their own,
// dropped when they end). Memory held: six KV windows (<= 6 x 2 MiB plus a block each),
// the boundary's snapshot blocks and their decoded floats, per set.
class RestoreBufferPool {
 public:
  static constexpr std::size_t kMaxPooled = 2;
  // A pooled set (the most recently returned) or a new, empty one.
  std::unique_ptr<RestoreBuffers> Take() {
    MutexLock lock(&mu_);
    if (free_.empty()) return std::make_unique<RestoreBuffers>();
    auto b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void Give(std::unique_ptr<RestoreBuffers> b) {
    MutexLock lock(&mu_);
    if (b && free_.size() < kMaxPooled) free_.push_back(std::move(b));
  }

 private:
  Mutex mu_;
  std::vector<std::unique_ptr<RestoreBuffers>> free_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace::kv
