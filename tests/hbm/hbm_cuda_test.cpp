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

TEST_CASE("CUDA HBM: PutDevice and GetDevice from 1 byte to 25 MiB; the checksum is DescribeBlock's; damage is caught") {
  if (SkipWithoutDevice()) return;
  auto t = MakeCuda(128 * kMiB);
  REQUIRE(t->caps().device_buffers);
  std::uint64_t id = 300;
  // Sizes around the 8 MiB staging buffer the checksum is computed through, and past three of them.
  for (std::size_t n : {std::size_t{1}, std::size_t{4097}, std::size_t{8 * kMiB}, std::size_t{8 * kMiB + 1},
                        std::size_t{25 * kMiB + 7}}) {
    INFO("block of " << n << " bytes");
    const auto data = TestBytes(id, n);
    void* src = nullptr;
    void* dst = nullptr;
    REQUIRE(cudaMalloc(&src, n) == cudaSuccess);
    REQUIRE(cudaMalloc(&dst, n) == cudaSuccess);
    REQUIRE(cudaMemcpy(src, data.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
    const std::span<const std::byte> dev_in(static_cast<const std::byte*>(src), n);
    const std::span<std::byte> dev_out(static_cast<std::byte*>(dst), n);

    auto put = t->PutDevice(TestKey(id), Codec::kBf16, dev_in);
    INFO(put.status().ToString());
    REQUIRE(put.ok());
    CHECK(*put == DescribeBlock(data, Codec::kBf16));
    CHECK(t->Lookup(TestKey(id)).value() == *put);

    BlockDesc d;
    REQUIRE(t->GetDevice(TestKey(id), dev_out, &d).ok());
    CHECK(d == *put);
    std::vector<std::byte> back(n);
    REQUIRE(cudaMemcpy(back.data(), dst, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(back == data);
    std::vector<std::byte> host(n);  // the staged host path verifies the same stored bytes
    REQUIRE(t->Get(TestKey(id), host, &d).ok());
    CHECK(host == data);

    // One stored byte flipped: GetDevice answers Corruption and drops the block.
    const std::byte* stored = t->ResidentPtr(TestKey(id));
    REQUIRE(stored != nullptr);
    const std::byte flipped = data[n / 2] ^ std::byte{0x5A};
    REQUIRE(cudaMemcpy(const_cast<std::byte*>(stored) + n / 2, &flipped, 1, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(t->GetDevice(TestKey(id), dev_out, &d).IsCorruption());
    CHECK(t->Lookup(TestKey(id)).status().IsNotFound());
    CHECK(cudaFree(src) == cudaSuccess);
    CHECK(cudaFree(dst) == cudaSuccess);
    ++id;
  }
}

TEST_CASE("CUDA HBM: without a usable device, mode cuda is Unavailable and says what CUDA answered") {
  if (HbmCudaDeviceAvailable()) return;  // the device cases above run instead
  HbmTierOptions o;
  o.mode = HbmMode::kCuda;
  o.capacity_bytes = 16 * kMiB;
  auto r = CreateHbmTier(o);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kUnavailable);
  INFO(r.status().ToString());
  CHECK(r.status().message().find("cudaGetDeviceCount") != std::string::npos);
}
