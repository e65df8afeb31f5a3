#include "tiers/nvme/staging_pool.h"

#include <cstdlib>
#include <new>

namespace terrace::nvme {

StagingPool::StagingPool(std::size_t count, std::size_t buffer_bytes) : count_(count), bytes_(buffer_bytes) {
  base_ = static_cast<std::byte*>(std::aligned_alloc(4096, count_ * bytes_));
  if (!base_) throw std::bad_alloc();
  for (std::size_t i = count_; i-- > 0;) free_.push_back(static_cast<int>(i));
}

StagingPool::~StagingPool() { std::free(base_); }

void StagingPool::Acquire(std::size_t want, std::vector<int>* out) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !free_.empty(); });
  while (want-- > 0 && !free_.empty()) {
    out->push_back(free_.back());
    free_.pop_back();
  }
}

void StagingPool::Release(std::span<const int> bufs) {
  if (bufs.empty()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    free_.insert(free_.end(), bufs.begin(), bufs.end());
  }
  cv_.notify_all();
}

std::vector<iovec> StagingPool::iovecs() const {
  std::vector<iovec> v(count_);
  for (std::size_t i = 0; i < count_; ++i) v[i] = iovec{data(static_cast<int>(i)), bytes_};
  return v;
}

}  // namespace terrace::nvme
