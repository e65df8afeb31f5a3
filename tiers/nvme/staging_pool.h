// A bounded pool of 4 KiB-aligned staging buffers, registered with io_uring as fixed buffers
// 0..count-1. Used for callers' spans that are not 4 KiB-aligned and for partial tail units.
// Thread-safety: Acquire / Release are thread-safe; a buffer belongs to one caller between them.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <span>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/mutex.h"

namespace terrace::nvme {

class StagingPool {
 public:
  StagingPool(std::size_t count, std::size_t buffer_bytes);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Appends between 1 and `want` (>= 1) buffer indices to *out; blocks until at least one is free.
  // A caller never holds buffers while waiting for more, so acquisition cannot deadlock.
  void Acquire(std::size_t want, std::vector<int>* out);
  void Release(std::span<const int> bufs);

  std::byte* data(int i) const { return base_.data() + static_cast<std::size_t>(i) * bytes_; }
  std::size_t buffer_bytes() const { return bytes_; }
  std::size_t count() const { return count_; }
  std::vector<iovec> iovecs() const;

 private:
  std::size_t count_, bytes_;
  AlignedBuffer base_;  // count_ * bytes_ bytes, 4 KiB-aligned
  Mutex mu_;
  CondVar cv_;
  std::vector<int> free_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace::nvme
