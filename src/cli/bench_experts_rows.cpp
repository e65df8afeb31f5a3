// terrace bench experts: measuring each row (bench_experts.h). Resident, then the experts stored
// on the NVMe tier and the drive's read rate, then each store-backed configuration over a cold
// cache, then the mmap baselines.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "src/cli/bench_experts.h"
#include "src/cli/bench_own_store.h"
#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/clock.h"
#include "src/common/list_dir.h"
#include "src/experts/mmap_experts.h"
#include "src/model/ops.h"

namespace terrace::cli::bench_experts {
namespace {

// The bench's store logger (warnings and errors to stderr) that also keeps the last error logged
// after Closing(): a tier's failed close (final commit, superblock, index) is reported only there,
// its own line last (after the index's lines that led to it).
// Thread-safe.
class CloseErrorLogger final : public Logger {
 public:
  void Log(LogLevel level, std::string_view component, std::string_view message) override {
    out_->Log(level, component, message);
    std::lock_guard<std::mutex> l(mu_);
    if (closing_ && level >= LogLevel::kError) last_ = std::string(message);
  }
  void Closing() {
    std::lock_guard<std::mutex> l(mu_);
    closing_ = true;
  }
  std::string last() {
    std::lock_guard<std::mutex> l(mu_);
    return last_;
  }

 private:
  const std::shared_ptr<Logger> out_ = StderrLogger(LogLevel::kWarning);
  std::mutex mu_;
  bool closing_ = false;
  std::string last_;
};

// A store over the bench's NVMe tier whose close is checked (Close).
struct BenchStore {
  std::shared_ptr<CloseErrorLogger> log = std::make_shared<CloseErrorLogger>();
  std::unique_ptr<Store> store;

  // Closes the store (every user of it gone first); IoError naming --dir with the last error its
  // tiers logged while closing, Ok when none.
  Status Close() {
    log->Closing();
    store.reset();
    const std::string last = log->last();
    if (last.empty()) return Status::Ok();
    return Status::IoError(fmt::format("--dir: closing the expert store failed: {}", last));
  }
};

// `e`, a failed open of the expert store in --dir, in the bench's words (InCliWords): the bench has
// no capacity flag (the store's size is the model's expert bytes), so a store of another size in
// --dir is not one it made, and is left to whoever made it.
Status InBenchWords(const Status& e) {
  store_cmd::StoreWords w = store_cmd::CommandDirWords(
      "--dir", "--dir", "(or give a --dir no other process uses: the bench stores the experts there again from --model)");
  w.capacity_flag = "size";
  w.lower_capacity = "give a --dir on a file system with that much free space (the expert store's size comes from "
                     "the model)";
  std::string m = store_cmd::InCliWords(e.message(), w);
  // The tier's capacity mismatch ("was created with capacity_bytes=N but the options ask for M; open
  // it with the original capacity ..."), which InCliWords leaves in the library's words.
  const std::pair<std::string_view, std::string_view> kMismatch[] = {
      {"but the options ask for", "but this model's experts need"},
      {"open it with the original capacity (or 0: as recorded) or use a new directory",
       "the bench did not make this store (it sizes its store from --model); give a --dir no other process uses"}};
  for (const auto& [from, to] : kMismatch)
    if (const std::size_t pos = m.find(from); pos != std::string::npos) m.replace(pos, from.size(), to);
  return Reworded(e, std::move(m));
}

// ExpertOffload::OpenStoreOptions's store over --dir with `budget` bytes of fast tier. A failed
// open's error is in the bench's words (InBenchWords).
Result<BenchStore> OpenBenchStore(const Run& run, std::uint64_t budget) {
  BenchStore b;
  StoreOptions o = experts::ExpertOffload::OpenStoreOptions(run.total, budget, run.a.dir, run.link);
  o.logger = b.log;
  auto store = Store::Open(o);
  if (!store.ok()) return InBenchWords(store.status());
  b.store = std::move(store).value();
  return b;
}

using SteadyClock = std::chrono::steady_clock;

constexpr std::uint64_t kNoIoCounters = ~0ull;

// The checkpoint's shards (model.safetensors or model-*-of-*.safetensors) in `dir`.
std::vector<std::filesystem::path> Shards(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& entry : ListDir(dir, &ec))
    if (entry.path().extension() == ".safetensors") out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  return out;
}

// fdatasync, then POSIX_FADV_DONTNEED on every shard (clean pages only can be dropped). True when
// every call succeeded; the kernel may still keep pages (mapped by someone else), so callers check
// with Residency.
bool AdviseDontNeed(const std::vector<std::filesystem::path>& shards) {
  bool ok = true;
  for (const auto& path : shards) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      ok = false;
      continue;
    }
    ok = ::fdatasync(fd) == 0 && ok;
    ok = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && ok;
    ::close(fd);
  }
  return ok;
}

// echo 1 > /proc/sys/vm/drop_caches after sync(): the whole system's clean page cache. The empty
// string on success, else why not.
std::string DropSystemPageCache() {
  if (::geteuid() != 0) return "not root";
  ::sync();
  std::FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (f == nullptr) return "cannot open /proc/sys/vm/drop_caches for writing";
  const bool ok = std::fputs("1\n", f) >= 0;
  return std::fclose(f) == 0 && ok ? "" : "writing /proc/sys/vm/drop_caches failed";
}

Residency MeasureResidency(const std::vector<std::filesystem::path>& shards) {
  Residency r;
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& path : shards) {
    std::error_code ec;
    const std::uint64_t size = std::filesystem::file_size(path, ec);
    if (ec || size == 0) {
      r.measured = r.measured && !ec;
      continue;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      r.measured = false;
      continue;
    }
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      r.measured = false;
      continue;
    }
    std::vector<unsigned char> vec((size + page - 1) / page);
    if (::mincore(p, size, vec.data()) == 0) {
      std::uint64_t pages = 0;
      for (unsigned char v : vec) pages += v & 1u;
      r.file_bytes += size;
      r.resident_bytes += std::min(size, pages * page);
    } else {
      r.measured = false;
    }
    ::munmap(p, size);
  }
  return r;
}

// This process's storage reads so far (/proc/self/io read_bytes); kNoIoCounters when unreadable.
std::uint64_t ProcessReadBytes() {
  std::FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return kNoIoCounters;
  char line[128];
  std::uint64_t v = kNoIoCounters;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long x = 0;
    if (std::sscanf(line, "read_bytes: %llu", &x) == 1) v = x;
  }
  std::fclose(f);
  return v;
}

// User + system CPU seconds of every thread of the process so far.
double ProcessCpuTotalSeconds() {
  const auto [user, sys] = ProcessCpuSeconds();
  return user + sys;
}

// CPU time so far: this (the forward) thread's and the whole process's.
struct CpuMark {
  double thread_s = 0, process_s = 0;
  static CpuMark Now() { return {ThreadCpuSeconds(), ProcessCpuTotalSeconds()}; }
};

// Sets r's per-token figures of `decode` steps that took `t` seconds since `cpu0`: tokens/s, wall
// time, the forward thread's CPU time and the other threads' CPU time.
void SetPerToken(double t, const CpuMark& cpu0, int decode, ConfigResult* r) {
  const CpuMark cpu1 = CpuMark::Now();
  const double fcpu = cpu1.thread_s - cpu0.thread_s, pcpu = cpu1.process_s - cpu0.process_s;
  r->tokens_per_s = decode / t;
  r->wall_s_per_token = t / decode;
  r->forward_cpu_s_per_token = fcpu / decode;
  r->background_cpu_s_per_token = std::max(pcpu - fcpu, 0.0) / decode;
}

// Prefill, then time `decode` greedy decode steps. `between` runs after the prefill (snapshots).
Result<double> TimedDecode(const model::Model& m, const std::vector<int>& prompt, int decode,
                           const model::ForwardOptions* hooks, const std::function<void()>& between,
                           PhaseProgress* progress) {
  model::Session s(m);
  if (hooks) s.set_hooks(*hooks);
  TERRACE_RETURN_IF_ERROR(s.Prefill(prompt).status());
  if (between) between();
  const auto t0 = SteadyClock::now();
  for (int i = 0; i < decode; ++i) {
    TERRACE_RETURN_IF_ERROR(StopCheck());
    TERRACE_RETURN_IF_ERROR(s.Decode(model::Argmax(s.last_logits())).status());
    progress->Tick("decode token", i + 1, decode);
  }
  return SecondsSince(t0);
}

experts::PredictionCounts Minus(const experts::PredictionCounts& a, const experts::PredictionCounts& b) {
  experts::PredictionCounts d;
  d.true_positive = a.true_positive - b.true_positive;
  d.false_positive = a.false_positive - b.false_positive;
  d.false_negative = a.false_negative - b.false_negative;
  return d;
}

experts::ExpertScheduleMetrics Minus(const experts::ExpertScheduleMetrics& a1, const experts::ExpertScheduleMetrics& a0) {
  experts::ExpertScheduleMetrics d;
  d.load_busy_ns = a1.load_busy_ns - a0.load_busy_ns;
  d.spec_landed = a1.spec_landed - a0.spec_landed;
  d.spec_load_ns = a1.spec_load_ns - a0.spec_load_ns;
  d.spec_used = a1.spec_used - a0.spec_used;
  d.spec_lead_layers = a1.spec_lead_layers - a0.spec_lead_layers;
  d.spec_lead_ns = a1.spec_lead_ns - a0.spec_lead_ns;
  d.spec_late = a1.spec_late - a0.spec_late;
  d.spec_evicted_unused = a1.spec_evicted_unused - a0.spec_evicted_unused;
  d.spec_evicted_before_target = a1.spec_evicted_before_target - a0.spec_evicted_before_target;
  d.selection_batches = a1.selection_batches - a0.selection_batches;
  d.selection_behind_spec = a1.selection_behind_spec - a0.selection_behind_spec;
  d.selection_behind_spec_keys = a1.selection_behind_spec_keys - a0.selection_behind_spec_keys;
  d.pump_held_inflight = a1.pump_held_inflight - a0.pump_held_inflight;
  d.pump_held_bytes = a1.pump_held_bytes - a0.pump_held_bytes;
  d.pump_held_selection = a1.pump_held_selection - a0.pump_held_selection;
  return d;
}

// Installs the row's predictor on `x` (none for on-demand). The oracle replays a recorded trace:
// its own, recorded by one untimed decode here, or (oracle+belady) the run's earlier one.
Status SetPredictor(Run* run, const CachedConfig& c, const experts::CacheBudget& budget, const model::Model& m,
                    experts::ExpertOffload& x) {
  const Args& a = run->a;
  if (c.predictor == experts::PredictorKind::kLookahead) {
    experts::LookaheadOptions lo;
    lo.depth = a.lookahead_depth;
    lo.embedding_depth = a.lookahead_embedding_depth;
    if (a.lookahead_min_confidence) lo.min_confidence = *a.lookahead_min_confidence;
    lo.supersede = !a.no_lookahead_supersede;
    lo.provisional = a.lookahead_provisional;
    if (a.lookahead_min_rank_precision) lo.min_rank_precision = *a.lookahead_min_rank_precision;
    if (a.lookahead_busy_rank_precision) lo.busy_rank_precision = *a.lookahead_busy_rank_precision;
    x.SetPredictor(experts::MakeLookaheadPredictor(m, lo));
  }
  if (c.predictor == experts::PredictorKind::kStatistical) x.SetPredictor(experts::MakeStatisticalPredictor(run->config));
  if (c.predictor == experts::PredictorKind::kOracle) {
    std::shared_ptr<const experts::RoutingTrace> trace =
        c.policy == experts::CachePolicyKind::kBelady ? run->recorded : nullptr;
    if (!trace) {
      model::ForwardOptions h;
      x.AttachHooks(&h);
      TERRACE_RETURN_IF_ERROR(TimedDecode(m, run->prompt, a.decode, &h, {}, &run->progress).status());
      trace = x.trace();
      TERRACE_RETURN_IF_ERROR(x.Reset());
    }
    x.SetPredictor(experts::MakeOraclePredictor(std::move(trace), kOracleDepth));
    run->progress.Phase(fmt::format("{} at {}: replaying the recorded trace", c.name, budget.ToString()));
  }
  return Status::Ok();
}

}  // namespace

void PhaseProgress::Phase(const std::string& what) {
  fmt::print(stderr, "bench experts [{:6.1f} s]: {}\n", SecondsSince(start_), what);
  phase_ = what;
  last_ = SteadyClock::now();
}

void PhaseProgress::Tick(const char* step, int done, int total) {
  if (SecondsSince(last_) < 2.0) return;
  fmt::print(stderr, "bench experts [{:6.1f} s]:   {}: {} {}/{}\n", SecondsSince(start_), phase_, step, done, total);
  last_ = SteadyClock::now();
}

const std::vector<CachedConfig>& CachedConfigs() {
  static const std::vector<CachedConfig> configs = {
      {"on-demand", experts::CachePolicyKind::kLru, experts::PredictorKind::kNone},
      {"lru+lookahead", experts::CachePolicyKind::kLru, experts::PredictorKind::kLookahead},
      {"utility+statistical", experts::CachePolicyKind::kUtility, experts::PredictorKind::kStatistical},
      {"utility+lookahead", experts::CachePolicyKind::kUtility, experts::PredictorKind::kLookahead},
      {"oracle", experts::CachePolicyKind::kUtility, experts::PredictorKind::kOracle},
      {std::string(kBeladyRow), experts::CachePolicyKind::kBelady, experts::PredictorKind::kOracle}};
  return configs;
}

double Run::OverlapTokensPerS(double drive_bytes) const {
  const double io_s = drive_bytes / std::max(nvme_bytes_per_s, 1.0) + drive_bytes / link.bandwidth_bytes_per_s;
  return 1.0 / std::max(compute_s_per_token, io_s);
}

// All-resident: the compute cost of a token, as this thread's CPU time per decode step (one BLAS
// thread: the forward pass runs on this thread), so that other jobs on a shared machine do not
// inflate it; the wall time per step is reported beside it.
Result<ConfigResult> RunResidentRow(Run* run, const model::ModelDir& md) {
  const Args& a = run->a;
  run->progress.Phase(
      fmt::format("resident (all {:.1f} MiB of experts in memory)", static_cast<double>(run->total) / (1 << 20)));
  TERRACE_ASSIGN_OR_RETURN(auto m, model::Model::Load(run->config, md));
  CpuMark cpu0;
  TERRACE_ASSIGN_OR_RETURN(const double t, TimedDecode(*m, run->prompt, a.decode, nullptr,
                                                       [&] { cpu0 = CpuMark::Now(); }, &run->progress));
  ConfigResult r;
  r.name = "resident";
  SetPerToken(t, cpu0, a.decode, &r);
  run->resident_wall_s_per_token = r.wall_s_per_token;
  run->compute_s_per_token = r.forward_cpu_s_per_token;
  if (a.threads > 1 || !(run->compute_s_per_token > 0)) run->compute_s_per_token = run->resident_wall_s_per_token;
  TERRACE_ASSIGN_OR_RETURN(run->limit, experts::MeasureLookaheadLimit(*m, run->prompt, a.decode));  // untimed
  r.stall_share = 0;  // every expert in memory: nothing to wait on
  r.bound_tokens_per_s = r.tokens_per_s;
  return r;
}

// The experts, once, onto the NVMe tier; then the drive's read rate over all of them (O_DIRECT,
// 32 blocks per batch, through a reused ring of buffers).
Status StoreExpertsAndMeasureDrive(Run* run, const model::ModelDir& md, const std::filesystem::path& dir) {
  run->progress.Phase(
      fmt::format("storing {:.1f} MiB of routed experts on the NVMe tier", static_cast<double>(run->total) / (1 << 20)));
  WaitAtStoreOpenGate();
  TERRACE_RETURN_IF_ERROR(CheckStillNew(dir, dir, "--dir"));
  run->made_store = true;  // a failed creation below leaves an unmarked store of this run's: the cleanup removes it
  TERRACE_ASSIGN_OR_RETURN(BenchStore bs, OpenBenchStore(*run, run->total));
  Store* st = bs.store.get();
  // Marked once the store exists (the NVMe tier wants an empty directory or a store).
  TERRACE_RETURN_IF_ERROR(WriteMarker(dir, kExpertsMarker, "terrace bench experts"));
  experts::ExpertOffloadOptions o;
  o.home = TierId::kNvme;
  o.budget = *experts::CacheBudget::Parse("100%");
  TERRACE_ASSIGN_OR_RETURN(auto off, experts::ExpertOffload::Create(run->config, md, st, std::move(o)));
  TERRACE_RETURN_IF_ERROR(st->Flush());
  run->progress.Phase("reading every expert block back from the NVMe tier (drive read rate)");
  std::vector<BlockKey> keys;
  for (int l = 0; l < run->config.num_hidden_layers; ++l)
    for (int e = 0; e < run->config.num_experts; ++e)
      if (auto k = off->key(l, e); k.ok()) keys.push_back(*k);
  constexpr std::size_t kBatch = 32;
  std::vector<std::vector<std::byte>> bufs(std::min(kBatch, keys.size()), std::vector<std::byte>(run->regime.block_bytes));
  const auto t0 = SteadyClock::now();
  for (std::size_t i = 0; i < keys.size(); i += kBatch) {
    std::vector<Store::GetItem> items;
    for (std::size_t j = i; j < std::min(keys.size(), i + kBatch); ++j) items.push_back(Store::GetItem{keys[j], bufs[j - i], {}});
    for (const Status& s : st->GetBatch(items)) TERRACE_RETURN_IF_ERROR(s);
    TERRACE_RETURN_IF_ERROR(StopCheck());
    run->progress.Tick("block", static_cast<int>(std::min(keys.size(), i + kBatch)), static_cast<int>(keys.size()));
  }
  run->nvme_bytes_per_s = static_cast<double>(run->total) / std::max(SecondsSince(t0), 1e-9);
  off.reset();
  return bs.Close();
}

Result<ConfigResult> RunCachedRow(Run* run, const model::ModelDir& md, const CachedConfig& c,
                                  const experts::CacheBudget& budget) {
  const Args& a = run->a;
  run->progress.Phase(fmt::format("{} at {}", c.name, budget.ToString()));
  // A cold cache: a fresh store over the same NVMe tier (the HBM and host tiers start empty).
  TERRACE_ASSIGN_OR_RETURN(BenchStore bs, OpenBenchStore(*run, budget.Resolve(run->total)));
  Store* st = bs.store.get();
  experts::ExpertOffloadOptions o;
  o.home = TierId::kNvme;
  o.budget = budget;
  o.policy = c.policy;
  // oracle+belady is the replacement bound: no partition constrains which expert goes.
  o.lead_protected_layers = c.policy == experts::CachePolicyKind::kBelady ? 0 : a.lead_protected_layers;
  if (a.lead_protected_share) o.lead_protected_share = *a.lead_protected_share;
  TERRACE_ASSIGN_OR_RETURN(auto off, experts::ExpertOffload::Create(run->config, md, st, std::move(o)));
  TERRACE_ASSIGN_OR_RETURN(auto m, model::Model::Load(run->config, md, off));
  experts::ExpertOffload& x = *off;
  TERRACE_RETURN_IF_ERROR(SetPredictor(run, c, budget, *m, x));
  model::ForwardOptions hooks;
  x.AttachHooks(&hooks);
  experts::ExpertMetrics m0;
  StoreStats s0;
  CpuMark cpu0;
  // The expert metrics are snapshotted last before the timed decode and first after it, so the
  // difference (load busy time above all) covers the timed steps and next to nothing else.
  TERRACE_ASSIGN_OR_RETURN(const double t, TimedDecode(*m, run->prompt, a.decode, &hooks, [&] {
    s0 = st->Stats();
    cpu0 = CpuMark::Now();
    m0 = x.Metrics();
  }, &run->progress));
  const experts::ExpertMetrics m1 = x.Metrics();
  ConfigResult r;
  SetPerToken(t, cpu0, a.decode, &r);
  const StoreStats s1 = st->Stats();
  if (!run->recorded) run->recorded = x.trace();
  r.name = c.name;
  r.budget_fraction = budget.fraction;
  r.stall_share = static_cast<double>(m1.stall_ns - m0.stall_ns) / 1e9 / t;
  const double hits = static_cast<double>(m1.hits - m0.hits);
  const double misses = static_cast<double>((m1.misses - m0.misses) + (m1.late_hits - m0.late_hits));
  r.hit_rate = hits + misses > 0 ? hits / (hits + misses) : 0;
  const experts::PredictionCounts pc = Minus(m1.prediction, m0.prediction);
  const bool predicts = c.predictor != experts::PredictorKind::kNone;  // on-demand predicts nothing
  if (predicts) {
    r.recall = pc.recall_if_defined();
    r.precision = pc.precision_if_defined();  // unset when the gates let nothing through
  }
  for (std::size_t l = 0; l < m1.layers.size(); ++l) {
    const auto& L1 = m1.layers[l];  // MoE layers only, the same order in m0
    // Decode-only per-layer recall (the prefill's predictions are left out, as in `recall`).
    const experts::PredictionCounts lc =
        l < m0.layers.size() ? Minus(L1.prediction, m0.layers[l].prediction) : L1.prediction;
    // Defined: --decode >= 1 and each decode step routes top-k experts in every MoE layer.
    if (predicts) r.layer_recall.push_back(lc.recall_if_defined().value());
    if (r.expert_load.size() < L1.expert_load.size()) r.expert_load.resize(L1.expert_load.size());
    for (std::size_t e = 0; e < L1.expert_load.size(); ++e) r.expert_load[e] += L1.expert_load[e];
    for (int e : L1.hot_experts)
      if (std::find(r.hot_experts.begin(), r.hot_experts.end(), e) == r.hot_experts.end()) r.hot_experts.push_back(e);
    r.layer_stall_s_per_token.push_back(
        static_cast<double>(L1.stall_ns - (l < m0.layers.size() ? m0.layers[l].stall_ns : 0)) / 1e9 / a.decode);
  }
  std::sort(r.hot_experts.begin(), r.hot_experts.end());
  r.schedule = Minus(m1.schedule, m0.schedule);
  for (int i = 0; i < kNumTiers; ++i) r.bytes_read[i] = s1.tiers[i].bytes_read - s0.tiers[i].bytes_read;
  // Whole run (prefill included), as the row has always reported them; "unused" is a gauge (still
  // resident and not used at the end), so it has no decode-only difference.
  r.speculative_bytes = m1.speculative_bytes;
  r.wasted_bytes = m1.speculative_wasted_bytes;
  r.unused_bytes = m1.speculative_unused_bytes;
  // The bounds at this hit rate: the misses' transfers (drive, then link) alone, and with the
  // compute added serially.
  r.miss_bytes_per_token = misses * static_cast<double>(run->regime.block_bytes) / a.decode;
  const double miss_s = r.miss_bytes_per_token / run->link.bandwidth_bytes_per_s +
                        r.miss_bytes_per_token / std::max(run->nvme_bytes_per_s, 1.0);
  r.io_bound_tokens_per_s = miss_s > 0 ? 1.0 / miss_s : 0;
  r.bound_tokens_per_s = 1.0 / (run->compute_s_per_token + miss_s);
  m.reset();  // the model and the offload use the store: gone before it closes
  off.reset();
  TERRACE_RETURN_IF_ERROR(bs.Close());
  return r;
}

// The mmap baselines: zero-copy reads of the checkpoint through the page cache, dropped first.
// `mmap-unbounded` keeps whatever the kernel reads (a cold start, not a budget); `mmap` at each
// budget holds the experts' page-cache bytes to the budget (LRU, evicted experts dropped).
Result<ConfigResult> RunMmapRow(Run* run, const std::string& name, double fraction, std::uint64_t budget_bytes) {
  const Args& a = run->a;
  const std::vector<std::filesystem::path> shards = Shards(a.model);
  run->progress.Phase(fmt::format("{}{} (dropping the checkpoint's pages from the page cache first)", name,
                                  budget_bytes > 0 ? fmt::format(" at {:g}%", fraction * 100) : ""));
  run->advised = AdviseDontNeed(shards) && run->advised;
  if (a.drop_caches) {
    const std::string why = DropSystemPageCache();
    run->drop_caches = why.empty() ? "done (echo 1 > /proc/sys/vm/drop_caches)" : "not done: " + why;
  }
  const Residency cold_before = MeasureResidency(shards);
  TERRACE_ASSIGN_OR_RETURN(auto md, model::ModelDir::Open(a.model));
  experts::MmapExpertOptions mo;
  mo.budget_bytes = budget_bytes;
  TERRACE_ASSIGN_OR_RETURN(auto p, experts::MmapExpertProvider::Open(*md, mo));
  experts::MmapExpertProvider* provider = p.get();
  TERRACE_ASSIGN_OR_RETURN(auto m, model::Model::Load(run->config, *md, std::shared_ptr<model::ExpertProvider>(std::move(p))));
  Residency at_decode;
  experts::MmapExpertStats st0;
  std::uint64_t io0 = 0;
  CpuMark cpu0;
  TERRACE_ASSIGN_OR_RETURN(const double t, TimedDecode(*m, run->prompt, a.decode, nullptr, [&] {
    at_decode = MeasureResidency(shards);
    st0 = provider->stats();
    io0 = ProcessReadBytes();
    cpu0 = CpuMark::Now();
  }, &run->progress));
  ConfigResult r;
  SetPerToken(t, cpu0, a.decode, &r);
  const std::uint64_t io1 = ProcessReadBytes();
  const Residency end = MeasureResidency(shards);
  const experts::MmapExpertStats st1 = provider->stats();
  r.name = name;
  r.budget_fraction = fraction;
  r.mmap_budget_bytes = budget_bytes;
  const double hits = static_cast<double>(st1.hits - st0.hits), loads = static_cast<double>(st1.loads - st0.loads);
  if (budget_bytes > 0) r.hit_rate = hits + loads > 0 ? hits / (hits + loads) : 0;
  // The drive's reads: this process's storage reads over the decode steps (/proc/self/io
  // read_bytes: page faults and the kernel's read-ahead for them); where that file is not
  // readable, the pages the decode brought into the page cache (mincore after minus before).
  r.bytes_read[static_cast<int>(TierId::kNvme)] =
      io0 != kNoIoCounters && io1 != kNoIoCounters
          ? io1 - io0
          : (end.resident_bytes > at_decode.resident_bytes ? end.resident_bytes - at_decode.resident_bytes : 0);
  r.mmap_cold_fraction_before = cold_before.fraction();
  r.mmap_cold_measured = cold_before.measured;
  r.mmap_fraction_at_decode = at_decode.fraction();
  auto resident = provider->ResidentExpertBytes();
  r.mmap_expert_bytes_after = resident.ok() ? *resident : 0;
  // Read-ahead that landed after the last sweep, then dropped: what the budget holds at rest.
  r.mmap_settled = provider->Settle();
  auto settled = provider->ResidentExpertBytes();
  r.mmap_expert_bytes_settled = settled.ok() ? *settled : 0;
  r.mmap_peak_charged_bytes = st1.peak_charged_bytes;
  r.mmap_evictions = st1.evictions - st0.evictions;
  r.mmap_overcommits = st1.overcommits;
  r.mmap_spill_dropped_bytes = st1.spill_dropped_bytes - st0.spill_dropped_bytes;
  r.mmap_drop_failures = st1.drop_failures;
  r.mmap_drop_s_per_token = static_cast<double>(st1.drop_ns - st0.drop_ns) / 1e9 / a.decode;
  // The same decode without the provider's own eviction work (on a RAM-limited machine the
  // kernel's reclaim does it on another thread): the stronger baseline, which the targets use.
  r.mmap_tokens_per_s_without_drops = a.decode / std::max(t - static_cast<double>(st1.drop_ns - st0.drop_ns) / 1e9, 1e-9);
  r.miss_bytes_per_token = static_cast<double>(r.nvme_bytes()) / a.decode;
  if (budget_bytes == 0) {
    run->before = cold_before;
    run->after = end;
  }
  return r;
}

}  // namespace terrace::cli::bench_experts
