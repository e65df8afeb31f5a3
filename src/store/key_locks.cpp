#include "src/store/key_locks.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace terrace::store_internal {
namespace {

// Stripes held by this thread, across every KeyLocks instance.
thread_local std::vector<std::pair<const KeyLocks*, std::size_t>> t_held;

}  // namespace

KeyLocks::Guard KeyLocks::Lock(const BlockKey& key) {
  std::size_t s = StripeOf(key);
  stripes_[s].lock();
  NoteHeld(s);
  return Guard(this, s);
}

std::optional<KeyLocks::Guard> KeyLocks::TryLock(const BlockKey& key) {
  if (HeldByThisThread(key)) return std::nullopt;
  std::size_t s = StripeOf(key);
  if (!stripes_[s].try_lock()) return std::nullopt;
  NoteHeld(s);
  return Guard(this, s);
}

bool KeyLocks::HeldByThisThread(const BlockKey& key) const {
  std::size_t s = StripeOf(key);
  return std::find(t_held.begin(), t_held.end(), std::pair<const KeyLocks*, std::size_t>(this, s)) != t_held.end();
}

void KeyLocks::NoteHeld(std::size_t stripe) { t_held.emplace_back(this, stripe); }

void KeyLocks::Unlock(std::size_t stripe) {
  auto it = std::find(t_held.begin(), t_held.end(), std::pair<const KeyLocks*, std::size_t>(this, stripe));
  if (it != t_held.end()) t_held.erase(it);
  stripes_[stripe].unlock();
}

}  // namespace terrace::store_internal
