// BouncePool: bounded, aligned staging buffers; a caller waits for a free one, a nested acquire
// never waits, and a block larger than a buffer takes the single oversize slot.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "src/store/bounce_pool.h"

namespace terrace::store_internal {
namespace {

bool Aligned(std::span<std::byte> b) { return reinterpret_cast<std::uintptr_t>(b.data()) % 4096 == 0; }

TEST_CASE("BouncePool: buffers are 4 KiB-aligned, rounded up, and reused") {
  BouncePool pool(2, 5000);
  CHECK(pool.buffer_bytes() == 8192);
  std::byte* first = nullptr;
  {
    auto a = pool.Acquire(100);
    REQUIRE(a.valid());
    CHECK(a.bytes().size() == 8192);
    CHECK(Aligned(a.bytes()));
    first = a.bytes().data();
  }
  auto b = pool.Acquire(8192);
  CHECK(b.bytes().data() == first);  // the same buffer, not a new allocation
  auto big = pool.TryAcquire(100000);  // oversize: its own buffer, of the block's size rounded up
  REQUIRE(big.valid());
  CHECK(big.bytes().size() == 102400);
  CHECK(Aligned(big.bytes()));
  CHECK_FALSE(pool.TryAcquire(100000).valid());  // one oversize lease at a time
}

TEST_CASE("BouncePool: memory() counts the pool buffers allocated, by the memory they are in") {
  BouncePool pool(3, 4096, /*cuda_register=*/false);
  CHECK(pool.memory().Name() == "none");
  {
    auto a = pool.Acquire(10);
    auto b = pool.Acquire(10);
    auto big = pool.Acquire(100000);  // oversize: per lease, not counted
    REQUIRE((a.valid() && b.valid() && big.valid()));
  }
  auto again = pool.Acquire(10);  // reuses a buffer: nothing new allocated
  const BouncePool::Memory m = pool.memory();
  CHECK(m.cuda_registered == 0);  // registration off (and no device on this machine anyway)
  CHECK(m.locked + m.pageable == 2);
  CHECK(pool.all_locked() == (m.pageable == 0));
  CHECK((m.Name() == "mlock" || m.Name() == "pageable" || m.Name() == "mixed"));
  BouncePool::Memory mixed{1, 1, 0};
  CHECK(mixed.Name() == "mixed");
  mixed += BouncePool::Memory{0, 0, 2};
  CHECK((mixed.cuda_registered == 1 && mixed.locked == 1 && mixed.pageable == 2));
  CHECK(BouncePool::Memory{3, 0, 0}.Name() == "cuda-registered");
}

TEST_CASE("BouncePool: a caller waits for a free buffer instead of allocating one") {
  BouncePool pool(1, 4096);
  std::atomic<bool> got{false};
  std::thread other;
  {
    auto held = pool.Acquire(4096);
    REQUIRE(held.valid());
    CHECK_FALSE(pool.TryAcquire(10).valid());
    other = std::thread([&] {
      auto l = pool.Acquire(10);  // a thread holding no lease waits
      got = l.valid();
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (pool.waits() == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(pool.waits() == 1);  // it is waiting, not holding a buffer of its own
    CHECK_FALSE(got.load());
  }  // released: the waiter proceeds
  other.join();
  CHECK(got.load());
  CHECK(pool.one_offs() == 0);
}

TEST_CASE("BouncePool: a nested acquire on a thread that holds a lease never waits") {
  BouncePool pool(1, 4096);
  auto outer = pool.Acquire(4096);
  REQUIRE(outer.valid());
  auto inner = pool.Acquire(4096);  // would deadlock if it waited for `outer`
  REQUIRE(inner.valid());
  CHECK(inner.bytes().data() != outer.bytes().data());
  CHECK(Aligned(inner.bytes()));
  CHECK(pool.one_offs() == 1);
}

}  // namespace
}  // namespace terrace::store_internal
