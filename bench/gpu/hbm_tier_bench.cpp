// HBM tier (CUDA mode) put/get throughput, from pageable and from pinned host buffers, 1 and 4
// threads. Output: a table, then lines "RESULT tier <put|get> <pageable|pinned> <threads> <GB/s>".
// Exit status: 0 on success, 2 when no CUDA device is usable, 1 on any failed operation.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "terrace/options.h"
#include "tiers/hbm/hbm_tier.h"

using namespace terrace;

int main() {
  if (!HbmCudaDeviceAvailable()) {
    fmt::print("SKIPPED: no CUDA device\n");
    return 2;
  }
  constexpr std::size_t kBlock = 16 << 20, kBlocks = 32;  // 512 MiB per pass
  constexpr int kPasses = 4;
  HbmTierOptions o;
  o.mode = HbmMode::kCuda;
  o.capacity_bytes = 2 * kGiB;
  o.copy_streams = 4;
  auto created = CreateHbmTier(o);
  if (!created.ok()) {
    fmt::print(stderr, "bench_hbm_tier: {}\n", created.status().ToString());
    return 1;
  }
  Tier& tier = **created;
  std::byte* pinned = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&pinned), kBlock * kBlocks, cudaHostAllocDefault) != cudaSuccess) {
    fmt::print(stderr, "bench_hbm_tier: cudaHostAlloc of {} MiB failed\n", (kBlock * kBlocks) >> 20);
    return 1;
  }
  std::vector<std::byte> pageable(kBlock * kBlocks);
  std::memset(pinned, 3, kBlock * kBlocks);
  std::memset(pageable.data(), 3, kBlock * kBlocks);
  const BlockDesc desc = DescribeBlock(std::span<const std::byte>(pageable.data(), kBlock));
  auto key = [](std::size_t i) { return BlockKey{1, BlockKind::kExpert, 0, ContentId{0, i}}; };
  std::atomic<int> errors{0};
  auto run = [&](bool put, std::byte* base, int threads) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        for (int p = 0; p < kPasses; ++p) {
          for (std::size_t i = static_cast<std::size_t>(t); i < kBlocks; i += static_cast<std::size_t>(threads)) {
            std::span<std::byte> buf(base + i * kBlock, kBlock);
            BlockDesc d;
            Status st = put ? tier.Put(key(i), desc, buf) : tier.Get(key(i), buf, &d);
            if (!st.ok()) {
              if (errors.fetch_add(1) == 0) fmt::print(stderr, "bench_hbm_tier: {}\n", st.ToString());
            }
          }
        }
      });
    }
    for (auto& th : ts) th.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return static_cast<double>(kBlock) * kBlocks * kPasses / s / 1e9;
  };
  fmt::print("HBM tier (CUDA), {} MiB blocks, {} streams\n{:>10} {:>8} {:>8} {:>10}\n", kBlock >> 20, o.copy_streams,
             "source", "threads", "op", "GB/s");
  std::string results;
  for (int threads : {1, 4}) {
    for (bool is_pinned : {false, true}) {
      std::byte* base = is_pinned ? pinned : pageable.data();
      for (bool put : {true, false}) {
        double gbs = run(put, base, threads);
        const char* src = is_pinned ? "pinned" : "pageable";
        fmt::print("{:>10} {:>8} {:>8} {:>10.2f}\n", src, threads, put ? "put" : "get", gbs);
        results += fmt::format("RESULT tier {} {} {} {:.3f}\n", put ? "put" : "get", src, threads, gbs);
      }
    }
  }
  fmt::print("{}{}\n", results, tier.Stats().detail);
  (void)cudaFreeHost(pinned);
  return errors.load() == 0 ? 0 : 1;
}
