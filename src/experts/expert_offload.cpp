// ExpertOffload's public side: the lease, Create (loading the experts into the store), the
// ExpertProvider calls and their forward-pass hooks, Reset and Metrics. The cache itself
// (ExpertOffload::Impl, its state machine and lock rule) is in offload_impl.h.
#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "src/experts/offload_impl.h"
#include "src/model/names.h"
#include "terrace/keys.h"

namespace terrace::experts {

using namespace offload;

namespace {

std::uint64_t Align64(std::uint64_t n) { return (n + 63) / 64 * 64; }

}  // namespace

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
        "expert offload keeps experts in MXFP4, but the weights hold no '{}': either the checkpoint's routed "
        "experts are not MXFP4 (weight_packed + weight_scale), or the ModelConfig does not match it (num_experts, "
        "first_k_dense_replace, num_hidden_layers); offload an MXFP4 checkpoint with its own config, or keep the "
        "experts resident (no expert offload)",
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

// Puts `block` under `key` in `home`. Store::Put keeps a block the store already holds with the
// same checksum without reading it, so such a block is read back first: a copy that fails its
// checksum (or whose block is lost) is forgotten and stored afresh, and *restored counts it. A
// damaged expert store is so mended by one Create, not by one run per damaged expert.
Status StoreExpertBlock(Store& store, const BlockKey& key, std::span<const std::byte> block, TierId home,
                        std::uint64_t* restored) {
  const auto where = store.Lookup(std::span<const BlockKey>(&key, 1));
  if (!where.empty() && where[0].found) {
    std::vector<std::byte> back(block.size());
    GetOptions go;
    go.promote = false;
    auto got = store.Get(key, back, go);
    if (!got.ok()) {
      if (!got.status().IsCorruption() && !got.status().IsNotFound()) return got.status();
      if (Status e = store.Erase(key); !e.ok() && !e.IsNotFound()) return e;
      ++*restored;
    }
  }
  PutOptions po;
  po.codec = Codec::kMxfp4;
  po.tier = home;
  return store.Put(key, block, po);
}

}  // namespace

std::uint64_t ExpertOffload::TotalExpertBytes(const model::ModelConfig& config) {
  const auto layers = static_cast<std::uint64_t>(config.NumMoeLayers());
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
  MutexLock lock(&impl_->mu);
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
  TERRACE_RETURN_IF_ERROR(model::ValidateConfig(config));  // the expert keys and sizes derive from it
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
  const TierStatsSnapshot hbm = store->Stats().tiers[static_cast<std::size_t>(TierId::kHbm)];
  if (!hbm.host_addressable) {
    return Status::InvalidArgument(fmt::format(
        "expert offload needs an hbm tier in host memory (the reference model reads the experts on the CPU); this "
        "store's hbm tier ({}) is not host-addressable (GPU device memory): open it with HbmMode::kEmulated, as "
        "ExpertOffload::OpenStoreOptions does",
        hbm.name));
  }
  TERRACE_RETURN_IF_ERROR(options.budget.Check().WithContext("expert offload"));
  if (!config.HasRoutedExperts()) {
    return Status::InvalidArgument(
        "expert offload: the model has no routed experts (num_experts is 0 or every layer is dense)");
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  MutexLock lock(&m.mu);  // uncontended (nothing else sees m yet): for the lock rule's checker
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

  const ContentId model_id = keys::ModelId(config, weights);
  const std::uint32_t ns = keys::Namespace(model_id, "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
  const ContentId ns_root = keys::NamespaceRoot(model_id, "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
  std::uint64_t restored = 0;
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
      s.key = keys::ExpertKey(ns, ns_root, l, e);
      s.bytes = block.size();
      Status st = StoreExpertBlock(*store, s.key, block, options.home, &restored);
      if (!st.ok())
        return st.WithContext(fmt::format("storing expert {} of layer {} in the {} tier", e, l, TierName(options.home)));
      m.total_bytes += s.bytes;
      m.max_block = std::max(m.max_block, s.bytes);
    }
  }
  if (restored > 0) {
    LoggerOrDefault(store->options().logger)
        ->Log(LogLevel::kWarning, "experts",
              fmt::format("{} expert blocks in the store failed their checksum or were lost; stored afresh from the "
                          "model's weights",
                          restored));
  }
  // A previous process may have left fast-tier copies (a persistent store keeps none, but a shared
  // store may): start cold so the budget accounting is exact. A copy another holder pins (a second
  // ExpertOffload of this model over the store) stays where it is, and is not this cache's:
  // InvalidArgument (the block was just stored in the home tier, so a lower copy exists).
  for (auto& s : m.slots) {
    if (s.bytes == 0) continue;
    Status st = store->EvictCopy(s.key, TierId::kHbm);
    if (!st.ok() && !st.IsNotFound() && !st.IsInvalidArgument())
      return st.WithContext("starting the expert cache cold");
  }
  m.budget = options.budget.Resolve(m.total_bytes);
  if (m.budget < m.max_block) {
    return Status::InvalidArgument(fmt::format(
        "expert cache budget {} is {} bytes, smaller than one expert block ({} bytes; all routed experts: {} bytes); "
        "give at least one expert's size",
        options.budget.ToString(), m.budget, m.max_block, m.total_bytes));
  }
  if (hbm.capacity_bytes < m.budget) {
    return Status::InvalidArgument(fmt::format(
        "expert cache budget {} is {} bytes, more than the store's hbm tier holds ({} bytes): the cache would "
        "fail loads once the tier is full; give a budget of at most the hbm capacity, or open the store with "
        "ExpertOffload::OpenStoreOptions for this budget",
        options.budget.ToString(), m.budget, hbm.capacity_bytes));
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
  MutexLock lock(&impl_->mu);
  TERRACE_ASSIGN_OR_RETURN(const model::ExpertWeights* w, impl_->AcquireLocked(layer, expert));
  ExpertLease lease;
  lease.owner_ = this;
  lease.weights_ = w;
  lease.layer_ = layer;
  lease.expert_ = expert;
  return lease;
}

void ExpertOffload::ReleaseLease(int layer, int expert) {
  MutexLock lock(&impl_->mu);
  impl_->ReleaseLocked(layer, expert);
}

Result<const model::ExpertWeights*> ExpertOffload::Acquire(int layer, int expert) {
  MutexLock lock(&impl_->mu);
  return impl_->AcquireLocked(layer, expert);
}

void ExpertOffload::Release(int layer, int expert) { ReleaseLease(layer, expert); }

void ExpertOffload::Prefetch(int layer, std::span<const int> experts) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
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
  m.Harvest(false);  // a prefetch that landed before this choice is resident, not late
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
  MutexLock lock(&m.mu);
  if (layer < 0 || layer >= m.L) return;
  m.Advance(layer + 1);
  if (layer + 1 == m.L) m.tokens += static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 0));
  std::vector<Prediction> preds;
  m.predictor->OnLayerEnd(m.step, layer, hidden, tokens, &preds);
  m.Submit(preds, /*score=*/true);
}

void ExpertOffload::OnTokenStart(std::span<const float> embedding, std::int64_t tokens) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  m.Advance(0);
  std::vector<Prediction> preds;
  m.predictor->OnTokenStart(m.step, embedding, tokens, &preds);
  m.Submit(preds, /*score=*/true);
}

void ExpertOffload::AttachHooks(model::ForwardOptions* options) {
  model::ForwardOptions mine;
  mine.on_routing = [this](int layer, const model::Routing& r) {
    Impl& m = *impl_;
    MutexLock lock(&m.mu);
    if (layer < 0 || layer >= m.L) return;
    m.have_token_load = true;
    for (int e : r.ids)
      if (e >= 0 && e < m.E) ++m.token_load[static_cast<std::size_t>(layer)][static_cast<std::size_t>(e)];
  };
  mine.on_layer_end = [this](int layer, std::span<const float> hidden, std::int64_t tokens) {
    OnLayerEnd(layer, hidden, tokens);
  };
  mine.on_embedding = [this](std::span<const float> embedding, std::int64_t tokens) {
    OnTokenStart(embedding, tokens);
  };
  *options = model::ChainHooks(std::move(*options), std::move(mine));
}

void ExpertOffload::Quiesce() {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
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
  MutexLock lock(&m.mu);
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
  m.loads_from.fill(0);
  m.loaded_bytes_from.fill(0);
  m.issued = m.cancelled = m.skipped = m.evictions = m.shared_drops = 0;
  m.spec_booked_since_pump = false;
  m.sched = ExpertScheduleMetrics{};
  m.load_iv.clear();
  m.load_busy_folded = 0;
  m.step_start_ns = m.step_start_busy_ns = 0;
  std::fill(m.layer_stall.begin(), m.layer_stall.end(), 0);
  m.corrupt_base = m.store->Stats().corruptions_dropped;
  return Status::Ok();
}

void ExpertOffload::SetPredictor(std::unique_ptr<Predictor> predictor) {
  MutexLock lock(&impl_->mu);
  impl_->InstallPredictor(std::move(predictor));
}

std::shared_ptr<const RoutingTrace> ExpertOffload::trace() const {
  MutexLock lock(&impl_->mu);
  return std::make_shared<const RoutingTrace>(*impl_->trace);
}

std::uint64_t ExpertOffload::budget_bytes() const { return impl_->budget; }

Result<BlockKey> ExpertOffload::key(int layer, int expert) const {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  if (layer < 0 || layer >= m.L || expert < 0 || expert >= m.E || m.slot(layer, expert).bytes == 0)
    return Status::InvalidArgument(fmt::format("expert {} of layer {} does not exist", expert, layer));
  return m.slot(layer, expert).key;
}

ExpertMetrics ExpertOffload::Metrics() const {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  // What landed is booked first (as the next acquire would book it), so the snapshot counts it as
  // landed and resident, and its load as ended at its landing. The queue is left to the forward
  // thread: a snapshot issues nothing.
  m.Harvest(false);
  m.ForgetLostCopies();  // resident_bytes is what the fast tier holds of ours, on a shared store too
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
  x.loads_from = m.loads_from;
  x.loaded_bytes_from = m.loaded_bytes_from;
  std::uint64_t unused = 0;
  for (const auto& s : m.slots)
    if (s.state == SlotState::kResident && s.unused_prefetch) unused += s.bytes;
  x.speculative_wasted_bytes = m.spec_wasted;
  x.speculative_unused_bytes = unused;
  x.prefetches_issued = m.issued;
  x.prefetches_cancelled = m.cancelled;
  x.prefetches_skipped = m.skipped;
  x.evictions = m.evictions;
  x.shared_drops = m.shared_drops;
  x.corrupt_copies_reread = m.store->Stats().corruptions_dropped - m.corrupt_base;
  x.budget_bytes = m.budget;
  std::uint64_t resident = 0;
  for (const auto& s : m.slots)
    if (s.state == SlotState::kResident) resident += s.bytes;
  x.resident_bytes = resident;
  x.total_expert_bytes = m.total_bytes;
  x.schedule = m.sched;
  // Loads still in flight count up to now: the difference of two snapshots then covers only the
  // time between them (a prefetch issued before the first and booked after it would otherwise
  // add its whole interval, from before the first snapshot, to the difference). A key that lands
  // between the harvest above and now counts up to its landing.
  x.schedule.load_busy_ns = m.LoadBusyNs(SteadyNanos());
  return x;
}

}  // namespace terrace::experts
