// ThreadPool: the store's background executor (a Boost.Asio io_context run by threads of its own,
// kept out of headers). Constructed without threads: Start() starts them and reports a thread the
// OS refuses as a Status (a constructor that started them could only throw).
// Post() is thread-safe; work posted before Start() waits for the threads. Join() lets the posted
// work (and the work it posts) finish, then joins the threads; the destructor calls it.
#pragma once

#include <functional>
#include <memory>
#include <string_view>

#include "terrace/status.h"

namespace terrace::store_internal {

class ThreadPool {
 public:
  ThreadPool();
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Starts max(1, threads) threads; call once, before Join. Unavailable naming `what` when a
  // thread cannot be started: the threads started before it are joined, and the pool runs nothing.
  Status Start(unsigned threads, std::string_view what);
  void Post(std::function<void()> fn);
  // True on one of this pool's threads (while it runs posted work).
  bool OnPoolThread() const;
  // Idempotent. Not from one of the pool's own threads (a thread cannot join itself).
  void Join();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace terrace::store_internal
