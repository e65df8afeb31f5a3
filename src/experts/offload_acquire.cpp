// Acquiring and releasing an expert (offload_impl.h): the forward pass's path through the cache,
// with its hit / miss / stall accounting and the layer clock it advances.
#include <fmt/format.h>

#include "src/experts/offload_impl.h"

namespace terrace::experts {

using namespace offload;

void ExpertOffload::Impl::Advance(int layer) {
  if (layer < cur_layer) {
    ++step;
    ++steps_seen;
    ReportLoadBusyShare();
  } else if (cur_layer < 0) {
    steps_seen = std::max<std::uint64_t>(steps_seen, 1);
    ReportLoadBusyShare();  // starts the first step's clock
  }
  cur_layer = layer;
  const std::int64_t now = Now();
  for (auto it = pending.begin(); it != pending.end();) {
    if (it->target < now) {
      slots[it->slot].pending = false;
      ++cancelled;
      it = pending.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& f : inflight)
    if (f.target < now && f.future.valid()) f.future.cancel();
}

Result<const model::ExpertWeights*> ExpertOffload::Impl::AcquireLocked(int layer, int expert) {
  if (!predictor_error.ok()) return predictor_error;
  if (layer < 0 || layer >= L || expert < 0 || expert >= E || slot(layer, expert).bytes == 0) {
    return Status::InvalidArgument(fmt::format(
        "expert {} of layer {} does not exist (the model has {} layers x {} routed experts; dense layers have none)",
        expert, layer, L, E));
  }
  if (layer != cur_layer) Advance(layer);
  // A speculative prefetch landed: refill the store's queue now rather than at the next
  // prediction or demand load, so the drive does not idle while this layer computes.
  HarvestAndRefill();
  Slot& s = slot(layer, expert);
  LayerCounters& c = counters[static_cast<std::size_t>(layer)];
  if (s.handle.valid()) {  // resident, verified and parsed at an earlier acquire
    if (s.demand_load) {
      ++c.misses;
    } else {
      ++c.hits;
    }
    ++s.refs;
    s.unused_prefetch = false;
    s.demand_load = false;
    s.last_use = ++tick;
    s.acquired_ord = Now();
    ++s.uses;
    return &s.weights;
  }
  const auto t0 = SteadyClock::now();
  const auto idx = static_cast<std::size_t>(&s - slots.data());
  // A landed copy we hold no handle on is not pinned: a shared store may have evicted it since it
  // landed (offload_impl.h). Pinned here while it is looked up and acquired, so that it cannot go
  // in between; a copy that is gone already is forgotten, and loaded below like an absent expert.
  bool pinned = false;
  auto hold_landed = [&] {
    mu.AssertHeld();  // called synchronously, under the mu AcquireLocked requires
    if (s.state != SlotState::kResident) return;
    pinned = store->Pin(s.key).ok();
    if (pinned && InFastTier(s.key)) return;
    if (pinned) (void)store->Unpin(s.key);
    pinned = false;
    ForgetCopy(idx);
  };
  bool stalled = false;
  // A selection-batch load counts as a miss (loaded on demand), landed or not.
  bool counted = false;
  bool sync_load = false;  // read by this thread's store->Acquire below
  hold_landed();
  if (s.state == SlotState::kInFlight) {
    const bool late = !s.demand_load;
    if (late) {
      ++c.late_hits;
    } else {
      ++c.misses;
    }
    counted = true;
    stalled = true;
    WaitForSlot(idx);  // this key only, not its whole batch
    std::erase_if(inflight, [](const InFlight& f) { return f.unbooked == 0; });
    hold_landed();
    if (late && s.state == SlotState::kAbsent) {  // landed, then evicted by the store: loaded again, a miss
      --c.late_hits;
      ++c.misses;
    }
  } else if (s.state == SlotState::kResident) {
    if (s.demand_load) {
      ++c.misses;
    } else {
      ++c.hits;
    }
    counted = true;
  }
  if (s.state == SlotState::kAbsent) {
    if (!counted) ++c.misses;
    stalled = true;
    TERRACE_RETURN_IF_ERROR(Reserve(s.bytes, ReserveKind::kDemand, layer, Now(), 0).WithContext(
        fmt::format("loading expert {} of layer {}", expert, layer)));
    s.state = SlotState::kResident;
    demand_bytes += s.bytes;
    sync_load = true;
  }
  const TierId source = sync_load ? SourceTiers(std::span<const BlockKey>(&s.key, 1))[0] : TierId::kHbm;
  const std::uint64_t load_start = sync_load ? SteadyNanos() : 0;
  auto h = store->Acquire(s.key, TierId::kHbm);
  if (pinned) (void)store->Unpin(s.key);  // h pins it now (or the acquire failed)
  if (sync_load) AddLoadInterval(load_start, SteadyNanos());
  if (sync_load && h.ok()) CountLoad(source, s.bytes);
  if (!h.ok()) {
    auto where = store->Lookup(std::span<const BlockKey>(&s.key, 1));
    if (where.empty() || !where[0].found || where[0].tier != TierId::kHbm) {
      s.state = SlotState::kAbsent;
      used -= s.bytes;
      s.unused_prefetch = false;
      s.demand_load = false;
    }
    if (stalled) AddStall(layer, t0);
    const Status& st = h.status();
    // Only a lost block is mended by storing the experts again; a full or failing fast tier is not.
    const bool lost = st.IsNotFound() || st.IsCorruption();
    std::string what = st.IsNotFound()    ? "its block is missing from the store"
                       : st.IsCorruption() ? "no copy of its block passed its checksum"
                                           : "its block could not be loaded into the fast tier";
    return Status(st).WithContext(fmt::format(
        "expert {} of layer {} ({}; block {}){}", expert, layer, what, s.key.ToString(),
        lost ? kLostExpertRemedy : ""));
  }
  auto w = model::ParseExpertBlock(std::span<const std::byte>(h->data(), h->size()), latent, intermediate);
  if (!w.ok()) {
    if (stalled) AddStall(layer, t0);
    return Status::Corruption(fmt::format("expert {} of layer {}: block {} is not a valid expert block: {}", expert,
                                          layer, s.key.ToString(), w.status().message()));
  }
  if (stalled) AddStall(layer, t0);
  s.handle = std::move(h).value();
  s.weights = std::move(w).value();
  s.refs = 1;
  s.unused_prefetch = false;
  s.demand_load = false;
  s.last_use = ++tick;
  s.acquired_ord = Now();
  ++s.uses;
  Pump();  // speculation waited while this demand load ran
  return &s.weights;
}

void ExpertOffload::Impl::ReleaseLocked(int layer, int expert) {
  if (layer < 0 || layer >= L || expert < 0 || expert >= E) return;
  Slot& s = slot(layer, expert);
  if (s.refs == 0) return;
  --s.refs;  // the handle stays (cached) until the expert is evicted
}

void ExpertOffload::Impl::AddStall(int layer, SteadyClock::time_point t0) {
  const std::uint64_t d = NanosSince(t0);
  stall_ns += d;
  layer_stall[static_cast<std::size_t>(layer)] += d;
}

void ExpertOffload::Impl::ScoreSpeculation(int layer, std::span<const int> sel) {
  const std::uint64_t t = SteadyNanos();
  for (int e : sel) {
    Slot& s = slot(layer, e);
    if (s.spec_issue_ns == 0) continue;
    ++sched.spec_used;
    sched.spec_lead_layers += static_cast<std::uint64_t>(std::max<std::int64_t>(Now() - s.spec_issue_ord, 0));
    sched.spec_lead_ns += t > s.spec_issue_ns ? t - s.spec_issue_ns : 0;
    if (s.state == SlotState::kInFlight) ++sched.spec_late;
    s.spec_issue_ns = 0;
  }
}

}  // namespace terrace::experts
