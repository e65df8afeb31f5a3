#include "src/store/thread_pool.h"

#include <algorithm>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

namespace terrace::store_internal {

struct ThreadPool::Impl {
  explicit Impl(unsigned threads) : pool(std::max(1u, threads)) {}
  boost::asio::thread_pool pool;
};

ThreadPool::ThreadPool(unsigned threads) : impl_(std::make_unique<Impl>(threads)) {}
ThreadPool::~ThreadPool() { Join(); }

void ThreadPool::Post(std::function<void()> fn) { boost::asio::post(impl_->pool, std::move(fn)); }

void ThreadPool::Join() { impl_->pool.join(); }

}  // namespace terrace::store_internal
