#include "src/store/key_locks.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace terrace::store_internal {
namespace {

// Stripes held by this thread, across every KeyLocks instance, with the key each was taken for.
struct Held {
  const KeyLocks* owner;
  std::size_t stripe;
  BlockKey key;
};
thread_local std::vector<Held> t_held;

}  // namespace

KeyLocks::Guard KeyLocks::Lock(const BlockKey& key) {
  std::size_t s = StripeOf(key);
  stripes_[s].lock();
  NoteHeld(s, key);
  return Guard(this, s);
}

std::optional<KeyLocks::Guard> KeyLocks::TryLock(const BlockKey& key) {
  if (HeldByThisThread(key)) return std::nullopt;
  std::size_t s = StripeOf(key);
  if (!stripes_[s].try_lock()) return std::nullopt;
  NoteHeld(s, key);
  return Guard(this, s);
}

bool KeyLocks::HeldByThisThread(const BlockKey& key) const {
  const std::size_t s = StripeOf(key);
  return std::any_of(t_held.begin(), t_held.end(), [&](const Held& h) { return h.owner == this && h.stripe == s; });
}

bool KeyLocks::LockedByThisThread(const BlockKey& key) const {
  return std::any_of(t_held.begin(), t_held.end(), [&](const Held& h) { return h.owner == this && h.key == key; });
}

void KeyLocks::NoteHeld(std::size_t stripe, const BlockKey& key) { t_held.push_back({this, stripe, key}); }

void KeyLocks::Unlock(std::size_t stripe) {
  auto it = std::find_if(t_held.begin(), t_held.end(), [&](const Held& h) { return h.owner == this && h.stripe == stripe; });
  if (it != t_held.end()) t_held.erase(it);
  stripes_[stripe].unlock();
  // Sequentially consistent with WaitForRelease's increment of waiters_ and its test: either this
  // thread sees the waiter and notifies it, or the waiter's test sees this release.
  releases_[stripe].fetch_add(1);
  if (waiters_.load() > 0) {
    MutexLock lock(&wait_mu_);
    released_.SignalAll();
  }
}

KeyLocks::Seen KeyLocks::Observe(const BlockKey& key) const {
  const std::size_t s = StripeOf(key);
  return {s, releases_[s].load()};
}

bool KeyLocks::AnyReleased(std::span<const Seen> seen) const {
  return std::any_of(seen.begin(), seen.end(), [&](const Seen& o) { return releases_[o.stripe].load() != o.releases; });
}

bool KeyLocks::WaitForRelease(std::span<const Seen> seen, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  waiters_.fetch_add(1);
  bool released;
  {
    MutexLock lock(&wait_mu_);
    while (!(released = AnyReleased(seen))) {
      if (!released_.WaitUntil(&wait_mu_, deadline)) {
        released = AnyReleased(seen);
        break;
      }
    }
  }
  waiters_.fetch_sub(1);
  return released;
}

}  // namespace terrace::store_internal
