// ThreadPool: the store's background executor (a boost::asio::thread_pool, kept out of headers).
// Post() is thread-safe; Join() waits for posted work and must be called once, before destruction.
#pragma once

#include <functional>
#include <memory>

namespace terrace::store_internal {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  void Post(std::function<void()> fn);
  void Join();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace terrace::store_internal
