#include "tiers/nvme/staging_pool.h"

#include <cstdlib>
#include <new>

namespace terrace::nvme {

StagingPool::StagingPool(std::size_t count, std::size_t buffer_bytes) : count_(count), bytes_(buffer_bytes) {
  base_ = AlignedBuffer(count_ * bytes_);
  if (!base_.data()) throw std::bad_alloc();
  for (std::size_t i = count_; i-- > 0;) free_.push_back(static_cast<int>(i));
}

StagingPool::~StagingPool() = default;

void StagingPool::Acquire(std::size_t want, std::vector<int>* out) {
  MutexLock l(&mu_);
  while (free_.empty()) cv_.Wait(&mu_);
  while (want-- > 0 && !free_.empty()) {
    out->push_back(free_.back());
    free_.pop_back();
  }
}

void StagingPool::Release(std::span<const int> bufs) {
  if (bufs.empty()) return;
  {
    MutexLock l(&mu_);
    free_.insert(free_.end(), bufs.begin(), bufs.end());
  }
  cv_.SignalAll();
}

std::vector<iovec> StagingPool::iovecs() const {
  std::vector<iovec> v(count_);
  for (std::size_t i = 0; i < count_; ++i) v[i] = iovec{data(static_cast<int>(i)), bytes_};
  return v;
}

}  // namespace terrace::nvme
