// Boost.Asio completion-token forms of the Store's async calls. This is the only Terrace header
// that includes Boost.Asio; include it only where you use Asio.
//
//   async_get(store, key, out, token)            completion signature void(Result<BlockDesc>)
//   async_put(store, key, data, opts, token)     void(Status)
//   async_prefetch(store, keys, target, priority, deadline, token)   void(std::vector<Status>)
//
// The work runs on the store's own thread pool; the completion handler runs on the handler's
// associated executor (boost::asio::bind_executor, the executor of a use_awaitable coroutine),
// or, when it has none, on the executor passed as the first argument of the overloads that take
// one, or else on the system executor: inline on the store's thread that completed the work.
// As Asio requires, an initiating function never invokes the handler itself: an outcome known
// during the call (an empty key list, a tier the store lacks, a closing store, work that finished
// at once) is posted to that executor (the system executor's own threads when there is none).
// Outstanding work is tracked on that executor, so io_context::run() does not return while an
// operation is pending; hence the executor's execution context (an io_context) must outlive
// every pending operation: destroying it first leaves the store's thread completing into freed
// memory. Tokens that work: plain callbacks, boost::asio::use_future, boost::asio::use_awaitable,
// deferred-style tokens. Buffers (`out`, `data`, `keys`) must stay alive until completion. The
// handler must not throw (it may run on a store thread, where nothing catches it).
// No exception leaves these calls. Where the executor refuses the completion (its post or dispatch
// throws: the system executor starts boost's system_context threads on its first post, and throws
// boost::system::system_error when the OS refuses a thread; an executor out of memory throws
// std::bad_alloc), the handler runs inline instead, with the operation's real outcome: in the
// initiating call itself for an outcome known during the call (the one exception to the rule
// above), else on the store thread that completed the work. A program that cannot tolerate that
// should give its handlers an executor that can run them (an io_context's).
#pragma once

#include <atomic>
#include <memory>
#include <new>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/execution.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/prefer.hpp>
#include <boost/asio/system_executor.hpp>

#include "terrace/store.h"

namespace terrace {
namespace asio_detail {

// The handler and its value, waiting for the executor to run them. `claimed` makes the run happen
// once: by the executor, or inline when handing it to the executor threw.
template <typename Handler, typename T>
struct PendingCompletion {
  Handler handler;
  T value;
  std::atomic<bool> claimed{false};

  PendingCompletion(Handler h, T v) : handler(std::move(h)), value(std::move(v)) {}
  // True when this call ran the handler; false when it had already run (or is running).
  bool Run() {
    if (claimed.exchange(true)) return false;
    std::move(handler)(std::move(value));
    return true;
  }
};

// Completes `handler` with `future`'s value on the handler's associated executor (falling back to
// `fallback`), keeping that executor's outstanding-work count up until then. Called in the
// initiating function: a completion on its thread (then() runs the callback inline when the value
// is already there) is posted, never run in the caller's frame; one on a store thread is
// dispatched. No exception leaves here: when the post or dispatch throws (the system executor's
// first post starts boost's system_context threads, and boost::system::system_error comes out when
// the OS refuses one; an executor may throw std::bad_alloc), the handler runs inline, on this
// thread, with the outcome (see the header comment).
template <typename T, typename Handler, typename Executor>
void CompleteOn(Future<T> future, Handler handler, const Executor& fallback) {
  auto ex = boost::asio::prefer(boost::asio::get_associated_executor(handler, fallback),
                                boost::asio::execution::outstanding_work.tracked);
  future.then([handler = std::move(handler), ex = std::move(ex),
               initiator = std::this_thread::get_id()](T value) mutable {
    using Pending = PendingCompletion<Handler, T>;
    std::shared_ptr<Pending> pending;
    try {
      pending = std::make_shared<Pending>(std::move(handler), std::move(value));
    } catch (const std::bad_alloc&) {  // nothing was moved: the allocation comes first
      std::move(handler)(std::move(value));
      return;
    }
    auto run_ex = ex;
    auto complete = [pending, ex = std::move(ex)]() mutable { pending->Run(); };
    try {
      if (std::this_thread::get_id() == initiator) {
        boost::asio::post(run_ex, std::move(complete));
      } else {
        boost::asio::dispatch(run_ex, std::move(complete));
      }
    } catch (...) {
      // The executor did not take the completion (a handler that throws, run inline by dispatch,
      // has claimed it: its exception goes on as before).
      if (!pending->Run()) throw;
    }
  });
}

}  // namespace asio_detail

template <typename Executor, typename CompletionToken>
auto async_get(const Executor& ex, Store& store, const BlockKey& key, std::span<std::byte> out,
               CompletionToken&& token) {
  return boost::asio::async_initiate<CompletionToken, void(Result<BlockDesc>)>(
      [&store, ex](auto handler, const BlockKey& k, std::span<std::byte> o) {
        asio_detail::CompleteOn(store.GetAsync(k, o), std::move(handler), ex);
      },
      token, key, out);
}

template <typename CompletionToken>
auto async_get(Store& store, const BlockKey& key, std::span<std::byte> out, CompletionToken&& token) {
  return async_get(boost::asio::system_executor(), store, key, out, std::forward<CompletionToken>(token));
}

template <typename Executor, typename CompletionToken>
auto async_put(const Executor& ex, Store& store, const BlockKey& key, std::span<const std::byte> data,
               const PutOptions& opts, CompletionToken&& token) {
  return boost::asio::async_initiate<CompletionToken, void(Status)>(
      [&store, ex](auto handler, const BlockKey& k, std::span<const std::byte> d, const PutOptions& o) {
        asio_detail::CompleteOn(store.PutAsync(k, d, o), std::move(handler), ex);
      },
      token, key, data, opts);
}

template <typename CompletionToken>
auto async_put(Store& store, const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts,
               CompletionToken&& token) {
  return async_put(boost::asio::system_executor(), store, key, data, opts, std::forward<CompletionToken>(token));
}

template <typename Executor, typename CompletionToken>
auto async_prefetch(const Executor& ex, Store& store, std::span<const BlockKey> keys, TierId target,
                    Priority priority, Clock::time_point deadline, CompletionToken&& token) {
  return boost::asio::async_initiate<CompletionToken, void(std::vector<Status>)>(
      [&store, ex](auto handler, std::span<const BlockKey> ks, TierId t, Priority p, Clock::time_point d) {
        asio_detail::CompleteOn(store.Prefetch(ks, t, p, d), std::move(handler), ex);
      },
      token, keys, target, priority, deadline);
}

template <typename CompletionToken>
auto async_prefetch(Store& store, std::span<const BlockKey> keys, TierId target, Priority priority,
                    Clock::time_point deadline, CompletionToken&& token) {
  return async_prefetch(boost::asio::system_executor(), store, keys, target, priority, deadline,
                        std::forward<CompletionToken>(token));
}

}  // namespace terrace
