// terrace demo: the real system end to end on embedded defaults (./terrace-data, no server, no GPU;
// docs/demo.md).
//
// It builds the k3-small model (random weights, the `model init` code path; kept in DIR/model for
// the next run), then plays a multi-turn chat workload through the reference model: one shared
// system prompt, several conversations, each turn's prompt = the conversation so far + new user
// tokens, greedy decoding. Every prefill goes through the prefix cache (DIR/kv and DIR/state, the
// same pools as `model run --store DIR`) and the routed experts are served by the expert offload
// (DIR/experts on NVMe, a fast-tier cache of --expert-cache with the lookahead predictor). Every
// turn is recomputed by a second, all-resident model with no store, and its generated ids and
// logits must be bitwise equal. The figures go to DIR/demo-run.json.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <array>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/demo_dir.h"
#include "src/cli/model_run_experts.h"
#include "src/cli/model_run_kv.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/json_text.h"
#include "src/common/json_unique.h"
#include "src/common/mutex.h"
#include "src/common/start_thread.h"
#include "src/model/model.h"
#include "src/model/ops.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "src/model/weights_init.h"
#include "src/plan/report.h"
#include "tiers/nvme/lock_holders.h"
#include "tiers/nvme/nvme_paths.h"

namespace terrace::cli {
namespace {

// A figure that may be undefined (a prefetch precision with nothing predicted): null in the JSON,
// "n/a" in the text, never 0.
nlohmann::json OrNull(std::optional<double> v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }
std::string PercentOrNa(std::optional<double> v) { return v ? FormatPercent(*v) : std::string("n/a"); }
// The number of a figure of the run's JSON, none where it is null (OrNull's undefined figure).
std::optional<double> Defined(const nlohmann::json& v) { return v.is_number() ? std::optional<double>(v.get<double>()) : std::nullopt; }
// `scale` x the figure `v` with `decimals` decimals, or "n/a" where it is null.
std::string FixedOrNa(const nlohmann::json& v, int decimals, double scale = 1) {
  const std::optional<double> x = Defined(v);
  return x ? fmt::format("{:.{}f}", scale * *x, decimals) : std::string("n/a");
}
// part / whole: a rate, share or mean over `whole`; none where whole is not > 0 (nothing to measure
// it over: a stall per decode step of a run without decode steps is undefined, not 0).
std::optional<double> Ratio(double part, double whole) {
  return whole > 0 ? std::optional<double>(part / whole) : std::nullopt;
}

using Clock = std::chrono::steady_clock;

struct DemoArgs {
  std::string dir = "terrace-data";
  unsigned conversations = 3;
  unsigned turns = 3;
  unsigned system_tokens = 128;
  unsigned user_tokens = 32;
  unsigned new_tokens = 8;
  std::uint64_t seed = 1;
  std::string expert_cache = "25%";
  std::uint64_t kv_nvme_bytes = 64ull << 20;
  std::uint64_t state_nvme_bytes = 128ull << 20;
  bool kv_nvme_given = false, state_nvme_given = false;  // on the command line: an existing pool must match
  bool fresh = false;
  bool json = false;
  std::string preset = "k3-small";
  std::string inject_fault;  // hidden, for tests: "state" perturbs a restored turn's state
  int threads = 1;  // OpenBLAS threads, as `model run`'s default: the same logits bit for bit
};

// The command that runs the demo again on the same data and model: "terrace demo" with --dir,
// --preset and --seed where `a` does not have their defaults, then `extra` ("--fresh", flags).
std::string RerunCommand(const DemoArgs& a, std::string_view extra = "") {
  const DemoArgs defaults;
  std::string cmd = "terrace demo";
  if (a.dir != defaults.dir) {
    // As a shell reads it: in double quotes unless every character is plain, and as --dir=DIR when
    // it starts with '-' (CLI11 would take it for a flag).
    const bool plain = !a.dir.empty() && std::all_of(a.dir.begin(), a.dir.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("/._-+,:@%").find(c) != std::string_view::npos;
    });
    std::string dir;
    if (plain) {
      dir = a.dir;
    } else {
      dir = "\"";
      for (char c : a.dir) {
        if (c == '"' || c == '\\' || c == '$' || c == '`') dir += '\\';
        dir += c;
      }
      dir += '"';
    }
    cmd += (!a.dir.empty() && a.dir.front() == '-' ? " --dir=" : " --dir ") + dir;
  }
  if (a.preset != defaults.preset) cmd += " --preset " + a.preset;
  if (a.seed != defaults.seed) cmd += fmt::format(" --seed {}", a.seed);
  if (!extra.empty()) cmd += fmt::format(" {}", extra);
  return cmd;
}

constexpr int kChunkTokens = 64;
constexpr std::size_t kTiers = kNumTiers;

// Progress lines (the steps, the turns, the ticker's "... N s") go to stderr, as every long
// command's do (docs/errors.md); stdout holds only the result: the summary, or the JSON object with
// --json.
void Progress(const std::string& line) {
  fmt::print(stderr, "{}\n", line);
  std::fflush(stderr);
}

// While it lives, prints "      ... <what>: N s" every `every` on a thread of its own, so that a
// long step with no progress of its own (building the model) still shows the demo is working.
// Where that thread cannot be started the step runs without the lines (they are only a sign of life).
class ProgressTicker {
 public:
  ProgressTicker(std::string what, std::chrono::seconds every) : what_(std::move(what)), every_(every) {
    if (auto t = StartThread("the demo's progress thread", [this] { Run(); }); t.ok()) thread_ = std::move(t).value();
  }
  ~ProgressTicker() {
    {
      MutexLock l(&mu_);
      done_ = true;
    }
    cv_.SignalAll();
    if (thread_.joinable()) thread_.join();
  }
  ProgressTicker(const ProgressTicker&) = delete;
  ProgressTicker& operator=(const ProgressTicker&) = delete;

 private:
  void Run() {
    const auto t0 = Clock::now();
    MutexLock l(&mu_);
    while (!done_) {
      if (cv_.WaitFor(&mu_, every_) || done_) continue;
      Progress(fmt::format("      ... {}: {:.0f} s{}", what_, SecondsSince(t0),
                           StopSignalReceived() != 0 ? " (stopping when this step is done; Ctrl-C again stops at once)"
                                                     : ""));
    }
  }
  const std::string what_;
  const std::chrono::seconds every_;
  Mutex mu_;
  CondVar cv_;
  bool done_ TERRACE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The demo's hold on its --dir for the whole run, from before it removes or builds anything (--fresh,
// a stopped model build in DIR/model.tmp) to its exit: an exclusive flock on the directory itself,
// taken as the NVMe tier takes the one on a store's data file (nvme::LockDataArea; its holder is
// named from /proc/locks the same way), so no file of its own is added to DIR. A second demo on the
// same DIR is refused at once; the stores' own locks cover the other commands that open them.
class DemoDirLock {
 public:
  DemoDirLock() = default;
  ~DemoDirLock() {
    if (fd_ >= 0) ::close(fd_);  // lets the lock go
  }
  DemoDirLock(const DemoDirLock&) = delete;
  DemoDirLock& operator=(const DemoDirLock&) = delete;

  // Creates `dir` when absent and locks it. Ok also when `dir` is not a real directory (a symlink, a
  // file): WhyNotDemoDir refuses it before anything is touched. Unavailable naming the holder's pid
  // when another process holds the lock; IoError when `dir` cannot be created or opened.
  Status Take(const std::filesystem::path& dir) {
    std::error_code ec;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0) {
      std::filesystem::create_directories(dir, ec);
      if (ec) return Status::IoError(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
      if (::lstat(dir.c_str(), &st) != 0) {
        return Status::IoError(fmt::format("--dir: cannot create {}: {}", dir.string(), std::strerror(errno)));
      }
    }
    if (!S_ISDIR(st.st_mode)) return Status::Ok();
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd_ < 0) return Status::IoError(fmt::format("--dir: cannot open {}: {}", dir.string(), std::strerror(errno)));
    const int err = nvme::LockDataArea(fd_, LOCK_EX, std::chrono::milliseconds(0));
    if (err == 0) return Status::Ok();
    if (err != EWOULDBLOCK) {
      return Status::IoError(fmt::format("--dir: cannot lock {}: {}", dir.string(), std::strerror(err)));
    }
    return Status::Unavailable(fmt::format(
        "--dir: {} is using this --dir directory (it holds the lock a 'terrace demo' run takes on {}); nothing in it "
        "was changed; wait for it to finish or give another --dir directory",
        nvme::FlockHolderText(fd_), dir.string()));
  }

 private:
  int fd_ = -1;
};

// A conversation's turns: the shared system prompt, then per turn `user_tokens` ids of its own.
std::vector<int> UserTokens(const DemoArgs& a, int vocab, unsigned conversation, unsigned turn) {
  std::mt19937_64 rng(a.seed * 1000003u + conversation * 1009u + turn + 1);
  std::vector<int> t(a.user_tokens);
  for (int& id : t) id = static_cast<int>(rng() % static_cast<std::uint64_t>(vocab));
  return t;
}
std::vector<int> SystemTokens(const DemoArgs& a, int vocab) {
  std::mt19937_64 rng(a.seed ^ 0x5157E3ull);
  std::vector<int> t(a.system_tokens);
  for (int& id : t) id = static_cast<int>(rng() % static_cast<std::uint64_t>(vocab));
  return t;
}

// The model in DIR/model: reused when its config is --preset's and its seed --seed's, written
// (seeded) when there is none.
Result<bool> EnsureModel(const std::filesystem::path& dir, const DemoArgs& a, const model::ModelConfig& config) {
  const std::string& preset = a.preset;
  const std::uint64_t seed = a.seed;
  const std::string fresh = RerunCommand(a, "--fresh");
  namespace fs = std::filesystem;
  const fs::path out = dir / kDemoModelDir;
  std::error_code ec;
  if (fs::exists(out / "config.json", ec)) {
    auto md = model::ModelDir::Open(out);
    if (!md.ok() || model::ToConfigJson((*md)->config()) != model::ToConfigJson(config)) {
      return Status::InvalidArgument(fmt::format(
          "--dir: {} holds a model that does not load as {} ({}); run '{}' to rebuild it", out.string(), preset,
          md.ok() ? "another config" : md.status().message(), fresh));
    }
    // The weights' seed, which `model init` records in the safetensors metadata ("terrace_seed"): a
    // model of another seed is not the one --seed asks for (its weights and so every logit differ).
    std::string built_seed;
    const std::vector<std::string> names = (*md)->Names();
    if (const model::SafetensorsFile* shard = names.empty() ? nullptr : (*md)->ShardOf(names.front())) {
      if (auto it = shard->metadata().find("terrace_seed"); it != shard->metadata().end()) built_seed = it->second;
    }
    if (built_seed == std::to_string(seed)) return true;
    if (built_seed.empty()) {
      return Status::InvalidArgument(fmt::format(
          "--seed: the model in {} does not record the seed it was built with; run '{}' to rebuild it with --seed {}",
          out.string(), fresh, seed));
    }
    return Status::InvalidArgument(fmt::format(
        "--seed: the model in {} was built with seed {}; run with --seed {} or '{}' (rebuilds it with --seed {})",
        out.string(), built_seed, built_seed, fresh, seed));
  }
  const fs::path tmp = dir / kDemoModelTmpDir;
  TERRACE_RETURN_IF_ERROR(RemoveStoppedModelBuild(dir));
  model::InitOptions o;
  o.seed = seed;
  {
    ProgressTicker ticker(fmt::format("building {} ({} of random weights)", preset,
                                      FormatBytes(static_cast<double>(model::WeightBytes(config)))),
                          std::chrono::seconds(5));
    TERRACE_RETURN_IF_ERROR(model::InitWeights(config, tmp, o).WithContext("building the demo model"));
  }
  fs::rename(tmp, out, ec);
  if (ec) return Status::IoError(fmt::format("cannot move {} to {}: {}", tmp.string(), out.string(), ec.message()));
  return false;
}

// The expert store DIR/experts (its NVMe tier the experts' home, sized to them) and the offload
// over it: as `model run --store DIR --expert-cache C` (model_run_experts.h) with a smaller file.
Result<ExpertRun> OpenDemoExperts(const DemoArgs& a, const std::filesystem::path& dir, const model::ModelConfig& config,
                                  const model::WeightSource& weights) {
  auto budget = experts::CacheBudget::Parse(a.expert_cache);
  if (!budget.ok()) return Status::InvalidArgument("--expert-cache: " + budget.status().message());
  const std::uint64_t total = experts::ExpertOffload::TotalExpertBytes(config);
  const std::filesystem::path nvme_dir = dir / "experts";
  std::error_code ec;
  std::filesystem::create_directories(nvme_dir, ec);
  if (ec) return Status::IoError(fmt::format("--dir: cannot create {}: {}", nvme_dir.string(), ec.message()));
  StoreOptions so = experts::ExpertOffload::OpenStoreOptions(total, budget->Resolve(total), nvme_dir.string());
  // Room for every block with its 4 KiB descriptor and alignment; an existing file keeps its size,
  // and a creation a stopped run left (terrace.data.creating) is completed with the size it began with.
  const auto interrupted = InterruptedCreationCapacity(nvme_dir);
  so.nvme.capacity_bytes = StoreDataExists(nvme_dir) ? 0
                           : interrupted.ok()         ? *interrupted
                                                      : ((total + total / 4 + (4ull << 20)) >> 20) << 20;
  auto store = Store::Open(so);
  if (!store.ok()) return store.status().WithContext("--dir: opening the expert store");
  ExpertRun run;
  run.store = std::move(store).value();
  experts::ExpertOffloadOptions opt;
  opt.home = TierId::kNvme;
  opt.budget = *budget;
  opt.policy = experts::CachePolicyKind::kUtility;
  opt.window = run.depth;
  auto off = experts::ExpertOffload::Create(config, weights, run.store.get(), std::move(opt));
  if (!off.ok())  // InvalidArgument: the budget (the other options are not the user's)
    return off.status().IsInvalidArgument() ? off.status().WithContext("--expert-cache " + a.expert_cache) : off.status();
  run.offload = std::move(off).value();
  run.predictor = experts::PredictorKind::kLookahead;
  return run;
}

struct TurnResult {
  unsigned conversation = 0, turn = 0;  // numbered from 1, as the text and `bench kv --json` number them
  std::vector<int> prompt;
  std::int64_t restored = 0, computed = 0;
  std::vector<int> generated, reference_generated;
  bool equal = false;
  double max_abs_diff = 0;
  std::string final_logits_xxh3;
  double ttft_s = 0, ttft_recompute_s = 0, decode_s = 0, forward_s = 0;
  std::array<std::uint64_t, kNumTiers> restore_bytes{};
  int fallbacks = 0;
  // This turn's share of the run's counters (deltas of ExpertMetrics and the stores' tier stats).
  std::uint64_t expert_hits = 0, expert_late_hits = 0, expert_misses = 0;
  double stall_prefill_s = 0, stall_decode_s = 0;  // forward time waiting for expert loads
  std::array<std::uint64_t, kNumTiers> prefix_hits{}, prefix_misses{};  // kv + state pools, per tier
};

// Tier hits and misses summed over the prefix pools.
std::array<std::array<std::uint64_t, kNumTiers>, 2> PrefixTierCounts(const Store& kv, const Store& state) {
  std::array<std::array<std::uint64_t, kNumTiers>, 2> c{};
  for (const Store* st : {&kv, &state}) {
    const StoreStats s = st->Stats();
    for (std::size_t t = 0; t < kTiers; ++t) {
      if (!s.present[t]) continue;
      c[0][t] += s.tiers[t].hits;
      c[1][t] += s.tiers[t].misses;
    }
  }
  return c;
}

// Differences between two logits arrays: bitwise equality and the largest |a - b|.
void Compare(std::span<const float> x, std::span<const float> y, bool* equal, double* max_abs) {
  if (x.size() != y.size()) {
    *equal = false;
    *max_abs = INFINITY;
    return;
  }
  if (std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) *equal = false;
  for (std::size_t i = 0; i < x.size(); ++i) *max_abs = std::max(*max_abs, static_cast<double>(std::fabs(x[i] - y[i])));
}

// part / whole of two counts (Ratio): none where whole is 0.
std::optional<double> Share(std::uint64_t part, std::uint64_t whole) {
  return Ratio(static_cast<double>(part), static_cast<double>(whole));
}

nlohmann::json TierRates(const Store& store) {
  nlohmann::json j = nlohmann::json::object();
  const StoreStats st = store.Stats();
  for (int t = 0; t < kNumTiers; ++t) {
    if (!st.present[static_cast<std::size_t>(t)]) continue;
    const auto& s = st.tiers[static_cast<std::size_t>(t)];
    j[kTierNames[t]] = {{"hit_rate", OrNull(Share(s.hits, s.hits + s.misses))},
                        {"hits", s.hits}, {"misses", s.misses},
                        {"bytes_read", s.bytes_read}, {"bytes_written", s.bytes_written}, {"blocks", s.blocks},
                        {"capacity_bytes", s.capacity_bytes}, {"evictions", s.evictions}, {"emulated", s.emulated}};
  }
  return j;
}

// The expert store's tiers (TierRates), with hits, misses and hit_rate counted by the expert
// offload rather than by the store, which sees none of them: the offload serves the cached experts
// from the HBM tier itself and loads the others with Store::Prefetch, whose reads the store's
// per-tier hit counters leave out. HBM ("counted_by": "expert_cache"): hits = the cache's hits,
// misses = every other expert acquire (late hits and misses), hit_rate = hits / all acquires
// (ExpertMetrics::hit_rate; null when there were none). A lower tier ("counted_by":
// "expert_loads"): hits = the expert loads read from it (ExpertMetrics::loads_from: the fastest
// tier holding the block when the load was issued), misses = the loads that looked past it (read
// from a slower tier), hit_rate = hits / (hits + misses), null when no load reached it; "loads" and
// "loaded_bytes" say the same in loads and bytes. The store's read-back of the blocks already
// stored when the offload was created (`at_start`: the store's stats then; a new store has none)
// is no expert load: it is counted apart, as "startup_check_reads" / "startup_check_bytes_read",
// and taken out of "bytes_read", which is then the tier's reads during the run.
nlohmann::json ExpertTierRates(const Store& store, const experts::ExpertMetrics& em, const StoreStats& at_start) {
  nlohmann::json j = TierRates(store);
  for (int t = 0; t < kNumTiers; ++t) {
    const auto i = static_cast<std::size_t>(t);
    if (!j.contains(kTierNames[t])) continue;
    nlohmann::json& v = j[kTierNames[t]];
    const TierStatsSnapshot& s0 = at_start.tiers[i];
    const std::uint64_t startup_reads = at_start.present[i] ? s0.hits : 0;
    const std::uint64_t startup_bytes = at_start.present[i] ? s0.bytes_read : 0;
    v["bytes_read"] = v["bytes_read"].get<std::uint64_t>() - std::min(startup_bytes, v["bytes_read"].get<std::uint64_t>());
    v["startup_check_reads"] = startup_reads;
    v["startup_check_bytes_read"] = startup_bytes;
    if (static_cast<TierId>(t) == TierId::kHbm) {
      const std::uint64_t acquires = em.hits + em.late_hits + em.misses;
      v["hits"] = em.hits;
      v["misses"] = em.late_hits + em.misses;
      v["hit_rate"] = OrNull(Share(em.hits, acquires));
      v["counted_by"] = "expert_cache";
      continue;
    }
    std::uint64_t slower = 0;
    for (std::size_t u = i + 1; u < em.loads_from.size(); ++u) slower += em.loads_from[u];
    v["hits"] = em.loads_from[i];
    v["misses"] = slower;
    v["hit_rate"] = OrNull(Share(em.loads_from[i], em.loads_from[i] + slower));
    v["loads"] = em.loads_from[i];
    v["loaded_bytes"] = em.loaded_bytes_from[i];
    v["counted_by"] = "expert_loads";
  }
  return j;
}

// A prefix pool whose NVMe file has no room left for one more block of its kind: its NVMe tier is
// its last (write-through, nothing below to demote to), so a write-back that does not fit there
// fails and the block is not cached (docs/demo.md, "When a pool is full").
struct FullPool {
  const char* pool;  // "kv" or "state"
  const char* flag;  // the flag that sizes it when it is created
  std::uint64_t capacity_bytes = 0, free_bytes = 0;
  std::uint64_t block_bytes = 0;  // the most one block of the pool takes in its NVMe file
};

// The prefix pools of `kv` whose NVMe tier has less free space than one more block of the pool may
// take (the layout's upper bound of its blocks, rounded up to 4 KiB, plus the 4 KiB descriptor).
std::vector<FullPool> FullPrefixPools(const KvRun& kv) {
  constexpr std::uint64_t kUnit = 4096;
  const kv::KvLayout& layout = kv.cache->layout();
  const struct {
    const char* pool;
    const char* flag;
    const Store* store;
    std::uint64_t block;
  } pools[] = {{"kv", "--kv-nvme-size", kv.kv_store.get(), layout.mla_chunk_block_bytes()},
               {"state", "--state-nvme-size", kv.state_store.get(), layout.state_block_bytes()}};
  std::vector<FullPool> full;
  for (const auto& p : pools) {
    const StoreStats st = p.store->Stats();
    if (!st.present[static_cast<std::size_t>(TierId::kNvme)]) continue;
    const TierStatsSnapshot& nvme = st.tiers[static_cast<std::size_t>(TierId::kNvme)];
    const std::uint64_t need = (p.block + kUnit - 1) / kUnit * kUnit + kUnit;
    const std::uint64_t free = nvme.capacity_bytes > nvme.allocated_bytes ? nvme.capacity_bytes - nvme.allocated_bytes : 0;
    if (free < need) full.push_back({p.pool, p.flag, nvme.capacity_bytes, free, need});
  }
  return full;
}

// The demo's summary: what the run measured, and its turns added up (AddUp).
struct DemoSummary {
  std::vector<TurnResult> results;
  kv::PrefixCacheStats kst;
  experts::ExpertMetrics em;
  nlohmann::json tiers;  // per pool: "kv", "state": TierRates; "experts": ExpertTierRates
  bool reused_model = false, second_run = false;
  std::uint64_t kv_blocks_before = 0, state_blocks_before = 0, expert_puts = 0;
  std::chrono::steady_clock::time_point t_start;  // the run's start (model, stores, turns)
  double turns_s = 0;                              // the chat turns alone
  // Added up over the turns.
  std::int64_t prompt_tokens = 0, restored = 0, generated = 0, computed = 0, decode_steps = 0;
  double forward_s = 0, decode_s = 0, ttft = 0, ttft_ref = 0, ttft_restored = 0, ttft_restored_ref = 0;
  double stall_prefill = 0, stall_decode = 0, nturns = 0;
  int restored_turns = 0;
  // Every turn's ids and logits equal to the recompute. A write-back that failed (a full pool) does
  // not clear it: the cache then stores less and later turns restore less, but what they restore
  // and compute is still checked (WriteBackNote reports the failures).
  bool verified = true;
  std::vector<FullPool> full_pools;  // FullPrefixPools after the run
  std::array<std::uint64_t, kNumTiers> restore_bytes{};
  std::uint64_t restore_all = 0;
};

// Adds up the turns of d->results into d's totals.
void AddUp(DemoSummary* d_out) {
  DemoSummary& d = *d_out;
  for (const TurnResult& r : d.results) {
    d.prompt_tokens += static_cast<std::int64_t>(r.prompt.size());
    d.restored += r.restored;
    d.generated += static_cast<std::int64_t>(r.generated.size());
    d.forward_s += r.forward_s;
    d.decode_s += r.decode_s;
    d.ttft += r.ttft_s;
    d.ttft_ref += r.ttft_recompute_s;
    if (r.restored > 0) {
      ++d.restored_turns;
      d.ttft_restored += r.ttft_s;
      d.ttft_restored_ref += r.ttft_recompute_s;
    }
    d.verified = d.verified && r.equal;
    d.stall_prefill += r.stall_prefill_s;
    d.stall_decode += r.stall_decode_s;
    d.computed += r.computed;
    d.decode_steps += r.generated.empty() ? 0 : static_cast<std::int64_t>(r.generated.size()) - 1;
    for (int t = 0; t < kNumTiers; ++t) d.restore_bytes[static_cast<std::size_t>(t)] += r.restore_bytes[static_cast<std::size_t>(t)];
  }
  d.nturns = static_cast<double>(d.results.size());
  d.restore_all = d.restore_bytes[0] + d.restore_bytes[1] + d.restore_bytes[2];
}

// The run as the object written to demo-run.json (and printed by --json; `terrace report` draws it).
nlohmann::json DemoRunJson(const DemoArgs& a, const std::filesystem::path& dir, const DemoSummary& d) {
  nlohmann::json j;
  j["verified"] = d.verified;
  j["model"] = {{"preset", a.preset}, {"seed", a.seed}, {"dir", (dir / kDemoModelDir).string()}, {"reused", d.reused_model}};
  j["reused_previous_run"] = d.second_run;
  j["blocks_from_earlier_runs"] = {{"kv", d.kv_blocks_before}, {"state", d.state_blocks_before}};
  j["workload"] = {{"conversations", a.conversations}, {"turns", a.turns}, {"system_tokens", a.system_tokens},
                   {"user_tokens", a.user_tokens}, {"new_tokens", a.new_tokens}, {"chunk_tokens", kChunkTokens},
                   {"kv_codec", "f32"}, {"state_codec", "f32"}, {"expert_cache", a.expert_cache},
                   {"predictor", "lookahead"}, {"expert_policy", "utility"}};
  for (const TurnResult& r : d.results) {
    nlohmann::json t;
    t["conversation"] = r.conversation;
    t["turn"] = r.turn;
    t["prompt"] = r.prompt;
    t["prompt_tokens"] = r.prompt.size();
    t["restored_tokens"] = r.restored;
    t["computed_tokens"] = r.computed;
    t["generated"] = r.generated;
    t["reference_generated"] = r.reference_generated;
    t["equal"] = r.equal;
    t["max_abs_diff"] = r.max_abs_diff;
    t["final_logits_xxh3_64"] = r.final_logits_xxh3;
    t["ttft_s"] = r.ttft_s;
    t["ttft_recompute_s"] = r.ttft_recompute_s;
    t["fallbacks"] = r.fallbacks;
    for (int tier = 0; tier < kNumTiers; ++tier) t["restore_bytes"][kTierNames[tier]] = r.restore_bytes[static_cast<std::size_t>(tier)];
    // This turn alone: hit rates (null where a tier had no lookups) and stalls per token.
    for (std::size_t tier = 0; tier < kTiers; ++tier) {
      const std::uint64_t looked = r.prefix_hits[tier] + r.prefix_misses[tier];
      t["prefix_hit_rate"][kTierNames[tier]] = OrNull(Share(r.prefix_hits[tier], looked));
    }
    const std::uint64_t acquires = r.expert_hits + r.expert_late_hits + r.expert_misses;
    const std::size_t steps = r.generated.empty() ? 0 : r.generated.size() - 1;
    t["experts"] = {{"hits", r.expert_hits}, {"late_hits", r.expert_late_hits}, {"misses", r.expert_misses},
                    {"hit_rate", OrNull(Share(r.expert_hits, acquires))},
                    {"stall_prefill_s", r.stall_prefill_s}, {"stall_decode_s", r.stall_decode_s},
                    {"stall_s_per_prefill_token", OrNull(Ratio(r.stall_prefill_s, static_cast<double>(r.computed)))},
                    {"stall_s_per_decode_token", OrNull(Ratio(r.stall_decode_s, static_cast<double>(steps)))}};
    j["turns"].push_back(t);
  }
  nlohmann::json& s = j["summary"];
  s["prompt_tokens"] = d.prompt_tokens;
  s["restored_tokens"] = d.restored;
  s["restored_share"] = OrNull(Share(static_cast<std::uint64_t>(d.restored), static_cast<std::uint64_t>(d.prompt_tokens)));
  s["generated_tokens"] = d.generated;
  s["tokens_per_s"] = OrNull(Ratio(static_cast<double>(d.prompt_tokens + d.generated), d.forward_s));
  // Decode steps (every generated token after a turn's first) per second of decoding: none without steps.
  const double steps = static_cast<double>(d.decode_steps);
  s["decode_tokens_per_s"] = OrNull(steps > 0 ? Ratio(steps, d.decode_s) : std::nullopt);
  s["ttft_mean_s"] = OrNull(Ratio(d.ttft, d.nturns));
  s["ttft_recompute_mean_s"] = OrNull(Ratio(d.ttft_ref, d.nturns));
  s["restored_turns"] = d.restored_turns;
  s["ttft_restored_turns_mean_s"] = OrNull(Ratio(d.ttft_restored, d.restored_turns));
  s["ttft_restored_turns_recompute_mean_s"] = OrNull(Ratio(d.ttft_restored_ref, d.restored_turns));
  for (int t = 0; t < kNumTiers; ++t)  // of the restored bytes: none where nothing was restored
    s["prefix_restore_share_by_tier"][kTierNames[t]] = OrNull(Share(d.restore_bytes[static_cast<std::size_t>(t)], d.restore_all));
  s["prefix_fallbacks"] = d.kst.fallbacks;
  s["prefix_write_failures"] = d.kst.write_failures;
  s["prefix_pools_full"] = nlohmann::json::array();
  for (const FullPool& f : d.full_pools)
    s["prefix_pools_full"].push_back({{"pool", f.pool}, {"flag", f.flag}, {"nvme_capacity_bytes", f.capacity_bytes},
                                      {"nvme_free_bytes", f.free_bytes}, {"block_bytes_max", f.block_bytes}});
  s["tiers"] = d.tiers;
  s["experts"] = {{"hit_rate", d.em.hit_rate}, {"hits", d.em.hits}, {"late_hits", d.em.late_hits}, {"misses", d.em.misses},
                  {"prefetch_precision", OrNull(d.em.prediction.precision_if_defined())},
                  {"prefetch_recall", OrNull(d.em.prediction.recall_if_defined())},
                  {"stall_s", static_cast<double>(d.em.stall_ns) * 1e-9},
                  {"stall_share", OrNull(Ratio(static_cast<double>(d.em.stall_ns) * 1e-9, d.forward_s))},
                  {"stall_s_per_prefill_token", OrNull(Ratio(d.stall_prefill, static_cast<double>(d.computed)))},
                  {"stall_s_per_decode_token", OrNull(Ratio(d.stall_decode, steps))},
                  {"demand_bytes", d.em.demand_bytes}, {"prefetched_bytes", d.em.speculative_bytes},
                  {"prefetched_wasted_bytes", d.em.speculative_wasted_bytes},
                  {"prefetched_unused_bytes", d.em.speculative_unused_bytes}, {"budget_bytes", d.em.budget_bytes},
                  {"total_expert_bytes", d.em.total_expert_bytes}, {"hot_factor", d.em.hot_factor}};
  // Per MoE layer: fast-tier hit rate, prefetch precision/recall, tokens routed to each expert, and the
  // experts whose load exceeds hot_factor x the layer mean (drawn by `terrace report`).
  s["experts"]["layers"] = nlohmann::json::array();
  for (const experts::LayerMetrics& l : d.em.layers) {
    s["experts"]["layers"].push_back({{"layer", l.layer}, {"hit_rate", l.hit_rate()},
                                      {"prefetch_precision", OrNull(l.prediction.precision_if_defined())},
                                      {"prefetch_recall", OrNull(l.prediction.recall_if_defined())},
                                      {"expert_load", l.expert_load},
                                      {"hot_experts", l.hot_experts}});
  }
  s["bytes_moved"] = {{"prefix_restored", d.restore_all}, {"prefix_written", d.kst.bytes_written},
                      {"experts_on_demand", d.em.demand_bytes}, {"experts_prefetched", d.em.speculative_bytes}};
  s["seconds"] = SecondsSince(d.t_start);
  s["turns_s"] = d.turns_s;
  s["forward_s"] = d.forward_s;
  s["verified_turns"] = d.results.size();

  return j;
}

// What the failed write-backs mean, as one line ("" when none failed): how many, which pool is full
// and how to make it larger (the flag with --fresh: a pool's size is fixed when it is created).
std::string WriteBackNote(const DemoArgs& a, const DemoSummary& d) {
  if (d.kst.write_failures == 0) return "";
  std::string note = fmt::format("{} prefix-cache write-back(s) failed, so those blocks are not cached and later turns "
                                 "restore less (the outputs are still checked); ",
                                 d.kst.write_failures);
  if (d.full_pools.empty()) return note + "no pool is full: the warnings above say why they failed";
  const DemoArgs defaults;
  std::vector<std::string> pools, flags, larger;
  for (const FullPool& f : d.full_pools) {
    pools.push_back(fmt::format("the {} pool's NVMe file is full ({} free of {}; a block takes up to {})", f.pool,
                                FormatBytes(static_cast<double>(f.free_bytes)), FormatBytes(static_cast<double>(f.capacity_bytes)),
                                FormatBytes(static_cast<double>(f.block_bytes))));
    const std::uint64_t def = std::string_view(f.pool) == "kv" ? defaults.kv_nvme_bytes : defaults.state_nvme_bytes;
    flags.push_back(fmt::format("{} SIZE", f.flag));
    larger.push_back(fmt::format("{} above {} (its default is {}MiB)", f.flag, FormatBytes(static_cast<double>(f.capacity_bytes)),
                                 def >> 20));
  }
  return note + fmt::format("{}; a pool's size is fixed when it is created, so run '{}' with {}", fmt::join(pools, "; "),
                            RerunCommand(a, fmt::format("--fresh {}", fmt::join(flags, " "))), fmt::join(larger, " and "));
}

// The summary as text (stdout): the totals, each pool's hit rates, the experts, what was verified,
// and where the figures and the report are.
void PrintDemoSummary(const DemoArgs& a, const DemoSummary& d, const nlohmann::json& j,
                      const std::filesystem::path& json_path, const std::filesystem::path& report_path) {
  const nlohmann::json& s = j.at("summary");
  // The blank line parts the summary from the progress lines (stderr) on a terminal; stdout
  // itself starts with the summary.
  std::fputc('\n', stderr);
  std::fflush(stderr);
  fmt::print("[4/4] summary ({} turns in {:.1f} s; the whole run took {:.1f} s)\n", d.results.size(), d.turns_s,
             SecondsSince(d.t_start));
  if (d.second_run) {
    std::vector<std::string> reused;
    if (d.reused_model) reused.push_back("the model");
    if (d.expert_puts == 0) reused.push_back("the experts");
    reused.push_back(fmt::format("{} KV + {} state blocks", d.kv_blocks_before, d.state_blocks_before));
    fmt::print("  reused the last run's data: {} found in {}; turn 1 restored {} of {} prompt tokens\n",
               fmt::join(reused, ", "), a.dir, d.results.empty() ? 0 : d.results.front().restored,
               d.results.empty() ? 0 : d.results.front().prompt.size());
  }
  fmt::print("  throughput:      {} tokens/s ({} prompt + {} generated tokens; decode {} tokens/s)\n",
             FixedOrNa(s["tokens_per_s"], 1), d.prompt_tokens, d.generated, FixedOrNa(s["decode_tokens_per_s"], 1));
  fmt::print("  first token:     {} s with restore, {} s by full recompute (mean of {} turns; of the {} turns "
             "that restored: {} s vs {} s)\n",
             FixedOrNa(s["ttft_mean_s"], 3), FixedOrNa(s["ttft_recompute_mean_s"], 3), d.results.size(), d.restored_turns,
             FixedOrNa(s["ttft_restored_turns_mean_s"], 3), FixedOrNa(s["ttft_restored_turns_recompute_mean_s"], 3));
  const nlohmann::json& kv_hbm = s["tiers"]["kv"].value("hbm", nlohmann::json::object());
  const char* hbm_name = kv_hbm.value("emulated", false) ? "hbm (emulated in host memory: no GPU)" : "hbm";
  fmt::print("  prefix cache:    {} of prompt tokens restored ({} of {}); restored bytes came {} from {}, {} from "
             "host, {} from nvme; {} fallback(s)\n",
             PercentOrNa(Defined(s["restored_share"])), d.restored, d.prompt_tokens,
             PercentOrNa(Defined(s["prefix_restore_share_by_tier"]["hbm"])), hbm_name,
             PercentOrNa(Defined(s["prefix_restore_share_by_tier"]["host"])),
             PercentOrNa(Defined(s["prefix_restore_share_by_tier"]["nvme"])), d.kst.fallbacks);
  for (const char* pool : {"kv", "state"}) {
    std::vector<std::string> parts;
    for (const auto& [tier, v] : s["tiers"][pool].items()) {
      parts.push_back(fmt::format("{} {}", tier,
                                  v["hit_rate"].is_null() ? std::string("n/a (no reads)") : FormatPercent(v["hit_rate"].get<double>())));
    }
    fmt::print("  {:<7} store:   hit rate per tier (hits / lookups): {}\n", pool, fmt::join(parts, ", "));
  }
  {
    // The expert store: HBM counted by the expert cache (hits / acquires), the lower tiers by the
    // expert loads (read from this tier / loads that reached it); start-up check reads apart.
    std::vector<std::string> parts, loads, startup;
    for (const auto& [tier, v] : s["tiers"]["experts"].items()) {
      const bool cache = v.value("counted_by", "") == "expert_cache";
      parts.push_back(fmt::format("{} {}{}", tier,
                                  v["hit_rate"].is_null() ? std::string(cache ? "n/a (no acquires)" : "n/a (no loads)")
                                                          : FormatPercent(v["hit_rate"].get<double>()),
                                  cache ? " (expert cache: hits / acquires)" : ""));
      if (!cache) loads.push_back(fmt::format("{} from {}", v.value("loads", std::uint64_t{0}), tier));
      if (v.value("startup_check_reads", std::uint64_t{0}) > 0)
        startup.push_back(fmt::format("{} blocks ({}) from {}", v["startup_check_reads"].get<std::uint64_t>(),
                                      FormatBytes(static_cast<double>(v["startup_check_bytes_read"].get<std::uint64_t>())), tier));
    }
    fmt::print("  experts store:   hit rate per tier: {} (expert loads: read from the tier / loads reaching it; {}){}\n",
               fmt::join(parts, ", "), fmt::join(loads, ", "),
               startup.empty() ? std::string()
                               : fmt::format("; start-up check of the stored experts read {} (not loads)", fmt::join(startup, ", ")));
  }
  fmt::print("  experts:         fast-tier hit rate {} ({} hits, {} late, {} misses); prefetch precision {}, recall "
             "{}; stalls {} of forward time ({} ms per computed prompt token, {} ms per decode step)\n",
             FormatPercent(d.em.hit_rate), d.em.hits, d.em.late_hits, d.em.misses, PercentOrNa(d.em.prediction.precision_if_defined()),
             PercentOrNa(d.em.prediction.recall_if_defined()), PercentOrNa(Defined(s["experts"]["stall_share"])),
             FixedOrNa(s["experts"]["stall_s_per_prefill_token"], 2, 1e3),
             FixedOrNa(s["experts"]["stall_s_per_decode_token"], 2, 1e3));
  fmt::print("  bytes moved:     prefix restored {}, prefix written {}, experts loaded on demand {}, prefetched {}\n",
             FormatBytes(static_cast<double>(d.restore_all)), FormatBytes(static_cast<double>(d.kst.bytes_written)),
             FormatBytes(static_cast<double>(d.em.demand_bytes)), FormatBytes(static_cast<double>(d.em.speculative_bytes)));
  if (const std::string note = WriteBackNote(a, d); !note.empty()) fmt::print("  write-backs:     {}\n", note);
  if (d.verified) {
    fmt::print("  verified:        all {} turns: generated ids and every logit (prefill and decode) bitwise equal to a "
               "full recompute with all experts resident and no store\n",
               d.results.size());
  } else {
    fmt::print("  NOT verified:    {} of {} turns differ from the full recompute (see 'equal' in the JSON)\n",
               std::count_if(d.results.begin(), d.results.end(), [](const TurnResult& r) { return !r.equal; }),
               d.results.size());
  }
  fmt::print("\nfigures: {}\nreport:  {} (charts; open it in a browser)\nrun '{}' again to reuse this data (restored "
             "from NVMe); '--fresh' starts over\n",
             json_path.string(), report_path.string(), RerunCommand(a));
}

// One turn of conversation `c`: its new user tokens appended to *prompt, the prompt run through the
// system (prefix-cache restore, expert offload) and through the oracle (all experts resident, no
// store, the whole prompt computed in the same pieces), compared, its line printed; the generated
// tokens are appended to *prompt for the next turn. --inject-fault state perturbs the first
// restored recurrent state (*fault_done: already done), so the comparison must fail.
Result<TurnResult> PlayTurn(const DemoArgs& a, const model::ModelConfig& config, KvRun& kv, ExpertRun& ex,
                            const model::Model& model, const model::Model& reference, unsigned c, unsigned t,
                            std::vector<int>* prompt_io, bool* fault_done) {
  kv::PrefixCache& cache = *kv.cache;
  TurnResult r;
  r.conversation = c + 1;
  r.turn = t + 1;
  std::vector<int>& prompt = *prompt_io;
  const std::vector<int> user = UserTokens(a, config.vocab_size, c, t);
  prompt.insert(prompt.end(), user.begin(), user.end());
  r.prompt = prompt;

  // The system: prefix-cache restore + expert offload.
  model::Session session(model);
  model::ForwardOptions hooks;
  ex.offload->AttachHooks(&hooks);
  session.set_hooks(hooks);
  const experts::ExpertMetrics em0 = ex.offload->Metrics();
  const auto tiers0 = PrefixTierCounts(*kv.kv_store, *kv.state_store);
  auto t_turn = Clock::now();
  const auto request = cache.Prepare(prompt, "");
  auto p = kv::PrefillWithCache(&session, cache, request);
  if (!p.ok()) return p.status();
  r.ttft_s = SecondsSince(t_turn);
  r.restored = p->restored_tokens;
  r.computed = p->computed_tokens;
  r.restore_bytes = p->restore.bytes_read;
  r.fallbacks = p->restore.fallbacks;
  const std::uint64_t stall_after_prefill = ex.offload->Metrics().stall_ns;
  if (a.inject_fault == "state" && r.restored > 0 && !*fault_done) {
    for (int l = 0; l < session.state().num_layers(); ++l) {
      auto& ls = session.state().layer(l);
      if (!ls.is_mla && !ls.recurrent.empty()) {
        ls.recurrent[0] += 1.0f;
        *fault_done = true;
        break;
      }
    }
  }
  std::vector<std::vector<float>> step_logits;
  auto t_dec = Clock::now();
  for (unsigned i = 0; i < a.new_tokens; ++i) {
    r.generated.push_back(model::Argmax(session.last_logits()));
    if (i + 1 < a.new_tokens) {
      auto l = session.Decode(r.generated.back());
      if (!l.ok()) return l.status();
      step_logits.push_back(*l);
    }
  }
  r.decode_s = SecondsSince(t_dec);
  r.forward_s = r.ttft_s + r.decode_s;
  {
    const experts::ExpertMetrics em1 = ex.offload->Metrics();
    const auto tiers1 = PrefixTierCounts(*kv.kv_store, *kv.state_store);
    r.expert_hits = em1.hits - em0.hits;
    r.expert_late_hits = em1.late_hits - em0.late_hits;
    r.expert_misses = em1.misses - em0.misses;
    r.stall_prefill_s = static_cast<double>(stall_after_prefill - em0.stall_ns) * 1e-9;
    r.stall_decode_s = static_cast<double>(em1.stall_ns - stall_after_prefill) * 1e-9;
    for (std::size_t tier = 0; tier < kTiers; ++tier) {
      r.prefix_hits[tier] = tiers1[0][tier] - tiers0[0][tier];
      r.prefix_misses[tier] = tiers1[1][tier] - tiers0[1][tier];
    }
  }
  const auto& last = session.last_logits();
  r.final_logits_xxh3 = fmt::format("{:016x}", XXH3_64bits(last.data(), last.size() * sizeof(float)));

  // The oracle: all experts resident, no store, the whole prompt computed in the same pieces.
  model::Session ref(reference);
  std::vector<float> ref_prefill;
  auto t_ref = Clock::now();
  const auto n = static_cast<std::int64_t>(prompt.size());
  for (std::int64_t pos = 0; pos < n;) {
    const std::int64_t end = std::min(n, (pos / kChunkTokens + 1) * kChunkTokens);
    auto piece = ref.Prefill(std::span(prompt).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(end - pos)));
    if (!piece.ok()) return piece.status();
    if (end > r.restored) {
      const std::int64_t from = std::max<std::int64_t>(pos, r.restored) - pos;
      ref_prefill.insert(ref_prefill.end(), piece->data.begin() + from * config.vocab_size, piece->data.end());
    }
    pos = end;
  }
  r.ttft_recompute_s = SecondsSince(t_ref);
  r.equal = true;
  Compare(p->logits.data, ref_prefill, &r.equal, &r.max_abs_diff);
  for (unsigned i = 0; i < a.new_tokens; ++i) {
    r.reference_generated.push_back(model::Argmax(ref.last_logits()));
    if (i + 1 < a.new_tokens) {
      auto l = ref.Decode(r.reference_generated.back());
      if (!l.ok()) return l.status();
      Compare(*l, step_logits[i], &r.equal, &r.max_abs_diff);
    }
  }
  r.equal = r.equal && r.generated == r.reference_generated;
  std::string from;
  if (r.restored > 0) {
    std::vector<std::string> parts;
    const std::uint64_t all = r.restore_bytes[0] + r.restore_bytes[1] + r.restore_bytes[2];
    for (int tier = 0; tier < kNumTiers; ++tier)
      if (r.restore_bytes[static_cast<std::size_t>(tier)] > 0)
        parts.push_back(fmt::format("{} {}", PercentOrNa(Share(r.restore_bytes[static_cast<std::size_t>(tier)], all)), kTierNames[tier]));
    from = fmt::format(" ({})", fmt::join(parts, ", "));
  }
  Progress(fmt::format("      conversation {} turn {}: prompt {:4} tokens, restored {:4}{}, computed {:4}; first "
                       "token {:.3f} s (recompute {:.3f} s); {} tokens generated; {}",
                       r.conversation, r.turn, prompt.size(), r.restored, from, r.computed, r.ttft_s, r.ttft_recompute_s,
                       r.generated.size(),
                       r.equal ? "ids and logits equal the recompute"
                               : fmt::format("DIFFERS from the recompute (max |diff| {:.3g})", r.max_abs_diff)));
  prompt.insert(prompt.end(), r.generated.begin(), r.generated.end());
  return r;
}

// The prefix cache's pools: in --dir, sized by --kv-nvme-size / --state-nvme-size.
KvRunArgs DemoKvArgs(const DemoArgs& a) {
  KvRunArgs kv_args;
  kv_args.store = a.dir;
  kv_args.kv_codec = "f32";
  kv_args.state_codec = "f32";
  kv_args.chunk_tokens = kChunkTokens;
  kv_args.snapshot_every = 1;
  kv_args.kv_nvme_bytes = a.kv_nvme_bytes;
  kv_args.state_nvme_bytes = a.state_nvme_bytes;
  kv_args.kv_nvme_given = a.kv_nvme_given;
  kv_args.state_nvme_given = a.state_nvme_given;
  kv_args.kv_nvme_flag = "--kv-nvme-size";
  kv_args.dir_flag = "--dir";
  kv_args.start_over = fmt::format("run '{}'", RerunCommand(a, "--fresh"));
  kv_args.hbm_bytes = 1ull << 20;
  kv_args.host_bytes = 2ull << 20;
  kv_args.state_host_bytes = 4ull << 20;
  return kv_args;
}

int RunDemo(const DemoArgs& a) {
  namespace fs = std::filesystem;
  if (!a.inject_fault.empty() && a.inject_fault != "state")
    return FailUsage(fmt::format("--inject-fault: '{}' is not 'state'", a.inject_fault));
  if (a.preset != "k3-small" && a.preset != "k3-toy")
    return FailUsage(fmt::format("--preset: '{}' is not k3-small or k3-toy", a.preset));
  model::ops::SetBlasThreads(a.threads);
  auto budget = experts::CacheBudget::Parse(a.expert_cache);
  if (!budget.ok()) return FailUsage("--expert-cache: " + budget.status().message());
  // A budget under one expert block is refused now, not after the model and the stores were built.
  if (Status s = CheckExpertBudget(*budget, a.expert_cache, *model::Preset(a.preset)); !s.ok())
    return FailUsage(s.message());
  if (Status s = CheckStoreDirArg(a.dir, "--dir"); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckKvPoolSizes(DemoKvArgs(a)); !s.ok()) return FailUsage(s.message());
  // Ctrl-C: the demo stops after the step it is in (building the model, opening the stores, a turn),
  // lets the stores finish what they were handed and exits 128 + the signal number; what it built
  // stays for the next run.
  StopSignals stop_signals;
  auto stopped = [&](const std::string& after) {
    return ExitStopped("terrace demo", fmt::format(" {}; what is in {} is kept for the next run (no {} or {} was "
                                                   "written)", after, a.dir, kDemoRunJson, kDemoReportHtml));
  };
  // DIR is the demo's alone from here to the exit: another demo's model build or --fresh removal
  // never meets this one's files half made.
  DemoDirLock dir_lock;
  if (Status s = dir_lock.Take(a.dir); !s.ok())
    return s.code() == Code::kUnavailable ? FailUsage(s.message()) : Fail(s.message());
  if (a.fresh) {
    auto removed = RemoveDemoDir(a.dir, "--dir");
    if (!removed.ok())
      return removed.status().IsIoError() ? Fail(removed.status().message()) : FailUsage(removed.status().message());
    if (*removed) Progress(fmt::format("terrace demo: --fresh removed the demo's data in {}", a.dir));
  }
  if (std::string why = WhyNotDemoDir(a.dir, "--dir"); !why.empty())
    return FailUsage(why + "; give a new or empty --dir for the demo");
  const auto t_start = Clock::now();
  const fs::path dir(a.dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", a.dir, ec.message()));
  // The demo's marker in DIR or in one of its stores, unless it is there already.
  const auto mark = [&](const fs::path& where) {
    if (IsKind(where / kDemoMarker, S_IFREG)) return Status::Ok();
    const Status s = WriteMarker(where, kDemoMarker, "terrace demo");
    return s.ok() ? s
                  : Status::IoError(fmt::format("--dir {}: {}; the demo writes its data there: give a --dir you can "
                                                "write to",
                                                a.dir, s.message()));
  };
  if (Status s = mark(dir); !s.ok()) return Fail(s.message());
  const model::ModelConfig config = *model::Preset(a.preset);
  const fs::path shown = fs::absolute(dir, ec);
  Progress(fmt::format("terrace demo: data in {}", (ec ? dir : shown).lexically_normal().string()));

  // 1. The model.
  auto t0 = Clock::now();
  Progress(fmt::format("[1/4] model: {} ({} layers, {} routed experts per MoE layer, top-{}) ...", a.preset,
                       config.num_hidden_layers, config.num_experts, config.num_experts_per_token));
  auto reused_model = EnsureModel(dir, a, config);
  if (!reused_model.ok())
    return reused_model.status().IsInvalidArgument() ? FailUsage(reused_model.status().message())
                                                     : Fail(reused_model.status().ToString());
  if (StopSignalReceived() != 0) return stopped("after step 1, the model");
  auto md = model::ModelDir::Open(dir / kDemoModelDir);
  if (!md.ok()) return Fail(md.status().ToString());
  Progress(fmt::format("      {} {} in {:.1f} s ({}, random weights, seed {})",
                       *reused_model ? "reused the model from the last run" : "built the model",
                       (dir / kDemoModelDir).string(), SecondsSince(t0), FormatBytes(static_cast<double>(model::WeightBytes(config))),
                       a.seed));

  // 2. The stores: prefix cache pools and the expert store, all on NVMe files under DIR.
  t0 = Clock::now();
  // A store gets the demo's marker once open: a new one, and one a stopped run left unmarked (it was
  // created between the store's creation and its marker; WhyNotDemoDir accepted it as the demo's).
  for (std::size_t i = 0; i < 3; ++i) {
    if (auto r = RemoveUnfinishedDemoStore(dir / kDemoStores[i], "--dir"); !r.ok()) return Fail(r.status().ToString());
  }
  auto kv = OpenKvRun(DemoKvArgs(a), config, **md);
  if (!kv.ok()) return kv.status().IsInvalidArgument() ? FailUsage(kv.status().message()) : Fail(kv.status().ToString());
  for (std::size_t i = 0; i < 2; ++i) {
    if (Status s = mark(dir / kDemoStores[i]); !s.ok()) return Fail(s.message());
  }
  Progress(fmt::format("[2/4] stores: prefix cache in {0}/kv and {0}/state; putting {1} routed experts ({2}) into the "
                       "expert store on NVMe ({0}/experts; an identical block already there is kept) ...",
                       a.dir,
                       static_cast<std::int64_t>(config.num_experts) *
                           (config.num_hidden_layers - config.first_k_dense_replace),
                       FormatBytes(static_cast<double>(experts::ExpertOffload::TotalExpertBytes(config)))));
  auto ex = [&] {
    ProgressTicker ticker("putting the experts into the expert store", std::chrono::seconds(5));
    return OpenDemoExperts(a, dir, config, **md);
  }();
  if (!ex.ok()) return ex.status().IsInvalidArgument() ? FailUsage(ex.status().message()) : Fail(ex.status().ToString());
  if (Status s = mark(dir / kDemoStores[2]); !s.ok()) return Fail(s.message());
  const std::uint64_t kv_blocks_before = kv->kv_store->Stats().blocks, state_blocks_before = kv->state_store->Stats().blocks;
  // The expert store after its start-up (puts of a new store, or the read-back of the blocks already
  // there): ExpertTierRates keeps those reads apart from the expert loads.
  const StoreStats expert_store_at_start = ex->store->Stats();
  const std::uint64_t expert_puts = expert_store_at_start.tiers[static_cast<std::size_t>(TierId::kNvme)].puts;
  Progress(fmt::format("      stores open in {:.1f} s: {} KV chunk and {} KDA state blocks from earlier runs; {} expert "
                       "blocks written ({}); expert cache {} of the experts ({}) in emulated HBM, lookahead predictor",
                       SecondsSince(t0), kv_blocks_before, state_blocks_before, expert_puts,
                       expert_puts == 0 ? "all were on NVMe from an earlier run" : "a new expert store",
                       a.expert_cache,
                       FormatBytes(static_cast<double>(ex->offload->budget_bytes())) +
                           (ex->offload->budget_bytes() >= ex->offload->Metrics().total_expert_bytes ? ", all of them" : "")));

  auto flush_stores = [&] {
    kv->cache->Flush();
    for (Store* st : {kv->kv_store.get(), kv->state_store.get(), ex->store.get()}) (void)st->Flush();
    ex->offload->Quiesce();
  };
  if (StopSignalReceived() != 0) {
    flush_stores();
    return stopped("after step 2, the stores");
  }
  auto model = model::Model::Load(config, **md, ex->offload);
  if (!model.ok()) return Fail(model.status().ToString());
  auto reference = model::Model::Load(config, **md);  // all experts resident, no store
  if (!reference.ok()) return Fail(reference.status().ToString());
  ex->offload->SetPredictor(experts::MakeLookaheadPredictor(**model, {.depth = ex->depth, .min_confidence = 0.5}));
  kv::PrefixCache& cache = *kv->cache;

  // 3. The chat workload, turn by turn, round-robin over the conversations.
  const std::vector<int> system = SystemTokens(a, config.vocab_size);
  std::vector<std::vector<int>> history(a.conversations, system);
  std::vector<TurnResult> results;
  Progress(fmt::format("[3/4] chat: {} conversations x {} turns (system prompt {} tokens, {} user tokens and {} "
                       "generated per turn), each turn checked against a full recompute ...",
                       a.conversations, a.turns, a.system_tokens, a.user_tokens, a.new_tokens));
  bool fault_done = false;
  const auto turns_start = Clock::now();
  for (unsigned t = 0; t < a.turns; ++t) {
    for (unsigned c = 0; c < a.conversations; ++c) {
      if (StopSignalReceived() != 0) break;
      auto r = PlayTurn(a, config, *kv, *ex, **model, **reference, c, t, &history[c], &fault_done);
      if (!r.ok()) return Fail(r.status().ToString());
      results.push_back(std::move(r).value());
    }
  }
  if (StopSignalReceived() != 0) {
    flush_stores();
    return stopped(fmt::format("in step 3 after {} of {} turns", results.size(), a.turns * a.conversations));
  }
  const double turns_s = SecondsSince(turns_start);
  cache.Flush();
  for (Store* st : {kv->kv_store.get(), kv->state_store.get(), ex->store.get()})
    if (Status s = st->Flush(); !s.ok()) return Fail(s.ToString());
  ex->offload->Quiesce();
  if (StopSignalReceived() != 0) return stopped(fmt::format("after all {} turns, before step 4", results.size()));

  // 4. The summary.
  DemoSummary d;
  d.results = std::move(results);
  d.kst = cache.Stats();
  d.em = ex->offload->Metrics();
  d.full_pools = FullPrefixPools(*kv);
  d.tiers = {{"kv", TierRates(*kv->kv_store)}, {"state", TierRates(*kv->state_store)},
             {"experts", ExpertTierRates(*ex->store, d.em, expert_store_at_start)}};
  d.reused_model = *reused_model;
  // Reused is what this run found and used, not that an earlier run left its summary (a --fresh
  // stopped after removing the stores leaves demo-run.json).
  d.second_run = d.reused_model || expert_puts == 0 || kv_blocks_before > 0 || state_blocks_before > 0;
  d.kv_blocks_before = kv_blocks_before;
  d.state_blocks_before = state_blocks_before;
  d.expert_puts = expert_puts;
  d.t_start = t_start;
  d.turns_s = turns_s;
  AddUp(&d);
  const nlohmann::json j = DemoRunJson(a, dir, d);
  const fs::path json_path = dir / kDemoRunJson;
  auto write = [](const fs::path& path, std::string_view content) {  // the exit status
    const Status st = WriteDemoFile(path, content);
    return st.ok() ? 0 : st.IsInvalidArgument() ? FailUsage(st.message()) : Fail(st.ToString());
  };
  const fs::path report_path = dir / kDemoReportHtml;
  auto report = plan::RenderReport(JsonText(j), json_path.string());
  if (!report.ok()) return Fail(report.status().ToString());
  // The last point a Ctrl-C stops the demo: from here on both files are written, and a signal that
  // arrives while they are is reported after them (the files are complete).
  if (StopSignalReceived() != 0) return stopped(fmt::format("after all {} turns, before writing", d.results.size()));
  if (int rc = write(json_path, JsonTextWithMark(j, 1) + "\n"); rc != 0) return rc;
  if (int rc = write(report_path, report->html); rc != 0) return rc;
  if (StopSignalReceived() != 0) {
    return ExitStopped("terrace demo", fmt::format(" after writing {} and {} (both complete)", json_path.string(),
                                                   report_path.string()));
  }
  if (a.json) {
    if (const std::string note = WriteBackNote(a, d); !note.empty()) Progress("terrace demo: " + note);
    fmt::print("{}\n", JsonTextWithMark(j));
    return d.verified ? 0 : Fail("the demo's outputs differ from the full recompute; see the turns in " + json_path.string());
  }

  PrintDemoSummary(a, d, j, json_path, report_path);
  return d.verified ? 0 : Fail("the demo's outputs differ from the full recompute; see the turns in " + json_path.string());
}

}  // namespace

void RegisterDemo(CLI::App& app, Runner* run) {
  auto a = std::make_shared<DemoArgs>();
  auto* demo = app.add_subcommand(
      "demo", "Run a multi-turn chat on the k3-small model with prefix-cache restore and expert offload, check it "
              "against a full recompute, and summarise");
  demo->add_option("--dir", a->dir, "Data directory (created if missing; reused by the next run)")->capture_default_str()->transform(NormalizedPath());
  AddIntOption(demo, "--conversations", &a->conversations, 1u, 64u, "Conversations sharing the system prompt");
  AddIntOption(demo, "--turns", &a->turns, 1u, 32u, "Turns per conversation");
  AddIntOption(demo, "--system-tokens", &a->system_tokens, 1u, 4096u, "Tokens of the shared system prompt");
  AddIntOption(demo, "--user-tokens", &a->user_tokens, 1u, 1024u, "New user tokens per turn");
  AddIntOption(demo, "--new-tokens", &a->new_tokens, 1u, 256u, "Tokens generated per turn");
  AddIntOption<std::uint64_t>(demo, "--seed", &a->seed, 0, UINT64_MAX, "Seed of the model weights and the prompts");
  AddIntOption(demo, "--threads", &a->threads, 1, 256,
               "OpenBLAS threads. Logits are bitwise reproducible for a given count (the default is `model run`'s, so "
               "`model run --store NEW --chunk-tokens 64 --kv-codec f32 --state-codec f32` matches a turn bit for "
               "bit); another count may change their last bits");
  demo->add_option("--expert-cache", a->expert_cache,
                   "Fast-tier expert cache: a share of all routed expert bytes (25%) or a size (16MiB)")
      ->capture_default_str();
  AddSizeOption(demo, "--kv-nvme-size", &a->kv_nvme_bytes,
                "NVMe capacity of the KV pool when it is created (an existing pool of another size is refused)",
                1 << 20)
      ->each([a](const std::string&) { a->kv_nvme_given = true; });
  AddSizeOption(demo, "--state-nvme-size", &a->state_nvme_bytes,
                "NVMe capacity of the KDA state pool when it is created (an existing pool of another size is refused)",
                1 << 20)
      ->each([a](const std::string&) { a->state_nvme_given = true; });
  demo->add_option("--preset", a->preset, "The model: k3-small (the demo) or k3-toy (a smaller one, for quick checks)")
      ->capture_default_str();
  demo->add_flag("--json", a->json, "Print the run's figures as one JSON object instead of the summary");
  demo->add_flag("--fresh", a->fresh,
                 "Delete the demo's data in --dir first (only what 'terrace demo' created; anything else is refused "
                 "and left alone)");
  demo->add_option("--inject-fault", a->inject_fault, "Test only: 'state' perturbs a restored turn's KDA state")->group("");
  demo->callback([run, a] { *run = [a] { return RunDemo(*a); }; });
}

}  // namespace terrace::cli
