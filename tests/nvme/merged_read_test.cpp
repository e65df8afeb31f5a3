// Merged reads: a GetBatch over blocks that lie one after the other on disk, into buffers laid out
// as TierCaps::read_gap_bytes describes, goes out as few large requests; every block still gets
// its own verdict and its exact bytes, and faults in a merged request reach every block in it.
#include <catch2/catch.hpp>

#include <vector>

#include "nvme_test_util.h"
#include "src/common/aligned_buffer.h"

using namespace terrace;
using namespace terrace::testing;

namespace {

constexpr std::size_t kBlockBytes = 60 * 1024;  // 15 units: slots of 64 KiB with the 4 KiB gap

// Puts blocks [0, n) one after the other into a fresh tier (so their extents are adjacent).
void PutRun(NvmeTier& tier, int n, std::uint64_t seed = 42) {
  for (int i = 0; i < n; ++i) REQUIRE(PutTestBlock(tier, i, seed, kBlockBytes).ok());
}

// One aligned buffer holding a slot per block: its size rounded to the unit plus `gap` bytes.
struct Slots {
  Slots(int n, std::size_t gap) : slot(RoundUp(kBlockBytes, 4096) + gap), count(n), mem(slot * static_cast<std::size_t>(n)) {
    REQUIRE(mem.data() != nullptr);
  }
  std::vector<GetOp> Ops() {
    std::vector<GetOp> ops(static_cast<std::size_t>(count));
    for (int i = 0; i < count; ++i)
      ops[static_cast<std::size_t>(i)] = GetOp{
          TestKey(static_cast<std::uint64_t>(i)), std::span<std::byte>(mem.data() + slot * static_cast<std::size_t>(i), slot), {}};
    return ops;
  }
  std::size_t slot;
  int count;
  AlignedBuffer mem;  // 4 KiB-aligned
};

bool HoldsBlock(const GetOp& op, std::uint64_t i, std::uint64_t seed = 42) {
  const auto want = TestBytes(i, kBlockBytes, seed);
  return op.desc.size == want.size() && std::equal(want.begin(), want.end(), op.out.begin());
}

}  // namespace

TEST_CASE("nvme merged reads: adjacent blocks in gap-laid buffers go out as requests of at most 1 MiB", "[nvme]") {
  TempDir dir("nvme-merge");
  auto t = NvmeTier::Open(SmallNvmeOptions(dir.path(), 64 * kMiB));
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  REQUIRE(tier.caps().read_gap_bytes == 4096);
  constexpr int kBlocks = 40;
  PutRun(tier, kBlocks);

  // Slots of 64 KiB: a request holds up to 16 blocks (16 x 64 KiB less the last gap <= 1 MiB),
  // so 40 blocks are 3 requests (16 + 16 + 8): 37 blocks ride along.
  Slots laid(kBlocks, tier.caps().read_gap_bytes);
  auto ops = laid.Ops();
  const std::uint64_t before = tier.merged_reads(), staged = tier.staged_ios(), requests = tier.Stats().read_requests;
  auto st = tier.GetBatch(ops);
  for (int i = 0; i < kBlocks; ++i) {
    INFO("block " << i << ": " << st[static_cast<std::size_t>(i)].ToString());
    CHECK(st[static_cast<std::size_t>(i)].ok());
    CHECK(HoldsBlock(ops[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
  }
  CHECK(tier.merged_reads() - before == kBlocks - 3);
  CHECK(tier.Stats().read_requests - requests == 3);
  CHECK(tier.staged_ios() == staged);

  // Buffers with no room for the gap: one request per block, the same bytes.
  Slots tight(kBlocks, 0);
  auto tight_ops = tight.Ops();
  const std::uint64_t before_tight = tier.merged_reads();
  st = tier.GetBatch(tight_ops);
  for (int i = 0; i < kBlocks; ++i) {
    CHECK(st[static_cast<std::size_t>(i)].ok());
    CHECK(HoldsBlock(tight_ops[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
  }
  CHECK(tier.merged_reads() == before_tight);

  // A batch in another order than the disk's: only neighbours on both sides merge (none here).
  std::vector<GetOp> reversed(ops.rbegin(), ops.rend());
  for (std::size_t k = 0; k < reversed.size(); ++k) reversed[k].out = ops[k].out;
  const std::uint64_t before_rev = tier.merged_reads();
  st = tier.GetBatch(reversed);
  for (std::size_t k = 0; k < reversed.size(); ++k) {
    CHECK(st[k].ok());
    CHECK(HoldsBlock(reversed[k], static_cast<std::uint64_t>(kBlocks - 1) - k));
  }
  CHECK(tier.merged_reads() == before_rev);
}

TEST_CASE("nvme merged reads: an error in a merged request fails every block in it, a short one is finished",
          "[nvme]") {
  TempDir dir("nvme-merge");
  nvme::FaultInjectingIoEngine* fault = nullptr;
  auto t = OpenFaulty(SmallNvmeOptions(dir.path(), 64 * kMiB), &fault);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr int kBlocks = 16;  // one request
  PutRun(tier, kBlocks);
  Slots laid(kBlocks, tier.caps().read_gap_bytes);

  auto ops = laid.Ops();
  fault->Arm(nvme::IoOp::kRead, nvme::FaultKind::kEio, 1);
  auto st = tier.GetBatch(ops);
  for (int i = 0; i < kBlocks; ++i) CHECK(st[static_cast<std::size_t>(i)].IsIoError());

  ops = laid.Ops();
  fault->Arm(nvme::IoOp::kRead, nvme::FaultKind::kShort, 1);
  st = tier.GetBatch(ops);
  CHECK(fault->injected(nvme::FaultKind::kShort) == 1);
  for (int i = 0; i < kBlocks; ++i) {
    CHECK(st[static_cast<std::size_t>(i)].ok());
    CHECK(HoldsBlock(ops[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
  }
}

TEST_CASE("nvme merged reads: bit flips in merged requests never return a wrong block as good", "[nvme]") {
  TempDir dir("nvme-merge");
  nvme::FaultInjectingIoEngine* fault = nullptr;
  auto t = OpenFaulty(SmallNvmeOptions(dir.path(), 64 * kMiB), &fault, 7);
  REQUIRE(t.ok());
  NvmeTier& tier = **t;
  constexpr int kBlocks = 24;
  PutRun(tier, kBlocks);
  Slots laid(kBlocks, tier.caps().read_gap_bytes);
  fault->SetRandom(0.5, {nvme::FaultKind::kBitFlip});
  int good = 0, corrupt = 0;
  for (int round = 0; round < 20; ++round) {
    auto ops = laid.Ops();
    auto st = tier.GetBatch(ops);
    for (int i = 0; i < kBlocks; ++i) {
      const Status& s = st[static_cast<std::size_t>(i)];
      if (s.ok()) {
        ++good;
        CHECK(HoldsBlock(ops[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
      } else {
        ++corrupt;
        INFO(s.ToString());
        CHECK((s.IsCorruption() || s.IsNotFound()));  // dropped after two bad reads: gone from then on
      }
    }
  }
  fault->Disarm();
  CHECK(fault->injected(nvme::FaultKind::kBitFlip) > 0);
  CHECK(good > 0);
  INFO("good " << good << ", failed " << corrupt);
  CHECK(good + corrupt == 20 * kBlocks);
}
