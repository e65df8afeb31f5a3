// StartThread (src/common/start_thread.h): a thread the OS refuses is a Status, never an exception.
#include <catch2/catch.hpp>

#include <atomic>
#include <string>

#include "src/common/start_thread.h"
#include "thread_limit.h"

using namespace terrace;
using terrace::testing::FailThreadStarts;
using terrace::testing::RunWithNoRoomForThreads;

TEST_CASE("StartThread runs the function on a new thread") {
  std::atomic<int> ran{0};
  auto t = StartThread("a test thread", [&] { ran = 1; });
  REQUIRE(t.ok());
  t->join();
  CHECK(ran == 1);
}

TEST_CASE("StartThread turns a refused thread into Unavailable naming what it was for") {
  FailThreadStarts fail(1);  // the first start succeeds, every later one is refused
  auto first = StartThread("the first thread", [] {});
  REQUIRE(first.ok());
  first->join();
  std::atomic<int> ran{0};
  auto second = StartThread("the second thread", [&] { ran = 1; });
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == Code::kUnavailable);
  CHECK(second.status().message().find("cannot start the second thread: ") == 0);
  CHECK(second.status().message().find("ulimit") != std::string::npos);
  CHECK(ran == 0);
  CHECK_FALSE(StartThread("the third thread", [] {}).ok());
}

TEST_CASE("StartThread reports a thread the OS refuses (address space capped) without throwing") {
  if (terrace::testing::kSanitizedBuild) return;  // the sanitizers' runtimes map memory of their own
  std::string message;
  const int end = RunWithNoRoomForThreads([] { return 0; }, [] {
    auto t = StartThread("a thread under the cap", [] {});
    if (t.ok()) {
      t->join();
      return 3;
    }
    return t.status().code() == Code::kUnavailable &&
                   t.status().message().find("cannot start a thread under the cap: Resource temporarily unavailable") == 0
               ? 0
               : 4;
  });
  INFO(terrace::testing::DescribeChildEnd(end));
  CHECK(end == 0);
}
