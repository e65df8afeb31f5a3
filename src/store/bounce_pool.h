// BouncePool: the store's bounded set of staging buffers for tier-to-tier copies that have no
// direct route (a block moving between two tiers neither of which can read or write the other's
// memory: NVMe -> NVMe, NVMe -> a tier that does not reserve space). Internal.
//
// - `count` buffers of `buffer_bytes` each (rounded up to 4 KiB), 4 KiB-aligned (so a tier with
//   TierCaps::io_alignment transfers into them without a staging copy of its own), allocated on
//   first use and kept. Page-locked on allocation: registered with CUDA (cudaHostRegister, through
//   staging_memory.h) when `cuda_register` is set and a CUDA device is usable, so host <-> HBM
//   copies from them are DMA; otherwise mlock'ed where the system permits; else pageable (a
//   refusal is counted, not fatal). memory() says which kinds were allocated.
// - A block larger than buffer_bytes uses the one oversize slot: an aligned buffer of the block's
//   size (rounded to 4 KiB) allocated for that lease and freed when it ends. Memory held is
//   therefore at most count * buffer_bytes plus one block.
// - Acquire waits until a buffer (or the oversize slot) is free. A thread that already holds a
//   lease never waits (a staged copy whose destination evicts into another staged copy): it takes
//   a free buffer if there is one, else a one-off aligned allocation, so nesting cannot deadlock;
//   the nesting depth is bounded by the number of tier slots.
// Thread-safety: every method; a Lease belongs to the thread that acquired it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/mutex.h"

namespace terrace::store_internal {

class BouncePool {
 public:
  BouncePool(std::size_t count, std::uint64_t buffer_bytes, bool cuda_register = true);
  ~BouncePool();
  BouncePool(const BouncePool&) = delete;
  BouncePool& operator=(const BouncePool&) = delete;

  // A buffer of at least the requested size; returned to the pool when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept;
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    // The whole buffer (>= the size asked for, a multiple of 4 KiB); empty for an invalid lease.
    std::span<std::byte> bytes() const { return bytes_; }
    bool valid() const { return pool_ != nullptr; }

   private:
    friend class BouncePool;
    void Release();
    BouncePool* pool_ = nullptr;
    std::span<std::byte> bytes_;
    int index_ = -1;       // pool buffer index; kOversize; kOneOff
    AlignedBuffer owned_;  // the bytes of a kOversize / kOneOff lease, allocated for it alone
  };

  // Waits for a buffer of at least `bytes` (see the class comment for when it does not wait).
  Lease Acquire(std::uint64_t bytes);
  // Never waits; an invalid Lease when no buffer is free.
  Lease TryAcquire(std::uint64_t bytes);

  std::uint64_t buffer_bytes() const { return buffer_bytes_; }
  std::size_t count() const { return count_; }
  // Acquires that had to wait for a buffer; one-off allocations made by nested acquires.
  std::uint64_t waits() const;
  std::uint64_t one_offs() const;
  bool all_locked() const;  // every buffer allocated so far is page-locked (CUDA-registered or mlock'ed)

  // The pool buffers allocated so far, by the memory they are in (oversize and one-off buffers,
  // allocated per lease, are plain aligned memory and not counted).
  struct Memory {
    std::uint64_t cuda_registered = 0, locked = 0, pageable = 0;
    // "cuda-registered", "mlock", "pageable", "mixed" (more than one kind), "none" (none yet).
    std::string_view Name() const;
    Memory& operator+=(const Memory& o);
  };
  Memory memory() const;

 private:
  static constexpr int kOversize = -2, kOneOff = -3;
  Lease Take(std::uint64_t bytes, bool wait, bool one_off);
  void Return(Lease& lease);

  enum class Pinning : std::uint8_t { kNone, kCuda, kMlock };

  const std::uint64_t buffer_bytes_;
  const std::size_t count_;
  const bool cuda_register_;
  mutable Mutex mu_;
  CondVar cv_;  // signalled when a buffer or the oversize slot is returned
  struct Buffer {
    AlignedBuffer mem;  // allocated on first use
    Pinning pinning = Pinning::kNone;
    bool busy = false;
  };
  // Allocates b's memory on first use and page-locks it (under mu_: first use is rare).
  void Allocate(Buffer& b) TERRACE_REQUIRES(mu_);
  std::vector<Buffer> buffers_ TERRACE_GUARDED_BY(mu_);  // size fixed at construction
  bool oversize_busy_ TERRACE_GUARDED_BY(mu_) = false;
  std::uint64_t waits_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t one_offs_ TERRACE_GUARDED_BY(mu_) = 0;
  Memory memory_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace::store_internal
