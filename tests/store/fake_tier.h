// FakeTier: a map-backed in-memory Tier for store tests. Follows the terrace/tier.h contract
// (atomic replace, checksum-verified Get, pins block Erase, OutOfCapacity leaves it unchanged) and
// counts Gets and GetBatch calls; an optional delay per Get (and per Put) makes concurrent work overlap. Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "terrace/tier.h"

namespace terrace::testing {

class FakeTier final : public Tier {
 public:
  // A tier of kind `id`: kNvme is persistent and not addressable, the others hold host memory.
  FakeTier(TierId id, std::uint64_t capacity, bool emulated = false) {
    caps_.id = id;
    caps_.name = std::string(TierName(id));
    caps_.emulated = emulated;
    caps_.persistent = id == TierId::kNvme;
    caps_.memory = id == TierId::kNvme ? MemoryKind::kNone : MemoryKind::kHost;
    caps_.capacity_bytes = capacity;
    caps_.max_block_bytes = capacity;
  }

  const TierCaps& caps() const override { return caps_; }
  // The name the store gives the tier's slot (caps().name); call before the store opens.
  void set_name(std::string name) { caps_.name = std::move(name); }

  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override {
    if (int ms = put_delay_ms.load(); ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    std::uint64_t old = it == blocks_.end() ? 0 : it->second.bytes.size();
    if (used_ - old + data.size() > caps_.capacity_bytes) return Status::OutOfCapacity("fake tier full");
    if (fragmented.load()) return Status::OutOfCapacity("fake: no free run long enough");
    if (it != blocks_.end() && it->second.pins > 0) return Status::InvalidArgument("fake: replacing a pinned block");
    Block& b = blocks_[key];
    b.desc = desc;
    b.bytes.assign(data.begin(), data.end());
    used_ = used_ - old + data.size();
    ++puts_;
    return Status::Ok();
  }

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    gets_.fetch_add(1);
    if (on_get) on_get(key);
    if (int ms = get_delay_ms.load(); ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return Status::NotFound("fake: no such block");
    const Block& b = it->second;
    if (out.size() < b.bytes.size()) return Status::InvalidArgument("fake: buffer too small");
    if (Checksum(b.bytes) != b.desc.checksum) {  // contract: drop and report
      ++corruptions_;
      used_ -= b.bytes.size();
      blocks_.erase(it);
      return Status::Corruption("fake: checksum mismatch, block dropped");
    }
    if (!b.bytes.empty()) std::memcpy(out.data(), b.bytes.data(), b.bytes.size());
    *desc = b.desc;
    return Status::Ok();
  }

  std::vector<Status> GetBatch(std::span<GetOp> ops) override {
    batch_calls_.fetch_add(1);
    batch_ops_.fetch_add(ops.size());
    return Tier::GetBatch(ops);
  }
  Result<BlockDesc> Lookup(const BlockKey& key) const override {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return Status::NotFound("fake: no such block");
    return it->second.desc;
  }

  Status Erase(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return Status::NotFound("fake: no such block");
    if (it->second.pins > 0) return Status::InvalidArgument("fake: block is pinned");
    used_ -= it->second.bytes.size();
    blocks_.erase(it);
    return Status::Ok();
  }

  Status Pin(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return Status::NotFound("fake: no such block");
    ++it->second.pins;
    return Status::Ok();
  }
  Status Unpin(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end() || it->second.pins == 0) return Status::InvalidArgument("fake: not pinned");
    --it->second.pins;
    return Status::Ok();
  }
  const std::byte* ResidentPtr(const BlockKey& key) const override {
    if (caps_.memory == MemoryKind::kNone) return nullptr;
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return nullptr;
    static const std::byte kEmptyBlock{};  // a present empty block is not null (tier.h)
    return it->second.bytes.empty() ? &kEmptyBlock : it->second.bytes.data();
  }

  std::uint64_t used_bytes() const override {
    std::lock_guard lock(mu_);
    return used_;
  }
  std::uint64_t block_count() const override {
    std::lock_guard lock(mu_);
    return blocks_.size();
  }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override {
    std::lock_guard lock(mu_);
    for (const auto& [k, b] : blocks_) fn(k, b.desc);
  }
  TierStatsSnapshot Stats() const override {
    TierStatsSnapshot s;
    s.name = caps_.name;
    s.emulated = caps_.emulated;
    s.capacity_bytes = caps_.capacity_bytes;
    std::lock_guard lock(mu_);
    s.used_bytes = used_;
    s.allocated_bytes = used_;  // the bytes are kept as they are (allocated_bytes() = used_bytes())
    s.blocks = blocks_.size();
    s.puts = puts_;
    s.corruptions = corruptions_;
    return s;
  }

  bool Has(const BlockKey& key) const {
    std::lock_guard lock(mu_);
    return blocks_.count(key) > 0;
  }
  // Flips one stored bit (corruption at rest); false if absent.
  bool CorruptStored(const BlockKey& key) {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end() || it->second.bytes.empty()) return false;
    it->second.bytes[0] ^= std::byte{0x01};
    return true;
  }
  std::uint64_t gets() const { return gets_.load(); }  // single Gets, including those of GetBatch
  std::uint64_t puts() const {  // completed Puts
    std::lock_guard lock(mu_);
    return puts_;
  }
  std::uint64_t batch_calls() const { return batch_calls_.load(); }
  std::uint64_t batch_ops() const { return batch_ops_.load(); }

  std::atomic<int> get_delay_ms{0};
  std::atomic<int> put_delay_ms{0};  // per Put, before it takes the lock (a slow drive's write)
  // Called at the start of every Get, outside the tier's lock. Set before the tier is shared.
  std::function<void(const BlockKey&)> on_get;
  // While set, every Put is refused with OutOfCapacity although the bytes would fit (a fragmented tier).
  std::atomic<bool> fragmented{false};

 private:
  struct Block {
    BlockDesc desc;
    std::vector<std::byte> bytes;
    int pins = 0;
  };
  TierCaps caps_;
  mutable std::mutex mu_;
  std::map<BlockKey, Block> blocks_;  // GUARDED_BY(mu_)
  std::uint64_t used_ = 0;            // GUARDED_BY(mu_)
  std::uint64_t puts_ = 0;            // GUARDED_BY(mu_)
  std::uint64_t corruptions_ = 0;     // GUARDED_BY(mu_)
  std::atomic<std::uint64_t> gets_{0}, batch_calls_{0}, batch_ops_{0};
};

// Holds every Get of one key inside a FakeTier until Open(), and records the keys of all Gets as
// they start, so a test can act while a read is in flight. Installs itself as the tier's on_get:
// create it before the tier is shared, and keep it alive (and open it) while the tier is used.
class GetGate {
 public:
  GetGate(FakeTier& tier, const BlockKey& held) : held_(held) {
    tier.on_get = [this](const BlockKey& k) {
      std::unique_lock lock(mu_);
      started_.push_back(k);
      if (!(k == held_)) return;
      inside_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    };
  }
  void WaitHeld() {  // returns once a Get of the held key is inside the tier
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return inside_; });
  }
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  std::size_t Started(const BlockKey& k) const {  // Gets of k that have started
    std::lock_guard lock(mu_);
    return static_cast<std::size_t>(std::count(started_.begin(), started_.end(), k));
  }

 private:
  const BlockKey held_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool inside_ = false, open_ = false;  // GUARDED_BY(mu_)
  std::vector<BlockKey> started_;       // GUARDED_BY(mu_)
};

// Three fakes (hbm, host, nvme) with the given capacities (0 = absent), plus raw pointers to
// them for inspection (owned by the store once passed to OpenWithTiers).
struct FakeTiers {
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  std::array<FakeTier*, kNumTiers> fake{};
  FakeTiers(std::uint64_t hbm, std::uint64_t host, std::uint64_t nvme) {
    std::uint64_t caps[kNumTiers] = {hbm, host, nvme};
    for (int i = 0; i < kNumTiers; ++i) {
      if (caps[i] == 0) continue;
      auto t = std::make_unique<FakeTier>(static_cast<TierId>(i), caps[i], i == 0);
      fake[i] = t.get();
      tiers[i] = std::move(t);
    }
  }
  FakeTier& at(TierId id) { return *fake[static_cast<int>(id)]; }
};

}  // namespace terrace::testing
