#include "tiers/nvme/fault_engine.h"

#include <cerrno>

#include "tiers/nvme/format.h"

namespace terrace::nvme {

FaultInjectingIoEngine::FaultInjectingIoEngine(std::unique_ptr<IoEngine> base, std::uint64_t seed)
    : base_(std::move(base)), rng_(seed) {}

void FaultInjectingIoEngine::Arm(IoOp op, FaultKind kind, int count) {
  MutexLock l(&mu_);
  armed_.push_back({op, kind, count});
}

void FaultInjectingIoEngine::ArmSync(int err, int count) {
  MutexLock l(&mu_);
  sync_err_ = err;
  sync_remaining_ = count;
}

void FaultInjectingIoEngine::SetRandom(double probability, std::vector<FaultKind> kinds) {
  MutexLock l(&mu_);
  probability_ = kinds.empty() ? 0 : probability;
  random_kinds_ = std::move(kinds);
}

void FaultInjectingIoEngine::Disarm() {
  MutexLock l(&mu_);
  armed_.clear();
  probability_ = 0;
  random_kinds_.clear();
  sync_remaining_ = 0;
}

std::uint64_t FaultInjectingIoEngine::injected_total() const {
  std::uint64_t n = 0;
  for (const auto& c : injected_) n += c.load();
  return n;
}

int FaultInjectingIoEngine::Decide(const IoRequest& r) {
  auto applicable = [&](FaultKind k) {
    if (k == FaultKind::kBitFlip) return r.op == IoOp::kRead && r.len > 0;
    if (k == FaultKind::kShort) return r.len > kUnit;  // keeps O_DIRECT remainders unit-aligned
    return true;
  };
  for (auto it = armed_.begin(); it != armed_.end(); ++it) {
    if (it->op != r.op || !applicable(it->kind)) continue;
    FaultKind k = it->kind;
    if (--it->remaining <= 0) armed_.erase(it);
    return static_cast<int>(k);
  }
  if (probability_ > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < probability_) {
    FaultKind k = random_kinds_[rng_() % random_kinds_.size()];
    if (applicable(k)) return static_cast<int>(k);
  }
  return -1;
}

void FaultInjectingIoEngine::Execute(std::span<IoRequest> reqs, const IoCompletion* on_complete) {
  std::vector<IoRequest> fwd;
  std::vector<std::size_t> fwd_map;
  std::vector<std::int8_t> fault(reqs.size(), -1);
  std::vector<std::uint64_t> flip_pos(reqs.size(), 0);
  {
    MutexLock l(&mu_);
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      int f = Decide(reqs[i]);
      fault[i] = static_cast<std::int8_t>(f);
      if (f == static_cast<int>(FaultKind::kBitFlip)) flip_pos[i] = rng_() % (std::uint64_t{reqs[i].len} * 8);
    }
  }
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    int f = fault[i];
    if (f >= 0) injected_[f].fetch_add(1);
    int err = f == static_cast<int>(FaultKind::kEio)      ? -EIO
              : f == static_cast<int>(FaultKind::kEnospc) ? -ENOSPC
              : f == static_cast<int>(FaultKind::kEagain) ? -EAGAIN
                                                          : 0;
    if (err != 0) {
      reqs[i].result = err;
      reqs[i].submit_ns = SteadyNanos();
      reqs[i].complete_ns = 0;
      if (on_complete) (*on_complete)(i);
      continue;
    }
    IoRequest r = reqs[i];
    if (f == static_cast<int>(FaultKind::kShort)) r.len = static_cast<std::uint32_t>(RoundUp(r.len / 2, kUnit) - kUnit);
    if (r.len == 0) r.len = static_cast<std::uint32_t>(kUnit);
    fwd.push_back(r);
    fwd_map.push_back(i);
  }
  IoCompletion cb = [&](std::size_t j) {
    std::size_t i = fwd_map[j];
    reqs[i].result = fwd[j].result;
    reqs[i].submit_ns = fwd[j].submit_ns;
    reqs[i].complete_ns = fwd[j].complete_ns;
    if (fault[i] == static_cast<int>(FaultKind::kBitFlip) && fwd[j].result > 0) {
      std::uint64_t bit = flip_pos[i] % (static_cast<std::uint64_t>(fwd[j].result) * 8);
      reqs[i].buf[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    }
    if (on_complete) (*on_complete)(i);
  };
  if (!fwd.empty()) base_->Execute(fwd, &cb);
}

int FaultInjectingIoEngine::SyncData() {
  {
    MutexLock l(&mu_);
    if (sync_remaining_ > 0) {
      --sync_remaining_;
      return -sync_err_;
    }
  }
  return base_->SyncData();
}

}  // namespace terrace::nvme
