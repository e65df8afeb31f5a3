// Future<T> / Promise<T>: the small shared-state handle the Store's async calls return.
//
// A Future is a single-consumer handle: is_ready() / wait() / wait_for() observe it, get() moves
// the value out once, then() hands the value to a callback instead. cancel() only *requests*
// cancellation: work that has not started completes with a Cancelled status; work already running
// finishes normally. T is the full outcome (Status, Result<BlockDesc>, std::vector<Status>), so a
// Future never throws.
//
// Thread-safety: a Future and its Promise may live on different threads. One Future object must
// not be used from two threads at once (like std::future); is_ready()/wait() on distinct copies of
// the shared state are fine. Callbacks registered with then() run on the thread that completes the
// Promise, or inline in then() when the value is already there; they must not block for long, and
// must not throw: nothing catches the exception, and on a store thread it ends the process
// (std::terminate).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace terrace {

namespace detail {

// A move-only, type-erased `void(T)` callable (std::move_only_function is C++23).
template <typename T>
class Callback {
 public:
  Callback() = default;
  template <typename F>
  explicit Callback(F f) : impl_(std::make_unique<Impl<F>>(std::move(f))) {}
  explicit operator bool() const { return impl_ != nullptr; }
  void operator()(T value) { impl_->Call(std::move(value)); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual void Call(T value) = 0;
  };
  template <typename F>
  struct Impl final : Base {
    explicit Impl(F f) : fn(std::move(f)) {}
    void Call(T value) override { fn(std::move(value)); }
    F fn;
  };
  std::unique_ptr<Base> impl_;
};

template <typename T>
class FutureState {
 public:
  // First value wins; later calls are ignored and return false.
  bool SetValue(T value) {
    Callback<T> cb;
    {
      std::lock_guard lock(mu_);
      if (value_.has_value() || consumed_) return false;
      if (callback_) {
        cb = std::move(callback_);
        consumed_ = true;
      } else {
        value_.emplace(std::move(value));
      }
      ready_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
    if (cb) cb(std::move(value));
    return true;
  }

  bool is_ready() const { return ready_.load(std::memory_order_acquire); }

  void Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_.load(std::memory_order_relaxed); });
  }

  template <typename Rep, typename Period>
  bool WaitFor(std::chrono::duration<Rep, Period> d) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, d, [&] { return ready_.load(std::memory_order_relaxed); });
  }

  // Precondition: the value is set and not consumed.
  T Take() {
    Wait();
    std::lock_guard lock(mu_);
    consumed_ = true;
    T v = std::move(*value_);
    value_.reset();
    return v;
  }

  void SetCallback(Callback<T> cb) {
    std::unique_lock lock(mu_);
    if (value_.has_value()) {
      T v = std::move(*value_);
      value_.reset();
      consumed_ = true;
      lock.unlock();
      cb(std::move(v));
      return;
    }
    callback_ = std::move(cb);
  }

  void RequestCancel() {
    std::function<void()> cb;
    {
      std::lock_guard lock(mu_);
      if (cancel_requested_.exchange(true, std::memory_order_acq_rel)) return;
      cb = std::move(on_cancel_);
    }
    if (cb) cb();
  }
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }
  // `fn` runs once, on the thread that requests cancellation (inline here if that already
  // happened). Replaces an earlier callback. Must not block.
  void SetCancelCallback(std::function<void()> fn) {
    {
      std::lock_guard lock(mu_);
      if (!cancel_requested_.load(std::memory_order_acquire)) {
        on_cancel_ = std::move(fn);
        return;
      }
    }
    fn();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> cancel_requested_{false};
  std::optional<T> value_;   // GUARDED_BY(mu_)
  Callback<T> callback_;     // GUARDED_BY(mu_)
  bool consumed_ = false;    // GUARDED_BY(mu_): the value went to get() or a callback
  std::function<void()> on_cancel_;  // GUARDED_BY(mu_)
};

}  // namespace detail

template <typename T>
class Future {
 public:
  Future() = default;
  explicit Future(std::shared_ptr<detail::FutureState<T>> state) : state_(std::move(state)) {}
  Future(Future&&) noexcept = default;
  Future& operator=(Future&&) noexcept = default;
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;

  // False for a default-constructed Future and after get() or then().
  bool valid() const { return state_ != nullptr; }
  // Preconditions for the rest: valid().
  bool is_ready() const { return state_->is_ready(); }
  void wait() const { state_->Wait(); }
  // True if the value became ready within `d`.
  template <typename Rep, typename Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return state_->WaitFor(d);
  }
  // Requests cancellation (see the file comment); the Future still completes, so wait()/get()
  // remain valid and return the (possibly Cancelled) outcome.
  void cancel() { state_->RequestCancel(); }
  // Waits, then moves the value out. Leaves the Future invalid.
  T get() {
    auto s = std::move(state_);
    return s->Take();
  }
  // Hands the value to `fn(T)` when ready (inline if it already is). Leaves the Future invalid;
  // cancel() must be called before then() if wanted. `fn` may be move-only.
  template <typename F>
  void then(F fn) {
    auto s = std::move(state_);
    s->SetCallback(detail::Callback<T>(std::move(fn)));
  }

 private:
  std::shared_ptr<detail::FutureState<T>> state_;
};

template <typename T>
class Promise {
 public:
  Promise() : state_(std::make_shared<detail::FutureState<T>>()) {}
  // Call at most once.
  Future<T> get_future() { return Future<T>(state_); }
  // First value wins; returns false if a value was already set.
  bool set_value(T value) { return state_->SetValue(std::move(value)); }
  bool cancel_requested() const { return state_->cancel_requested(); }
  // Runs `fn` once when the Future's cancel() is called (at once if it already was), on the
  // calling thread; for work that sleeps and wants to be woken by a cancellation. Must not block.
  void on_cancel(std::function<void()> fn) { state_->SetCancelCallback(std::move(fn)); }

 private:
  std::shared_ptr<detail::FutureState<T>> state_;
};

// A Future that is ready with `value`.
template <typename T>
Future<T> MakeReadyFuture(T value) {
  Promise<T> p;
  auto f = p.get_future();
  p.set_value(std::move(value));
  return f;
}

}  // namespace terrace
