#include "src/store/bounce_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <utility>

#include "src/store/staging_memory.h"

namespace terrace::store_internal {
namespace {

constexpr std::uint64_t kAlign = 4096;

// At least one unit, so an empty request still gets a usable buffer.
std::uint64_t BufferBytes(std::uint64_t n) { return RoundUp(std::max<std::uint64_t>(n, 1), kAlign); }

// Leases this thread holds, over every pool (a nested acquire never waits).
thread_local int t_leases_held = 0;

}  // namespace

BouncePool::BouncePool(std::size_t count, std::uint64_t buffer_bytes, bool cuda_register)
    : buffer_bytes_(BufferBytes(buffer_bytes)),
      count_(std::max<std::size_t>(count, 1)),
      cuda_register_(cuda_register),
      buffers_(count_) {}

BouncePool::~BouncePool() {
  MutexLock lock(&mu_);
  for (Buffer& b : buffers_) {
    if (b.pinning == Pinning::kCuda) staging_memory::Unregister(b.mem.data());
    if (b.pinning == Pinning::kMlock) (void)munlock(b.mem.data(), buffer_bytes_);
  }
}

void BouncePool::Allocate(Buffer& b) {
  b.mem = AlignedBuffer(static_cast<std::size_t>(buffer_bytes_), kAlign);
  if (b.mem.data() == nullptr) return;
  if (cuda_register_ && staging_memory::CudaDevicePresent() &&
      staging_memory::Register(b.mem.data(), static_cast<std::size_t>(buffer_bytes_))) {
    b.pinning = Pinning::kCuda;
    ++memory_.cuda_registered;
  } else if (mlock(b.mem.data(), buffer_bytes_) == 0) {
    b.pinning = Pinning::kMlock;
    ++memory_.locked;
  } else {
    ++memory_.pageable;
  }
}

std::string_view BouncePool::Memory::Name() const {
  const int kinds = (cuda_registered > 0) + (locked > 0) + (pageable > 0);
  if (kinds == 0) return "none";
  if (kinds > 1) return "mixed";
  if (cuda_registered > 0) return "cuda-registered";
  return locked > 0 ? "mlock" : "pageable";
}

BouncePool::Memory& BouncePool::Memory::operator+=(const Memory& o) {
  cuda_registered += o.cuda_registered;
  locked += o.locked;
  pageable += o.pageable;
  return *this;
}

BouncePool::Lease::Lease(Lease&& o) noexcept { *this = std::move(o); }

BouncePool::Lease& BouncePool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = std::exchange(o.pool_, nullptr);
    bytes_ = std::exchange(o.bytes_, {});
    index_ = o.index_;
    owned_ = std::move(o.owned_);
  }
  return *this;
}

BouncePool::Lease::~Lease() { Release(); }

void BouncePool::Lease::Release() {
  if (pool_ == nullptr) return;
  pool_->Return(*this);
  pool_ = nullptr;
  bytes_ = {};
}

BouncePool::Lease BouncePool::Acquire(std::uint64_t bytes) {
  const bool nested = t_leases_held > 0;
  return Take(bytes, /*wait=*/!nested, /*one_off=*/nested);
}

BouncePool::Lease BouncePool::TryAcquire(std::uint64_t bytes) { return Take(bytes, false, false); }

BouncePool::Lease BouncePool::Take(std::uint64_t bytes, bool wait, bool one_off) {
  Lease l;
  const bool oversize = bytes > buffer_bytes_;
  {
    MutexLock lock(&mu_);
    bool waited = false;
    for (;;) {
      if (oversize) {
        if (!oversize_busy_) {
          oversize_busy_ = true;
          l.index_ = kOversize;
          break;
        }
      } else {
        int free_index = -1;
        for (std::size_t i = 0; i < buffers_.size() && free_index < 0; ++i) {
          if (!buffers_[i].busy) free_index = static_cast<int>(i);
        }
        if (free_index >= 0) {
          Buffer& b = buffers_[static_cast<std::size_t>(free_index)];
          b.busy = true;
          if (b.mem.data() == nullptr) Allocate(b);
          if (b.mem.data() == nullptr) {
            b.busy = false;
            return Lease{};  // out of memory
          }
          l.index_ = free_index;
          l.bytes_ = {b.mem.data(), static_cast<std::size_t>(buffer_bytes_)};
          break;
        }
      }
      if (!wait) {
        if (!one_off) return Lease{};
        l.index_ = kOneOff;
        ++one_offs_;
        break;
      }
      if (!waited) ++waits_;
      waited = true;
      cv_.Wait(&mu_);
    }
  }
  if (l.index_ == kOversize || l.index_ == kOneOff) {
    l.owned_ = AlignedBuffer(static_cast<std::size_t>(BufferBytes(bytes)), kAlign);
    if (l.owned_.data() == nullptr) {
      if (l.index_ == kOversize) {
        {
          MutexLock lock(&mu_);
          oversize_busy_ = false;
        }
        cv_.SignalAll();
      }
      return Lease{};
    }
    l.bytes_ = {l.owned_.data(), l.owned_.capacity()};
  }
  l.pool_ = this;
  ++t_leases_held;
  return l;
}

void BouncePool::Return(Lease& l) {
  --t_leases_held;
  l.owned_ = AlignedBuffer();
  if (l.index_ == kOneOff) return;
  {
    MutexLock lock(&mu_);
    if (l.index_ == kOversize) {
      oversize_busy_ = false;
    } else {
      buffers_[static_cast<std::size_t>(l.index_)].busy = false;
    }
  }
  cv_.SignalAll();
}

std::uint64_t BouncePool::waits() const {
  MutexLock lock(&mu_);
  return waits_;
}

std::uint64_t BouncePool::one_offs() const {
  MutexLock lock(&mu_);
  return one_offs_;
}

bool BouncePool::all_locked() const {
  MutexLock lock(&mu_);
  return memory_.pageable == 0;
}

BouncePool::Memory BouncePool::memory() const {
  MutexLock lock(&mu_);
  return memory_;
}

}  // namespace terrace::store_internal
