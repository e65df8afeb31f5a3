// Slow home tiers for the expert-offload tests: wrappers that make a real home tier (the host tier,
// or the NVMe tier with its batched io_uring reads) a deliberately slow single-channel device,
// record what was read in order, and can store corrupt copies. Test support only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "forwarding_tier.h"
#include "terrace/tier.h"

namespace terrace::experts::testing {

// A wrapped tier whose reads are served one call at a time, in arrival order, each call first
// waiting `delay` (a slow single-channel device); records every key read, in the order served.
// Subclasses decide which calls are reads (Serve). Thread-safe.
class SlowHomeTier : public terrace::testing::ForwardingTier {
 public:
  SlowHomeTier(std::unique_ptr<Tier> inner, std::chrono::milliseconds delay)
      : ForwardingTier(std::move(inner)), delay_(delay) {}
  void set_delay(std::chrono::milliseconds d) {
    std::lock_guard lock(mu_);
    delay_ = d;
  }
  // Every key read so far, in the order the reads were served (a batch's keys in op order).
  std::vector<BlockKey> reads() const {
    std::lock_guard lock(mu_);
    return reads_;
  }
  // The number of keys each read call carried, in the order served (1 per Get, n per GetBatch).
  std::vector<std::size_t> read_calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }

 protected:
  // Waits for every earlier call to finish, records `keys`, waits the delay, then returns read().
  template <typename Read>
  auto Serve(std::span<const BlockKey> keys, Read&& read) {
    std::unique_lock lock(mu_);
    const std::uint64_t ticket = next_ticket_++;
    cv_.wait(lock, [&] { return serving_ == ticket; });
    reads_.insert(reads_.end(), keys.begin(), keys.end());
    calls_.push_back(keys.size());
    const auto d = delay_;
    lock.unlock();
    std::this_thread::sleep_for(d);
    auto result = read();
    lock.lock();
    ++serving_;
    lock.unlock();
    cv_.notify_all();
    return result;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds delay_;                // guarded by mu_
  std::uint64_t next_ticket_ = 0, serving_ = 0;    // guarded by mu_
  std::vector<BlockKey> reads_;                    // guarded by mu_
  std::vector<std::size_t> calls_;                 // guarded by mu_
};

// Over a host tier: serves Gets one at a time, each paying the delay. Batches use Tier's looping
// default, so each key of a batch is a call of its own.
class SlowTier final : public SlowHomeTier {
 public:
  using SlowHomeTier::SlowHomeTier;

  // No zero-copy access: every read of this tier goes through Get and pays the delay (else a move
  // up into HBM copies straight from the inner host arena).
  const std::byte* ResidentPtr(const BlockKey&) const override { return nullptr; }

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    return Serve(std::span<const BlockKey>(&key, 1), [&] { return inner_->Get(key, out, desc); });
  }
};

// Over the real NVMe tier: a Get or a whole GetBatch is one call paying the delay once, then goes
// to the NVMe tier as it came (a batch stays one batched io_uring read, merged where adjacent).
// The store's registration of the fast tier's memory for direct reads is passed through.
class SlowNvmeTier final : public SlowHomeTier {
 public:
  using SlowHomeTier::SlowHomeTier;

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    return Serve(std::span<const BlockKey>(&key, 1), [&] { return inner_->Get(key, out, desc); });
  }
  std::vector<Status> GetBatch(std::span<GetOp> ops) override {
    std::vector<BlockKey> keys;
    for (const GetOp& op : ops) keys.push_back(op.key);
    return Serve(keys, [&] { return inner_->GetBatch(ops); });
  }
  std::vector<std::span<std::byte>> IoRegions() const override { return inner_->IoRegions(); }
  Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) override {
    return inner_->RegisterIoRegions(regions);
  }
  Status Flush() override { return inner_->Flush(); }
};

}  // namespace terrace::experts::testing
