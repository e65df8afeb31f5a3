#include "tiers/fault/fault_tier.h"

#include <vector>

#include <fmt/format.h>

namespace terrace {

FaultInjectingTier::FaultInjectingTier(std::unique_ptr<Tier> inner)
    : owned_(std::move(inner)), inner_(owned_.get()), caps_(inner_->caps()) {
  caps_.verifies_gets = false;  // flipped bits land after the inner tier's check
  caps_.reserves = false;       // every byte put goes through Put, where faults are injected
}
FaultInjectingTier::FaultInjectingTier(Tier& inner) : inner_(&inner), caps_(inner_->caps()) {
  caps_.verifies_gets = false;
  caps_.reserves = false;
}

void FaultInjectingTier::FailNextPuts(int n, Status status) {
  MutexLock lock(&mu_);
  fail_puts_ = Armed{n, std::move(status)};
  armed_any_ = true;
}

void FaultInjectingTier::FailNextGets(int n, Status status) {
  MutexLock lock(&mu_);
  fail_gets_ = Armed{n, std::move(status)};
  armed_any_ = true;
}

void FaultInjectingTier::FailNextErases(int n, Status status) {
  MutexLock lock(&mu_);
  fail_erases_ = Armed{n, std::move(status)};
  armed_any_ = true;
}

void FaultInjectingTier::FailNextErasesAfterApplying(int n, Status status) {
  MutexLock lock(&mu_);
  fail_erases_applied_ = Armed{n, std::move(status)};
  armed_any_ = true;
}

void FaultInjectingTier::FlipBitInNextGets(int n) {
  MutexLock lock(&mu_);
  flip_gets_ = n;
  armed_any_ = true;
}

void FaultInjectingTier::CorruptNextPuts(int n) {
  MutexLock lock(&mu_);
  corrupt_puts_ = n;
  armed_any_ = true;
}

void FaultInjectingTier::SetRandom(const RandomFaults& faults) {
  MutexLock lock(&mu_);
  random_ = faults;
  random_on_ = true;
  rng_.seed(faults.seed);
  armed_any_ = true;
}

void FaultInjectingTier::Disarm() {
  MutexLock lock(&mu_);
  fail_puts_ = fail_gets_ = fail_erases_ = fail_erases_applied_ = Armed{};
  flip_gets_ = corrupt_puts_ = 0;
  random_on_ = false;
  armed_any_ = false;
}

InjectedFaultCounts FaultInjectingTier::injected() const {
  MutexLock lock(&mu_);
  return counts_;
}

std::uint64_t FaultInjectingTier::NextRandom() { return rng_(); }

Status FaultInjectingTier::TakeFailure(Armed& armed, double random_rate, std::uint64_t& counter) {
  if (armed.count > 0) {
    --armed.count;
    ++counter;
    return armed.status.ok() ? Status::IoError("injected fault") : armed.status;
  }
  if (random_on_ && random_rate > 0 &&
      static_cast<double>(NextRandom() >> 11) * 0x1.0p-53 < random_rate) {
    ++counter;
    return random_.error.ok() ? Status::IoError("injected fault (random)", true) : random_.error;
  }
  return Status::Ok();
}

bool FaultInjectingTier::TakeFlag(int& count, double random_rate, std::uint64_t& counter) {
  if (count > 0) {
    --count;
    ++counter;
    return true;
  }
  if (random_on_ && random_rate > 0 && static_cast<double>(NextRandom() >> 11) * 0x1.0p-53 < random_rate) {
    ++counter;
    return true;
  }
  return false;
}

Status FaultInjectingTier::Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) {
  if (!armed_any_.load(std::memory_order_acquire)) return inner_->Put(key, desc, data);
  bool corrupt = false;
  std::uint64_t bit = 0;
  {
    MutexLock lock(&mu_);
    Status injected = TakeFailure(fail_puts_, random_.put_error * random_on_, counts_.put_errors);
    if (!injected.ok()) return injected.WithContext(fmt::format("put of block {}", key.ToString()));
    if (!data.empty()) corrupt = TakeFlag(corrupt_puts_, 0, counts_.corrupted_puts);
    if (corrupt) bit = NextRandom() % (data.size() * 8);
  }
  if (!corrupt) return inner_->Put(key, desc, data);
  std::vector<std::byte> copy(data.begin(), data.end());
  copy[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
  return inner_->Put(key, desc, copy);
}

Status FaultInjectingTier::TakeGetFailure(std::string_view what) {
  MutexLock lock(&mu_);
  Status injected = TakeFailure(fail_gets_, random_.get_error * random_on_, counts_.get_errors);
  return injected.ok() ? injected : injected.WithContext(what);
}

void FaultInjectingTier::MaybeFlipBit(std::span<std::byte> bytes) {
  if (bytes.empty()) return;
  std::uint64_t bit = 0;
  {
    MutexLock lock(&mu_);
    if (!TakeFlag(flip_gets_, random_.get_bit_flip * random_on_, counts_.bit_flips)) return;
    bit = NextRandom() % (bytes.size() * 8);
  }
  bytes[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
}

Status FaultInjectingTier::Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  if (!armed_any_.load(std::memory_order_acquire)) return inner_->Get(key, out, desc);
  TERRACE_RETURN_IF_ERROR(TakeGetFailure(fmt::format("get of block {}", key.ToString())));
  BlockDesc got;
  TERRACE_RETURN_IF_ERROR(inner_->Get(key, out, &got));
  if (desc) *desc = got;
  MaybeFlipBit(out.first(got.size));
  return Status::Ok();
}

std::vector<Status> FaultInjectingTier::GetRangeBatch(std::span<RangeOp> ops) {
  if (!armed_any_.load(std::memory_order_acquire)) return inner_->GetRangeBatch(ops);
  std::vector<Status> st(ops.size());
  std::vector<std::size_t> passed;  // ops not failed here, in order
  std::vector<RangeOp> inner_ops;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    st[i] = TakeGetFailure(fmt::format("range read of block {}", ops[i].key.ToString()));
    if (!st[i].ok()) continue;
    passed.push_back(i);
    inner_ops.push_back(ops[i]);
  }
  if (inner_ops.empty()) return st;
  std::vector<Status> got = inner_->GetRangeBatch(inner_ops);
  for (std::size_t k = 0; k < passed.size(); ++k) {
    RangeOp& op = ops[passed[k]];
    op.desc = inner_ops[k].desc;
    if (got[k].ok()) MaybeFlipBit(op.out.first(op.length));
    st[passed[k]] = std::move(got[k]);
  }
  return st;
}

Result<BlockDesc> FaultInjectingTier::PutDevice(const BlockKey& key, Codec codec,
                                                std::span<const std::byte> device_data) {
  if (armed_any_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    Status injected = TakeFailure(fail_puts_, random_.put_error * random_on_, counts_.put_errors);
    if (!injected.ok()) return injected.WithContext(fmt::format("device put of block {}", key.ToString()));
  }
  return inner_->PutDevice(key, codec, device_data);
}

Status FaultInjectingTier::GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) {
  if (armed_any_.load(std::memory_order_acquire)) {
    TERRACE_RETURN_IF_ERROR(TakeGetFailure(fmt::format("device get of block {}", key.ToString())));
  }
  return inner_->GetDevice(key, device_out, desc);
}

Status FaultInjectingTier::Erase(const BlockKey& key) {
  if (armed_any_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    Status injected = TakeFailure(fail_erases_, 0, counts_.erase_errors);
    if (!injected.ok()) return injected.WithContext(fmt::format("erase of block {}", key.ToString()));
    Status after = TakeFailure(fail_erases_applied_, 0, counts_.erase_errors);
    if (!after.ok()) {
      (void)inner_->Erase(key);
      return after.WithContext(fmt::format("erase of block {} (applied, then failed)", key.ToString()));
    }
  }
  return inner_->Erase(key);
}

}  // namespace terrace
