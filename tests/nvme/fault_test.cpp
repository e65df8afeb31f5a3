// Fault injection: every fault is a clear Status; no crash, no corrupt bytes returned, no
// acknowledged block lost (also across reopen).
#include <catch2/catch.hpp>

#include <cerrno>

#include "nvme_test_util.h"

using namespace terrace;
using namespace terrace::testing;
using nvme::FaultKind;
using nvme::IoOp;

namespace {

constexpr int kAcked = 12;

// Puts blocks [0, kAcked) and flushes: the acknowledged baseline every test must keep.
void PutBaseline(NvmeTier& tier) {
  for (int i = 0; i < kAcked; ++i) REQUIRE(PutTestBlock(tier, i).ok());
  REQUIRE(tier.Flush().ok());
}

void CheckBaseline(NvmeTier& tier, int skip = -1) {
  for (int i = 0; i < kAcked; ++i) {
    if (i == skip) continue;
    INFO("block " << i);
    Status s = CheckTestBlock(tier, i);
    REQUIRE(s.ok());
  }
}

// A tier on a FaultInjectingIoEngine, and the engine to arm.
struct FaultyTier {
  std::unique_ptr<NvmeTier> tier;
  nvme::FaultInjectingIoEngine* fault = nullptr;
};

// Opens `opts` with the io_uring engine wrapped in a fault injector (OpenFaulty); REQUIREs success.
FaultyTier OpenFaultyTier(const NvmeTierOptions& opts, std::uint64_t seed = 1) {
  FaultyTier f;
  auto t = OpenFaulty(opts, &f.fault, seed);
  REQUIRE(t.ok());
  f.tier = std::move(*t);
  return f;
}

void ReopenAndCheck(std::unique_ptr<NvmeTier>& tier, const NvmeTierOptions& opts, int skip = -1) {
  tier.reset();
  auto again = NvmeTier::Open(opts);
  REQUIRE(again.ok());
  CHECK((*again)->recovery_report().dropped() == 0);
  CheckBaseline(**again, skip);
  tier = std::move(*again);
}

}  // namespace

TEST_CASE("nvme faults: write EIO / ENOSPC fail the put cleanly", "[nvme][fault]") {
  TempDir dir("nvme");
  auto mode = GENERATE(Durability::kAsync, Durability::kSync);
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, mode);
  auto [tier, fault] = OpenFaultyTier(opts);
  PutBaseline(*tier);
  const std::uint64_t free_before = tier->free_bytes();

  // Arm() hits the next write through the engine: commit nothing in the background meanwhile (a
  // group commit writes the superblock through the engine too).
  REQUIRE(tier->Flush().ok());
  fault->Arm(IoOp::kWrite, FaultKind::kEio);
  Status s = PutTestBlock(*tier, 100);
  REQUIRE(s.IsIoError());
  CHECK(s.retryable());
  CHECK(s.message().find(TestKey(100).ToString()) != std::string::npos);
  CHECK(s.message().find("terrace.data") != std::string::npos);
  CHECK(tier->Lookup(TestKey(100)).status().IsNotFound());

  // ENOSPC from under the tier is the file system's, not the tier's allocator: an I/O error that
  // names the data file, never "the tier is full".
  REQUIRE(tier->Flush().ok());
  fault->Arm(IoOp::kWrite, FaultKind::kEnospc);
  s = PutTestBlock(*tier, 101);
  REQUIRE(s.IsIoError());
  CHECK_FALSE(s.IsOutOfCapacity());
  CHECK(s.message().find(TestKey(101).ToString()) != std::string::npos);
  CHECK(s.message().find("file system") != std::string::npos);
  CHECK(s.message().find("terrace.data") != std::string::npos);
  CHECK(tier->Lookup(TestKey(101)).status().IsNotFound());

  // An overwrite that fails keeps the old version.
  REQUIRE(tier->Flush().ok());
  fault->Arm(IoOp::kWrite, FaultKind::kEio);
  REQUIRE_FALSE(PutTestBlock(*tier, 3, /*seed=*/99).ok());
  REQUIRE(tier->Flush().ok());  // failed extents return once their descriptors are cleared
  CHECK(tier->free_bytes() == free_before);
  CHECK(tier->Stats().io_errors == 3);
  CheckBaseline(*tier);
  // The retry succeeds.
  REQUIRE(PutTestBlock(*tier, 100).ok());
  REQUIRE(CheckTestBlock(*tier, 100).ok());
  ReopenAndCheck(tier, opts);
}

TEST_CASE("nvme faults: read EIO is retryable, data untouched", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  auto [tier, fault] = OpenFaultyTier(opts);
  PutBaseline(*tier);
  fault->Arm(IoOp::kRead, FaultKind::kEio);
  std::vector<std::byte> buf(4 * kMiB);
  Status s = tier->Get(TestKey(2), buf, nullptr);
  REQUIRE(s.IsIoError());
  CHECK(s.retryable());
  CHECK(s.message().find(TestKey(2).ToString()) != std::string::npos);
  CHECK(tier->Lookup(TestKey(2)).ok());  // an I/O error does not drop the block
  CheckBaseline(*tier);
  ReopenAndCheck(tier, opts);
}

TEST_CASE("nvme faults: short reads and writes, EAGAIN are retried transparently", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  auto [tier, fault] = OpenFaultyTier(opts);
  fault->Arm(IoOp::kWrite, FaultKind::kShort, 1000);
  fault->Arm(IoOp::kWrite, FaultKind::kEagain, 3);
  PutBaseline(*tier);
  CHECK(fault->injected(FaultKind::kShort) > 0);
  CHECK(fault->injected(FaultKind::kEagain) == 3);
  fault->Disarm();
  fault->Arm(IoOp::kRead, FaultKind::kShort, 1000);
  fault->Arm(IoOp::kRead, FaultKind::kEagain, 2);
  CheckBaseline(*tier);
  CHECK(fault->injected(FaultKind::kShort) > 4);
  CHECK(tier->Stats().io_errors == 0);
  fault->Disarm();
  ReopenAndCheck(tier, opts);
}

TEST_CASE("nvme faults: bit flips are never returned", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path());
  auto [tier, fault] = OpenFaultyTier(opts);
  PutBaseline(*tier);

  // One transient flip: the re-read succeeds, nothing is dropped.
  fault->Arm(IoOp::kRead, FaultKind::kBitFlip, 1);
  REQUIRE(CheckTestBlock(*tier, 4).ok());
  CHECK(tier->Stats().corruptions == 0);

  // A persistent flip: Corruption naming key and path, the block is dropped, never returned.
  fault->Arm(IoOp::kRead, FaultKind::kBitFlip, 2);
  std::vector<std::byte> buf(4 * kMiB);
  Status s = tier->Get(TestKey(6), buf, nullptr);
  REQUIRE(s.IsCorruption());
  CHECK(s.message().find(TestKey(6).ToString()) != std::string::npos);
  CHECK(s.message().find("terrace.data") != std::string::npos);
  CHECK(tier->Stats().corruptions == 1);
  CHECK(tier->Lookup(TestKey(6)).status().IsNotFound());
  CheckBaseline(*tier, /*skip=*/6);
  // The drop is durable: after reopen block 6 is gone and everything else is intact.
  ReopenAndCheck(tier, opts, /*skip=*/6);
  CHECK(tier->Lookup(TestKey(6)).status().IsNotFound());
}

TEST_CASE("nvme faults: fdatasync failure fails the commit, acknowledged data survives", "[nvme][fault]") {
  TempDir dir("nvme");
  auto mode = GENERATE(Durability::kAsync, Durability::kSync);
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, mode);
  auto [tier, fault] = OpenFaultyTier(opts);
  PutBaseline(*tier);
  fault->ArmSync(EIO, 1);
  Status s = PutTestBlock(*tier, 200);
  if (mode == Durability::kAsync) {
    REQUIRE(s.ok());  // acknowledged as written; the commit fails
    s = tier->Flush();
  }
  REQUIRE(s.IsIoError());
  CHECK_FALSE(s.retryable());
  CHECK(s.message().find("fdatasync") != std::string::npos);
  // The tier now refuses writes until reopened; reads still work.
  CHECK(PutTestBlock(*tier, 201).IsIoError());
  CheckBaseline(*tier);
  ReopenAndCheck(tier, opts);
}

TEST_CASE("nvme faults: seeded random schedule over many operations", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, Durability::kSync);
  const std::uint64_t seed = GENERATE(11, 12);
  auto [tier, fault] = OpenFaultyTier(opts, seed);
  PutBaseline(*tier);
  fault->SetRandom(0.2, {FaultKind::kEio, FaultKind::kEnospc, FaultKind::kEagain, FaultKind::kShort,
                         FaultKind::kBitFlip});
  std::vector<int> acked;
  std::vector<std::byte> buf(4 * kMiB);
  int corrupt = 0;
  for (int n = 0; n < 60; ++n) {
    int key = 300 + n % 20;
    Status s = PutTestBlock(*tier, key, 7 + n);
    if (s.ok()) {
      acked.push_back(n);
    } else {
      CHECK((s.IsIoError() || s.IsOutOfCapacity()));
    }
    Status g = tier->Get(TestKey(key), buf, nullptr);
    if (g.IsCorruption()) ++corrupt;
    CHECK((g.ok() || g.IsIoError() || g.IsCorruption() || g.IsNotFound()));
  }
  fault->Disarm();
  CHECK(fault->injected_total() > 0);
  // Baseline untouched except blocks a bit flip dropped; what reads back is always exact.
  for (int i = 0; i < kAcked; ++i) {
    Status s = CheckTestBlock(*tier, i);
    CHECK((s.ok() || (s.IsNotFound() && tier->Stats().corruptions > 0)));
  }
  // The newest acknowledged version of each key in [300, 320), unless dropped as corrupt.
  for (int key = 300; key < 320; ++key) {
    int last = -1;
    for (int n : acked) {
      if (300 + n % 20 == key) last = n;
    }
    if (last < 0) continue;
    Status s = CheckTestBlock(*tier, key, 7 + last);
    CHECK((s.ok() || s.IsNotFound()));
  }
  CHECK(static_cast<int>(tier->Stats().corruptions) >= corrupt);
}

TEST_CASE("nvme faults: a group commit cut short after its index write is finished at the next open", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, Durability::kAsync);
  opts.group_commit_interval = std::chrono::seconds(60);  // only the Flushes below commit
  const Status cut = LeaveCommitCutAfterIndexWrite(opts);
  INFO(cut.ToString());
  REQUIRE(cut.IsIoError());
  CHECK(cut.message().find("descriptor") != std::string::npos);
  const RecoveryReport opened = OpenInCutCommitState(opts);
  CHECK(opened.redo_descriptors == 2);  // keys 0 and 2
  CHECK(opened.redo_clears == 2);       // key 0's old extent, key 1's
  // The data file now says what the index says: a rebuild from it gives the same blocks.
  auto scan = NvmeTier::ScanDataFile(opts, {});
  REQUIRE(scan.ok());
  CHECK(scan->blocks == 2);
  RebuildCutCommitStore(opts);
  OpenInCutCommitState(opts);
}

TEST_CASE("nvme faults: a generation reservation that did not reach the disk is tried again", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, Durability::kAsync);
  opts.group_commit_interval = std::chrono::seconds(60);  // no sync but the reservation's
  auto [tier, fault] = OpenFaultyTier(opts);
  // A fresh store reserves generations at its first put: its superblock sync fails.
  fault->ArmSync(EIO);
  CHECK(PutTestBlock(*tier, 0).IsIoError());
  // Still unreserved: the next put writes and syncs the superblock again (and fails the same way),
  // instead of writing a descriptor generation above the limit on disk.
  fault->ArmSync(EIO);
  CHECK(PutTestBlock(*tier, 1).IsIoError());
  REQUIRE(PutTestBlock(*tier, 2).ok());
  REQUIRE(tier->Flush().ok());
  tier.reset();
  auto t = NvmeTier::Open(opts);
  REQUIRE(t.ok());
  REQUIRE(CheckTestBlock(**t, 2).ok());
}

TEST_CASE("nvme faults: a rebuild before any read-write open follows a commit cut short before its descriptors",
          "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, Durability::kAsync);
  opts.group_commit_interval = std::chrono::seconds(60);
  REQUIRE(LeaveCommitCutAfterIndexWrite(opts).IsIoError());
  // The data file still describes key 0's old version and key 1, and not key 0's new one or key 2.
  // The old index knows the commit: the rebuild follows it.
  // A second rebuild before any open must give the same (the first leaves the commit pending, not
  // half-applied: it writes no descriptors).
  for (int round = 0; round < 2; ++round) {
    INFO("rebuild " << round + 1);
    CHECK(RebuildCutCommitStore(opts).cut_commit_entries >= 3);
  }
  CHECK(OpenInCutCommitState(opts).redo_descriptors == 2);  // finishes the commit: writes its descriptors
  // Now the data file alone says the same.
  CHECK(RebuildCutCommitStore(opts).cut_commit_entries == 0);
  OpenInCutCommitState(opts);
}

TEST_CASE("nvme faults: a failed close is returned by Close, and the acknowledged blocks stay", "[nvme][fault]") {
  TempDir dir("nvme");
  auto opts = SmallNvmeOptions(dir.path(), 64 * kMiB, Durability::kSync);
  auto [tier, fault] = OpenFaultyTier(opts);
  PutBaseline(*tier);
  fault->ArmSync(EIO);  // the close's sync of the superblock recording the final commit
  Status s = tier->Close();
  INFO(s.ToString());
  REQUIRE(s.IsIoError());
  CHECK(s.message().find("closing '" + (dir.path() / "terrace.data").string() + "'") != std::string::npos);
  CHECK(tier->Close().ok());  // closed: a second call has nothing left to do
  ReopenAndCheck(tier, opts);
}
