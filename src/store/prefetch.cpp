// Prefetch scheduling (priorities, deadlines, cancellation, yielding to demand) and the async
// Get/Put forms, all on the store's thread pool.
#include <iterator>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {

struct PrefetchJob {
  std::vector<BlockKey> keys;
  int target = 0;  // slot
  Priority priority = Priority::kHigh;
  Clock::time_point deadline;
  std::function<void(std::size_t, const Status&)> on_item;  // PrefetchOptions::on_item; immutable
  // kDemand jobs: counted in demand->active from enqueue until the last item is done.
  std::shared_ptr<DemandGate> demand;
  Promise<std::vector<Status>> promise;
  std::vector<Status> results;          // slot i written once, by the thread completing item i
  std::atomic<std::size_t> remaining{0};

  // Called exactly once per item, with no store lock held.
  void Complete(std::size_t i, Status s) {
    results[i] = std::move(s);
    if (on_item) on_item(i, results[i]);
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (demand) {
      {
        MutexLock lock(&demand->mu);
        --demand->active;
      }
      demand->cv.SignalAll();
    }
    promise.set_value(std::move(results));
  }
};

Future<std::vector<Status>> StoreImpl::Prefetch(std::span<const BlockKey> keys, TierId target,
                                                const PrefetchOptions& options) {
  auto job = std::make_shared<PrefetchJob>();
  job->keys.assign(keys.begin(), keys.end());
  job->target = SlotOf(target);
  job->priority = options.priority;
  job->deadline = options.deadline;
  job->on_item = options.on_item;
  job->results.resize(keys.size());
  job->remaining.store(keys.size());
  auto future = job->promise.get_future();
  if (keys.empty()) {
    job->promise.set_value({});
    return future;
  }
  if (job->target < 0) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      job->Complete(i, Status::InvalidArgument(fmt::format("prefetch {}: tier {} is not configured",
                                                           keys[i].ToString(), TierName(target))));
    }
    return future;
  }
  if (static_cast<int>(options.priority) > static_cast<int>(Priority::kLow)) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      job->Complete(i, Status::InvalidArgument(fmt::format(
          "prefetch {}: priority {} is not a Priority (kDemand, kHigh or kLow)", keys[i].ToString(),
          static_cast<int>(options.priority))));
    }
    return future;
  }
  // A cancel() wakes a group waiting for demand to end, so its items complete now.
  job->promise.on_cancel([gate = std::weak_ptr<DemandGate>(demand_)] {
    if (auto g = gate.lock()) g->Wake();
  });
  if (job->priority == Priority::kDemand) {
    job->demand = demand_;
    MutexLock lock(&demand_->mu);
    ++demand_->active;
  }
  EnqueuePrefetch(job);
  // Speculative groups already waiting for demand re-check: one may have to give its lane thread
  // to this job (RunPrefetchGroup).
  if (job->priority == Priority::kDemand) demand_->Wake();
  return future;
}

void StoreImpl::EnqueuePrefetch(const std::shared_ptr<PrefetchJob>& job) {
  // Whether the items are queued is decided once, under prefetch_mu_: queued items are completed by
  // a drainer (or, once the lane is joined, by CancelQueuedPrefetch), the others here; never both.
  unsigned start = 0;
  bool queued = false;
  {
    MutexLock lock(&prefetch_mu_);
    if (!stopping_.load(std::memory_order_acquire)) {
      queued = true;
      auto& q = prefetch_queues_[static_cast<int>(job->priority)];
      for (std::size_t i = 0; i < job->keys.size(); ++i) q.emplace_back(job, i);
      while (prefetch_drainers_ < lane_threads_) {
        ++prefetch_drainers_;
        ++start;
      }
    }
  }
  if (!queued) {
    for (std::size_t i = 0; i < job->keys.size(); ++i) job->Complete(i, Status::Cancelled("the store is closing"));
    return;
  }
  // A drainer posted after the destructor joined prefetch_lane_ never runs; its items are then
  // still queued and CancelQueuedPrefetch completes them.
  for (unsigned i = 0; i < start; ++i) prefetch_lane_.Post([this] { DrainPrefetch(); });
}

void StoreImpl::CancelQueuedPrefetch() {
  std::vector<PrefetchItem> left;
  {
    MutexLock lock(&prefetch_mu_);
    for (auto& q : prefetch_queues_) {
      std::move(q.begin(), q.end(), std::back_inserter(left));
      q.clear();
    }
  }
  for (auto& [job, i] : left) job->Complete(i, Status::Cancelled("the store is closing"));
}

void StoreImpl::DrainPrefetch() {
  // With two or more lane threads, speculation runs on all but one, so a demand job never waits
  // for a speculative group to finish.
  const unsigned spec_lanes = lane_threads_ > 1 ? lane_threads_ - 1 : 1;
  for (;;) {
    // A group: up to kPrefetchGroup demand items (Store::kSpeculativeGroup speculative ones) from
    // the front of the most urgent non-empty queue that share a target, so their NVMe reads go out
    // as one batch.
    std::vector<PrefetchItem> group;
    bool speculative = false;
    {
      MutexLock lock(&prefetch_mu_);
      for (auto& q : prefetch_queues_) {
        if (q.empty()) continue;
        const bool demand = &q == &prefetch_queues_[static_cast<int>(Priority::kDemand)];
        // Speculation is left to the threads already running it (they take the next group).
        if (!demand && prefetch_spec_running_ >= spec_lanes) break;
        const int target = q.front().first->target;
        const std::size_t limit = demand ? kPrefetchGroup : Store::kSpeculativeGroup;
        while (!q.empty() && group.size() < limit && q.front().first->target == target) {
          group.push_back(std::move(q.front()));
          q.pop_front();
        }
        if (!demand) {
          speculative = true;
          ++prefetch_spec_running_;
        }
        break;
      }
      if (group.empty()) {
        --prefetch_drainers_;
        return;
      }
    }
    RunPrefetchGroup(group);  // done, or requeued for a demand job: either way, take the next group
    if (speculative) {
      MutexLock lock(&prefetch_mu_);
      --prefetch_spec_running_;
    }
  }
}

Status StoreImpl::PrefetchCheck(const PrefetchJob& job, std::size_t i) const {
  const BlockKey& key = job.keys[i];
  if (stopping_.load(std::memory_order_acquire)) return Status::Cancelled("the store is closing");
  if (job.promise.cancel_requested()) {
    return Status::Cancelled(fmt::format("prefetch of {} was cancelled before it completed", key.ToString()));
  }
  if (Clock::now() > job.deadline) {
    return Status::TimedOut(fmt::format("prefetch of {} to tier {} missed its deadline before it completed",
                                        key.ToString(), SlotName(job.target)));
  }
  return Status::Ok();
}

void StoreImpl::RunPrefetchGroup(std::span<PrefetchItem> group) {
  // Items that can no longer start are completed now; the rest yield to demand (Gets, kDemand
  // jobs) if they are speculative (one queue: one priority), re-checked after every wait.
  std::vector<PrefetchItem> live;
  auto sift = [&](std::span<PrefetchItem> items) {
    std::vector<PrefetchItem> keep;
    for (auto& [job, i] : items) {
      Status s = PrefetchCheck(*job, i);
      if (s.ok()) {
        keep.emplace_back(job, i);
      } else {
        job->Complete(i, std::move(s));
      }
    }
    live = std::move(keep);
  };
  sift(group);
  if (!live.empty() && live.front().first->priority != Priority::kDemand) {
    // Sleep until demand ends, an item's deadline passes, a job is cancelled, a demand job is
    // queued or the store stops; then re-check the items (no polling). The two locks are leaves:
    // never held together.
    DemandGate& gate = *demand_;
    for (;;) {
      std::uint64_t wakes = 0;
      {
        MutexLock lock(&gate.mu);
        if (live.empty() || gate.active == 0 || stopping_.load(std::memory_order_acquire)) break;
        wakes = gate.wakes;
      }
      {
        // A queued demand job may need this thread (every lane thread may be waiting here).
        MutexLock lock(&prefetch_mu_);
        auto& dq = prefetch_queues_[static_cast<int>(Priority::kDemand)];
        if (!dq.empty()) {
          auto& q = prefetch_queues_[static_cast<int>(live.front().first->priority)];
          for (auto it = live.rbegin(); it != live.rend(); ++it) q.push_front(std::move(*it));
          return;
        }
      }
      Clock::time_point wake = Clock::time_point::max();
      for (const auto& [job, i] : live) wake = std::min(wake, job->deadline);
      {
        MutexLock lock(&gate.mu);
        while (!(gate.active == 0 || gate.wakes != wakes || stopping_.load(std::memory_order_acquire))) {
          if (wake == Clock::time_point::max()) {
            gate.cv.Wait(&gate.mu);
          } else if (!gate.cv.WaitUntil(&gate.mu, wake)) {
            break;  // an item's deadline passed
          }
        }
      }
      sift(live);
    }
  }
  if (live.empty()) return;
  const int target = live.front().first->target;
  std::vector<BulkItem> bulk;
  bulk.reserve(live.size());
  for (auto& [job, i] : live) bulk.push_back(BulkItem{job->keys[i], {}, false, {}, {}});
  // Each item completes as soon as it is done (PrefetchOptions::on_item sees it then).
  std::vector<char> done(live.size(), 0);
  BulkFetch(
      bulk, target, /*by_prefetch=*/true,
      [&](std::size_t k) { return PrefetchCheck(*live[k].first, live[k].second); },
      [&](std::size_t k) {
        done[k] = 1;
        live[k].first->Complete(live[k].second, std::move(bulk[k].status));
      });
  for (std::size_t k = 0; k < live.size(); ++k) {
    if (done[k]) continue;
    auto& [job, i] = live[k];
    if (bulk[k].handled) {
      job->Complete(i, std::move(bulk[k].status));
      continue;
    }
    Status s = PrefetchCheck(*job, i);
    job->Complete(i, s.ok() ? MoveUp(job->keys[i], target, /*by_prefetch=*/true) : std::move(s));
  }
}

Future<Result<BlockDesc>> StoreImpl::GetAsync(const BlockKey& key, std::span<std::byte> out) {
  Promise<Result<BlockDesc>> p;
  auto f = p.get_future();
  if (stopping_.load(std::memory_order_acquire)) {
    p.set_value(Status::Cancelled("the store is closing"));
    return f;
  }
  pool_.Post([this, key, out, p]() mutable {
    if (p.cancel_requested()) {
      p.set_value(Status::Cancelled(fmt::format("get {} was cancelled before it started", key.ToString())));
      return;
    }
    p.set_value(Get(key, out));
  });
  return f;
}

Future<Status> StoreImpl::PutAsync(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  Promise<Status> p;
  auto f = p.get_future();
  if (stopping_.load(std::memory_order_acquire)) {
    p.set_value(Status::Cancelled("the store is closing"));
    return f;
  }
  pool_.Post([this, key, data, opts, p]() mutable {
    if (p.cancel_requested()) {
      p.set_value(Status::Cancelled(fmt::format("put {} was cancelled before it started", key.ToString())));
      return;
    }
    p.set_value(Put(key, data, opts));
  });
  return f;
}

}  // namespace terrace::store_internal
