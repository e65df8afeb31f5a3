// FaultInjectingTier: wraps any Tier and injects faults on demand, for tests of the layers above
// (the Store's error handling) and of the tiers themselves (Get must catch corrupt bytes).
//
// Faults (armed by the methods below; each counts down and then disarms):
// - FailNextPuts / FailNextGets / FailNextErases: return the given Status without calling the
//   wrapped tier, e.g. Eio(true) for a retryable EIO, Enospc() for ENOSPC (OutOfCapacity).
//   FailNextErasesAfterApplying: call the wrapped Erase, then return the given Status.
// - FlipBitInNextGets: call the wrapped Get, then flip one bit of the bytes it returned and return
//   OK with the recorded desc. The wrapper deliberately does NOT re-verify or fix the bytes: it
//   models corruption after the tier's own check (a bad DMA, a buggy tier), so the layer above must
//   verify Checksum(out) against desc.checksum itself and treat a mismatch as Corruption.
// - CorruptNextPuts: flip one bit in a private copy of the caller's bytes and put that copy with the
//   caller's (now wrong) desc: models corruption at rest; the wrapped tier's Get must then return
//   Corruption and drop the block (the terrace/tier.h contract).
// - SetRandom: each put/get independently fails or flips with the given probabilities, from a
//   seeded generator (reproducible for a given seed and call order).
// Range reads (GetRangeBatch) are gets here: each op, in order, takes an armed or random get
// failure (FailNextGets, get_error) and, once the inner tier returned it, a bit flip
// (FlipBitInNextGets, get_bit_flip) that lands inside the returned range; the ops not failed
// here go to the inner tier's GetRangeBatch in one call, so its own ranged path runs.
// Everything else forwards unchanged; caps() is the wrapped tier's, except verifies_gets (false).
// Thread-safety: all methods, including arming while other threads call Put/Get.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>

#include "src/common/mutex.h"
#include "terrace/tier.h"

namespace terrace {

struct RandomFaults {
  double put_error = 0;   // probability a Put fails with `error`
  double get_error = 0;   // probability a Get fails with `error`
  double get_bit_flip = 0;  // probability a successful Get has one bit flipped
  std::uint64_t seed = 1;
  Status error = Status::IoError("injected EIO (random fault)", true);
};

struct InjectedFaultCounts {
  std::uint64_t put_errors = 0, get_errors = 0, erase_errors = 0, bit_flips = 0, corrupted_puts = 0;
};

class FaultInjectingTier final : public Tier {
 public:
  explicit FaultInjectingTier(std::unique_ptr<Tier> inner);  // owns `inner`
  explicit FaultInjectingTier(Tier& inner);                  // `inner` must outlive the wrapper

  static Status Eio(bool retryable) { return Status::IoError("injected EIO", retryable); }
  static Status Enospc() { return Status::OutOfCapacity("injected ENOSPC: no space left on device"); }

  void FailNextPuts(int n, Status status);
  void FailNextGets(int n, Status status);
  void FailNextErases(int n, Status status);
  // The next n Erases reach the wrapped tier (which removes the block) and then return `status`:
  // a tier that applied an erase but could not make it durable (the NVMe tier whose group commit
  // failed).
  void FailNextErasesAfterApplying(int n, Status status);
  void FlipBitInNextGets(int n);
  void CorruptNextPuts(int n);
  void SetRandom(const RandomFaults& faults);
  void Disarm();  // clears every armed fault, including random mode
  InjectedFaultCounts injected() const;
  Tier& inner() { return *inner_; }

  const TierCaps& caps() const override { return caps_; }  // the inner tier's, verifies_gets false
  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override;
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override;
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override;
  // Device buffers go to the inner tier (caps().device_buffers is the inner tier's); armed put/get
  // failures apply to them too, bit flips and corrupted puts do not (the bytes are not on the host).
  Result<BlockDesc> PutDevice(const BlockKey& key, Codec codec, std::span<const std::byte> device_data) override;
  Status GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) override;
  Result<BlockDesc> Lookup(const BlockKey& key) const override { return inner_->Lookup(key); }
  Status Erase(const BlockKey& key) override;
  Status Pin(const BlockKey& key) override { return inner_->Pin(key); }
  Status Unpin(const BlockKey& key) override { return inner_->Unpin(key); }
  const std::byte* ResidentPtr(const BlockKey& key) const override { return inner_->ResidentPtr(key); }
  std::vector<std::span<std::byte>> IoRegions() const override { return inner_->IoRegions(); }
  Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) override {
    return inner_->RegisterIoRegions(regions);
  }
  Status Flush() override { return inner_->Flush(); }
  std::uint64_t used_bytes() const override { return inner_->used_bytes(); }
  std::uint64_t allocated_bytes() const override { return inner_->allocated_bytes(); }
  std::uint64_t block_count() const override { return inner_->block_count(); }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override {
    inner_->ForEach(fn);
  }
  TierStatsSnapshot Stats() const override { return inner_->Stats(); }
  // PutBatch/GetBatch use the looping defaults so every op sees the armed faults.

 private:
  struct Armed {
    int count = 0;
    Status status;
  };
  // Decides the fate of one call. Returns a non-OK Status to inject, or OK.
  Status TakeFailure(Armed& armed, double random_rate, std::uint64_t& counter) TERRACE_REQUIRES(mu_);
  bool TakeFlag(int& count, double random_rate, std::uint64_t& counter) TERRACE_REQUIRES(mu_);
  // A get's armed or random failure (Get, GetDevice, each op of GetRangeBatch), with `what` ("get
  // of block K") as its context; OK when none is due. Takes mu_.
  Status TakeGetFailure(std::string_view what);
  // Flips one bit of `bytes` (what a get returned) when a flip is due; no-op for empty bytes.
  void MaybeFlipBit(std::span<std::byte> bytes);
  std::uint64_t NextRandom() TERRACE_REQUIRES(mu_);

  std::unique_ptr<Tier> owned_;
  Tier* inner_;
  TierCaps caps_;  // a copy of inner_->caps() taken at construction
  std::atomic<bool> armed_any_{false};  // fast path: nothing armed, no lock taken
  mutable Mutex mu_;
  Armed fail_puts_ TERRACE_GUARDED_BY(mu_);
  Armed fail_gets_ TERRACE_GUARDED_BY(mu_);
  Armed fail_erases_ TERRACE_GUARDED_BY(mu_);
  Armed fail_erases_applied_ TERRACE_GUARDED_BY(mu_);
  int flip_gets_ TERRACE_GUARDED_BY(mu_) = 0;
  int corrupt_puts_ TERRACE_GUARDED_BY(mu_) = 0;
  RandomFaults random_ TERRACE_GUARDED_BY(mu_);
  bool random_on_ TERRACE_GUARDED_BY(mu_) = false;
  std::mt19937_64 rng_ TERRACE_GUARDED_BY(mu_);
  InjectedFaultCounts counts_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace terrace
