// FaultInjectingIoEngine: wraps an IoEngine and injects faults, for tests and drills.
//
// Faults are chosen per request, either explicitly (Arm: the next N matching requests) or by a
// seeded random schedule (SetRandom). Injected kinds: EIO, ENOSPC, EAGAIN (the request is not
// issued), short transfers (the first part is issued, the rest must be resubmitted), and bit
// flips in data read back. fdatasync failures are armed with ArmSync. Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "src/common/mutex.h"
#include "tiers/nvme/io_engine.h"

namespace terrace::nvme {

enum class FaultKind : std::uint8_t { kEio = 0, kEnospc, kEagain, kShort, kBitFlip };
inline constexpr int kNumFaultKinds = 5;

class FaultInjectingIoEngine final : public IoEngine {
 public:
  FaultInjectingIoEngine(std::unique_ptr<IoEngine> base, std::uint64_t seed);

  // The next `count` requests of `op` get `kind` (kBitFlip applies to reads only).
  void Arm(IoOp op, FaultKind kind, int count = 1);
  // The next `count` SyncData calls fail with -err.
  void ArmSync(int err, int count = 1);
  // From now on, each read / write is faulted with `probability`, kind drawn uniformly from `kinds`.
  void SetRandom(double probability, std::vector<FaultKind> kinds);
  // Clears armed and random faults.
  void Disarm();

  std::uint64_t injected(FaultKind kind) const { return injected_[static_cast<int>(kind)].load(); }
  std::uint64_t injected_total() const;

  void Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) override;
  int SyncData() override;
  Status RegisterBuffers(std::span<const iovec> bufs) override { return base_->RegisterBuffers(bufs); }
  bool fixed_buffers() const override { return base_->fixed_buffers(); }
  unsigned queue_depth() const override { return base_->queue_depth(); }
  std::string_view name() const override { return "fault-injecting"; }

 private:
  struct Armed {
    IoOp op;
    FaultKind kind;
    int remaining;
  };
  // Returns the fault for `r`, or -1 for none. Caller holds mu_.
  int Decide(const IoRequest& r) TERRACE_REQUIRES(mu_);

  std::unique_ptr<IoEngine> base_;
  mutable Mutex mu_;
  std::mt19937_64 rng_ TERRACE_GUARDED_BY(mu_);
  std::vector<Armed> armed_ TERRACE_GUARDED_BY(mu_);
  double probability_ TERRACE_GUARDED_BY(mu_) = 0;
  std::vector<FaultKind> random_kinds_ TERRACE_GUARDED_BY(mu_);
  int sync_err_ TERRACE_GUARDED_BY(mu_) = 0;
  int sync_remaining_ TERRACE_GUARDED_BY(mu_) = 0;
  std::array<std::atomic<std::uint64_t>, kNumFaultKinds> injected_{};
};

}  // namespace terrace::nvme
