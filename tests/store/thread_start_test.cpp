// Store::Open when the OS refuses the store's threads (or a tier's): an error Status naming them,
// never std::terminate (boost::asio::thread_pool threw from StoreImpl's constructor) and never a
// hang (a pool whose later thread failed left the earlier ones running).
#include <catch2/catch.hpp>

#include <string>

#include "store_test_util.h"
#include "thread_limit.h"

namespace terrace::testing {
namespace {

TEST_CASE("Store::OpenWithTiers returns Unavailable when any of the store's threads cannot be started") {
  StoreOptions o = Quiet();
  o.background_threads = 3;  // 3 async get/put threads, 2 prefetch threads, 1 demotion thread
  constexpr int kThreads = 6;
  for (int started = 0; started < kThreads; ++started) {
    CAPTURE(started);
    FakeTiers f(0, 8 << 20, 8 << 20);
    Result<std::unique_ptr<Store>> s = Status::Internal("not opened");
    {
      FailThreadStarts fail(started);
      s = Store::OpenWithTiers(o, std::move(f.tiers));
    }
    REQUIRE_FALSE(s.ok());  // and the threads started before the refused one were joined: no hang
    CHECK(s.status().code() == Code::kUnavailable);
    CHECK(s.status().message().find("open store: cannot start the store's") == 0);
    CHECK(s.status().message().find("StoreOptions::background_threads 3") != std::string::npos);
  }
  FakeTiers f(0, 8 << 20, 8 << 20);
  {
    FailThreadStarts fail(kThreads);  // exactly enough: the store opens and works
    auto store = OpenFakeStore(f, o);
    REQUIRE(store->Put(TestKey(1), TestBytes(1, 4096), {Codec::kRaw, TierId::kHost}).ok());
    std::vector<std::byte> out(4096);
    REQUIRE(store->GetAsync(TestKey(1), out).get().ok());
  }
}

TEST_CASE("Store::Open returns Unavailable, not std::terminate, when the OS refuses its threads") {
  if (kSanitizedBuild) return;  // the sanitizers' runtimes map memory of their own
  const int end = RunWithNoRoomForThreads([] { return 0; }, [] {
    StoreOptions o;
    o.hbm.mode = HbmMode::kOff;
    o.host.capacity_bytes = 16 * kMiB;
    o.host.chunk_bytes = 4 * kMiB;
    o.host.pin = false;
    o.host.prefault = false;  // the store's own threads are the first the open starts
    auto s = Store::Open(o);
    if (s.ok()) return 3;
    if (s.status().code() != Code::kUnavailable) return 4;
    if (s.status().message().find("open store: cannot start the store's async get/put threads") != 0) return 5;
    o.host.prefault = true;  // the host tier's prefault thread first
    s = Store::Open(o);
    if (s.ok()) return 6;
    if (s.status().code() != Code::kUnavailable) return 7;
    return s.status().message().find("open store: host tier: cannot start the host tier's prefault thread") == 0 ? 0 : 8;
  });
  INFO(DescribeChildEnd(end));
  CHECK(end == 0);
}

TEST_CASE("Store::Open returns Unavailable when the host tier's prefault thread cannot be started") {
  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 16 * kMiB;
  o.host.chunk_bytes = 4 * kMiB;
  o.host.pin = false;
  o.host.prefault = true;
  FailThreadStarts fail(0);
  auto s = Store::Open(o);
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().code() == Code::kUnavailable);
  CHECK(s.status().message().find("the host tier's prefault thread") != std::string::npos);
}

TEST_CASE("Store::Open returns Unavailable when the NVMe tier's group-commit thread cannot be started") {
  TempDir dir("threads-nvme");
  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 16 * kMiB;
  o.host.chunk_bytes = 4 * kMiB;
  o.host.pin = false;
  o.nvme.path = dir.path();
  o.nvme.capacity_bytes = 16 * kMiB;
  o.host.prefault = false;  // else the host tier's prefault thread is refused first
  o.nvme.durability = Durability::kAsync;
  {
    FailThreadStarts fail(0);
    auto s = Store::Open(o);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == Code::kUnavailable);
    CHECK(s.status().message().find("group-commit thread") != std::string::npos);
  }
  auto s = Store::Open(o);  // the files the refused open created are still a store that opens
  INFO(s.status().ToString());
  REQUIRE(s.ok());
}

}  // namespace
}  // namespace terrace::testing
