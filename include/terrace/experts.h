// Public expert-offload API (docs/experts.md): routed MoE experts kept as MXFP4 blocks in a Store's
// host or NVMe tier (one immutable copy each), cached in the store's HBM tier under a byte budget,
// and prefetched ahead of use by a predictor. The reference model reaches it only through its
// ExpertProvider seam, so offloaded runs compute exactly what all-resident runs compute.
//
// Thread-safety: ExpertOffload's methods may be called from any thread (one internal mutex; the
// forward pass's calls are serialised by it). Predictor and CachePolicy implementations are only
// called under that mutex. Units: bytes, nanoseconds, tokens.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/block.h"
#include "terrace/model.h"
#include "terrace/model_config.h"
#include "terrace/model_weights.h"
#include "terrace/status.h"
#include "terrace/store.h"
#include "terrace/tier.h"

namespace terrace::experts {

// The fast-tier (HBM) budget: a fraction of all routed expert bytes ("25%") or an absolute size
// ("64MiB", "2GiB", "1048576"; KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal: "64MB" is
// 64,000,000 bytes). Parse errors name the text and the accepted forms.
struct CacheBudget {
  double fraction = 0.25;   // used when bytes == 0
  std::uint64_t bytes = 0;  // absolute budget; 0: use fraction
  // "25%" (a fraction in (0, 1]) or a size ("64MiB", "64MB", "1048576"; > 0). InvalidArgument
  // naming the text and both forms otherwise.
  static Result<CacheBudget> Parse(std::string_view text);
  // A percentage only ("25%"); InvalidArgument naming the text and that one form otherwise (a
  // size included), for callers that take no sizes.
  static Result<CacheBudget> ParsePercent(std::string_view text);
  // InvalidArgument unless a fraction budget (bytes == 0) has 0 < fraction <= 1 (NaN refused).
  // Parse's results always pass; ExpertOffload::Create checks a budget filled in by hand.
  Status Check() const;
  // The budget in bytes for routed experts totalling `total_expert_bytes`, capped at that total (a
  // cache larger than every expert holds nothing more); 0 for a budget that Check refuses.
  std::uint64_t Resolve(std::uint64_t total_expert_bytes) const;
  std::string ToString() const;
};

// kBelady: Belady's optimal replacement, which needs the future (the oracle predictor's recorded
// trace, Predictor::known_future): evicts the expert whose next use is farthest ahead.
enum class CachePolicyKind : std::uint8_t { kLru, kLfu, kUtility, kBelady };
enum class PredictorKind : std::uint8_t { kNone, kLookahead, kStatistical, kOracle };
// "lru" "lfu" "utility" "belady"; "none" "lookahead" "statistical" "oracle". InvalidArgument listing them.
Result<CachePolicyKind> ParseCachePolicy(std::string_view name);
Result<PredictorKind> ParsePredictor(std::string_view name);
std::string_view CachePolicyName(CachePolicyKind kind);
std::string_view PredictorName(PredictorKind kind);
// InvalidArgument when `policy` cannot run with `predictor`: belady needs the oracle (the only
// predictor that knows the future). Ok otherwise. The message says why, not what to do instead:
// the caller names its own remedy (the CLI: its flags).
Status CheckPolicyPredictor(CachePolicyKind policy, PredictorKind predictor);

// The routing of a run: for every forward step (one Forward call: a prefill or one decode token)
// and every model layer, the distinct experts it used, ascending (empty for dense layers).
struct RoutingTrace {
  int num_layers = 0;
  std::vector<std::vector<std::vector<int>>> steps;  // [step][layer] -> experts
};

// A predictor's guess that `experts` of `layer` in forward step `step` will be used.
// confidence in [0, 1] orders prefetches and feeds the predicted-utility policy.
struct Prediction {
  std::int64_t step = 0;
  int layer = 0;
  std::vector<int> experts;  // ascending
  double confidence = 1.0;
  // A fresher prediction of the same (step, layer) than the predictor's earlier ones: queued
  // prefetches for that target that `experts` leaves out are dropped (counted as cancelled);
  // ones already handed to the store keep going. The scorer still counts every prediction.
  bool supersedes = false;
  // A fresher prediction of this target will follow before its layer runs (lookahead at distance
  // > 1): its items are held to max_inflight_prefetches even when confident, so that what the
  // fresher one leaves out is still queued when it arrives.
  bool provisional = false;
};

// Predictors, behind one interface. Called under ExpertOffload's mutex, on the forward thread.
class Predictor {
 public:
  virtual ~Predictor() = default;
  virtual std::string_view name() const = 0;
  // Layer `layer` of step `step` routed to `experts` (distinct, ascending), before they run.
  virtual void OnRouting(std::int64_t step, int layer, std::span<const int> experts,
                         std::vector<Prediction>* out) {
    (void)step, (void)layer, (void)experts, (void)out;
  }
  // Layer `layer` of step `step` finished; `hidden` [tokens, hidden_size] feeds the next layer.
  virtual void OnLayerEnd(std::int64_t step, int layer, std::span<const float> hidden, std::int64_t tokens,
                          std::vector<Prediction>* out) {
    (void)step, (void)layer, (void)hidden, (void)tokens, (void)out;
  }
  // Step `step` starts: `embedding` [tokens, hidden_size] is what layer 0 starts from (the forward
  // pass's on_embedding hook, before any layer of the step has run).
  virtual void OnTokenStart(std::int64_t step, std::span<const float> embedding, std::int64_t tokens,
                            std::vector<Prediction>* out) {
    (void)step, (void)embedding, (void)tokens, (void)out;
  }
  // A new step starts: `share` (0..1) is the share of the last step's wall time during which an
  // expert load was in flight (ExpertScheduleMetrics::load_busy_ns over that step): how busy the
  // drive and link were. Called before OnTokenStart of the new step.
  virtual void OnLoadBusyShare(double share) { (void)share; }
  // The routing this predictor knows in advance (the oracle's recorded trace), or null. The belady
  // cache policy runs only with a predictor that has one.
  virtual std::shared_ptr<const RoutingTrace> known_future() const { return nullptr; }
};

struct LookaheadOptions {
  int depth = 2;                 // predict the next `depth` MoE layers after layer l (dense ones not counted)
  // A distance j > 1 is predicted only while its measured precision (a running mean, starting at
  // 1) stays >= min_confidence (depth gated by confidence); a gated distance is still tried every
  // 8th step so that its estimate can recover.
  double min_confidence = 0.5;
  // At token start (OnTokenStart) predict the first `embedding_depth` MoE layers of the step from
  // the embedding (0: off), so their loads start before layer 0 runs. Each such target is gated
  // like a distance > 1: predicted while its own running precision stays >= min_confidence, and
  // tried every 8th step otherwise.
  int embedding_depth = 1;
  // Predictions made after a layer supersede the earlier ones of the same target (Prediction::
  // supersedes): what a fresher, nearer prediction leaves out and is still queued is not read.
  bool supersede = true;
  // Predictions at distance > 1 are provisional (Prediction::provisional: held to two in flight
  // until the nearer prediction arrives). Off by default: it read 2-5% less on moe-bench-plain but
  // lost in the median of alternating runs on moe-bench (docs/benchmarks.md).
  bool provisional = false;
  // Per-rank gating (0: off). Each distance (and each embedding target) keeps a running precision
  // per rank of the router's top-k (rank 0: the highest score; every candidate is scored when its
  // layer's routing arrives, issued or not); a prediction carries only the experts whose rank's
  // precision is >= min_rank_precision (all of them every 8th step). A wrong prefetch costs a
  // block's read and evicts a cached expert, so a rank that is usually wrong is not worth reading
  // ahead: the layer's selection batch loads it if the router chooses it after all. 0.7 read 6-8%
  // fewer drive bytes than 0 on both bench checkpoints (docs/benchmarks.md).
  double min_rank_precision = 0.7;
  // A rank gate that follows the drive (0: off, the threshold stays min_rank_precision). When the
  // expert loads kept the drive busy for most of the last step, a false positive's read delays
  // the reads that are needed, and an early read saves little; so the threshold rises linearly
  // from min_rank_precision at a busy share of kBusyGateFrom to busy_rank_precision at a share of
  // 1 (Predictor::OnLoadBusyShare). Below kBusyGateFrom it stays min_rank_precision.
  double busy_rank_precision = 0;
  static constexpr double kBusyGateFrom = 0.5;
  // The threshold at busy share `share`.
  double RankThreshold(double share) const;
};
// Factories. lookahead needs the loaded model (its routers); the model must outlive the predictor.
std::unique_ptr<Predictor> MakeNonePredictor();
std::unique_ptr<Predictor> MakeLookaheadPredictor(const model::Model& model, const LookaheadOptions& options);
// Layer-to-layer transitions (experts of layer l -> experts of layer l+1) and token-to-token ones
// (a layer's experts in the previous step -> the same layer now), counted online.
std::unique_ptr<Predictor> MakeStatisticalPredictor(const model::ModelConfig& config, int depth = 1);
// Replays `trace` (recorded from the same run) `depth` MoE layers ahead (the layers the trace routes;
// dense ones not counted), across step boundaries: after each layer's routing, and at token start
// (OnTokenStart) the step's first `depth` MoE layers. Depth 0: no predictions.
std::unique_ptr<Predictor> MakeOraclePredictor(std::shared_ptr<const RoutingTrace> trace, int depth = 2);

// Prediction quality against what was routed, per layer: a prediction for (step, layer) counts
// once, as the union of every prediction made for it, when that layer's routing arrives.
struct PredictionCounts {
  std::uint64_t true_positive = 0, false_positive = 0, false_negative = 0;
  // tp / (tp + fp); nullopt when nothing was predicted (0/0 is undefined, not "every prediction
  // was wrong"): JSON null, "n/a" in text, no Prometheus sample (ExpertMetrics).
  std::optional<double> precision_if_defined() const;
  // tp / (tp + fn); nullopt when nothing was routed. 0 when experts were routed and none predicted.
  std::optional<double> recall_if_defined() const;
};
class PredictionScorer {
 public:
  explicit PredictionScorer(int num_layers);
  void Predict(const Prediction& p);
  // Scores the predictions for (step, layer) against `actual`, then forgets them.
  void Observe(std::int64_t step, int layer, std::span<const int> actual);
  const PredictionCounts& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }
  PredictionCounts total() const;
  int num_layers() const { return static_cast<int>(layers_.size()); }

 private:
  std::vector<PredictionCounts> layers_;
  std::vector<std::pair<std::int64_t, std::vector<std::vector<int>>>> pending_;  // step -> [layer] predicted
};

struct LayerMetrics {
  int layer = 0;
  std::uint64_t hits = 0;        // acquired while resident in the fast tier
  std::uint64_t late_hits = 0;   // acquired while its prefetch was in flight (waited for it)
  std::uint64_t misses = 0;      // loaded on demand
  double hit_rate() const;       // hits / (hits + late_hits + misses)
  PredictionCounts prediction;
  std::vector<std::uint64_t> expert_load;  // tokens routed to each expert (selections without hooks)
  double load_max = 0, load_mean = 0, load_cv = 0;  // over this layer's experts
  std::vector<int> hot_experts;  // load > hot_factor x mean
  std::uint64_t stall_ns = 0;    // forward-thread time waiting for this layer's expert loads
};

// Where a run's load time went (docs/experts.md, "Metrics"): sums since the last Reset, so that
// two snapshots' difference describes the steps between them. Times are steady-clock nanoseconds.
struct ExpertScheduleMetrics {
  // Wall time during which at least one expert load (a store prefetch key not yet landed, or a
  // demand load on the forward thread) was outstanding: the drive/link were busy or queued. A load
  // ends when it lands, whether or not the cache has looked at it since; loads in flight when
  // Metrics() is called count up to that moment. Never decreases between two snapshots.
  std::uint64_t load_busy_ns = 0;
  // Speculative loads that landed: their count, summed issue-to-landing time, and summed lead
  // (layers and ns from issue to the moment their layer's router chose, for the ones it chose).
  std::uint64_t spec_landed = 0, spec_load_ns = 0;
  std::uint64_t spec_used = 0, spec_lead_layers = 0, spec_lead_ns = 0;
  // Chosen while still in flight (not landed when its layer's router chose it; its acquire then
  // waits unless it lands first: late_hits counts the acquires that waited).
  std::uint64_t spec_late = 0;
  std::uint64_t spec_evicted_unused = 0;      // prefetched, evicted before any use
  std::uint64_t spec_evicted_before_target = 0;  // ... while its predicted use was still ahead (thrash)
  std::uint64_t selection_batches = 0;        // a layer's selection batches handed to the store
  std::uint64_t selection_behind_spec = 0;    // ... issued while speculative keys were in flight
  std::uint64_t selection_behind_spec_keys = 0;  // summed speculative keys in flight at those issues
  std::uint64_t pump_held_inflight = 0;       // queue left waiting by max_inflight_prefetches
  std::uint64_t pump_held_bytes = 0;          // ... by the speculative-bytes cap
  std::uint64_t pump_held_selection = 0;      // ... because a selection batch was in flight
};

struct ExpertMetrics {
  std::vector<LayerMetrics> layers;  // MoE layers only, by layer index
  std::uint64_t hits = 0, late_hits = 0, misses = 0;
  double hit_rate = 0;
  PredictionCounts prediction;
  std::uint64_t tokens = 0, steps = 0;
  std::uint64_t stall_ns = 0;               // forward-thread time waiting for expert loads
  double stall_ns_per_token = 0;
  std::uint64_t demand_bytes = 0;           // bytes loaded into the fast tier on demand
  std::uint64_t speculative_bytes = 0;      // bytes prefetched into the fast tier (landed)
  // Every load into the fast tier that landed (on demand, selection batch or prefetch), by the
  // tier its block was read from, index = TierId: the fastest tier holding the block when the load
  // was issued (Store::Lookup). loaded_bytes_from sums to demand_bytes + speculative_bytes (but for
  // an acquire's own demand load that failed, which demand_bytes counts). Reads outside the loads
  // (Create's read-back of blocks already stored) are not counted.
  std::array<std::uint64_t, kNumTiers> loads_from{}, loaded_bytes_from{};
  // Parts of speculative_bytes: prefetched, then evicted before any use (a counter: it never
  // decreases), and prefetched, resident and not used yet at the snapshot (a gauge: it falls when
  // such an expert is used or evicted).
  std::uint64_t speculative_wasted_bytes = 0;
  std::uint64_t speculative_unused_bytes = 0;
  std::uint64_t prefetches_issued = 0, prefetches_cancelled = 0, prefetches_skipped = 0;
  std::uint64_t evictions = 0;
  // Fast-tier copies the cache stopped counting as its own without evicting them, on a shared
  // store (docs/experts.md, "Sharing a store"): a victim another holder pins (a second
  // ExpertOffload's lease or cached copy, a Pin; the copy stays), or a landed copy the store had
  // evicted on its own (its next acquire loads it again). Not part of evictions.
  std::uint64_t shared_drops = 0;
  std::uint64_t corrupt_copies_reread = 0;  // copies that failed their checksum; re-read from a slower copy
  std::uint64_t budget_bytes = 0, resident_bytes = 0, total_expert_bytes = 0;
  double load_max = 0, load_mean = 0, load_cv = 0, hot_factor = 2.0;
  std::uint64_t hot_experts = 0;
  std::string policy, predictor;
  ExpertScheduleMetrics schedule;

  std::string ToText() const;        // the CLI's lines
  std::string ToJson() const;        // one JSON object
  std::string PrometheusText() const;  // text exposition 0.0.4, terrace_experts_* metrics
};

struct ExpertOffloadOptions {
  TierId home = TierId::kHost;      // where each expert's immutable copy lives: kHost or kNvme
  CacheBudget budget;               // the fast-tier (kHbm) cache
  CachePolicyKind policy = CachePolicyKind::kLru;
  // The predictor; null: none. ExpertOffload takes ownership. With policy kBelady it must be null
  // (set the oracle later with SetPredictor) or have a known_future(): Create refuses any other.
  std::unique_ptr<Predictor> predictor;
  int window = 2;                   // layers ahead the utility policy protects
  // Cap on speculative bytes in flight (issued, not landed); 0: a quarter of the budget.
  std::uint64_t max_speculative_bytes = 0;
  // Speculative blocks handed to the store and not landed (the items of one target go out as one
  // multi-key Store::Prefetch); the rest wait in our queue. The current layer's known selection
  // (its top-k) is not counted: it loads as one demand batch. 8 raised the oracle's hit rate on
  // moe-bench but slowed lookahead (more wrong predictions read): docs/benchmarks.md.
  unsigned max_inflight_prefetches = 2;
  // Predictions whose confidence is >= confident_prefetch_min may keep up to this many speculative
  // blocks in flight instead (0: twice the model's top-k), still under max_speculative_bytes: a
  // predictor that is usually right keeps the drive's queue full, one that is usually wrong is held
  // to max_inflight_prefetches (docs/experts.md, "Prefetch control").
  unsigned max_inflight_confident_prefetches = 0;
  double confident_prefetch_min = 0.75;
  // Lead-time-aware residency (docs/experts.md, "The cache"). A miss in a step's first MoE layers
  // cannot be hidden by any prefetch (their experts are known only from the embedding, a dense
  // layer and one attention ahead), while a miss deeper in the stack mostly can. The first
  // `lead_protected_layers` MoE layers (0: off) get a reserved share of the budget,
  // `lead_protected_share` x budget bytes (in [0, 1]): while their resident and in-flight experts
  // hold less than that, no load for another layer evicts one of them; once they hold that much, a
  // load for one of them evicts among them (the policy picks which). A demand or selection load that
  // finds no victim on its side of the partition may take one from the other (budget first); a
  // prefetch may not. The budget itself holds exactly as without it.
  int lead_protected_layers = 1;
  double lead_protected_share = 0.5;
  double hot_factor = 2.0;
};

class ExpertOffload;

// An RAII lease on one expert in the fast tier: pins the block there while it lives; weights()
// are MXFP4 views into the pinned bytes. Move-only; must not outlive its ExpertOffload.
class ExpertLease {
 public:
  ExpertLease() = default;
  ~ExpertLease() { Release(); }
  ExpertLease(ExpertLease&& o) noexcept;
  ExpertLease& operator=(ExpertLease&& o) noexcept;
  ExpertLease(const ExpertLease&) = delete;
  ExpertLease& operator=(const ExpertLease&) = delete;
  bool valid() const { return owner_ != nullptr; }
  const model::ExpertWeights& weights() const { return *weights_; }
  int layer() const { return layer_; }
  int expert() const { return expert_; }
  void Release();

 private:
  friend class ExpertOffload;
  ExpertOffload* owner_ = nullptr;
  const model::ExpertWeights* weights_ = nullptr;
  int layer_ = -1, expert_ = -1;
};

// What a Lease failure for a lost expert block (NotFound / Corruption) ends with: the remedy in
// the library's words. A front end that names its own remedy replaces this text.
inline constexpr std::string_view kLostExpertRemedy =
    "; ExpertOffload::Create over the same weights stores a fresh copy (it reads back every expert block the "
    "store holds and stores the damaged or lost ones afresh)";

// The store-backed ExpertProvider.
class ExpertOffload final : public model::ExpertProvider {
 public:
  // Puts every routed expert of `weights` (MXFP4 checkpoints only) into `store` as one block in
  // options.home, keyed by keys::ExpertKey. A block already there is read back (one read of every
  // stored expert) and kept when it passes its checksum; a damaged or lost one is stored afresh
  // (a warning through the store's logger counts them). The store
  // needs an HBM tier with host-addressable memory (HbmMode::kEmulated: the reference model
  // computes on the CPU) that holds at least the budget, and Placement::kInclusive, so a fast-tier
  // copy never removes the home copy. `store` must outlive the result. Use OpenStoreOptions to get
  // a store that fits. InvalidArgument for a store that does not (naming what), a budget that
  // CacheBudget::Check refuses or one smaller than an expert block. The store may be shared (a
  // second ExpertOffload of the same model, other holders of expert handles or pins, other blocks
  // in the fast tier): each cache's budget is then what it holds, and a copy another holder pins
  // is not its to evict (docs/experts.md, "Sharing a store").
  static Result<std::shared_ptr<ExpertOffload>> Create(const model::ModelConfig& config,
                                                       const model::WeightSource& weights, Store* store,
                                                       ExpertOffloadOptions options);
  // StoreOptions for a dedicated expert store: HBM emulated (sized above the budget so the store
  // never evicts on its own), host, and NVMe at `nvme_dir` when not empty (then the experts' home);
  // logs warnings and errors to stderr.
  static StoreOptions OpenStoreOptions(std::uint64_t total_expert_bytes, std::uint64_t budget_bytes,
                                       const std::string& nvme_dir, const LinkModel& link = {});
  // Routed expert bytes of `config` as blocks (every MoE layer's experts, block headers included).
  static std::uint64_t TotalExpertBytes(const model::ModelConfig& config);

  ~ExpertOffload() override;

  // Errors name the layer and expert (NotFound, Corruption with no good copy, OutOfCapacity).
  Result<ExpertLease> Lease(int layer, int expert);

  // model::ExpertProvider: Acquire takes a lease (kept until Release); Prefetch records the
  // layer's actual selection (routing trace, predictor, scoring) and protects it.
  Result<const model::ExpertWeights*> Acquire(int layer, int expert) override;
  void Release(int layer, int expert) override;
  void Prefetch(int layer, std::span<const int> experts) override;

  // Installs on_routing (expert load), on_embedding and on_layer_end (predictor) into `options`, after any
  // callbacks already there (model::ChainHooks: those run first). The callbacks hold a plain pointer: this object must outlive them.
  void AttachHooks(model::ForwardOptions* options);
  // Lookahead's entry point (also called by the on_layer_end hook).
  void OnLayerEnd(int layer, std::span<const float> hidden, std::int64_t tokens);
  // Token start (called by the on_embedding hook): starts the step's clock at layer 0 and issues
  // the predictor's OnTokenStart predictions.
  void OnTokenStart(std::span<const float> embedding, std::int64_t tokens);

  // Replaces the predictor (null: none), e.g. lookahead once the model is loaded over this
  // provider, or an oracle built from trace() after a first run. Under the belady policy a
  // non-null predictor without a known_future() (or one whose trace has another layer count) is
  // refused: every later Lease/Acquire fails with InvalidArgument saying so, until a predictor
  // with one, or null, is set (CheckPolicyPredictor tells beforehand). Null under belady means no
  // known future yet (the pass that records the trace): it evicts as lru meanwhile.
  void SetPredictor(std::unique_ptr<Predictor> predictor);
  // Issues every queued prefetch and waits until all have finished (or were cancelled).
  void Quiesce();
  // Drops every unpinned fast-tier copy (a cold cache), zeroes the metrics and starts a new routing
  // trace (steps count from 0 again): take trace() first to replay the run so far.
  Status Reset();
  // A snapshot of the counters since Reset. Books the loads that have landed first (as the next
  // acquire would), so that a landed prefetch counts as landed and resident, and forgets the
  // landed copies a shared store has evicted since (resident_bytes counts what the fast tier holds
  // of this cache's); issues nothing.
  ExpertMetrics Metrics() const;
  // The routing seen so far (for an oracle replay of the same run).
  std::shared_ptr<const RoutingTrace> trace() const;
  std::uint64_t budget_bytes() const;
  // The store key of an expert's block (keys::ExpertKey in this model's namespace); InvalidArgument
  // for a dense layer or an index out of range.
  Result<BlockKey> key(int layer, int expert) const;

 private:
  friend class ExpertLease;
  struct Impl;
  explicit ExpertOffload(std::unique_ptr<Impl> impl);
  void ReleaseLease(int layer, int expert);
  std::unique_ptr<Impl> impl_;
};

}  // namespace terrace::experts
