// The load side of ExpertOffload (offload_impl.h): the prefetch queue, handing loads to the store
// as multi-key Store::Prefetch calls, and booking what landed.
#include "src/experts/offload_impl.h"

namespace terrace::experts {

using namespace offload;

std::vector<TierId> ExpertOffload::Impl::SourceTiers(std::span<const BlockKey> keys) const {
  std::vector<TierId> out(keys.size(), static_cast<TierId>(kNumTiers));
  const std::vector<LookupResult> where = store->Lookup(keys);
  for (std::size_t k = 0; k < keys.size() && k < where.size(); ++k)
    if (where[k].found) out[k] = where[k].tier;
  return out;
}

void ExpertOffload::Impl::CountLoad(TierId source, std::uint64_t bytes) {
  const auto t = static_cast<std::size_t>(source);
  if (t >= loads_from.size()) return;
  ++loads_from[t];
  loaded_bytes_from[t] += bytes;
}

void ExpertOffload::Impl::BookItem(InFlight& f, std::size_t k, const Status& st) {
  f.booked[k] = 1;
  --f.unbooked;
  Slot& s = slots[f.slot_ids[k]];
  if (!f.demand) {
    spec_inflight -= s.bytes;
    --spec_keys_inflight;
    spec_booked_since_pump = true;
  }
  bool landed = st.ok();
  const std::uint64_t done_ns = f.landing->DoneNs(k);
  if (done_ns > f.issue_ns) AddLoadInterval(f.issue_ns, done_ns);
  if (!landed) {
    // A cancelled item never started; any other failure may still have left a copy.
    auto where = store->Lookup(std::span<const BlockKey>(&s.key, 1));
    landed = !where.empty() && where[0].found && where[0].tier == TierId::kHbm;
    if (!landed && !f.demand && (st.code() == Code::kCancelled || st.code() == Code::kTimedOut)) ++cancelled;
  }
  if (landed) {
    s.state = SlotState::kResident;
    s.last_use = ++tick;
    CountLoad(f.source[k], s.bytes);
    if (f.demand) {
      demand_bytes += s.bytes;
    } else {
      s.unused_prefetch = true;
      spec_bytes += s.bytes;
      ++sched.spec_landed;
      sched.spec_load_ns += done_ns > f.issue_ns ? done_ns - f.issue_ns : 0;
    }
  } else {
    s.state = SlotState::kAbsent;
    s.demand_load = false;
    s.spec_issue_ns = 0;
    used -= s.bytes;
  }
  if (f.unbooked == 0) f.future = Future<std::vector<Status>>();
}

bool ExpertOffload::Impl::Book(InFlight& f, bool wait) {
  for (std::size_t k = 0; k < f.slot_ids.size() && f.unbooked > 0; ++k) {
    if (f.booked[k]) continue;
    if (wait) {
      BookItem(f, k, f.landing->Wait(k));
    } else if (std::optional<Status> st = f.landing->Poll(k)) {
      BookItem(f, k, *st);
    }
  }
  return f.unbooked == 0;
}

void ExpertOffload::Impl::WaitForSlot(std::size_t i) {
  for (auto& f : inflight) {
    if (f.unbooked == 0) continue;
    for (std::size_t k = 0; k < f.slot_ids.size(); ++k) {
      if (f.slot_ids[k] != i || f.booked[k]) continue;
      BookItem(f, k, f.landing->Wait(k));
      return;
    }
  }
}

InFlight ExpertOffload::Impl::Issue(std::vector<std::size_t> ids, std::int64_t target, bool demand, Priority prio) {
  InFlight f;
  std::vector<BlockKey> keys;
  keys.reserve(ids.size());
  for (std::size_t i : ids) keys.push_back(slots[i].key);
  f.slot_ids = std::move(ids);
  f.target = target;
  f.demand = demand;
  f.landing = std::make_shared<Landing>(f.slot_ids.size());
  f.booked.assign(f.slot_ids.size(), 0);
  f.unbooked = f.slot_ids.size();
  f.source = SourceTiers(keys);
  f.issue_ns = SteadyNanos();
  if (!demand) {
    for (std::size_t i : f.slot_ids) {
      slots[i].spec_issue_ns = f.issue_ns;
      slots[i].spec_issue_ord = Now();
    }
  }
  PrefetchOptions po;
  po.priority = prio;
  po.on_item = [landing = f.landing](std::size_t k, const Status& st) { landing->Set(k, st); };
  f.future = store->Prefetch(keys, TierId::kHbm, po);
  return f;
}

void ExpertOffload::Impl::Harvest(bool wait) {
  for (auto& f : inflight) Book(f, wait);
  std::erase_if(inflight, [](const InFlight& f) { return f.unbooked == 0; });
}

void ExpertOffload::Impl::HarvestAndRefill() {
  Harvest(false);
  if (spec_booked_since_pump && !pending.empty()) Pump();
}

void ExpertOffload::Impl::Pump() {
  Harvest(false);
  spec_booked_since_pump = false;
  // Demand preempts speculation: while the current layer's selection batch is in flight, queued
  // speculation waits here (the prefetches already handed to the store go on).
  for (const InFlight& f : inflight) {
    if (f.demand) {
      if (!pending.empty()) ++sched.pump_held_selection;
      return;
    }
  }
  std::sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
    return a.target < b.target || (a.target == b.target && a.confidence > b.confidence);
  });
  std::vector<std::size_t> group;
  std::int64_t group_target = 0;
  // The lambdas run synchronously, under the mu this function requires.
  auto flush = [&] {
    mu.AssertHeld();
    if (group.empty()) return;
    const Priority prio = group_target <= Now() + 1 ? Priority::kHigh : Priority::kLow;
    inflight.push_back(Issue(std::move(group), group_target, /*demand=*/false, prio));
    group.clear();
  };
  // The nearest target (the next layer to run that has predictions) may go deep when its
  // prediction is confident; later targets are held to max_inflight, so that a fresher
  // prediction for them can still supersede what is queued (Submit).
  std::int64_t nearest = pending.empty() ? 0 : pending.front().target;
  for (const InFlight& f : inflight)
    if (!f.demand && f.unbooked > 0) nearest = std::min(nearest, f.target);
  auto admit = [&](const Pending& p) {
    mu.AssertHeld();
    return spec_keys_inflight < max_inflight || (p.target == nearest && !p.provisional &&
                                                 p.confidence >= confident_min &&
                                                 spec_keys_inflight < max_inflight_confident);
  };
  while (!pending.empty() && admit(pending.front())) {
    Pending p = pending.front();
    Slot& s = slots[p.slot];
    if (s.state != SlotState::kAbsent) {
      s.pending = false;
      pending.pop_front();
      continue;
    }
    if (spec_inflight + s.bytes > spec_cap && spec_inflight > 0) {
      ++sched.pump_held_bytes;
      break;
    }
    pending.pop_front();
    s.pending = false;
    CacheEntryView v = View(p.slot);
    v.wanted = p.target;
    v.wanted_confidence = p.confidence;
    const double value = policy->Score(v, Context());
    if (!Reserve(s.bytes, ReserveKind::kSpeculative, LayerOf(p.slot), p.target, value).ok()) {
      ++skipped;
      continue;
    }
    if (!group.empty() && p.target != group_target) flush();
    group_target = p.target;
    s.state = SlotState::kInFlight;
    spec_inflight += s.bytes;
    ++spec_keys_inflight;
    ++issued;
    group.push_back(p.slot);
  }
  if (!pending.empty() && !admit(pending.front())) ++sched.pump_held_inflight;
  flush();
}

void ExpertOffload::Impl::LoadSelection(int layer, std::span<const int> sel) {
  std::vector<std::size_t> ids;
  for (int e : sel) {
    const std::size_t i = static_cast<std::size_t>(layer) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e);
    Slot& s = slots[i];
    if (s.bytes == 0 || s.state != SlotState::kAbsent) continue;
    if (!Reserve(s.bytes, ReserveKind::kSelection, layer, Now(), 0).ok()) break;
    s.state = SlotState::kInFlight;
    s.demand_load = true;
    ids.push_back(i);
  }
  if (ids.empty()) return;
  ++sched.selection_batches;
  if (spec_keys_inflight > 0) {
    ++sched.selection_behind_spec;
    sched.selection_behind_spec_keys += spec_keys_inflight;
  }
  inflight.push_back(Issue(std::move(ids), Now(), /*demand=*/true, Priority::kDemand));
}

void ExpertOffload::Impl::Submit(std::vector<Prediction>& preds, bool score) {
  const std::int64_t now = Now();
  for (Prediction& p : preds) {
    if (p.layer < 0 || p.layer >= L || config.IsDenseLayer(p.layer)) continue;
    if (score) scorer.Predict(p);
    const std::int64_t target = Ordinal(p.step, p.layer);
    if (target < now) continue;
    if (p.supersedes) {
      for (auto it = pending.begin(); it != pending.end();) {
        if (it->target == target && !std::binary_search(p.experts.begin(), p.experts.end(), ExpertOf(it->slot))) {
          Slot& s = slots[it->slot];
          s.pending = false;
          if (s.wanted == target) {
            s.wanted = -1;
            s.wanted_confidence = 0;
          }
          ++cancelled;
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (int e : p.experts) {
      if (e < 0 || e >= E) continue;
      const std::size_t i = static_cast<std::size_t>(p.layer) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e);
      Slot& s = slots[i];
      if (s.wanted < now || target < s.wanted || (target == s.wanted && p.confidence > s.wanted_confidence)) {
        s.wanted = target;
        s.wanted_confidence = p.confidence;
      }
      if (s.state == SlotState::kAbsent && !s.pending) {
        s.pending = true;
        pending.push_back(Pending{i, target, p.confidence, p.provisional});
      } else if (s.pending && !p.provisional) {
        for (Pending& q : pending) {
          if (q.slot == i && q.target == target) {
            q.provisional = false;
            q.confidence = std::max(q.confidence, p.confidence);
          }
        }
      }
    }
  }
  Pump();
}

}  // namespace terrace::experts
