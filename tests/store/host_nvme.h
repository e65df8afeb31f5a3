// A Store of the real host tier over one real NVMe tier, for tests that count what a read or a move
// did (StoreStats, the NVMe tier's own staging counter), and helpers to fill and damage it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "store_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::testing {

// host (unpinned arena) over one NVMe tier in `dir`, opened directly so the test can read the NVMe
// tier's own staging counter. With fault_wrapped, the NVMe tier sits inside a FaultInjectingTier
// (`fault`), so a test can flip bits in what it returns (the store then verifies every read).
struct HostNvme {
  std::unique_ptr<Store> store;
  NvmeTier* nvme = nullptr;
  FaultInjectingTier* fault = nullptr;
  explicit HostNvme(const std::filesystem::path& dir, StoreOptions o = Quiet(), bool fault_wrapped = false) {
    NvmeTierOptions no;
    no.path = dir;
    no.capacity_bytes = 16 * kMiB;
    auto n = NvmeTier::Open(no);
    REQUIRE(n.ok());
    nvme = n->get();
    HostTierOptions ho;
    ho.capacity_bytes = 8 * kMiB;
    ho.chunk_bytes = 4 * kMiB;
    ho.pin = false;
    auto h = HostTier::Create(ho);
    REQUIRE(h.ok());
    std::vector<std::unique_ptr<Tier>> tiers;
    tiers.push_back(std::move(*h));
    if (fault_wrapped) {
      auto f = std::make_unique<FaultInjectingTier>(std::unique_ptr<Tier>(std::move(*n)));
      fault = f.get();
      tiers.push_back(std::move(f));
    } else {
      tiers.push_back(std::move(*n));
    }
    auto s = Store::OpenWithTiers(o, std::move(tiers));
    INFO(s.status().ToString());
    REQUIRE(s.ok());
    store = std::move(*s);
  }
};

// Aligned and ragged sizes, so that the direct route is seen to need no staging for either.
inline std::size_t SizeOf(int i) {
  return i % 3 == 0 ? 16 * kKiB : 4096 * static_cast<std::size_t>(i % 5) + 1 + 97 * static_cast<std::size_t>(i);
}

inline std::vector<BlockKey> PutInNvme(Store& store, int n) {
  std::vector<BlockKey> keys;
  for (int i = 0; i < n; ++i) {
    keys.push_back(TestKey(static_cast<std::uint64_t>(i)));
    REQUIRE(store.Put(keys.back(), TestBytes(static_cast<std::uint64_t>(i), SizeOf(i)), {Codec::kRaw, TierId::kNvme}).ok());
  }
  return keys;
}

inline std::uint64_t BytesOf(int n) {
  std::uint64_t b = 0;
  for (int i = 0; i < n; ++i) b += SizeOf(i);
  return b;
}

// The caller buffers a single Get is tried with: 4 KiB-aligned with room for the block rounded up
// to 4 KiB; one byte past a 4 KiB boundary (with room); 4 KiB-aligned, exactly the block's size.
enum class Shape { kAlignedRoom, kUnaligned, kAlignedExact };

inline const char* ShapeName(Shape s) {
  return s == Shape::kAlignedRoom ? "aligned, with room" : s == Shape::kUnaligned ? "unaligned" : "aligned, exact size";
}

// True when the NVMe tier (O_DIRECT, 4 KiB units) can read a `size`-byte block into a buffer of
// `shape` without a staging copy: aligned, and room for the size rounded up to 4 KiB.
inline bool NvmeReadsInPlace(Shape shape, std::size_t size) {
  return shape == Shape::kAlignedRoom || (shape == Shape::kAlignedExact && size % 4096 == 0);
}

// A buffer of `shape` for a `size`-byte block. No Catch assertion inside (tests build these on
// their own threads): a failed allocation leaves out() empty, which any Get refuses.
class ShapedBuffer {
 public:
  ShapedBuffer(Shape shape, std::size_t size) : mem_(static_cast<std::size_t>(RoundUp(size, 4096)) + 4096) {
    if (mem_.data() == nullptr) return;
    const std::size_t room = static_cast<std::size_t>(RoundUp(size, 4096));
    out_ = {mem_.data() + (shape == Shape::kUnaligned ? 1 : 0), shape == Shape::kAlignedExact ? size : room};
  }
  std::span<std::byte> out() const { return out_; }
  std::vector<std::byte> First(std::size_t n) const { return {out_.begin(), out_.begin() + static_cast<std::ptrdiff_t>(n)}; }

 private:
  AlignedBuffer mem_;
  std::span<std::byte> out_;
};

// Flips one byte of the block's bytes inside the NVMe data file(s) under `dir`; false if the
// bytes are not found.
inline bool CorruptOnDisk(const std::filesystem::path& dir, const std::vector<std::byte>& block) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().filename() != "terrace.data") continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto it = std::search(all.begin(), all.end(), reinterpret_cast<const char*>(block.data()),
                          reinterpret_cast<const char*>(block.data()) + block.size());
    if (it == all.end()) continue;
    const off_t off = static_cast<off_t>(it - all.begin()) + 17;
    int fd = ::open(e.path().c_str(), O_WRONLY);
    if (fd < 0) return false;
    char c = static_cast<char>(all[static_cast<std::size_t>(off)] ^ 0x5a);
    const bool ok = ::pwrite(fd, &c, 1, off) == 1 && ::fsync(fd) == 0;
    ::close(fd);
    return ok;
  }
  return false;
}

}  // namespace terrace::testing
