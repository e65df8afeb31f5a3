// terrace::Store facade, StoreImpl set-up and recovery, BlockHandle. Store::Open (which builds
// the concrete tiers) lives in tier_registry.cpp, outside the store core.
#include <algorithm>
#include <cassert>
#include <atomic>
#include <list>
#include <thread>

#include <fmt/format.h>

#include "src/common/mutex.h"
#include "src/common/start_thread.h"
#include "src/store/store_impl.h"

namespace terrace {
namespace store_internal {

namespace {

// Slot names: the given name, else caps().name with "-2", "-3", ... for later slots of one name.
std::vector<std::string> SlotNames(const std::vector<NamedTier>& tiers) {
  std::vector<std::string> names;
  for (const NamedTier& t : tiers) {
    std::string base = !t.name.empty() ? t.name : t.tier ? t.tier->caps().name : std::string("tier");
    std::string name = base;
    for (int n = 2; std::find(names.begin(), names.end(), name) != names.end(); ++n) name = fmt::format("{}-{}", base, n);
    names.push_back(std::move(name));
  }
  return names;
}

}  // namespace

StoreImpl::StoreImpl(const StoreOptions& options, std::vector<NamedTier> tiers)
    : options_(options), logger_(LoggerOrDefault(options.logger)), slots_(tiers.size()),
      bounce_(options.bounce_buffers, options.bounce_buffer_bytes),
      batch_bounce_(options.bounce_buffers, options.bounce_buffer_bytes),
      lane_threads_(std::max(1u, options.background_threads) - (options.background_threads > 1 ? 1 : 0)) {
  const std::vector<std::string> names = SlotNames(tiers);
  for (std::size_t i = 0; i < tiers.size(); ++i) {
    slots_[i].tier = std::move(tiers[i].tier);
    slots_[i].name = names[i];
    if (slots_[i].tier) slots_[i].kind = slots_[i].tier->caps().id;
    slots_[i].policy = MakeEvictionPolicy(options_.eviction);
  }
}

StoreImpl::~StoreImpl() {
  // BlockHandles must not outlive their store (store.h): one released later would touch freed
  // memory. Say so while the store still can (handles_ counts the live ones per key and slot).
  std::uint64_t live = 0;
  std::string first;
  {
    MutexLock lock(&mu_);
    for (const auto& [key, per_slot] : handles_) {
      for (std::size_t i = 0; i < per_slot.size(); ++i) {
        if (per_slot[i] != 0 && first.empty())
          first = fmt::format("{} in tier {}", key.ToString(), SlotName(static_cast<int>(i)));
        live += per_slot[i];
      }
    }
  }
  if (live != 0) {
    logger_->Log(LogLevel::kError, "store",
                 fmt::format("the store is destroyed while {} BlockHandle(s) it handed out are still live (the first: "
                             "{}); destroy or Release() every BlockHandle before its Store: a handle released "
                             "after it touches freed memory",
                             live, first));
    assert(live == 0 && "a BlockHandle outlives its Store");  // debug builds stop here
  }
  stopping_.store(true, std::memory_order_release);
  demand_->Wake();
  prefetch_lane_.Join();  // queued prefetch items complete as Cancelled; running work finishes
  CancelQueuedPrefetch();  // items whose drainer was posted too late to run (none queue after this)
  pool_.Join();           // then async gets and puts
  demotion_lane_.Join();  // then demotions either may have scheduled (a pass stops at stopping_)
}

namespace {

// The threads closing stores dropped on their own threads. Constructed at the first such close, so
// it is destroyed at exit before every static constructed earlier; its destructor joins the
// threads, so a program returning from main waits for those stores' final commits.
class ClosingThreads {
 public:
  static ClosingThreads& Get() {
    static ClosingThreads threads;
    return threads;
  }
  ~ClosingThreads() { JoinAll(); }

  // Starts `close` on a thread of its own; the error of StartThread when none can be had.
  template <typename F>
  Status Start(F&& close) {
    MutexLock lock(&mu_);
    ReapFinishedLocked();
    Closing& c = running_.emplace_back();
    auto t = StartThread("the store's closing thread (the store was dropped on one of its own threads)",
                         [close = std::forward<F>(close), done = &c.done]() mutable {
                           close();
                           done->store(true, std::memory_order_release);
                         });
    if (!t.ok()) {
      running_.pop_back();
      return t.status();
    }
    c.thread = std::move(*t);
    return Status::Ok();
  }

  // Returns once every close started before or during the call has finished.
  void JoinAll() {
    for (;;) {
      std::list<Closing> joining;
      {
        MutexLock lock(&mu_);
        joining.swap(running_);
      }
      if (joining.empty()) return;
      for (Closing& c : joining) c.thread.join();
    }
  }

 private:
  struct Closing {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  // Joins the closes that have finished (their join returns at once), so that a long-running
  // program does not accumulate them.
  void ReapFinishedLocked() TERRACE_REQUIRES(mu_) {
    running_.remove_if([](Closing& c) {
      if (!c.done.load(std::memory_order_acquire)) return false;
      c.thread.join();
      return true;
    });
  }

  Mutex mu_;
  std::list<Closing> running_ TERRACE_GUARDED_BY(mu_);
};

}  // namespace

void WaitForClosingStores() { ClosingThreads::Get().JoinAll(); }

void StoreImpl::CloseElsewhere(std::unique_ptr<StoreImpl> impl) {
  StoreImpl* raw = impl.release();  // owned by the closing thread from here, or leaked
  Status started = ClosingThreads::Get().Start([raw] { delete raw; });
  if (started.ok()) return;
  raw->logger_->Log(LogLevel::kError, "store",
                    fmt::format("the store was dropped in a completion callback on one of its own threads and "
                                "cannot be closed: {}; it is left open (its memory and threads stay) instead of "
                                "joining the calling thread from itself",
                                started.message()));
}

int StoreImpl::SlotOf(TierId kind) const {
  for (int i = 0; i < slot_count(); ++i) {
    if (slot(i).kind == kind) return i;
  }
  return -1;
}

int StoreImpl::SlotAtOrBelow(TierId kind) const {
  for (int i = 0; i < slot_count(); ++i) {
    if (slot(i).kind >= kind) return i;
  }
  return -1;
}

bool StoreImpl::AdoptFromShared(const BlockKey& key) {
  for (int i = 0; i < slot_count(); ++i) {
    if (!(shared_mask_ & Bit(i))) continue;
    Result<BlockDesc> d = tier(i).Lookup(key);
    if (!d.ok()) continue;
    MutexLock lock(&mu_);
    auto [it, inserted] = entries_.try_emplace(key);
    if (!inserted && it->second.mask != 0) return true;  // entered meanwhile (cannot happen under the stripe)
    it->second.desc = *d;
    it->second.version = ++last_version_;
    SetMaskLocked(key, it->second, Bit(i));
    return true;
  }
  return false;
}

Result<std::unique_ptr<StoreImpl>> OpenImpl(const StoreOptions& options, std::vector<NamedTier> tiers) {
  auto impl = std::make_unique<StoreImpl>(options, std::move(tiers));
  TERRACE_RETURN_IF_ERROR(impl->Init());
  TERRACE_RETURN_IF_ERROR(impl->StartThreads().WithContext("open store"));
  return impl;
}

Status StoreImpl::StartThreads() {
  const unsigned threads = std::max(1u, options_.background_threads);
  // On a failure the pools started before are joined by the destructor (they ran nothing yet).
  auto failed = [&](const Status& s) {
    return Status::Unavailable(fmt::format("{}; the store starts {} threads (StoreOptions::background_threads {})",
                                           s.message(), threads + lane_threads_ + 1, options_.background_threads));
  };
  if (Status s = pool_.Start(threads, "the store's async get/put threads"); !s.ok()) return failed(s);
  if (Status s = prefetch_lane_.Start(lane_threads_, "the store's prefetch threads"); !s.ok()) return failed(s);
  if (Status s = demotion_lane_.Start(1, "the store's demotion thread"); !s.ok()) return failed(s);
  return Status::Ok();
}

// An enum value the library does not name would fall back to a default silently.
Status ValidateStoreEnums(const StoreOptions& options) {
  const std::pair<bool, const char*> out_of_range[] = {
      {options.eviction > terrace::EvictionPolicy::kS3Fifo, "eviction (EvictionPolicy::kLru or kS3Fifo)"},
      {options.placement > Placement::kInclusive, "placement (Placement::kExclusive or kInclusive)"},
      {options.write_policy > WritePolicy::kWriteThrough, "write_policy (WritePolicy::kWriteBack or kWriteThrough)"},
      {static_cast<int>(options.put_tier) >= kNumTiers, "put_tier (TierId::kHbm, kHost or kNvme)"},
  };
  for (const auto& [bad, what] : out_of_range)
    if (bad) return Status::InvalidArgument(fmt::format("store options: {} holds a value it does not name", what));
  return Status::Ok();
}

Status StoreImpl::Init() {
  // Store::Open and OpenWithTiers refuse an empty list first, each in its own words.
  if (slots_.empty()) return Status::InvalidArgument("the store was given no tier; it needs at least one");
  if (slot_count() > kMaxTierSlots) {
    return Status::InvalidArgument(fmt::format("the store was given {} tiers; it composes at most {}",
                                               slot_count(), kMaxTierSlots));
  }
  for (int i = 0; i < slot_count(); ++i) {
    if (!slot(i).tier) {
      return Status::InvalidArgument(fmt::format("tier slot {} of {} is null; pass only configured tiers", i,
                                                 slot_count()));
    }
    if (tier(i).caps().shared) shared_mask_ |= Bit(i);
  }
  TERRACE_RETURN_IF_ERROR(ValidateStoreEnums(options_));
  if (!(options_.low_watermark > 0 && options_.low_watermark <= options_.high_watermark &&
        options_.high_watermark <= 1.0)) {
    return Status::InvalidArgument(fmt::format(
        "store watermarks low={} high={} are invalid; need 0 < low_watermark <= high_watermark <= 1",
        options_.low_watermark, options_.high_watermark));
  }
  if (options_.bounce_buffers == 0 || options_.bounce_buffer_bytes < 4096) {
    return Status::InvalidArgument(fmt::format(
        "store bounce buffers: {} buffers of {} bytes; need bounce_buffers >= 1 and bounce_buffer_bytes >= 4096",
        options_.bounce_buffers, options_.bounce_buffer_bytes));
  }
  const int put_slot = SlotAtOrBelow(options_.put_tier);
  if (put_slot < 0) {
    // Every Put without PutOptions::tier would fail: refuse the store instead.
    std::string have;
    for (int i = 0; i < slot_count(); ++i) have += fmt::format("{}{}", i == 0 ? "" : ", ", SlotName(i));
    const std::string configure = options_.put_tier == TierId::kNvme ? "an nvme tier (nvme.path, or tier_list)"
                                                                     : fmt::format("a {} tier", TierName(options_.put_tier));
    return Status::InvalidArgument(fmt::format(
        "store options: put_tier {} has no tier at or below it (the store's tiers: {}); configure {} or set "
        "StoreOptions::put_tier to one of the store's tiers",
        TierName(options_.put_tier), have, configure));
  }
  promote_slot_ = put_slot;
  // Recover what the tiers already hold, slowest (persistent) first: a faster copy whose
  // descriptor disagrees is stale and removed. Tier I/O (ForEach, Erase) runs outside mu_.
  for (int i = LowestSlot(); i >= 0; --i) {
    std::vector<std::pair<BlockKey, BlockDesc>> found;
    tier(i).ForEach([&](const BlockKey& k, const BlockDesc& d) { found.emplace_back(k, d); });
    std::vector<BlockKey> stale;
    {
      MutexLock lock(&mu_);
      for (const auto& [k, d] : found) {
        Entry& e = entries_[k];
        if (e.mask == 0) {
          e.desc = d;
        } else if (!(e.desc == d)) {
          stale.push_back(k);
          continue;
        }
        SetMaskLocked(k, e, static_cast<SlotMask>(e.mask | Bit(i)));
      }
    }
    for (const BlockKey& k : stale) (void)tier(i).Erase(k);
  }
  return Status::Ok();
}

}  // namespace store_internal

using store_internal::StoreImpl;

Store::Store(std::unique_ptr<StoreImpl> impl) : impl_(std::move(impl)) {}
// On another thread, impl_ stays set while its destructor joins the store's threads: callbacks still
// running there may call Store methods (answered Cancelled, "the store is closing").
Store::~Store() {
  if (impl_ && impl_->OnOwnThread()) StoreImpl::CloseElsewhere(std::move(impl_));
}

Result<std::unique_ptr<Store>> Store::OpenWithTiers(const StoreOptions& options,
                                                    std::vector<std::unique_ptr<Tier>> tiers) {
  if (tiers.empty()) {
    // `options`' hbm, host, nvme and tier_list are not read here: the tiers passed are the store's.
    return Status::InvalidArgument("Store::OpenWithTiers was given no tier (an empty list, or an array of null "
                                   "tiers); pass at least one tier, or use Store::Open to build them from options");
  }
  std::vector<store_internal::NamedTier> named;
  named.reserve(tiers.size());
  for (auto& t : tiers) named.push_back({std::move(t), {}});
  TERRACE_ASSIGN_OR_RETURN(auto impl, store_internal::OpenImpl(options, std::move(named)));
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Result<std::unique_ptr<Store>> Store::OpenWithTiers(const StoreOptions& options,
                                                    std::array<std::unique_ptr<Tier>, kNumTiers> tiers) {
  std::vector<std::unique_ptr<Tier>> list;
  for (int i = 0; i < kNumTiers; ++i) {
    if (!tiers[i]) continue;
    const auto want = static_cast<TierId>(i);
    if (tiers[i]->caps().id != want) {
      return Status::InvalidArgument(fmt::format("tier '{}' was passed in slot {} but reports id {}; pass each "
                                                 "tier at index TierId", tiers[i]->caps().name, TierName(want),
                                                 TierName(tiers[i]->caps().id)));
    }
    list.push_back(std::move(tiers[i]));
  }
  return OpenWithTiers(options, std::move(list));
}

Status Store::Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  return impl_->Put(key, data, opts);
}
Result<BlockDesc> Store::Get(const BlockKey& key, std::span<std::byte> out, const GetOptions& opts) {
  return impl_->Get(key, out, opts);
}
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

std::vector<Status> Store::GetBatch(std::span<GetItem> items, const GetOptions& opts) {
  return impl_->GetBatch(items, opts);
}

std::vector<Status> Store::GetRanges(std::span<GetRangeItem> items) { return impl_->GetRanges(items); }

std::vector<Status> Store::EraseBatch(std::span<const BlockKey> keys) {
  std::vector<Status> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(impl_->Erase(k));
  return out;
}

Future<std::vector<Status>> Store::Prefetch(std::span<const BlockKey> keys, TierId target, Priority priority,
                                            Clock::time_point deadline) {
  PrefetchOptions o;
  o.priority = priority;
  o.deadline = deadline;
  return impl_->Prefetch(keys, target, o);
}

Future<std::vector<Status>> Store::Prefetch(std::span<const BlockKey> keys, TierId target,
                                            const PrefetchOptions& options) {
  return impl_->Prefetch(keys, target, options);
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
std::uint32_t Store::read_gap_bytes() const { return impl_->read_gap_bytes(); }

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
    slot_ = other.slot_;
  }
  return *this;
}

void BlockHandle::Release() {
  if (!impl_) return;
  impl_->ReleaseHandle(key_, slot_);
  impl_ = nullptr;
  data_ = nullptr;
}

}  // namespace terrace
