// KeyLocks: striped per-key mutexes that serialize every mutation of one key (Put, Erase, moves,
// eviction) in the store. Blocking Lock() is taken at most once per thread (the key an operation
// is about); any further key (an eviction victim) is taken with TryLock(), which never waits, so
// lock order cannot deadlock. Thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <mutex>
#include <optional>

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
  // True if this thread holds `key`'s stripe (then `key` must not be evicted by this thread).
  bool HeldByThisThread(const BlockKey& key) const;

 private:
  static std::size_t StripeOf(const BlockKey& key) { return key.Hash() % kStripes; }
  void Unlock(std::size_t stripe);
  void NoteHeld(std::size_t stripe);

  std::array<std::mutex, kStripes> stripes_;
};

}  // namespace terrace::store_internal
