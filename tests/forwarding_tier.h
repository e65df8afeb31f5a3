// ForwardingTier: the base of the test tiers that wrap a real tier to record, delay, gate or
// relabel some of its calls. Forwards Put, Get, Lookup, Erase, Pin, Unpin, the sizes (used and allocated bytes), ForEach and
// Stats to `inner`; everything else keeps Tier's defaults (no resident pointers, no reservations,
// looping batches). caps() is a copy of the inner tier's, which a subclass may edit in its
// constructor (caps_). Thread-safety: as the inner tier's, plus whatever the subclass adds.
// GetRangeBatch is deliberately NOT forwarded: Tier's default reads each range through this
// tier's own (virtual) Get, so a subclass that overrides only Get (VanishingTier, QueuedSlowTier,
// SlowTier, ...) still sees, delays or gates every read, ranged ones included. Forwarding it to
// the inner tier's ranged path would let range reads bypass the subclass.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "terrace/tier.h"

namespace terrace::testing {

class ForwardingTier : public Tier {
 public:
  explicit ForwardingTier(std::shared_ptr<Tier> inner) : inner_(std::move(inner)), caps_(inner_->caps()) {}

  const TierCaps& caps() const override { return caps_; }
  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override {
    return inner_->Put(key, desc, data);
  }
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override { return inner_->Get(key, out, desc); }
  Result<BlockDesc> Lookup(const BlockKey& key) const override { return inner_->Lookup(key); }
  Status Erase(const BlockKey& key) override { return inner_->Erase(key); }
  Status Pin(const BlockKey& key) override { return inner_->Pin(key); }
  Status Unpin(const BlockKey& key) override { return inner_->Unpin(key); }
  std::uint64_t used_bytes() const override { return inner_->used_bytes(); }
  std::uint64_t allocated_bytes() const override { return inner_->allocated_bytes(); }
  std::uint64_t block_count() const override { return inner_->block_count(); }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override { inner_->ForEach(fn); }
  TierStatsSnapshot Stats() const override { return inner_->Stats(); }

 protected:
  std::shared_ptr<Tier> inner_;
  TierCaps caps_;
};

}  // namespace terrace::testing
