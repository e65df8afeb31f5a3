#include "src/store/thread_pool.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "src/common/start_thread.h"

namespace terrace::store_internal {

// Not boost::asio::thread_pool: its constructor starts the threads and throws when one fails, and
// with Boost 1.74 a failure after the first thread leaves the started ones running work that never
// ends, so unwinding its thread group never returns.
struct ThreadPool::Impl {
  boost::asio::io_context context;
  // Keeps run() going while no work is queued; reset by Join so run() returns once the work is done.
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work{
      boost::asio::make_work_guard(context)};
  std::vector<std::thread> threads;

  void Join() {
    work.reset();
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
};

ThreadPool::ThreadPool() : impl_(std::make_unique<Impl>()) {}
ThreadPool::~ThreadPool() { Join(); }

Status ThreadPool::Start(unsigned threads, std::string_view what) {
  const unsigned n = std::max(1u, threads);
  impl_->threads.reserve(n);
  for (unsigned i = 0; i < n; ++i) {
    auto t = StartThread(n == 1 ? std::string(what) : fmt::format("{} (thread {} of {})", what, i + 1, n),
                         [ctx = &impl_->context] { ctx->run(); });
    if (!t.ok()) {
      Join();
      return t.status();
    }
    impl_->threads.push_back(std::move(t).value());
  }
  return Status::Ok();
}

void ThreadPool::Post(std::function<void()> fn) { boost::asio::post(impl_->context, std::move(fn)); }

bool ThreadPool::OnPoolThread() const { return impl_->context.get_executor().running_in_this_thread(); }

void ThreadPool::Join() { impl_->Join(); }

}  // namespace terrace::store_internal
