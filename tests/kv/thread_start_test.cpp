// The prefix cache when the OS refuses a thread: PrefixCache::Create (its writer thread) and
// BeginRestore / Restore (a restore's reader, decoder, snapshot and page-fault threads) return
// Unavailable; never std::terminate, also when a later thread of a restore fails after earlier ones
// started (those are stopped and joined).
#include <catch2/catch.hpp>

#include "kv_test_util.h"
#include "thread_limit.h"

namespace terrace::kv {
namespace {

using namespace testing;
using terrace::testing::FailThreadStarts;

TEST_CASE("PrefixCache::Create returns Unavailable when its writer thread cannot be started") {
  const auto& m = Toy();
  auto store = HostStore();
  {
    FailThreadStarts fail(0);
    auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
    REQUIRE_FALSE(cache.ok());
    CHECK(cache.status().code() == Code::kUnavailable);
    CHECK(cache.status().message().find("cannot start the prefix cache's writer thread") == 0);
  }
  CHECK(PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get()).ok());
}

TEST_CASE("PrefixCache::Create returns Unavailable, not std::terminate, when the OS refuses its thread") {
  if (terrace::testing::kSanitizedBuild) return;  // the sanitizers' runtimes map memory of their own
  const auto& m = Toy();
  std::unique_ptr<Store> store;
  const int end = terrace::testing::RunWithNoRoomForThreads(
      [&] {
        store = HostStore();  // its threads start before the cap
        return 0;
      },
      [&] {
        auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
        if (cache.ok()) return 3;
        return cache.status().code() == Code::kUnavailable ? 0 : 4;
      });
  INFO(terrace::testing::DescribeChildEnd(end));
  CHECK(end == 0);
}

TEST_CASE("a restore whose threads cannot all be started returns Unavailable, joins those started and Resets the state") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 24);
  const auto req = (*cache)->Prepare(p2, "");
  // A snapshot thread, kRestoreKvReaders readers and a decoder at least: every one of them refused in turn.
  constexpr int kThreads = 2 + kRestoreKvReaders;
  for (int started = 0; started < kThreads; ++started) {
    CAPTURE(started);
    model::Session s(*m.model);
    REQUIRE(s.Prefill(Tokens(20, 9)).ok());  // the state holds tokens of another prompt
    for (const bool layerwise : {true, false}) {
      CAPTURE(layerwise);
      Status st;
      {
        FailThreadStarts fail(started);
        st = layerwise ? (*cache)->BeginRestore(req, &s.state()).status() : (*cache)->Restore(req, &s.state()).status();
      }
      CHECK(st.code() == Code::kUnavailable);
      CHECK(st.message().find("cannot start a prefix-cache restore's") == 0);
      CHECK(s.state().num_tokens() == 0);
      CHECK(model::ValidateJointBoundary(s.state()).ok());
    }
  }
  // With the threads it needs, the same restore reaches its boundary.
  model::Session s(*m.model);
  auto r = (*cache)->Restore(req, &s.state());
  REQUIRE(r.ok());
  CHECK(r->boundary_tokens == 80);
}

}  // namespace
}  // namespace terrace::kv
