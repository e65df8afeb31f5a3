// Mutex, MutexLock and CondVar: std::mutex / std::condition_variable with clang thread-safety
// annotations (src/common/thread_annotations.h), so that TERRACE_GUARDED_BY(mu_) members and
// TERRACE_REQUIRES(mu_) functions are checked by `clang++ -Wthread-safety`. Internal. Same costs
// and semantics as the std types they wrap; not recursive.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "src/common/thread_annotations.h"

namespace terrace {

class TERRACE_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() TERRACE_ACQUIRE() { mu_.lock(); }
  void Unlock() TERRACE_RELEASE() { mu_.unlock(); }
  bool TryLock() TERRACE_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the caller holds this mutex (a caller it cannot follow took it, e.g. around
  // a callback). Checks nothing at run time.
  void AssertHeld() const TERRACE_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction; Unlock()/Lock() release and retake it inside the
// scope (the destructor releases it only when held).
class TERRACE_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) TERRACE_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() TERRACE_RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() TERRACE_RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() TERRACE_ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A condition variable; each wait names the Mutex it releases (the analysis checks the caller
// holds it). Wait in a loop that re-tests the condition under the mutex
// (`while (!ready_) cv_.Wait(&mu_);`): the analysis checks the test's guarded reads, which it
// cannot do inside a predicate lambda. All waiters of one CondVar use the same Mutex.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Atomically releases `mu` and waits for a notify (or a spurious wake-up); returns with
  // the mutex held again.
  void Wait(Mutex* mu) TERRACE_REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    cv_.wait(l);
    l.release();
  }
  // As Wait, until `deadline` at the latest. Returns false on timeout.
  template <class Clock, class Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline) TERRACE_REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    const bool woke = cv_.wait_until(l, deadline) == std::cv_status::no_timeout;
    l.release();
    return woke;
  }
  template <class Rep, class Period>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout) TERRACE_REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace terrace
