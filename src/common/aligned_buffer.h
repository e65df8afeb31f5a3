// An owned, uninitialised byte buffer at an aligned address, for O_DIRECT and DMA staging.
//
// Contract: the address and the usable room (capacity()) are multiples of the alignment
// (a power of two, at least alignof(std::max_align_t)); size() is what the caller asked for
// (<= capacity()). The bytes start uninitialised: the buffer exists for reads and copies to
// overwrite, and zero-filling it would only add page faults. Allocation failure leaves the
// buffer empty (data() == nullptr with size() > 0; check ok()), never throws. Move-only; not
// thread-safe (one owner, like std::vector).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <utility>

namespace terrace {

// v rounded up to a multiple of `unit` (> 0).
constexpr std::uint64_t RoundUp(std::uint64_t v, std::uint64_t unit) { return (v + unit - 1) / unit * unit; }

class AlignedBuffer {
 public:
  static constexpr std::size_t kDefaultAlignment = 4096;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes, std::size_t alignment = kDefaultAlignment)
      : size_(bytes), capacity_(static_cast<std::size_t>(RoundUp(bytes == 0 ? 1 : bytes, alignment))) {
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(alignment, capacity_)));
    if (!data_) capacity_ = 0;
  }

  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::move(o.data_)), size_(std::exchange(o.size_, 0)), capacity_(std::exchange(o.capacity_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    data_ = std::move(o.data_);
    size_ = std::exchange(o.size_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
    return *this;
  }

  // True unless the allocation failed.
  bool ok() const { return data_ != nullptr || size_ == 0; }
  std::byte* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::size_t capacity() const { return capacity_; }
  std::span<std::byte> span() const { return {data_.get(), data_ ? size_ : 0}; }

  // Keeps the buffer when its room already holds `bytes`; otherwise replaces it (old bytes are
  // not kept). Returns ok().
  bool Ensure(std::size_t bytes, std::size_t alignment = kDefaultAlignment) {
    if (data_ && capacity_ >= bytes) {
      size_ = bytes;
      return true;
    }
    *this = AlignedBuffer(bytes, alignment);
    return ok();
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

}  // namespace terrace
