#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "terrace/block.h"
#include "tiers/host/stream_copy.h"

using namespace terrace::tiers;

namespace {

constexpr std::size_t kGuard = 192;  // bytes checked untouched on either side of the destination
constexpr std::byte kFill{0xEE};

std::vector<CopyKernel> SupportedKernels() {
  std::vector<CopyKernel> ks;
  for (CopyKernel k : {CopyKernel::kMemcpy, CopyKernel::kSse2, CopyKernel::kAvx2}) {
    if (CopyKernelSupported(k)) ks.push_back(k);
  }
  return ks;
}

// Sizes at every edge of the kernels: below / at / above the streaming minimum, one step (64, 128
// bytes) and one line around it, pages, the put threshold, and a 1 MiB block with a ragged tail.
std::vector<std::size_t> EdgeSizes() {
  std::vector<std::size_t> sizes = {0, 1, 7, 63, 64, 65, 127, 128, 129, 255, 256, 257, 319, 320, 383, 384, 385,
                                    4095, 4096, 4097, 12345};
  for (std::size_t s : {kStreamCopyMinBytes - 1, kStreamCopyMinBytes, kStreamCopyMinBytes + 1,
                        kStreamCopyMinBytes + 77, std::size_t{1} << 20, (std::size_t{1} << 20) + 13}) {
    sizes.push_back(s);
  }
  return sizes;
}

// Copies `n` random bytes from src offset `so` to dst offset `doff` (relative to 64-byte-aligned
// bases) with `copy`, and checks the copy equals memcpy's and nothing around it was written.
template <typename CopyFn>
void CheckCopy(CopyFn copy, std::size_t n, std::size_t so, std::size_t doff, std::mt19937_64& rng) {
  std::vector<std::byte> src_store(n + so + 128), dst_store(n + doff + 2 * kGuard + 128, kFill);
  auto* src = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(src_store.data()) + 63) & ~std::uintptr_t{63}) + so;
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(dst_store.data()) + 63) & ~std::uintptr_t{63});
  std::byte* dst = base + kGuard + doff;
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<std::byte>(rng());
  copy(dst, src, n);
  INFO("n=" << n << " src offset " << so << " dst offset " << doff);
  CHECK(std::memcmp(dst, src, n) == 0);
  bool guards_ok = true;
  for (std::byte* p = base; p < dst; ++p) guards_ok &= *p == kFill;
  for (std::size_t i = 0; i < kGuard; ++i) guards_ok &= dst[n + i] == kFill;
  CHECK(guards_ok);
}

}  // namespace

TEST_CASE("Streaming copy kernels copy exactly the bytes memcpy does, at any size and alignment") {
  std::mt19937_64 rng(42);
  const std::vector<std::size_t> offsets = {0, 1, 8, 31, 33, 63};
  for (CopyKernel k : SupportedKernels()) {
    INFO("kernel " << static_cast<int>(k));
    for (std::size_t n : EdgeSizes()) {
      // Every offset pair on small sizes; on the large ones a diagonal, to keep the test quick.
      for (std::size_t so : offsets) {
        for (std::size_t doff : offsets) {
          if (n > 65536 && so != doff && so + doff != 64) continue;
          CheckCopy([k](void* d, const void* s, std::size_t len) { CopyWith(k, d, s, len); }, n, so, doff, rng);
        }
      }
    }
  }
}

TEST_CASE("CopyForPut copies exactly around the streaming threshold, aligned or not") {
  std::mt19937_64 rng(7);
  for (std::size_t n : EdgeSizes()) {
    for (std::size_t off : {std::size_t{0}, std::size_t{5}, std::size_t{40}}) {
      CheckCopy([](void* d, const void* s, std::size_t len) { CopyForPut(d, s, len); }, n, off, 64 - off, rng);
      CheckCopy([](void* d, const void* s, std::size_t len) { CopyForPut(d, s, len); }, n, off, off, rng);
    }
  }
}

TEST_CASE("The best streaming kernel is a supported one, and x86-64 always streams") {
  CHECK(CopyKernelSupported(BestStreamKernel()));
  CHECK(CopyKernelSupported(CopyKernel::kMemcpy));
#if defined(__x86_64__)
  CHECK(BestStreamKernel() != CopyKernel::kMemcpy);
  CHECK(CopyKernelSupported(CopyKernel::kSse2));
#endif
}

TEST_CASE("CopyForPutAndChecksum copies exactly and returns terrace::Checksum of the bytes") {
  std::mt19937_64 rng(9);
  for (std::size_t n : EdgeSizes()) {
    for (std::size_t off : {std::size_t{0}, std::size_t{3}, std::size_t{40}}) {
      std::uint64_t sum = 0, want = 0;
      CheckCopy(
          [&](void* d, const void* s, std::size_t len) {
            want = terrace::Checksum({static_cast<const std::byte*>(s), len});
            sum = CopyForPutAndChecksum(d, s, len);
          },
          n, off, (off * 7) % 64, rng);
      INFO("n=" << n << " offset " << off);
      CHECK(sum == want);
    }
  }
}

TEST_CASE("ChecksumAndStream copies exactly and returns terrace::Checksum of the source bytes") {
  std::mt19937_64 rng(11);
  std::vector<std::size_t> sizes = EdgeSizes();
  sizes.push_back((std::size_t{8} << 10) * 40 + 5);  // many 8 KiB pieces and a short last one
  for (std::size_t n : sizes) {
    for (std::size_t off : {std::size_t{0}, std::size_t{5}, std::size_t{63}}) {
      std::uint64_t sum = 0, want = 0;
      CheckCopy(
          [&](void* d, const void* s, std::size_t len) {
            want = terrace::Checksum({static_cast<const std::byte*>(s), len});
            sum = ChecksumAndStream(d, s, len);
          },
          n, (off * 3) % 64, off, rng);
      INFO("n=" << n << " dst offset " << off);
      CHECK(sum == want);
    }
  }
}

TEST_CASE("The last-level cache size is read from the kernel where it reports one") {
  const std::uint64_t llc = LastLevelCacheBytes();
  CHECK(llc == LastLevelCacheBytes());  // probed once
  if (llc == 0) {
    WARN("no cache size under /sys/devices/system/cpu/cpu0/cache or in sysconf: gets never stream by default here");
  } else {
    CHECK(llc >= 64 * 1024);   // no CPU this runs on has a smaller last level
    CHECK(llc <= (std::uint64_t{4} << 30));
  }
}
