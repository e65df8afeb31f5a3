// The store's device-buffer data path on a real CUDA device: a device GetBatch of NVMe-resident
// blocks is staged through bounce buffers registered with CUDA (so the HBM tier copies them by DMA,
// not through its own staging), then copied device to device into cudaMalloc'ed buffers. Built only
// in CUDA builds; every case prints "SKIPPED: no CUDA device" (ctest: skipped) without a device.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <vector>

#include "cuda_test_util.h"
#include "terrace/store.h"
#include "test_util.h"
#include "tiers/hbm/hbm_tier.h"

using namespace terrace;
using terrace::testing::TempDir;
using terrace::testing::SkipWithoutDevice;
using terrace::testing::TestBytes;
using terrace::testing::TestKey;

namespace {

// A cudaMalloc'ed buffer.
struct DeviceBuffer {
  std::byte* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBuffer(std::size_t bytes) : n(bytes) {
    void* v = nullptr;
    REQUIRE(cudaMalloc(&v, bytes) == cudaSuccess);
    p = static_cast<std::byte*>(v);
  }
  ~DeviceBuffer() { (void)cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<std::byte> ToHost(std::size_t bytes) const {
    std::vector<std::byte> h(bytes);
    REQUIRE(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

std::size_t SizeOf(int i) { return kMiB + 4096 * static_cast<std::size_t>(i) + 13 * static_cast<std::size_t>(i); }

}  // namespace

TEST_CASE("CUDA store: device GetBatch of NVMe blocks goes through CUDA-registered bounce buffers") {
  if (SkipWithoutDevice()) return;
  TempDir dir("cuda-store");
  StoreOptions o;
  o.high_watermark = 1.0;
  o.low_watermark = 1.0;
  o.hbm.mode = HbmMode::kCuda;
  o.hbm.capacity_bytes = 64 * kMiB;
  o.host.capacity_bytes = 32 * kMiB;
  o.host.chunk_bytes = 8 * kMiB;
  o.nvme.path = dir.path();
  o.nvme.capacity_bytes = 64 * kMiB;
  auto opened = Store::Open(o);
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  Store& store = **opened;
  constexpr int kN = 8;
  std::vector<BlockKey> keys;
  for (int i = 0; i < kN; ++i) {
    keys.push_back(TestKey(i));
    REQUIRE(store.Put(keys.back(), TestBytes(i, SizeOf(i)), {Codec::kRaw, TierId::kNvme}).ok());
  }
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  std::vector<Store::GetRefItem> items;
  for (int i = 0; i < kN; ++i) {
    bufs.push_back(std::make_unique<DeviceBuffer>(SizeOf(i)));
    items.push_back({keys[i], BufferRef{{bufs.back()->p, SizeOf(i)}, BufferKind::kDevice}, {}});
  }
  DeviceBuffer missing_buf(4096);
  items.push_back({TestKey(99), BufferRef{{missing_buf.p, 4096}, BufferKind::kDevice}, {}});
  std::vector<Status> st = store.GetBatch(std::span<Store::GetRefItem>(items));
  for (int i = 0; i < kN; ++i) {
    INFO(i << ": " << st[i].ToString());
    REQUIRE(st[i].ok());
    CHECK(bufs[i]->ToHost(SizeOf(i)) == TestBytes(i, SizeOf(i)));
  }
  CHECK(st[kN].IsNotFound());
  const StoreStats s = store.Stats();
  CHECK(s.bounce_cuda_registered > 0);
  CHECK(s.bounce_memory == "cuda-registered");
  CHECK(s.staged_transfers == kN);  // NVMe -> bounce buffer -> HBM
  CHECK(s.device_copies == kN);     // HBM -> the caller's device buffers
  // The HBM tier saw only pinned host sources and device destinations: nothing went through its
  // own staging buffers.
  INFO(s.slots[0].detail);
  CHECK_THAT(s.slots[0].detail, Catch::Contains("staged 0"));

  // A single device Get of a block now in HBM matches the batched one.
  DeviceBuffer again(SizeOf(3));
  auto r = store.Get(keys[3], BufferRef{{again.p, SizeOf(3)}, BufferKind::kDevice});
  REQUIRE(r.ok());
  CHECK(again.ToHost(SizeOf(3)) == TestBytes(3, SizeOf(3)));
}
