// KeyLocks: striped per-key mutexes that serialize every mutation of one key (Put, Erase, moves,
// eviction) in the store. Blocking Lock() is taken at most once per thread (the key an operation
// is about); any further key (an eviction victim) is taken with TryLock(), which never waits, so
// lock order cannot deadlock. A thread that found a key busy may wait, with a timeout, for its
// stripe to be released (WaitForRelease): a timeout, not an order, keeps that from deadlocking.
// Another key on a stripe this thread holds is excluded from every other thread too, so this
// thread may evict it without a lock of its own (HeldByThisThread without LockedByThisThread).
// Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>

#include "src/common/mutex.h"

#include "terrace/block.h"

namespace terrace::store_internal {

class KeyLocks {
 public:
  static constexpr std::size_t kStripes = 1024;

  class Guard {
   public:
    Guard(KeyLocks* owner, std::size_t stripe) : owner_(owner), stripe_(stripe) {}
    Guard(Guard&& o) noexcept : owner_(o.owner_), stripe_(o.stripe_) { o.owner_ = nullptr; }
    Guard& operator=(Guard&&) = delete;
    Guard(const Guard&) = delete;
    ~Guard() {
      if (owner_) owner_->Unlock(stripe_);
    }

   private:
    KeyLocks* owner_;
    std::size_t stripe_;
  };

  // Blocks. Precondition: this thread holds no stripe of this KeyLocks.
  Guard Lock(const BlockKey& key);
  // nullopt if the stripe is held by another thread or by this one.
  std::optional<Guard> TryLock(const BlockKey& key);
  // True if this thread holds `key`'s stripe (through `key` or another key on it).
  bool HeldByThisThread(const BlockKey& key) const;
  // True if this thread took `key` itself (Lock or TryLock): an operation on it is under way on this
  // thread, so this thread must not evict it.
  bool LockedByThisThread(const BlockKey& key) const;

  // How often `key`'s stripe had been released when observed. Observe before a TryLock that may
  // fail, so that a release right after the failure is not missed by WaitForRelease.
  struct Seen {
    std::size_t stripe = 0;
    std::uint64_t releases = 0;
  };
  Seen Observe(const BlockKey& key) const;
  // Blocks until one of the observed stripes has been released since its observation (true) or
  // `timeout` passes (false). Call it holding at most the one stripe Lock() took.
  bool WaitForRelease(std::span<const Seen> seen, std::chrono::milliseconds timeout);

 private:
  static std::size_t StripeOf(const BlockKey& key) { return key.Hash() % kStripes; }
  void Unlock(std::size_t stripe);
  void NoteHeld(std::size_t stripe, const BlockKey& key);
  bool AnyReleased(std::span<const Seen> seen) const;

  std::array<std::mutex, kStripes> stripes_;
  std::array<std::atomic<std::uint64_t>, kStripes> releases_{};  // per stripe, only ever grows
  std::atomic<int> waiters_{0};  // threads in WaitForRelease; Unlock notifies only when > 0
  Mutex wait_mu_;                // orders a waiter's test against an Unlock's notify
  CondVar released_;
};

}  // namespace terrace::store_internal
