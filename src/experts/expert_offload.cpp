// ExpertOffload: the store-backed ExpertProvider (loading, the fast-tier cache, the prefetch queue,
// leases and the bookkeeping behind ExpertMetrics).
//
// State machine of one expert's fast-tier copy: absent -> in flight (a prefetch was handed to the
// store; its bytes are reserved in the budget) -> resident (in the HBM tier, counted in the budget)
// -> absent (EvictCopy: the home copy below stays; nothing is written back). A layer's known
// selection goes absent -> in flight as one demand batch (one multi-key Store::Prefetch, reserved
// but not speculative); any other demand load goes absent -> resident directly on the calling
// thread. A resident expert keeps the store handle (pinned in the fast tier) and its parsed weights
// from its first acquire until it is evicted, so a hit costs no checksum and no parse (the store
// verifies the copy once, at that first acquire); only leased experts (refs > 0) are never victims.
// Everything is guarded by Impl::mu. Store threads never take mu: a Store::Prefetch reports each
// key to its InFlight's Landing (its own mutex), which the forward thread polls or waits on, so
// expert e of a batch is usable as soon as e is in, not when the whole batch is.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "src/experts/cache_policy.h"
#include "src/model/names.h"
#include "terrace/experts.h"
#include "terrace/keys.h"

namespace terrace::experts {
namespace {

using SteadyClock = std::chrono::steady_clock;

std::uint64_t Align64(std::uint64_t n) { return (n + 63) / 64 * 64; }

std::uint64_t SteadyNs() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count());
}

std::uint64_t NsSince(SteadyClock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - t0).count());
}

enum class SlotState : std::uint8_t { kAbsent, kInFlight, kResident };

struct Slot {
  BlockKey key;
  std::uint64_t bytes = 0;  // block size; 0: no such expert (dense layer)
  SlotState state = SlotState::kAbsent;
  BlockHandle handle;              // valid from the first acquire after landing until eviction
  model::ExpertWeights weights;    // views into handle's bytes while handle is valid
  int refs = 0;
  bool unused_prefetch = false;    // landed by a prefetch and not acquired since
  bool pending = false;            // in the prefetch queue
  bool protect = false;            // in the current layer's selection
  bool demand_load = false;        // in flight or landed by its layer's selection batch, not acquired since
  std::uint64_t last_use = 0, uses = 0;
  std::int64_t acquired_ord = -1;  // ordinal of its last acquire (belady: used already in this layer)
  std::int64_t wanted = -1;        // nearest predicted ordinal
  double wanted_confidence = 0;
  // The speculative load in flight or landed and not yet chosen by its layer (0: none): when it was
  // issued (steady ns) and at which ordinal, for ExpertScheduleMetrics.
  std::uint64_t spec_issue_ns = 0;
  std::int64_t spec_issue_ord = 0;
};

// Per-key outcomes of one Store::Prefetch call, written by store threads (PrefetchOptions::on_item)
// and read by the forward thread. Thread-safe; its mutex is a leaf.
struct Landing {
  explicit Landing(std::size_t n) : status(n), done(n, 0), done_ns(n, 0) {}
  void Set(std::size_t k, const Status& s) {
    const std::uint64_t t = SteadyNs();
    {
      std::lock_guard lock(mu);
      status[k] = s;
      done[k] = 1;
      done_ns[k] = t;
    }
    cv.notify_all();
  }
  std::optional<Status> Poll(std::size_t k) {
    std::lock_guard lock(mu);
    if (!done[k]) return std::nullopt;
    return status[k];
  }
  std::uint64_t DoneNs(std::size_t k) {
    std::lock_guard lock(mu);
    return done_ns[k];
  }
  Status Wait(std::size_t k) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done[k] != 0; });
    return status[k];
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Status> status;  // GUARDED_BY(mu)
  std::vector<char> done;      // GUARDED_BY(mu)
  std::vector<std::uint64_t> done_ns;  // GUARDED_BY(mu): steady ns when key k finished
};

// One Store::Prefetch call: its keys are slots[slot_ids[k]]'s, in order.
struct InFlight {
  std::vector<std::size_t> slot_ids;
  std::int64_t target;  // ordinal of the (predicted or known) use
  bool demand = false;  // the current layer's known selection (Priority::kDemand): never cancelled for room
  std::uint64_t issue_ns = 0;          // steady ns of the Store::Prefetch call
  Future<std::vector<Status>> future;  // reset once every key is booked
  std::shared_ptr<Landing> landing;
  std::vector<char> booked;            // key k's outcome is accounted for
  std::size_t unbooked = 0;
};

struct Pending {
  std::size_t slot;
  std::int64_t target;
  double confidence;
  bool provisional = false;  // Prediction::provisional: never admitted past max_inflight
};

struct LayerCounters {
  std::uint64_t hits = 0, late_hits = 0, misses = 0;
};

}  // namespace

struct ExpertOffload::Impl {
  // Immutable after Create.
  model::ModelConfig config;
  Store* store = nullptr;
  TierId home = TierId::kHost;
  int L = 0, E = 0;
  std::int64_t latent = 0, intermediate = 0;
  std::uint64_t budget = 0, spec_cap = 0, total_bytes = 0, max_block = 0;
  int window = 2;
  unsigned max_inflight = 2;  // speculative blocks handed to the store, not landed
  unsigned max_inflight_confident = 16;  // ... when the prediction's confidence >= confident_min
  double confident_min = 0.75;
  double hot_factor = 2.0;
  double seconds_per_byte = 0;
  // Lead-time partition (ExpertOffloadOptions::lead_protected_*): lead_layer[l] for the protected
  // MoE layers; lead_cap their reserved bytes (0: off).
  std::vector<char> lead_layer;
  std::uint64_t lead_cap = 0;
  std::unique_ptr<CachePolicy> policy;

  mutable std::mutex mu;
  std::unique_ptr<Predictor> predictor;  // GUARDED_BY(mu)
  // belady: the known future's acquires, per slot the ascending ordinals at which its layer routes
  // to it (empty when there is no known future: future_known false); predictor_error: the
  // predictor SetPredictor refused, returned by every acquire until another is set.
  std::vector<std::vector<std::int64_t>> future_uses;
  bool future_known = false;
  Status predictor_error;
  std::vector<Slot> slots;               // [layer * E + expert]
  std::uint64_t used = 0;                // resident + in-flight bytes
  std::uint64_t spec_inflight = 0;
  unsigned spec_keys_inflight = 0;
  std::deque<Pending> pending;
  std::vector<InFlight> inflight;
  std::int64_t step = 0;
  int cur_layer = -1;
  std::uint64_t tick = 0;
  std::shared_ptr<RoutingTrace> trace;
  PredictionScorer scorer{0};
  std::vector<LayerCounters> counters;
  std::vector<std::vector<std::uint64_t>> token_load, select_load;  // [layer][expert]
  bool have_token_load = false;
  std::uint64_t tokens = 0, steps_seen = 0, stall_ns = 0, demand_bytes = 0, spec_bytes = 0, spec_wasted = 0;
  std::uint64_t issued = 0, cancelled = 0, skipped = 0, evictions = 0;
  std::uint64_t corrupt_base = 0;  // store corruptions_dropped at the last Reset
  ExpertScheduleMetrics sched;     // everything but load_busy_ns, which Metrics derives from load_iv
  // [start, end) steady ns of each load not yet folded into load_busy_folded (CompactLoadIntervals).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> load_iv;
  std::uint64_t load_busy_folded = 0;  // union length of the intervals folded away
  std::uint64_t step_start_ns = 0, step_start_busy_ns = 0;  // steady ns and LoadBusyNs() when this step began
  std::vector<std::uint64_t> layer_stall;  // [layer] ns

  Slot& slot(int l, int e) { return slots[static_cast<std::size_t>(l) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)]; }
  std::int64_t Ordinal(std::int64_t s, int l) const { return s * L + l; }
  std::int64_t Now() const { return Ordinal(step, std::max(cur_layer, 0)); }
  int LayerOf(std::size_t i) const { return static_cast<int>(i / static_cast<std::size_t>(E)); }
  int ExpertOf(std::size_t i) const { return static_cast<int>(i % static_cast<std::size_t>(E)); }

  // Moves the clock to `layer` (a lower layer than the current one starts a new step) and cancels
  // prefetches whose layer has passed.
  void Advance(int layer) {
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

  // Tells the predictor how busy the loads kept the drive during the step that just ended.
  void ReportLoadBusyShare() {
    const std::uint64_t now = SteadyNs(), busy = LoadBusyNs(now);
    if (step_start_ns != 0 && now > step_start_ns) {
      const double share = static_cast<double>(busy - std::min(busy, step_start_busy_ns)) /
                           static_cast<double>(now - step_start_ns);
      predictor->OnLoadBusyShare(std::clamp(share, 0.0, 1.0));
    }
    step_start_ns = now;
    step_start_busy_ns = busy;
  }

  CacheContext Context() const {
    return CacheContext{Now(), L, window, steps_seen, seconds_per_byte};
  }
  CacheEntryView View(std::size_t i) const {
    const Slot& s = slots[i];
    return CacheEntryView{LayerOf(i), ExpertOf(i), s.bytes, s.last_use, s.uses, s.wanted, s.wanted_confidence,
                          future_known ? NextUse(i) : -1};
  }

  // belady: the position (ordinal * E + expert: a layer acquires its experts in ascending order) of
  // slot i's next acquire in the known future; an expert already acquired in the current layer is
  // next acquired in a later step. kNeverUsed past the trace's end.
  std::int64_t NextUse(std::size_t i) const {
    const std::vector<std::int64_t>& uses = future_uses[i];
    const std::int64_t now = Now();
    const std::int64_t from = slots[i].acquired_ord == now ? now + 1 : now;
    auto it = std::lower_bound(uses.begin(), uses.end(), from);
    return it == uses.end() ? CacheEntryView::kNeverUsed : *it * E + ExpertOf(i);
  }

  // Installs `p` (null: none). Under belady, indexes its known future, or records why it cannot
  // run (predictor_error) when `p` is not null and has none.
  void InstallPredictor(std::unique_ptr<Predictor> p) {
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

  // Ok when `p` can drive the belady policy over a model of `layers` layers.
  static Status CheckFuture(const Predictor& p, int layers) {
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

  void DropResident(std::size_t i, bool count_eviction) {
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

  Status Evict(std::size_t i) {
    Slot& s = slots[i];
    s.weights = model::ExpertWeights{};
    s.handle.Release();  // unleased (refs == 0): the cached pin only
    Status st = store->EvictCopy(s.key, TierId::kHbm);
    if (!st.ok() && !st.IsNotFound())
      return st.WithContext(fmt::format("evicting expert {} of layer {} from the fast tier", ExpertOf(i), LayerOf(i)));
    DropResident(i, true);
    return Status::Ok();
  }

  // Accounts for key k of `f`, whose store outcome is `st`.
  void BookItem(InFlight& f, std::size_t k, const Status& st) {
    f.booked[k] = 1;
    --f.unbooked;
    Slot& s = slots[f.slot_ids[k]];
    if (!f.demand) {
      spec_inflight -= s.bytes;
      --spec_keys_inflight;
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

  // Books the keys of `f` that are done (all of them, waiting, when `wait`). True when every key
  // of `f` is booked.
  bool Book(InFlight& f, bool wait) {
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

  // Waits for slot `i`'s key in whichever InFlight holds it, and books it (only it).
  void WaitForSlot(std::size_t i) {
    for (auto& f : inflight) {
      if (f.unbooked == 0) continue;
      for (std::size_t k = 0; k < f.slot_ids.size(); ++k) {
        if (f.slot_ids[k] != i || f.booked[k]) continue;
        BookItem(f, k, f.landing->Wait(k));
        return;
      }
    }
  }

  // A Store::Prefetch of `ids`' keys whose every key reports to the returned InFlight's Landing.
  InFlight Issue(std::vector<std::size_t> ids, std::int64_t target, bool demand, Priority prio) {
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
    f.issue_ns = SteadyNs();
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

  void Harvest(bool wait) {
    for (auto& f : inflight) Book(f, wait);
    std::erase_if(inflight, [](const InFlight& f) { return f.unbooked == 0; });
  }

  enum class ReserveKind { kDemand, kSelection, kSpeculative };

  bool LeadProtected(int layer) const { return lead_cap > 0 && lead_layer[static_cast<std::size_t>(layer)] != 0; }

  // Resident and in-flight bytes of the lead-protected layers.
  std::uint64_t LeadUsed() const {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i].state != SlotState::kAbsent && LeadProtected(LayerOf(i))) n += slots[i].bytes;
    return n;
  }

  // Which side of the lead-time partition a victim may come from.
  enum class VictimSide { kAny, kLead, kOther };

  // Makes room for `bytes` of an expert of `layer`. A speculative reservation for ordinal `target`
  // may evict only experts that are neither in the current selection nor wanted before `target`,
  // and (utility, belady: PrefetchMustOutscore) only those scoring below the candidate; a
  // selection one (the current layer's batch) any unpinned expert outside the current selection,
  // without waiting; a demand
  // one any unpinned expert, cancelling and waiting for in-flight speculative prefetches (and
  // waiting for the selection batch) when nothing else can go. With the lead-time partition on,
  // the victim comes from the side the partition names (lead_protected_share), then, for demand
  // and selection loads only, from either side.
  Status Reserve(std::uint64_t bytes, ReserveKind kind, int layer, std::int64_t target, double candidate_value) {
    const bool speculative = kind == ReserveKind::kSpeculative;
    const CacheContext ctx = Context();
    const bool incoming_lead = LeadProtected(layer);
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
        std::optional<std::size_t> victim;
        double best = 0;
        for (std::size_t i = 0; i < slots.size(); ++i) {
          const Slot& s = slots[i];
          if (s.state != SlotState::kResident || s.refs > 0) continue;
          if (from != VictimSide::kAny && LeadProtected(LayerOf(i)) != (from == VictimSide::kLead)) continue;
          if (kind == ReserveKind::kSelection && s.protect) continue;
          if (speculative && (s.protect || (s.wanted >= ctx.now && s.wanted <= target))) continue;
          const double score = policy->Score(View(i), ctx);
          if (speculative && policy->PrefetchMustOutscore() && score >= candidate_value) continue;
          if (!victim || score < best) {
            victim = i;
            best = score;
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
          "raise --expert-cache or release leases",
          budget, bytes));
    }
    used += bytes;
    return Status::Ok();
  }

  // Hands queued prefetches to the store while the cap and the in-flight limit allow: the items of
  // one target go out as one multi-key Store::Prefetch, so the store reads them as one batch.
  void Pump() {
    Harvest(false);
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
    auto flush = [&] {
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

  // The current layer's known selection: every absent expert of it is reserved and handed to the
  // store as ONE Priority::kDemand Prefetch (read as one batch, at the NVMe tier's queue depth),
  // before the forward thread acquires the first. Experts that do not fit are left to Acquire.
  void LoadSelection(int layer, std::span<const int> sel) {
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

  void Submit(std::vector<Prediction>& preds, bool score) {
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

  Result<const model::ExpertWeights*> AcquireLocked(int layer, int expert) {
    if (!predictor_error.ok()) return predictor_error;
    if (layer < 0 || layer >= L || expert < 0 || expert >= E || slot(layer, expert).bytes == 0) {
      return Status::InvalidArgument(fmt::format(
          "expert {} of layer {} does not exist (the model has {} layers x {} routed experts; dense layers have none)",
          expert, layer, L, E));
    }
    if (layer != cur_layer) Advance(layer);
    const unsigned spec_before = spec_keys_inflight;
    Harvest(false);
    // A speculative prefetch landed: refill the store's queue now rather than at the next
    // prediction or demand load, so the drive does not idle while this layer computes.
    if (spec_keys_inflight < spec_before && !pending.empty()) Pump();
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
    bool stalled = false;
    // A selection-batch load counts as a miss (loaded on demand), landed or not.
    bool counted = false;
    bool sync_load = false;  // read by this thread's store->Acquire below
    if (s.state == SlotState::kInFlight) {
      if (s.demand_load) {
        ++c.misses;
      } else {
        ++c.late_hits;
      }
      counted = true;
      stalled = true;
      WaitForSlot(static_cast<std::size_t>(&s - slots.data()));  // this key only, not its whole batch
      std::erase_if(inflight, [](const InFlight& f) { return f.unbooked == 0; });
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
    const std::uint64_t load_start = sync_load ? SteadyNs() : 0;
    auto h = store->Acquire(s.key, TierId::kHbm);
    if (sync_load) AddLoadInterval(load_start, SteadyNs());
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
      std::string what = st.IsNotFound()    ? "its block is missing from the store"
                         : st.IsCorruption() ? "no copy of its block passed its checksum"
                                             : "its block could not be loaded into the fast tier";
      return Status(st).WithContext(fmt::format(
          "expert {} of layer {} ({}; block {}); loading the model again (terrace model run: the same --model) "
          "stores a fresh copy",
          expert, layer, what, s.key.ToString()));
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

  void AddStall(int layer, SteadyClock::time_point t0) {
    const std::uint64_t d = NsSince(t0);
    stall_ns += d;
    layer_stall[static_cast<std::size_t>(layer)] += d;
  }

  // The layer's router chose `sel`: scores the speculative loads of its experts (lead, lateness).
  void ScoreSpeculation(int layer, std::span<const int> sel) {
    const std::uint64_t t = SteadyNs();
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

  // Merges `iv` in place (sorted, disjoint).
  static void MergeIntervals(std::vector<std::pair<std::uint64_t, std::uint64_t>>& iv) {
    std::sort(iv.begin(), iv.end());
    std::size_t n = 0;
    for (const auto& x : iv) {
      if (n > 0 && x.first <= iv[n - 1].second) {
        iv[n - 1].second = std::max(iv[n - 1].second, x.second);
      } else {
        iv[n++] = x;
      }
    }
    iv.resize(n);
  }

  // Records one load's interval; keeps load_iv bounded over a long run by folding the merged
  // intervals that no later load can overlap (every later one starts at or after the earliest
  // issue still in flight, or now).
  void AddLoadInterval(std::uint64_t start, std::uint64_t end) {
    load_iv.emplace_back(start, end);
    if (load_iv.size() < 4096) return;
    std::uint64_t horizon = SteadyNs();
    for (const InFlight& f : inflight)
      if (f.unbooked > 0) horizon = std::min(horizon, f.issue_ns);
    MergeIntervals(load_iv);
    std::size_t keep = 0;
    while (keep < load_iv.size() && load_iv[keep].second < horizon) {
      load_busy_folded += load_iv[keep].second - load_iv[keep].first;
      ++keep;
    }
    load_iv.erase(load_iv.begin(), load_iv.begin() + static_cast<std::ptrdiff_t>(keep));
  }

  // Union of every load interval since Reset, ns; with open_until, also of the loads still in
  // flight, as if they ended then.
  std::uint64_t LoadBusyNs(std::uint64_t open_until = 0) const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> iv = load_iv;
    if (open_until != 0) {
      for (const InFlight& f : inflight)
        if (f.unbooked > 0 && f.issue_ns < open_until) iv.emplace_back(f.issue_ns, open_until);
    }
    std::uint64_t folded = load_busy_folded;
    std::sort(iv.begin(), iv.end());
    std::uint64_t busy = 0, cur_start = 0, cur_end = 0;
    bool open = false;
    for (const auto& [a, b] : iv) {
      if (!open || a > cur_end) {
        if (open) busy += cur_end - cur_start;
        cur_start = a;
        cur_end = b;
        open = true;
      } else {
        cur_end = std::max(cur_end, b);
      }
    }
    if (open) busy += cur_end - cur_start;
    return busy + folded;
  }

  void ReleaseLocked(int layer, int expert) {
    if (layer < 0 || layer >= L || expert < 0 || expert >= E) return;
    Slot& s = slot(layer, expert);
    if (s.refs == 0) return;
    --s.refs;  // the handle stays (cached) until the expert is evicted
  }
};

// ---- ExpertLease ----------------------------------------------------------------------------------

ExpertLease::ExpertLease(ExpertLease&& o) noexcept
    : owner_(std::exchange(o.owner_, nullptr)), weights_(o.weights_), layer_(o.layer_), expert_(o.expert_) {}

ExpertLease& ExpertLease::operator=(ExpertLease&& o) noexcept {
  if (this != &o) {
    Release();
    owner_ = std::exchange(o.owner_, nullptr);
    weights_ = o.weights_;
    layer_ = o.layer_;
    expert_ = o.expert_;
  }
  return *this;
}

void ExpertLease::Release() {
  if (owner_ == nullptr) return;
  std::exchange(owner_, nullptr)->ReleaseLease(layer_, expert_);
  weights_ = nullptr;
}

// ---- ExpertOffload --------------------------------------------------------------------------------

namespace {

std::uint64_t BlockBytes(std::int64_t latent, std::int64_t intermediate) {
  const auto n = static_cast<std::uint64_t>(latent) * static_cast<std::uint64_t>(intermediate);
  return 64 + 3 * (Align64(n / 2) + Align64(n / 32));
}

Result<model::Mxfp4Matrix> ViewMatrix(const model::WeightSource& src, int layer, int expert, const char* proj,
                                      std::int64_t rows, std::int64_t cols) {
  const std::string pn = model::ExpertTensorName(layer, expert, proj, "weight_packed");
  const std::string sn = model::ExpertTensorName(layer, expert, proj, "weight_scale");
  if (!src.Has(pn)) {
    return Status::InvalidArgument(fmt::format(
        "expert offload keeps experts in MXFP4, but '{}' is missing: the checkpoint's routed experts are not "
        "MXFP4 (weight_packed + weight_scale); use an MXFP4 checkpoint or run without --expert-cache",
        pn));
  }
  TERRACE_ASSIGN_OR_RETURN(model::TensorView p, src.Get(pn));
  TERRACE_ASSIGN_OR_RETURN(model::TensorView s, src.Get(sn));
  if (p.data.size() != static_cast<std::size_t>(rows * cols / 2) || s.data.size() != static_cast<std::size_t>(rows * cols / 32)) {
    return Status::InvalidArgument(fmt::format("expert {} of layer {}: {} / {} hold {} / {} bytes; [{}, {}] MXFP4 needs {} / {}",
                                               expert, layer, pn, sn, p.data.size(), s.data.size(), rows, cols,
                                               rows * cols / 2, rows * cols / 32));
  }
  model::Mxfp4Matrix m;
  m.packed = reinterpret_cast<const std::uint8_t*>(p.data.data());
  m.scales = reinterpret_cast<const std::uint8_t*>(s.data.data());
  m.rows = rows;
  m.cols = cols;
  return m;
}

}  // namespace

std::uint64_t ExpertOffload::TotalExpertBytes(const model::ModelConfig& config) {
  std::uint64_t layers = 0;
  for (int l = 0; l < config.num_hidden_layers; ++l) layers += config.IsDenseLayer(l) ? 0 : 1;
  return layers * static_cast<std::uint64_t>(std::max(config.num_experts, 0)) *
         BlockBytes(config.routed_expert_hidden_size, config.moe_intermediate_size);
}

StoreOptions ExpertOffload::OpenStoreOptions(std::uint64_t total, std::uint64_t budget, const std::string& nvme_dir,
                                             const LinkModel& link) {
  auto mib = [](std::uint64_t n) { return (n + kMiB - 1) / kMiB * kMiB; };
  StoreOptions o;
  o.hbm.mode = HbmMode::kEmulated;
  o.hbm.link = link;
  // Twice the budget plus slack: the store's own watermark demotion never starts, the cache decides.
  o.hbm.capacity_bytes = mib(2 * budget + 16 * kMiB);
  o.host.capacity_bytes = mib(total + total / 4 + 64 * kMiB);
  o.host.pin = false;
  if (!nvme_dir.empty()) {
    o.nvme.path = nvme_dir;
    o.nvme.capacity_bytes = mib(total + total / 2 + 64 * kMiB);
  }
  o.placement = Placement::kInclusive;
  o.promote_on_get = false;
  o.logger = StderrLogger(LogLevel::kWarning);  // "hbm emulated" is expected here, not news
  o.put_tier = nvme_dir.empty() ? TierId::kHost : TierId::kNvme;
  // Two prefetch lane threads (a layer's selection batch runs beside a speculative one) and one
  // io_uring ring per concurrent reader: the two lanes plus the forward thread's demand loads.
  o.background_threads = 3;
  o.nvme.io_threads = 3;
  return o;
}

ExpertOffload::ExpertOffload(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ExpertOffload::~ExpertOffload() {
  if (!impl_) return;
  std::lock_guard lock(impl_->mu);
  for (auto& f : impl_->inflight)
    if (f.future.valid()) f.future.cancel();
  impl_->Harvest(true);
  for (auto& s : impl_->slots) {
    s.weights = model::ExpertWeights{};
    s.handle.Release();
  }
}

Result<std::shared_ptr<ExpertOffload>> ExpertOffload::Create(const model::ModelConfig& config,
                                                             const model::WeightSource& weights, Store* store,
                                                             ExpertOffloadOptions options) {
  if (store == nullptr) return Status::InvalidArgument("ExpertOffload::Create: store is null");
  if (options.home != TierId::kHost && options.home != TierId::kNvme)
    return Status::InvalidArgument("expert offload: the experts' home tier must be host or nvme");
  if (!store->HasTier(TierId::kHbm) || !store->HasTier(options.home)) {
    return Status::InvalidArgument(fmt::format(
        "expert offload needs a store with an hbm tier and a {} tier (the experts' home); open it with "
        "ExpertOffload::OpenStoreOptions",
        TierName(options.home)));
  }
  if (store->options().placement != Placement::kInclusive) {
    return Status::InvalidArgument(
        "expert offload needs a store with inclusive placement (a fast-tier copy keeps the home copy, so an "
        "evicted expert is dropped, never written back); open it with ExpertOffload::OpenStoreOptions");
  }
  if (config.num_experts <= 0) return Status::InvalidArgument("expert offload: the model has no routed experts");
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.config = config;
  m.store = store;
  m.home = options.home;
  m.L = config.num_hidden_layers;
  m.E = config.num_experts;
  m.latent = config.routed_expert_hidden_size;
  m.intermediate = config.moe_intermediate_size;
  m.window = std::max(options.window, 1);
  m.max_inflight = std::max(options.max_inflight_prefetches, 1u);
  m.max_inflight_confident = options.max_inflight_confident_prefetches != 0
                                 ? options.max_inflight_confident_prefetches
                                 : static_cast<unsigned>(2 * std::max(config.num_experts_per_token, 1));
  m.max_inflight_confident = std::max(m.max_inflight_confident, m.max_inflight);
  m.confident_min = options.confident_prefetch_min;
  m.hot_factor = options.hot_factor;
  m.policy = MakeCachePolicy(options.policy);
  m.slots.resize(static_cast<std::size_t>(m.L) * static_cast<std::size_t>(m.E));
  if (options.policy == CachePolicyKind::kBelady && options.predictor)
    TERRACE_RETURN_IF_ERROR(Impl::CheckFuture(*options.predictor, m.L));
  m.InstallPredictor(std::move(options.predictor));
  m.counters.resize(static_cast<std::size_t>(m.L));
  m.layer_stall.assign(static_cast<std::size_t>(m.L), 0);
  m.token_load.assign(static_cast<std::size_t>(m.L), std::vector<std::uint64_t>(static_cast<std::size_t>(m.E), 0));
  m.select_load = m.token_load;
  m.scorer = PredictionScorer(m.L);
  m.trace = std::make_shared<RoutingTrace>();
  m.trace->num_layers = m.L;

  const std::uint32_t ns = keys::Namespace(keys::ModelId(config, weights), "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
  for (int l = 0; l < m.L; ++l) {
    if (config.IsDenseLayer(l)) continue;
    for (int e = 0; e < m.E; ++e) {
      model::ExpertWeights w;
      w.format = model::ExpertFormat::kMxfp4;
      TERRACE_ASSIGN_OR_RETURN(w.q1, ViewMatrix(weights, l, e, "w1", m.intermediate, m.latent));
      TERRACE_ASSIGN_OR_RETURN(w.q2, ViewMatrix(weights, l, e, "w2", m.latent, m.intermediate));
      TERRACE_ASSIGN_OR_RETURN(w.q3, ViewMatrix(weights, l, e, "w3", m.intermediate, m.latent));
      const std::vector<std::byte> block = model::SerializeExpertBlock(w);
      Slot& s = m.slot(l, e);
      s.key = keys::ExpertKey(ns, l, e);
      s.bytes = block.size();
      PutOptions po;
      po.codec = Codec::kMxfp4;
      po.tier = options.home;
      Status st = store->Put(s.key, block, po);
      if (!st.ok())
        return st.WithContext(fmt::format("storing expert {} of layer {} in the {} tier", e, l, TierName(options.home)));
      m.total_bytes += s.bytes;
      m.max_block = std::max(m.max_block, s.bytes);
    }
  }
  // A previous process may have left fast-tier copies (a persistent store keeps none, but a shared
  // store may): start cold so the budget accounting is exact.
  for (auto& s : m.slots) {
    if (s.bytes == 0) continue;
    Status st = store->EvictCopy(s.key, TierId::kHbm);
    if (!st.ok() && !st.IsNotFound()) return st.WithContext("starting the expert cache cold");
  }
  m.budget = options.budget.Resolve(m.total_bytes);
  if (m.budget < m.max_block) {
    return Status::InvalidArgument(fmt::format(
        "--expert-cache {} is {} bytes, smaller than one expert block ({} bytes; all routed experts: {} bytes); "
        "give at least one expert's size",
        options.budget.ToString(), m.budget, m.max_block, m.total_bytes));
  }
  m.spec_cap = options.max_speculative_bytes != 0 ? options.max_speculative_bytes : std::max(m.budget / 4, m.max_block);
  const LinkModel& link = store->options().hbm.link;
  m.seconds_per_byte = 1.0 / std::max(link.bandwidth_bytes_per_s, 1.0);
  if (options.home == TierId::kNvme) m.seconds_per_byte += 1.0 / 7e9;  // a Gen4 drive's sequential read
  if (!(options.lead_protected_share >= 0.0 && options.lead_protected_share <= 1.0) || options.lead_protected_layers < 0) {
    return Status::InvalidArgument(fmt::format(
        "expert offload: lead_protected_share must be in [0, 1] and lead_protected_layers >= 0 (got {} and {})",
        options.lead_protected_share, options.lead_protected_layers));
  }
  m.lead_layer.assign(static_cast<std::size_t>(m.L), 0);
  for (int l = 0, n = 0; l < m.L && n < options.lead_protected_layers; ++l) {
    if (config.IsDenseLayer(l)) continue;
    m.lead_layer[static_cast<std::size_t>(l)] = 1;
    ++n;
  }
  if (options.lead_protected_layers > 0)
    m.lead_cap = static_cast<std::uint64_t>(options.lead_protected_share * static_cast<double>(m.budget));
  m.corrupt_base = store->Stats().corruptions_dropped;
  return std::shared_ptr<ExpertOffload>(new ExpertOffload(std::move(impl)));
}

Result<ExpertLease> ExpertOffload::Lease(int layer, int expert) {
  std::lock_guard lock(impl_->mu);
  TERRACE_ASSIGN_OR_RETURN(const model::ExpertWeights* w, impl_->AcquireLocked(layer, expert));
  ExpertLease lease;
  lease.owner_ = this;
  lease.weights_ = w;
  lease.layer_ = layer;
  lease.expert_ = expert;
  return lease;
}

void ExpertOffload::ReleaseLease(int layer, int expert) {
  std::lock_guard lock(impl_->mu);
  impl_->ReleaseLocked(layer, expert);
}

Result<const model::ExpertWeights*> ExpertOffload::Acquire(int layer, int expert) {
  std::lock_guard lock(impl_->mu);
  return impl_->AcquireLocked(layer, expert);
}

void ExpertOffload::Release(int layer, int expert) { ReleaseLease(layer, expert); }

void ExpertOffload::Prefetch(int layer, std::span<const int> experts) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (layer < 0 || layer >= m.L) return;
  m.Advance(layer);
  std::vector<int> sel(experts.begin(), experts.end());
  std::sort(sel.begin(), sel.end());
  sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
  std::erase_if(sel, [&](int e) { return e < 0 || e >= m.E; });
  // The routing trace and the scores of earlier predictions.
  auto& steps = m.trace->steps;
  while (static_cast<std::int64_t>(steps.size()) <= m.step)
    steps.emplace_back(static_cast<std::size_t>(m.L));
  steps[static_cast<std::size_t>(m.step)][static_cast<std::size_t>(layer)] = sel;
  m.scorer.Observe(m.step, layer, sel);
  m.ScoreSpeculation(layer, sel);
  for (auto& s : m.slots) s.protect = false;
  for (int e : sel) {
    m.slot(layer, e).protect = true;
    ++m.select_load[static_cast<std::size_t>(layer)][static_cast<std::size_t>(e)];
  }
  std::vector<Prediction> preds;
  m.predictor->OnRouting(m.step, layer, sel, &preds);
  // This layer's own selection, known now: its absent experts load as one batch (demand, with every
  // predictor: they are certain to be used) while the earlier ones compute.
  if (!m.config.IsDenseLayer(layer)) m.LoadSelection(layer, sel);
  m.Submit(preds, /*score=*/true);
}

void ExpertOffload::OnLayerEnd(int layer, std::span<const float> hidden, std::int64_t tokens) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (layer < 0 || layer >= m.L) return;
  m.Advance(layer + 1);
  if (layer + 1 == m.L) m.tokens += static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 0));
  std::vector<Prediction> preds;
  m.predictor->OnLayerEnd(m.step, layer, hidden, tokens, &preds);
  m.Submit(preds, /*score=*/true);
}

void ExpertOffload::OnTokenStart(std::span<const float> embedding, std::int64_t tokens) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  m.Advance(0);
  std::vector<Prediction> preds;
  m.predictor->OnTokenStart(m.step, embedding, tokens, &preds);
  m.Submit(preds, /*score=*/true);
}

void ExpertOffload::AttachHooks(model::ForwardOptions* options) {
  auto prev_routing = options->on_routing;
  options->on_routing = [this, prev_routing](int layer, const model::Routing& r) {
    if (prev_routing) prev_routing(layer, r);
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    if (layer < 0 || layer >= m.L) return;
    m.have_token_load = true;
    for (int e : r.ids)
      if (e >= 0 && e < m.E) ++m.token_load[static_cast<std::size_t>(layer)][static_cast<std::size_t>(e)];
  };
  auto prev_end = options->on_layer_end;
  options->on_layer_end = [this, prev_end](int layer, std::span<const float> hidden, std::int64_t tokens) {
    if (prev_end) prev_end(layer, hidden, tokens);
    OnLayerEnd(layer, hidden, tokens);
  };
  auto prev_embedding = options->on_embedding;
  options->on_embedding = [this, prev_embedding](std::span<const float> embedding, std::int64_t tokens) {
    if (prev_embedding) prev_embedding(embedding, tokens);
    OnTokenStart(embedding, tokens);
  };
}

void ExpertOffload::Quiesce() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  // Each round issues at least one queued item (the cap admits one when nothing is in flight) or
  // drops it, so this ends.
  m.Harvest(true);
  while (!m.pending.empty()) {
    m.Pump();
    m.Harvest(true);
  }
}

Status ExpertOffload::Reset() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  for (auto& f : m.inflight)
    if (f.future.valid()) f.future.cancel();
  m.Harvest(true);
  for (auto& p : m.pending) m.slots[p.slot].pending = false;
  m.pending.clear();
  for (std::size_t i = 0; i < m.slots.size(); ++i) {
    Slot& s = m.slots[i];
    if (s.state == SlotState::kResident && s.refs == 0) TERRACE_RETURN_IF_ERROR(m.Evict(i));
    s.uses = 0;
    s.last_use = 0;
    s.acquired_ord = -1;
    s.wanted = -1;
    s.wanted_confidence = 0;
    s.protect = false;
    s.unused_prefetch = false;
    s.demand_load = false;
    s.spec_issue_ns = 0;
  }
  m.step = 0;
  m.cur_layer = -1;
  m.tick = 0;
  m.trace = std::make_shared<RoutingTrace>();
  m.trace->num_layers = m.L;
  m.scorer = PredictionScorer(m.L);
  m.counters.assign(static_cast<std::size_t>(m.L), LayerCounters{});
  for (auto& v : m.token_load) std::fill(v.begin(), v.end(), 0);
  for (auto& v : m.select_load) std::fill(v.begin(), v.end(), 0);
  m.have_token_load = false;
  m.tokens = m.steps_seen = m.stall_ns = m.demand_bytes = m.spec_bytes = m.spec_wasted = 0;
  m.issued = m.cancelled = m.skipped = m.evictions = 0;
  m.sched = ExpertScheduleMetrics{};
  m.load_iv.clear();
  m.load_busy_folded = 0;
  m.step_start_ns = m.step_start_busy_ns = 0;
  std::fill(m.layer_stall.begin(), m.layer_stall.end(), 0);
  m.corrupt_base = m.store->Stats().corruptions_dropped;
  return Status::Ok();
}

void ExpertOffload::SetPredictor(std::unique_ptr<Predictor> predictor) {
  std::lock_guard lock(impl_->mu);
  impl_->InstallPredictor(std::move(predictor));
}

std::shared_ptr<const RoutingTrace> ExpertOffload::trace() const {
  std::lock_guard lock(impl_->mu);
  return std::make_shared<const RoutingTrace>(*impl_->trace);
}

std::uint64_t ExpertOffload::budget_bytes() const { return impl_->budget; }

Result<BlockKey> ExpertOffload::key(int layer, int expert) const {
  const Impl& m = *impl_;
  if (layer < 0 || layer >= m.L || expert < 0 || expert >= m.E ||
      m.slots[static_cast<std::size_t>(layer) * static_cast<std::size_t>(m.E) + static_cast<std::size_t>(expert)].bytes == 0)
    return Status::InvalidArgument(fmt::format("expert {} of layer {} does not exist", expert, layer));
  return m.slots[static_cast<std::size_t>(layer) * static_cast<std::size_t>(m.E) + static_cast<std::size_t>(expert)].key;
}

ExpertMetrics ExpertOffload::Metrics() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  ExpertMetrics x;
  x.policy = std::string(CachePolicyName(m.policy->kind()));
  x.predictor = std::string(m.predictor->name());
  x.hot_factor = m.hot_factor;
  std::vector<double> all;
  for (int l = 0; l < m.L; ++l) {
    if (m.config.IsDenseLayer(l)) continue;
    LayerMetrics lm;
    lm.layer = l;
    const LayerCounters& c = m.counters[static_cast<std::size_t>(l)];
    lm.hits = c.hits;
    lm.late_hits = c.late_hits;
    lm.misses = c.misses;
    lm.stall_ns = m.layer_stall[static_cast<std::size_t>(l)];
    lm.prediction = m.scorer.layer(l);
    lm.expert_load = m.have_token_load ? m.token_load[static_cast<std::size_t>(l)] : m.select_load[static_cast<std::size_t>(l)];
    double sum = 0, sq = 0, mx = 0;
    for (auto v : lm.expert_load) {
      const double d = static_cast<double>(v);
      sum += d;
      sq += d * d;
      mx = std::max(mx, d);
      all.push_back(d);
    }
    const double n = static_cast<double>(std::max<std::size_t>(lm.expert_load.size(), 1));
    lm.load_mean = sum / n;
    lm.load_max = mx;
    lm.load_cv = lm.load_mean > 0 ? std::sqrt(std::max(sq / n - lm.load_mean * lm.load_mean, 0.0)) / lm.load_mean : 0;
    for (std::size_t e = 0; e < lm.expert_load.size(); ++e)
      if (lm.load_mean > 0 && static_cast<double>(lm.expert_load[e]) > m.hot_factor * lm.load_mean)
        lm.hot_experts.push_back(static_cast<int>(e));
    x.hits += lm.hits;
    x.late_hits += lm.late_hits;
    x.misses += lm.misses;
    x.hot_experts += lm.hot_experts.size();
    x.layers.push_back(std::move(lm));
  }
  if (!all.empty()) {
    double sum = 0, sq = 0, mx = 0;
    for (double d : all) {
      sum += d;
      sq += d * d;
      mx = std::max(mx, d);
    }
    const double n = static_cast<double>(all.size());
    x.load_mean = sum / n;
    x.load_max = mx;
    x.load_cv = x.load_mean > 0 ? std::sqrt(std::max(sq / n - x.load_mean * x.load_mean, 0.0)) / x.load_mean : 0;
  }
  const std::uint64_t acc = x.hits + x.late_hits + x.misses;
  x.hit_rate = acc == 0 ? 0 : static_cast<double>(x.hits) / static_cast<double>(acc);
  x.prediction = m.scorer.total();
  x.steps = m.steps_seen;
  x.tokens = m.tokens != 0 ? m.tokens : m.steps_seen;
  x.stall_ns = m.stall_ns;
  x.stall_ns_per_token = x.tokens == 0 ? 0 : static_cast<double>(m.stall_ns) / static_cast<double>(x.tokens);
  x.demand_bytes = m.demand_bytes;
  x.speculative_bytes = m.spec_bytes;
  std::uint64_t unused = 0;
  for (const auto& s : m.slots)
    if (s.state == SlotState::kResident && s.unused_prefetch) unused += s.bytes;
  x.speculative_wasted_bytes = m.spec_wasted + unused;
  x.prefetches_issued = m.issued;
  x.prefetches_cancelled = m.cancelled;
  x.prefetches_skipped = m.skipped;
  x.evictions = m.evictions;
  x.corrupt_copies_reread = m.store->Stats().corruptions_dropped - m.corrupt_base;
  x.budget_bytes = m.budget;
  std::uint64_t resident = 0;
  for (const auto& s : m.slots)
    if (s.state == SlotState::kResident) resident += s.bytes;
  x.resident_bytes = resident;
  x.total_expert_bytes = m.total_bytes;
  x.schedule = m.sched;
  x.schedule.load_busy_ns = m.LoadBusyNs();
  return x;
}

}  // namespace terrace::experts
