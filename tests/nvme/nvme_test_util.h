// Helpers shared by the NVMe tier tests: options, deterministic blocks, fault-injected opens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "terrace/options.h"
#include "test_util.h"
#include "tiers/nvme/fault_engine.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/uring_engine.h"

namespace terrace::testing {

inline NvmeTierOptions SmallNvmeOptions(const std::filesystem::path& dir, std::uint64_t capacity = 64 * kMiB,
                                        Durability durability = Durability::kAsync) {
  NvmeTierOptions o;
  o.path = dir;
  o.capacity_bytes = capacity;
  o.queue_depth = 16;
  o.io_threads = 2;
  o.durability = durability;
  o.group_commit_interval = std::chrono::microseconds(2000);
  return o;
}

// Block i: size from a fixed menu (aligned, unaligned, multi-chunk), content from (seed, i).
inline std::size_t NvmeTestSize(std::uint64_t i) {
  static constexpr std::size_t kSizes[] = {4096, 5000, 1, 65536, 12288 + 17, 300000, 8192, 1536 * 1024 + 3};
  return kSizes[i % (sizeof kSizes / sizeof kSizes[0])];
}

inline Status PutTestBlock(Tier& tier, std::uint64_t i, std::uint64_t seed = 42, std::size_t size = 0) {
  auto data = TestBytes(i, size ? size : NvmeTestSize(i), seed);
  return tier.Put(TestKey(i), DescribeBlock(data), data);
}

// OK when block i reads back with exactly the expected bytes.
inline Status CheckTestBlock(Tier& tier, std::uint64_t i, std::uint64_t seed = 42, std::size_t size = 0) {
  auto want = TestBytes(i, size ? size : NvmeTestSize(i), seed);
  std::vector<std::byte> got(want.size() + 7);
  BlockDesc d;
  TERRACE_RETURN_IF_ERROR(tier.Get(TestKey(i), got, &d));
  if (d.size != want.size() || !std::equal(want.begin(), want.end(), got.begin())) {
    return Status::Internal("block " + TestKey(i).ToString() + " read back with different bytes");
  }
  return Status::Ok();
}

// Opens `options` with the io_uring engine wrapped in a FaultInjectingIoEngine; *fault receives it.
inline Result<std::unique_ptr<NvmeTier>> OpenFaulty(const NvmeTierOptions& options, nvme::FaultInjectingIoEngine** fault,
                                                   std::uint64_t seed = 1) {
  return NvmeTier::OpenWithEngine(options, [fault, seed](const nvme::IoEngineConfig& cfg)
                                               -> Result<std::unique_ptr<nvme::IoEngine>> {
    TERRACE_ASSIGN_OR_RETURN(auto base, nvme::OpenUringEngine(cfg));
    auto f = std::make_unique<nvme::FaultInjectingIoEngine>(std::move(base), seed);
    *fault = f.get();
    return std::unique_ptr<nvme::IoEngine>(std::move(f));
  });
}

// Leaves the store of `options` (async, a long group_commit_interval) with its last group commit
// cut short after its index write: keys 0 and 1 (seed 1) durable, then one commit that overwrites
// key 0 (seed 2), erases key 1 and puts key 2 (seed 1), whose every data-file write after the index
// write (the descriptors, the zeroed units) fails. Returns the final Flush's error (an IoError
// naming a descriptor) or what went wrong before it.
inline Status LeaveCommitCutAfterIndexWrite(const NvmeTierOptions& options, std::size_t size = 0) {
  nvme::FaultInjectingIoEngine* fault = nullptr;
  TERRACE_ASSIGN_OR_RETURN(auto tier, OpenFaulty(options, &fault));
  TERRACE_RETURN_IF_ERROR(PutTestBlock(*tier, 0, 1, size));
  TERRACE_RETURN_IF_ERROR(PutTestBlock(*tier, 1, 1, size));
  TERRACE_RETURN_IF_ERROR(tier->Flush());
  TERRACE_RETURN_IF_ERROR(PutTestBlock(*tier, 0, 2, size));
  TERRACE_RETURN_IF_ERROR(tier->Erase(TestKey(1)));
  TERRACE_RETURN_IF_ERROR(PutTestBlock(*tier, 2, 1, size));
  fault->Arm(nvme::IoOp::kWrite, nvme::FaultKind::kEio, 1000);
  const Status s = tier->Flush();
  if (s.ok()) return Status::Internal("the commit did not fail");
  return s;
}

// OK when `tier` holds what LeaveCommitCutAfterIndexWrite's commit made: key 0 at seed 2, key 2
// at seed 1 (blocks of `size`), key 1 absent.
inline Status CheckCutCommitState(Tier& tier, std::size_t size = 0) {
  TERRACE_RETURN_IF_ERROR(CheckTestBlock(tier, 0, 2, size).WithContext("key 0 (overwritten)"));
  TERRACE_RETURN_IF_ERROR(CheckTestBlock(tier, 2, 1, size).WithContext("key 2 (new)"));
  if (!tier.Lookup(TestKey(1)).status().IsNotFound()) return Status::Internal("key 1 (erased) is back");
  return Status::Ok();
}

// Opens the store `options` names, requires CheckCutCommitState, and returns what the open recovered.
inline RecoveryReport OpenInCutCommitState(const NvmeTierOptions& options) {
  auto t = NvmeTier::Open(options);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  const Status state = CheckCutCommitState(**t);
  INFO(state.ToString());
  CHECK(state.ok());
  return (*t)->recovery_report();
}

// Rebuilds the index of the store LeaveCommitCutAfterIndexWrite left, requires the two blocks its
// commit leaves indexed, and returns the rebuild's report.
inline RebuildReport RebuildCutCommitStore(const NvmeTierOptions& options) {
  auto r = NvmeTier::RebuildIndex(options);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  CHECK(r->blocks_indexed == 2);
  return *r;
}

}  // namespace terrace::testing
