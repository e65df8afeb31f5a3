// ExpertOffload::Impl and its private types: shared by expert_offload.cpp (the public API, Create,
// Metrics) and the files that hold the cache's parts: offload_acquire.cpp (the forward pass's
// acquire and release), offload_loads.cpp (the prefetch queue and the loads in flight),
// offload_residency.cpp (budget, victims, eviction) and offload_busy_time.cpp (drive busy time).
// Private to src/experts.
//
// State machine of one expert's fast-tier copy: absent -> in flight (a prefetch was handed to the
// store; its bytes are reserved in the budget) -> resident (in the HBM tier, counted in the budget)
// -> absent (EvictCopy: the home copy below stays; nothing is written back; or forgotten: see the
// shared store below). A layer's known
// selection goes absent -> in flight as one demand batch (one multi-key Store::Prefetch, reserved
// but not speculative); any other demand load goes absent -> resident directly on the calling
// thread. A resident expert keeps the store handle (pinned in the fast tier) and its parsed weights
// from its first acquire until it is evicted, so a hit costs no checksum and no parse (the store
// verifies the copy once, at that first acquire); only leased experts (refs > 0) are never victims.
//
// The store may be shared (a second ExpertOffload of the same model, whose keys are the same; a
// PrefixCache writing to the fast tier): the books hold what this cache holds, which the store
// does not always agree with. A resident copy without a handle (landed, not acquired since) is
// not pinned, so the store may evict it on its own: the books forget it (ForgetCopy) when an
// acquire finds it gone (the acquire then loads it like any absent expert), when a snapshot or a
// full budget looks (ForgetLostCopies), or when Evict finds no copy. A victim whose copy the store
// refuses to drop (another holder pins it: a handle or lease of the other cache, a Pin) is not this
// cache's to evict: the books forget it and the copy stays. shared_drops counts both.
//
// Thread-safety: every member of Impl past the "Immutable after Create" block is guarded by
// Impl::mu, and every method below requires it held. Store threads never take mu: a
// Store::Prefetch reports each key to its InFlight's Landing (its own mutex), which the forward
// thread polls or waits on, so expert e of a batch is usable as soon as e is in, not when the
// whole batch is.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "src/common/clock.h"
#include "src/common/mutex.h"
#include "src/experts/cache_policy.h"
#include "terrace/experts.h"

namespace terrace::experts {
namespace offload {

using SteadyClock = std::chrono::steady_clock;

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
  // The done time is taken under mu: a reader that finds key k not done read its own clock before
  // k's done time, so a load counted as open up to that reading never ends earlier in a later one.
  void Set(std::size_t k, const Status& s) {
    {
      MutexLock lock(&mu);
      status[k] = s;
      done[k] = 1;
      done_ns[k] = SteadyNanos();
    }
    cv.SignalAll();
  }
  std::optional<Status> Poll(std::size_t k) {
    MutexLock lock(&mu);
    if (!done[k]) return std::nullopt;
    return status[k];
  }
  // Steady ns when key k finished; `open_until` while it has not.
  std::uint64_t DoneNs(std::size_t k, std::uint64_t open_until = 0) {
    MutexLock lock(&mu);
    return done[k] ? done_ns[k] : open_until;
  }
  Status Wait(std::size_t k) {
    MutexLock lock(&mu);
    while (done[k] == 0) cv.Wait(&mu);
    return status[k];
  }
  Mutex mu;
  CondVar cv;
  std::vector<Status> status TERRACE_GUARDED_BY(mu);
  std::vector<char> done TERRACE_GUARDED_BY(mu);
  std::vector<std::uint64_t> done_ns TERRACE_GUARDED_BY(mu);  // steady ns when key k finished (done[k])
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
  std::vector<TierId> source;          // key k's fastest copy when issued (Store::Lookup; kNumTiers: none)
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

}  // namespace offload

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

  mutable Mutex mu;
  std::unique_ptr<Predictor> predictor TERRACE_GUARDED_BY(mu);
  // belady: the known future's acquires, per slot the ascending ordinals at which its layer routes
  // to it (empty when there is no known future: future_known false); predictor_error: the
  // predictor SetPredictor refused, returned by every acquire until another is set.
  std::vector<std::vector<std::int64_t>> future_uses TERRACE_GUARDED_BY(mu);
  bool future_known TERRACE_GUARDED_BY(mu) = false;
  Status predictor_error TERRACE_GUARDED_BY(mu);
  std::vector<offload::Slot> slots TERRACE_GUARDED_BY(mu);  // [layer * E + expert]
  std::uint64_t used TERRACE_GUARDED_BY(mu) = 0;  // resident + in-flight bytes
  std::uint64_t spec_inflight TERRACE_GUARDED_BY(mu) = 0;
  unsigned spec_keys_inflight TERRACE_GUARDED_BY(mu) = 0;
  // A speculative key was booked since the last Pump: its place in flight is free for the queue.
  bool spec_booked_since_pump TERRACE_GUARDED_BY(mu) = false;
  std::deque<offload::Pending> pending TERRACE_GUARDED_BY(mu);
  std::vector<offload::InFlight> inflight TERRACE_GUARDED_BY(mu);
  std::int64_t step TERRACE_GUARDED_BY(mu) = 0;
  int cur_layer TERRACE_GUARDED_BY(mu) = -1;
  std::uint64_t tick TERRACE_GUARDED_BY(mu) = 0;
  std::shared_ptr<RoutingTrace> trace TERRACE_GUARDED_BY(mu);
  PredictionScorer scorer TERRACE_GUARDED_BY(mu){0};
  std::vector<offload::LayerCounters> counters TERRACE_GUARDED_BY(mu);
  // [layer][expert]
  std::vector<std::vector<std::uint64_t>> token_load TERRACE_GUARDED_BY(mu);
  std::vector<std::vector<std::uint64_t>> select_load TERRACE_GUARDED_BY(mu);
  bool have_token_load TERRACE_GUARDED_BY(mu) = false;
  std::uint64_t tokens TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t steps_seen TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t stall_ns TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t demand_bytes TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t spec_bytes TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t spec_wasted TERRACE_GUARDED_BY(mu) = 0;
  // Landed loads and their bytes by source tier (ExpertMetrics::loads_from).
  std::array<std::uint64_t, kNumTiers> loads_from TERRACE_GUARDED_BY(mu){};
  std::array<std::uint64_t, kNumTiers> loaded_bytes_from TERRACE_GUARDED_BY(mu){};
  std::uint64_t issued TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t cancelled TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t skipped TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t evictions TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t shared_drops TERRACE_GUARDED_BY(mu) = 0;  // ExpertMetrics::shared_drops
  std::uint64_t corrupt_base TERRACE_GUARDED_BY(mu) = 0;  // store corruptions_dropped at the last Reset
  ExpertScheduleMetrics sched TERRACE_GUARDED_BY(mu);  // everything but load_busy_ns, which Metrics derives from load_iv
  // [start, end) steady ns of each load not yet folded into load_busy_folded (AddLoadInterval).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> load_iv TERRACE_GUARDED_BY(mu);
  std::uint64_t load_busy_folded TERRACE_GUARDED_BY(mu) = 0;  // union length of the intervals folded away
  // steady ns and LoadBusyNs() when this step began
  std::uint64_t step_start_ns TERRACE_GUARDED_BY(mu) = 0;
  std::uint64_t step_start_busy_ns TERRACE_GUARDED_BY(mu) = 0;
  std::vector<std::uint64_t> layer_stall TERRACE_GUARDED_BY(mu);  // [layer] ns

  offload::Slot& slot(int l, int e) TERRACE_REQUIRES(mu) {
    return slots[static_cast<std::size_t>(l) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)];
  }
  std::int64_t Ordinal(std::int64_t s, int l) const { return s * L + l; }
  std::int64_t Now() const TERRACE_REQUIRES(mu) { return Ordinal(step, std::max(cur_layer, 0)); }
  int LayerOf(std::size_t i) const { return static_cast<int>(i / static_cast<std::size_t>(E)); }
  int ExpertOf(std::size_t i) const { return static_cast<int>(i % static_cast<std::size_t>(E)); }
  CacheContext Context() const TERRACE_REQUIRES(mu) { return CacheContext{Now(), L, window, steps_seen, seconds_per_byte}; }

  // ---- the forward pass's path (offload_acquire.cpp)
  // Moves the clock to `layer` (a lower layer than the current one starts a new step) and cancels
  // prefetches whose layer has passed.
  void Advance(int layer) TERRACE_REQUIRES(mu);
  // ExpertOffload::Acquire under mu: a hit, a wait for the load in flight, or a demand load on
  // this thread; counts hits, misses and stall time.
  Result<const model::ExpertWeights*> AcquireLocked(int layer, int expert) TERRACE_REQUIRES(mu);
  // Drops one reference (the copy stays cached until evicted).
  void ReleaseLocked(int layer, int expert) TERRACE_REQUIRES(mu);
  // Adds the time since t0 to the total and layer's stall.
  void AddStall(int layer, offload::SteadyClock::time_point t0) TERRACE_REQUIRES(mu);
  // The layer's router chose `sel`: scores the speculative loads of its experts (lead, lateness).
  void ScoreSpeculation(int layer, std::span<const int> sel) TERRACE_REQUIRES(mu);

  // ---- loads: the prefetch queue and what is in flight (offload_loads.cpp)
  // Queues the predicted experts not yet resident or queued (a superseding prediction first drops
  // what was queued for its target and is not in it), marks when each is wanted, then Pump()s.
  // `score`: the predictions count toward precision / recall.
  void Submit(std::vector<Prediction>& preds, bool score) TERRACE_REQUIRES(mu);
  // Hands queued prefetches to the store while the cap and the in-flight limit allow: the items of
  // one target go out as one multi-key Store::Prefetch, so the store reads them as one batch.
  void Pump() TERRACE_REQUIRES(mu);
  // The current layer's known selection: every absent expert of it is reserved and handed to the
  // store as ONE Priority::kDemand Prefetch (read as one batch, at the NVMe tier's queue depth),
  // before the forward thread acquires the first. Experts that do not fit are left to Acquire.
  void LoadSelection(int layer, std::span<const int> sel) TERRACE_REQUIRES(mu);
  // A Store::Prefetch of `ids`' keys whose every key reports to the returned InFlight's Landing.
  offload::InFlight Issue(std::vector<std::size_t> ids, std::int64_t target, bool demand, Priority prio) TERRACE_REQUIRES(mu);
  // The tier each key's fastest copy is in now (Store::Lookup), or static_cast<TierId>(kNumTiers)
  // for a key no tier holds: where a load issued now reads it from.
  std::vector<TierId> SourceTiers(std::span<const BlockKey> keys) const TERRACE_REQUIRES(mu);
  // Counts a landed load of `bytes` read from `source` (ExpertMetrics::loads_from).
  void CountLoad(TierId source, std::uint64_t bytes) TERRACE_REQUIRES(mu);
  // Accounts for key k of `f`, whose store outcome is `st`.
  void BookItem(offload::InFlight& f, std::size_t k, const Status& st) TERRACE_REQUIRES(mu);
  // Books the keys of `f` that are done (all of them, waiting, when `wait`). True when every key
  // of `f` is booked.
  bool Book(offload::InFlight& f, bool wait) TERRACE_REQUIRES(mu);
  // Waits for slot `i`'s key in whichever InFlight holds it, and books it (only it).
  void WaitForSlot(std::size_t i) TERRACE_REQUIRES(mu);
  // Books every InFlight's finished keys (waiting for all of them when `wait`) and drops the
  // InFlights that are done.
  void Harvest(bool wait) TERRACE_REQUIRES(mu);
  // Harvest(false), then a Pump when a speculative key was booked since the last Pump and the queue
  // is not empty: a landed prefetch's place goes to a queued one now, so the drive does not idle.
  void HarvestAndRefill() TERRACE_REQUIRES(mu);

  // ---- residency: budget, victims, eviction, the belady future (offload_residency.cpp)
  enum class ReserveKind { kDemand, kSelection, kSpeculative };
  // Which side of the lead-time partition a victim may come from.
  enum class VictimSide { kAny, kLead, kOther };
  bool LeadProtected(int layer) const { return lead_cap > 0 && lead_layer[static_cast<std::size_t>(layer)] != 0; }
  // Resident and in-flight bytes of the lead-protected layers.
  std::uint64_t LeadUsed() const TERRACE_REQUIRES(mu);
  // Makes room for `bytes` of an expert of `layer`. A speculative reservation for ordinal `target`
  // may evict only experts that are neither in the current selection nor wanted before `target`,
  // and (utility, belady: PrefetchMustOutscore) only those scoring below the candidate; a
  // selection one (the current layer's batch) any unpinned expert outside the current selection,
  // without waiting; a demand
  // one any unpinned expert, cancelling and waiting for in-flight speculative prefetches (and
  // waiting for the selection batch) when nothing else can go. With the lead-time partition on,
  // the victim comes from the side the partition names (lead_protected_share), then, for demand
  // and selection loads only, from either side.
  Status Reserve(std::uint64_t bytes, ReserveKind kind, int layer, std::int64_t target, double candidate_value) TERRACE_REQUIRES(mu);
  // Drops slot i's fast-tier copy (unleased, resident): its handle, parsed weights and the store's
  // copy. A copy the store no longer holds there, or refuses to drop (pinned by another holder, or
  // the last copy of its block), is forgotten instead (ForgetCopy): Ok. Another failure is
  // returned with the books as the store has it: the handle is released, and the slot stays
  // resident (unpinned) only while the fast tier still holds the copy.
  Status Evict(std::size_t i) TERRACE_REQUIRES(mu);
  // Slot i (resident, not leased) is no longer this cache's: marks it absent and frees its budget
  // without evicting anything (counted in shared_drops, not in evictions).
  void ForgetCopy(std::size_t i) TERRACE_REQUIRES(mu);
  // Forgets every resident slot without a handle whose copy the fast tier no longer holds (a shared
  // store evicted it on its own): one Store::Lookup of those keys.
  void ForgetLostCopies() TERRACE_REQUIRES(mu);
  // Whether the fast tier holds `key`'s fastest copy now (Store::Lookup).
  bool InFastTier(const BlockKey& key) const TERRACE_REQUIRES(mu);
  // Marks slot i absent and frees its budget (counting an unused prefetch as wasted and, when
  // count_eviction, the eviction).
  void DropResident(std::size_t i, bool count_eviction) TERRACE_REQUIRES(mu);
  // Slot i as the cache policy sees it.
  CacheEntryView View(std::size_t i) const TERRACE_REQUIRES(mu);
  // belady: the position (ordinal * E + expert: a layer acquires its experts in ascending order) of
  // slot i's next acquire in the known future; an expert already acquired in the current layer is
  // next acquired in a later step. kNeverUsed past the trace's end.
  std::int64_t NextUse(std::size_t i) const TERRACE_REQUIRES(mu);
  // Installs `p` (null: none). Under belady, indexes its known future, or records why it cannot
  // run (predictor_error) when `p` is not null and has none.
  void InstallPredictor(std::unique_ptr<Predictor> p) TERRACE_REQUIRES(mu);
  // Ok when `p` can drive the belady policy over a model of `layers` layers.
  static Status CheckFuture(const Predictor& p, int layers);

  // ---- drive busy time (offload_busy_time.cpp)
  // Tells the predictor how busy the loads kept the drive during the step that just ended.
  void ReportLoadBusyShare() TERRACE_REQUIRES(mu);
  // Records one load's interval; keeps load_iv bounded over a long run by folding the merged
  // intervals that no later load can overlap (every later one starts at or after the earliest
  // issue still in flight, or now).
  void AddLoadInterval(std::uint64_t start, std::uint64_t end) TERRACE_REQUIRES(mu);
  // Union of every load interval since Reset, ns; with open_until, also of the keys not booked yet:
  // a landed one up to its landing, one still in flight as if it ended at open_until.
  std::uint64_t LoadBusyNs(std::uint64_t open_until = 0) const TERRACE_REQUIRES(mu);
  // Merges `iv` in place (sorted, disjoint).
  static void MergeIntervals(std::vector<std::pair<std::uint64_t, std::uint64_t>>& iv);
};

}  // namespace terrace::experts
