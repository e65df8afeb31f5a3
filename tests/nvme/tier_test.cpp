#include <catch2/catch.hpp>

#include <fcntl.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <random>
#include <thread>

#include "nvme_test_util.h"
#include "tiers/nvme/staging_pool.h"

using namespace terrace;
using namespace terrace::testing;

TEST_CASE("nvme tier: put/get/lookup/erase across block sizes, then reopen", "[nvme]") {
  TempDir dir("nvme");
  auto mode = GENERATE(Durability::kAsync, Durability::kSync);
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, mode);
  constexpr int kBlocks = 24;
  {
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    NvmeTier& tier = **t;
    CHECK(tier.recovery_report().created);
    CHECK(tier.caps().persistent);
    CHECK(tier.caps().memory == MemoryKind::kNone);
    for (int i = 0; i < kBlocks; ++i) REQUIRE(PutTestBlock(tier, i).ok());
    for (int i = 0; i < kBlocks; ++i) REQUIRE(CheckTestBlock(tier, i).ok());
    auto d = tier.Lookup(TestKey(3));
    REQUIRE(d.ok());
    CHECK(d->size == NvmeTestSize(3));
    CHECK(d->checksum == Checksum(TestBytes(3, NvmeTestSize(3))));
    CHECK(tier.block_count() == kBlocks);
    REQUIRE(tier.Erase(TestKey(5)).ok());
    CHECK(tier.Lookup(TestKey(5)).status().IsNotFound());
    CHECK(tier.Erase(TestKey(5)).IsNotFound());
    std::vector<std::byte> buf(10);
    CHECK(tier.Get(TestKey(5), buf, nullptr).IsNotFound());
    CHECK(tier.Get(TestKey(7), buf, nullptr).IsInvalidArgument());  // buffer too small
    auto stats = tier.Stats();
    CHECK(stats.name == "nvme");
    CHECK(stats.puts == kBlocks);
    CHECK(stats.hits == kBlocks);
    CHECK(stats.misses == 1);
    CHECK(stats.blocks == kBlocks - 1);
  }
  auto t = NvmeTier::Open(opts);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  CHECK_FALSE(tier.recovery_report().created);
  CHECK(tier.recovery_report().blocks_recovered == kBlocks - 1);
  CHECK(tier.recovery_report().dropped() == 0);
  for (int i = 0; i < kBlocks; ++i) {
    if (i == 5) {
      CHECK(tier.Lookup(TestKey(i)).status().IsNotFound());
    } else {
      REQUIRE(CheckTestBlock(tier, i).ok());
    }
  }
  std::uint64_t expect_used = 0;
  for (int i = 0; i < kBlocks; ++i) expect_used += i == 5 ? 0 : NvmeTestSize(i);
  CHECK(tier.used_bytes() == expect_used);
}

TEST_CASE("nvme tier: overwrite replaces atomically and frees the old extent", "[nvme]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 8 * kMiB);
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  const std::uint64_t free0 = tier.free_bytes();
  // 200 overwrites of one 1 MiB key in an 8 MiB tier: only works if old extents come back.
  for (int v = 0; v < 200; ++v) {
    auto data = TestBytes(1000 + v, kMiB);
    REQUIRE(tier.Put(TestKey(1), DescribeBlock(data), data).ok());
  }
  auto want = TestBytes(1000 + 199, kMiB);
  std::vector<std::byte> got(kMiB);
  REQUIRE(tier.Get(TestKey(1), got, nullptr).ok());
  REQUIRE(got == want);
  REQUIRE(tier.Flush().ok());
  CHECK(tier.free_bytes() == free0 - (kMiB + nvme::kUnit));  // data + descriptor unit
  REQUIRE(tier.Erase(TestKey(1)).ok());
  REQUIRE(tier.Flush().ok());
  CHECK(tier.free_bytes() == free0);
}

TEST_CASE("nvme tier: pin blocks erase, unpin allows it", "[nvme]") {
  TempDir dir("nvme");
  auto t = NvmeTier::Open(SmallNvmeOptions(dir.path()));
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  REQUIRE(PutTestBlock(tier, 1).ok());
  REQUIRE(tier.Pin(TestKey(1)).ok());
  REQUIRE(tier.Pin(TestKey(1)).ok());
  CHECK(tier.Erase(TestKey(1)).IsInvalidArgument());
  REQUIRE(tier.Unpin(TestKey(1)).ok());
  CHECK(tier.Erase(TestKey(1)).IsInvalidArgument());
  REQUIRE(tier.Unpin(TestKey(1)).ok());
  CHECK(tier.Unpin(TestKey(1)).IsInvalidArgument());
  CHECK(tier.Pin(TestKey(2)).IsNotFound());
  REQUIRE(tier.Erase(TestKey(1)).ok());
}

TEST_CASE("nvme tier: batches match single ops, aligned and unaligned spans", "[nvme]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 128 * kMiB);
  opts.queue_depth = 4;  // batches much deeper than the queue
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr int kN = 64;
  // Aligned caller memory (direct I/O path) and deliberately misaligned views (staged path).
  std::size_t slot = 80 * 1024;
  std::byte* arena = static_cast<std::byte*>(std::aligned_alloc(4096, kN * slot));
  std::vector<PutOp> puts;
  for (int i = 0; i < kN; ++i) {
    std::size_t size = i % 2 ? 64 * 1024 : 64 * 1024 - 1 - i;
    auto bytes = TestBytes(i, size);
    std::byte* p = arena + i * slot + (i % 4 == 3 ? 5 : 0);
    std::copy(bytes.begin(), bytes.end(), p);
    std::span<const std::byte> data(p, size);
    puts.push_back(PutOp{TestKey(i), DescribeBlock(data), data});
  }
  auto st = tier.PutBatch(puts);
  for (auto& s : st) REQUIRE(s.ok());
  std::vector<std::vector<std::byte>> outs(kN);
  std::vector<GetOp> gets;
  for (int i = 0; i < kN; ++i) {
    outs[i].resize(puts[i].data.size());
    gets.push_back(GetOp{TestKey(i), outs[i], {}});
  }
  gets.push_back(GetOp{TestKey(999), outs[0], {}});
  auto gs = tier.GetBatch(gets);
  for (int i = 0; i < kN; ++i) {
    REQUIRE(gs[i].ok());
    REQUIRE(gets[i].desc == puts[i].desc);
    REQUIRE(std::equal(outs[i].begin(), outs[i].end(), puts[i].data.begin()));
  }
  CHECK(gs[kN].IsNotFound());
  // Wrong checksum in a desc: rejected, nothing stored.
  auto data = TestBytes(5000, 4096);
  BlockDesc bad = DescribeBlock(data);
  bad.checksum ^= 1;
  CHECK(tier.Put(TestKey(5000), bad, data).IsInvalidArgument());
  CHECK(tier.Lookup(TestKey(5000)).status().IsNotFound());
  // External registration: same results through fixed buffers.
  iovec iov{arena, kN * slot};
  Status reg = tier.RegisterExternalBuffers(std::span<const iovec>(&iov, 1));
  if (reg.ok()) {
    std::span<std::byte> out(arena, 64 * 1024);
    REQUIRE(tier.Get(TestKey(1), out, nullptr).ok());
    auto want = TestBytes(1, 64 * 1024);
    REQUIRE(std::equal(want.begin(), want.end(), out.begin()));
  } else {
    WARN("external buffer registration unavailable: " << reg.ToString());
  }
  std::free(arena);
}

TEST_CASE("nvme tier: a get whose rounded-up read runs past a registered region reads without it", "[nvme]") {
  // The block's 100 bytes lie inside the registered region, the 4 KiB the device transfers do not:
  // a fixed-buffer read of that length is refused by the kernel (EFAULT), so it must be a plain one.
  TempDir dir("nvme");
  auto t = NvmeTier::Open(SmallNvmeOptions(dir.path(), 16 * kMiB));
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  auto data = TestBytes(7, 100);
  REQUIRE(tier.Put(TestKey(7), DescribeBlock(data), data).ok());
  std::byte* mem = static_cast<std::byte*>(std::aligned_alloc(4096, 3 * 4096));
  REQUIRE(mem != nullptr);
  iovec iov{mem, 4096 + 100};
  Status reg = tier.RegisterExternalBuffers(std::span<const iovec>(&iov, 1));
  if (reg.ok()) {
    std::span<std::byte> out(mem + 4096, 4096);  // room for the rounded-up read: not staged
    const std::uint64_t staged = tier.staged_ios();  // the put staged its short block
    BlockDesc d;
    Status s = tier.Get(TestKey(7), out, &d);
    CHECK(s.ok());
    CHECK(d.size == 100);
    CHECK(std::equal(data.begin(), data.end(), out.begin()));
    CHECK(tier.staged_ios() == staged);
    // Inside the region, fixed-buffer I/O still serves it.
    std::span<std::byte> in(mem, 4096);
    CHECK(tier.Get(TestKey(7), in, nullptr).ok());
    CHECK(std::equal(data.begin(), data.end(), in.begin()));
    REQUIRE(tier.RegisterExternalBuffers({}).ok());
  } else {
    WARN("external buffer registration unavailable: " << reg.ToString());
  }
  std::free(mem);
}

// The open flags of this process's descriptor for `path` (from /proc/self/fdinfo), or -1.
long OpenFlagsOf(const std::filesystem::path& path) {
  std::error_code ec;
  const auto want = std::filesystem::canonical(path, ec);
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code ec2;
    if (std::filesystem::read_symlink(e.path(), ec2) != want) continue;
    std::ifstream info("/proc/self/fdinfo/" + e.path().filename().string());
    std::string key;
    while (info >> key) {
      if (key == "flags:") {
        std::string octal;
        info >> octal;
        return std::stol(octal, nullptr, 8);
      }
    }
  }
  return -1;
}

TEST_CASE("nvme tier: the data file is read without access-time updates (O_NOATIME)", "[nvme]") {
  TempDir dir("nvme");
  auto t = NvmeTier::Open(SmallNvmeOptions(dir.path(), 16 * kMiB));
  REQUIRE(t.ok());
  const long flags = OpenFlagsOf(dir.path() / "terrace.data");
  REQUIRE(flags >= 0);
  CHECK((flags & O_NOATIME) != 0);
}

TEST_CASE("nvme tier: concurrent put/get/erase/overwrite from 8 threads", "[nvme][concurrency]") {
  TempDir dir("nvme");
  auto mode = GENERATE(Durability::kAsync, Durability::kSync);
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, mode);
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr int kThreads = 8, kOps = 150, kKeys = 32;
  std::atomic<int> failures{0}, corrupt{0};
  std::vector<std::thread> th;
  for (int w = 0; w < kThreads; ++w) {
    th.emplace_back([&, w] {
      std::mt19937_64 rng(w);
      std::vector<std::byte> buf(64 * 1024);
      for (int n = 0; n < kOps; ++n) {
        std::uint64_t k = rng() % kKeys;
        int op = static_cast<int>(rng() % 10);
        if (op < 4) {
          // Content encodes the key, so any cross-key mix-up is visible.
          auto data = TestBytes(k * 1000 + rng() % 3, 4096 * (1 + k % 8) + k);
          Status s = tier.Put(TestKey(k), DescribeBlock(data), data);
          if (!s.ok()) ++failures;
        } else if (op < 9) {
          BlockDesc d;
          Status s = tier.Get(TestKey(k), buf, &d);
          if (s.ok()) {
            bool match = false;
            for (int v = 0; v < 3 && !match; ++v) {
              auto want = TestBytes(k * 1000 + v, 4096 * (1 + k % 8) + k);
              match = d.size == want.size() && std::equal(want.begin(), want.end(), buf.begin());
            }
            if (!match) ++corrupt;
          } else if (!s.IsNotFound()) {
            ++failures;
          }
        } else {
          Status s = tier.Erase(TestKey(k));
          if (!s.ok() && !s.IsNotFound()) ++failures;
        }
      }
    });
  }
  for (auto& x : th) x.join();
  CHECK(failures == 0);
  CHECK(corrupt == 0);
  CHECK(tier.Stats().corruptions == 0);
  REQUIRE(tier.Flush().ok());
  std::uint64_t blocks = tier.block_count();
  t->reset();
  auto again = NvmeTier::Open(opts);
  REQUIRE(again.ok());
  CHECK((*again)->block_count() == blocks);
  CHECK((*again)->recovery_report().dropped() == 0);
}

TEST_CASE("nvme tier: verify_on_open reads every block", "[nvme]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  {
    auto t = NvmeTier::Open(opts);
    REQUIRE(t.ok());
    for (int i = 0; i < 8; ++i) REQUIRE(PutTestBlock(**t, i).ok());
  }
  opts.verify_on_open = true;
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  CHECK((*t)->recovery_report().blocks_recovered == 8);
  CHECK((*t)->recovery_report().dropped_checksum == 0);
  CHECK((*t)->Stats().hits == 8);
}
