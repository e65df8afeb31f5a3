// The real CUDA path of the HBM tier. Built only in CUDA builds; every case prints
// "SKIPPED: no CUDA device" and ctest reports the test as skipped when no device is usable.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"
#include "tiers/hbm/hbm_tier.h"

using namespace terrace;
using terrace::testing::SkipWithoutDevice;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

std::unique_ptr<Tier> MakeCuda(std::uint64_t capacity, unsigned streams = 2) {
  HbmTierOptions o;
  o.mode = HbmMode::kCuda;
  o.capacity_bytes = capacity;
  o.copy_streams = streams;
  auto r = CreateHbmTier(o);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(r).value();
}

}  // namespace

TEST_CASE("CUDA HBM: round trip over many sizes, staged and direct") {
  if (SkipWithoutDevice()) return;
  auto t = MakeCuda(256 * kMiB);
  CHECK(t->caps().memory == MemoryKind::kDevice);
  CHECK_FALSE(t->caps().emulated);
  std::uint64_t i = 0;
  for (std::size_t size : {std::size_t{1}, std::size_t{4095}, std::size_t{4096}, std::size_t{65537},
                           std::size_t{kMiB + 3}, std::size_t{20 * kMiB + 11}}) {
    auto data = TestBytes(i, size);
    REQUIRE(t->Put(TestKey(i), DescribeBlock(data), data).ok());
    std::vector<std::byte> out(size);
    BlockDesc d;
    REQUIRE(t->Get(TestKey(i), out, &d).ok());
    CHECK(d == DescribeBlock(data));
    CHECK(out == data);
    ++i;
  }
  // Direct path: source and destination already pinned.
  const std::size_t n = 9 * kMiB + 5;
  void* src = nullptr;
  void* dst = nullptr;
  REQUIRE(cudaHostAlloc(&src, n, cudaHostAllocDefault) == cudaSuccess);
  REQUIRE(cudaHostAlloc(&dst, n, cudaHostAllocDefault) == cudaSuccess);
  auto data = TestBytes(77, n);
  std::memcpy(src, data.data(), n);
  std::span<const std::byte> in(static_cast<const std::byte*>(src), n);
  REQUIRE(t->Put(TestKey(77), DescribeBlock(in), in).ok());
  BlockDesc d;
  REQUIRE(t->Get(TestKey(77), std::span(static_cast<std::byte*>(dst), n), &d).ok());
  CHECK(std::memcmp(dst, data.data(), n) == 0);
  CHECK(t->Stats().detail.find("direct from pinned memory 2") != std::string::npos);
  (void)cudaFreeHost(src);
  (void)cudaFreeHost(dst);
}

TEST_CASE("CUDA HBM: ResidentPtr is a device pointer holding the block") {
  if (SkipWithoutDevice()) return;
  auto t = MakeCuda(64 * kMiB);
  auto data = TestBytes(5, 3 * kMiB + 17);
  REQUIRE(t->Put(TestKey(5), DescribeBlock(data), data).ok());
  REQUIRE(t->Pin(TestKey(5)).ok());
  const std::byte* dev = t->ResidentPtr(TestKey(5));
  REQUIRE(dev != nullptr);
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, dev) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeDevice);
  std::vector<std::byte> back(data.size());
  REQUIRE(cudaMemcpy(back.data(), dev, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == data);
  CHECK(t->Erase(TestKey(5)).IsInvalidArgument());
  REQUIRE(t->Unpin(TestKey(5)).ok());
  CHECK(t->Erase(TestKey(5)).ok());
}

TEST_CASE("CUDA HBM: concurrent puts and gets over several streams") {
  if (SkipWithoutDevice()) return;
  auto t = MakeCuda(512 * kMiB, 4);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int th = 0; th < 8; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < 20; ++i) {
        std::uint64_t id = th * 1000 + i;
        auto data = TestBytes(id, 256 * 1024 + i * 40000 + th);
        if (!t->Put(TestKey(id), DescribeBlock(data), data).ok()) ++bad;
        std::vector<std::byte> out(data.size());
        BlockDesc d;
        if (!t->Get(TestKey(id), out, &d).ok() || out != data) ++bad;
        if (i % 3 == 0 && !t->Erase(TestKey(id)).ok()) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  CHECK(t->block_count() == 8 * 13);
}

TEST_CASE("CUDA HBM: capacity exhaustion is OutOfCapacity without damage") {
  if (SkipWithoutDevice()) return;
  auto t = MakeCuda(8 * kMiB);
  std::vector<std::vector<std::byte>> kept;
  std::uint64_t i = 0;
  for (;; ++i) {
    auto data = TestBytes(i, kMiB);
    Status st = t->Put(TestKey(i), DescribeBlock(data), data);
    if (!st.ok()) {
      CHECK(st.IsOutOfCapacity());
      break;
    }
    kept.push_back(std::move(data));
  }
  CHECK(kept.size() == 8);
  for (std::uint64_t k = 0; k < kept.size(); ++k) {
    std::vector<std::byte> out(kMiB);
    BlockDesc d;
    REQUIRE(t->Get(TestKey(k), out, &d).ok());
    CHECK(out == kept[k]);
  }
}
