// What ExpertOffload keeps in the fast tier (offload_impl.h): the byte budget, victim choice and
// eviction, the policy's view of an entry and the known future behind the belady policy.
#include <fmt/format.h>

#include "src/experts/offload_impl.h"

namespace terrace::experts {

using namespace offload;

CacheEntryView ExpertOffload::Impl::View(std::size_t i) const {
  const Slot& s = slots[i];
  return CacheEntryView{LayerOf(i), ExpertOf(i), s.bytes, s.last_use, s.uses, s.wanted, s.wanted_confidence,
                        future_known ? NextUse(i) : -1};
}

std::int64_t ExpertOffload::Impl::NextUse(std::size_t i) const {
  const std::vector<std::int64_t>& uses = future_uses[i];
  const std::int64_t now = Now();
  const std::int64_t from = slots[i].acquired_ord == now ? now + 1 : now;
  auto it = std::lower_bound(uses.begin(), uses.end(), from);
  return it == uses.end() ? CacheEntryView::kNeverUsed : *it * E + ExpertOf(i);
}

void ExpertOffload::Impl::InstallPredictor(std::unique_ptr<Predictor> p) {
  const bool given = p != nullptr;
  predictor = given ? std::move(p) : MakeNonePredictor();
  predictor_error = Status::Ok();
  future_known = false;
  future_uses.assign(policy->kind() == CachePolicyKind::kBelady ? slots.size() : 0, {});
  if (policy->kind() != CachePolicyKind::kBelady || !given) return;
  predictor_error = CheckFuture(*predictor, L);
  if (!predictor_error.ok()) return;
  const std::shared_ptr<const RoutingTrace> future = predictor->known_future();
  for (std::size_t st = 0; st < future->steps.size(); ++st) {
    const auto& layers = future->steps[st];
    for (int l = 0; l < L && l < static_cast<int>(layers.size()); ++l)
      for (int e : layers[static_cast<std::size_t>(l)])
        if (e >= 0 && e < E) future_uses[static_cast<std::size_t>(l) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)]
                                 .push_back(Ordinal(static_cast<std::int64_t>(st), l));
  }
  future_known = true;
}

Status ExpertOffload::Impl::CheckFuture(const Predictor& p, int layers) {
  const std::shared_ptr<const RoutingTrace> future = p.known_future();
  if (!future) {
    return Status::InvalidArgument(fmt::format(
        "the belady expert cache policy needs a predictor that knows the future (the oracle, over a recorded "
        "trace); the {} predictor does not: use MakeOraclePredictor, or another policy",
        p.name()));
  }
  if (future->num_layers != layers) {
    return Status::InvalidArgument(fmt::format(
        "the belady expert cache policy got a recorded trace of {} layers for a model of {}: record it from this "
        "model",
        future->num_layers, layers));
  }
  return Status::Ok();
}

void ExpertOffload::Impl::DropResident(std::size_t i, bool count_eviction) {
  Slot& s = slots[i];
  s.state = SlotState::kAbsent;
  used -= s.bytes;
  if (s.unused_prefetch) {
    spec_wasted += s.bytes;
    if (count_eviction) {
      ++sched.spec_evicted_unused;
      if (s.wanted >= Now()) ++sched.spec_evicted_before_target;
    }
  }
  s.unused_prefetch = false;
  s.spec_issue_ns = 0;
  s.demand_load = false;
  if (count_eviction) ++evictions;
}

Status ExpertOffload::Impl::Evict(std::size_t i) {
  Slot& s = slots[i];
  s.weights = model::ExpertWeights{};
  s.handle.Release();  // unleased (refs == 0): the cached pin only
  const Status st = store->EvictCopy(s.key, TierId::kHbm);
  if (st.ok()) {
    DropResident(i, true);
    return Status::Ok();
  }
  // NotFound: the store evicted the copy on its own. InvalidArgument: it refuses to drop it, since
  // another holder pins it (a second ExpertOffload's handle or lease, a Pin) or no lower copy
  // exists. Either way the copy is not this cache's to evict: it stops counting it and goes on.
  if (st.IsNotFound() || st.IsInvalidArgument()) {
    ForgetCopy(i);
    return Status::Ok();
  }
  if (!InFastTier(s.key)) DropResident(i, false);  // else: resident without a handle, as after a landing
  return Status(st).WithContext(
      fmt::format("evicting expert {} of layer {} from the fast tier", ExpertOf(i), LayerOf(i)));
}

void ExpertOffload::Impl::ForgetCopy(std::size_t i) {
  Slot& s = slots[i];
  s.weights = model::ExpertWeights{};
  s.handle.Release();
  DropResident(i, false);
  ++shared_drops;
}

bool ExpertOffload::Impl::InFastTier(const BlockKey& key) const {
  return SourceTiers(std::span<const BlockKey>(&key, 1))[0] == TierId::kHbm;
}

void ExpertOffload::Impl::ForgetLostCopies() {
  std::vector<std::size_t> ids;
  std::vector<BlockKey> keys;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].state != SlotState::kResident || slots[i].handle.valid()) continue;
    ids.push_back(i);
    keys.push_back(slots[i].key);
  }
  if (ids.empty()) return;
  const std::vector<TierId> where = SourceTiers(keys);
  for (std::size_t k = 0; k < ids.size(); ++k)
    if (where[k] != TierId::kHbm) ForgetCopy(ids[k]);
}

std::uint64_t ExpertOffload::Impl::LeadUsed() const {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i].state != SlotState::kAbsent && LeadProtected(LayerOf(i))) n += slots[i].bytes;
  return n;
}

Status ExpertOffload::Impl::Reserve(std::uint64_t bytes, ReserveKind kind, int layer, std::int64_t target, double candidate_value) {
  const bool speculative = kind == ReserveKind::kSpeculative;
  const CacheContext ctx = Context();
  const bool incoming_lead = LeadProtected(layer);
  // Copies a shared store evicted on its own hold none of the budget: forget them before evicting.
  if (used + bytes > budget) ForgetLostCopies();
  while (used + bytes > budget) {
    VictimSide side = VictimSide::kAny;
    if (lead_cap > 0) {
      // Counted afresh each pass: an eviction or a cancelled prefetch (below) frees lead bytes.
      const std::uint64_t lead_used = LeadUsed();
      if (incoming_lead) {
        side = lead_used + bytes > lead_cap ? VictimSide::kLead : VictimSide::kOther;
      } else if (lead_used <= lead_cap) {
        side = VictimSide::kOther;
      }
    }
    auto pick = [&](VictimSide from) {
      mu.AssertHeld();  // called synchronously, under the mu Reserve requires
      std::optional<std::size_t> victim;
      double best = 0;
      CacheEntryView best_view;
      for (std::size_t i = 0; i < slots.size(); ++i) {
        const Slot& s = slots[i];
        if (s.state != SlotState::kResident || s.refs > 0) continue;
        if (from != VictimSide::kAny && LeadProtected(LayerOf(i)) != (from == VictimSide::kLead)) continue;
        if (kind == ReserveKind::kSelection && s.protect) continue;
        if (speculative && (s.protect || (s.wanted >= ctx.now && s.wanted <= target))) continue;
        const CacheEntryView view = View(i);
        const double score = policy->Score(view, ctx);
        if (speculative && policy->PrefetchMustOutscore() && score >= candidate_value) continue;
        if (!victim || EvictsBefore(score, view, best, best_view)) {
          victim = i;
          best = score;
          best_view = view;
        }
      }
      return victim;
    };
    std::optional<std::size_t> victim = pick(side);
    if (!victim && !speculative && side != VictimSide::kAny) victim = pick(VictimSide::kAny);
    if (victim) {
      TERRACE_RETURN_IF_ERROR(Evict(*victim));
      continue;
    }
    if (kind != ReserveKind::kDemand) return Status::OutOfCapacity("no expert may be evicted for a prefetch");
    if (!inflight.empty()) {
      for (auto& f : inflight)
        if (f.future.valid() && !f.demand) f.future.cancel();
      Harvest(/*wait=*/true);
      continue;
    }
    return Status::OutOfCapacity(fmt::format(
        "the expert cache ({} bytes) cannot fit another expert block ({} bytes): every cached expert is leased; "
        "raise the cache budget (ExpertOffloadOptions::budget; --expert-cache in the CLI) or release leases",
        budget, bytes));
  }
  used += bytes;
  return Status::Ok();
}

}  // namespace terrace::experts
