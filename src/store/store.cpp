// terrace::Store facade, StoreImpl set-up and recovery, BlockHandle.
#include <fmt/format.h>

#include "src/store/store_impl.h"
#include "src/store/tier_factory.h"

namespace terrace {
namespace store_internal {

StoreImpl::StoreImpl(const StoreOptions& options, std::array<std::unique_ptr<Tier>, kNumTiers> tiers)
    : options_(options), logger_(LoggerOrDefault(options.logger)), tiers_(std::move(tiers)), pool_(std::max(1u, options.background_threads)) {
  for (auto& p : policies_) p = MakeEvictionPolicy(options_.eviction);
}

StoreImpl::~StoreImpl() {
  stopping_.store(true, std::memory_order_release);
  demand_cv_.notify_all();
  pool_.Join();  // queued prefetch items complete as Cancelled; running work finishes
}

Status StoreImpl::Init() {
  for (int i = 0; i < kNumTiers; ++i) {
    if (!tiers_[i]) continue;
    if (tiers_[i]->caps().id != TierAt(i)) {
      return Status::InvalidArgument(fmt::format("tier '{}' was passed in slot {} but reports id {}; pass each "
                                                 "tier at index TierId", tiers_[i]->caps().name,
                                                 TierName(TierAt(i)), TierName(tiers_[i]->caps().id)));
    }
    present_mask_ |= Bit(TierAt(i));
  }
  if (present_mask_ == 0) return Status::InvalidArgument("store options configure no tier; enable host, hbm or nvme");
  if (!(options_.low_watermark > 0 && options_.low_watermark <= options_.high_watermark &&
        options_.high_watermark <= 1.0)) {
    return Status::InvalidArgument(fmt::format(
        "store watermarks low={} high={} are invalid; need 0 < low_watermark <= high_watermark <= 1",
        options_.low_watermark, options_.high_watermark));
  }
  promote_tier_ = LowestPresent();
  for (int i = Idx(options_.put_tier); i < kNumTiers; ++i) {
    if (tiers_[i]) {
      promote_tier_ = TierAt(i);
      break;
    }
  }
  // Recover what the tiers already hold, slowest (persistent) first: a faster copy whose
  // descriptor disagrees is stale and removed.
  std::lock_guard lock(mu_);
  for (int i = kNumTiers - 1; i >= 0; --i) {
    if (!tiers_[i]) continue;
    std::vector<std::pair<BlockKey, BlockDesc>> found;
    tiers_[i]->ForEach([&](const BlockKey& k, const BlockDesc& d) { found.emplace_back(k, d); });
    for (const auto& [k, d] : found) {
      Entry& e = entries_[k];
      if (e.mask == 0) {
        e.desc = d;
      } else if (!(e.desc == d)) {
        (void)tiers_[i]->Erase(k);
        continue;
      }
      SetMaskLocked(k, e, static_cast<std::uint8_t>(e.mask | Bit(TierAt(i))));
    }
  }
  return Status::Ok();
}

}  // namespace store_internal

using store_internal::StoreImpl;

Store::Store(std::unique_ptr<StoreImpl> impl) : impl_(std::move(impl)) {}
Store::~Store() = default;

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  TERRACE_ASSIGN_OR_RETURN(auto tiers, store_internal::BuildTiers(options));
  return OpenWithTiers(options, std::move(tiers));
}

Result<std::unique_ptr<Store>> Store::OpenWithTiers(const StoreOptions& options,
                                                    std::array<std::unique_ptr<Tier>, kNumTiers> tiers) {
  auto impl = std::make_unique<StoreImpl>(options, std::move(tiers));
  TERRACE_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  return impl_->Put(key, data, opts);
}
Result<BlockDesc> Store::Get(const BlockKey& key, std::span<std::byte> out) { return impl_->Get(key, out); }
Result<BlockHandle> Store::Acquire(const BlockKey& key, TierId where) { return impl_->Acquire(key, where); }
std::vector<LookupResult> Store::Lookup(std::span<const BlockKey> keys) const { return impl_->Lookup(keys); }
bool Store::Contains(const BlockKey& key) const { return impl_->Contains(key); }
Status Store::Erase(const BlockKey& key) { return impl_->Erase(key); }
Status Store::Pin(const BlockKey& key) { return impl_->Pin(key); }
Status Store::Unpin(const BlockKey& key) { return impl_->Unpin(key); }

std::vector<Status> Store::PutBatch(std::span<const PutItem> items) {
  std::vector<Status> out;
  out.reserve(items.size());
  for (const auto& it : items) out.push_back(impl_->Put(it.key, it.data, it.opts));
  return out;
}

std::vector<Status> Store::GetBatch(std::span<GetItem> items) { return impl_->GetBatch(items); }

std::vector<Status> Store::EraseBatch(std::span<const BlockKey> keys) {
  std::vector<Status> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(impl_->Erase(k));
  return out;
}

Future<std::vector<Status>> Store::Prefetch(std::span<const BlockKey> keys, TierId target, Priority priority,
                                            Clock::time_point deadline) {
  return impl_->Prefetch(keys, target, priority, deadline);
}
Future<Result<BlockDesc>> Store::GetAsync(const BlockKey& key, std::span<std::byte> out) {
  return impl_->GetAsync(key, out);
}
Future<Status> Store::PutAsync(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  return impl_->PutAsync(key, data, opts);
}
Status Store::Flush() { return impl_->Flush(); }
StoreStats Store::Stats() const { return impl_->Stats(); }
std::string Store::PrometheusText() const { return impl_->PrometheusText(); }
const StoreOptions& Store::options() const { return impl_->options(); }
bool Store::HasTier(TierId id) const { return impl_->HasTier(id); }

BlockHandle::~BlockHandle() { Release(); }

BlockHandle::BlockHandle(BlockHandle&& other) noexcept { *this = std::move(other); }

BlockHandle& BlockHandle::operator=(BlockHandle&& other) noexcept {
  if (this != &other) {
    Release();
    impl_ = std::exchange(other.impl_, nullptr);
    key_ = other.key_;
    desc_ = other.desc_;
    data_ = std::exchange(other.data_, nullptr);
    memory_ = other.memory_;
    tier_ = other.tier_;
  }
  return *this;
}

void BlockHandle::Release() {
  if (!impl_) return;
  impl_->ReleaseHandle(key_, tier_);
  impl_ = nullptr;
  data_ = nullptr;
}

}  // namespace terrace
