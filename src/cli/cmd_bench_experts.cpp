// terrace bench experts: decode speed with the routed experts offloaded (docs/experts.md,
// "Benchmark"). Side by side in one run: all-resident; on-demand; lru+lookahead;
// utility+statistical; oracle (each at every --budget, experts cold on the NVMe tier with O_DIRECT,
// the host-to-HBM link modelled by the emulated HBM tier); and an mmap baseline (experts read
// through mmap of the safetensors files, page cache dropped first where permitted).
#include <algorithm>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/model/names.h"
#include "src/model/ops.h"
#include "src/model/safetensors.h"
#include "terrace/experts.h"
#include "terrace/model.h"

namespace terrace::cli {
namespace {

constexpr std::string_view kMarker = "terrace-bench-experts.marker";
using SteadyClock = std::chrono::steady_clock;

struct BenchExpertsArgs {
  std::string model;
  std::string dir = "terrace-bench-experts";
  std::string budgets = "25%,50%";
  int prompt = 16;
  int decode = 32;
  int threads = 1;
  double link_gbps = 55.0;
  bool json = false;
  bool keep = false;
};

double Seconds(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// Experts served zero-copy from the checkpoint's mmap (llama.cpp's way): the page cache is the cache.
class MmapExpertProvider final : public model::ExpertProvider {
 public:
  static Result<std::unique_ptr<MmapExpertProvider>> Create(const model::WeightSource& src, const model::ModelConfig& c) {
    auto p = std::unique_ptr<MmapExpertProvider>(new MmapExpertProvider());
    p->E_ = c.num_experts;
    p->experts_.resize(static_cast<std::size_t>(c.num_hidden_layers) * static_cast<std::size_t>(c.num_experts));
    const std::int64_t L = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.IsDenseLayer(l)) continue;
      for (int e = 0; e < c.num_experts; ++e) {
        model::ExpertWeights& w = p->experts_[static_cast<std::size_t>(l * c.num_experts + e)];
        w.format = model::ExpertFormat::kMxfp4;
        struct P {
          const char* name;
          model::Mxfp4Matrix* m;
          std::int64_t rows, cols;
        };
        for (P q : {P{"w1", &w.q1, I, L}, P{"w2", &w.q2, L, I}, P{"w3", &w.q3, I, L}}) {
          TERRACE_ASSIGN_OR_RETURN(model::TensorView pk, src.Get(model::ExpertTensorName(l, e, q.name, "weight_packed")));
          TERRACE_ASSIGN_OR_RETURN(model::TensorView sc, src.Get(model::ExpertTensorName(l, e, q.name, "weight_scale")));
          *q.m = model::Mxfp4Matrix{reinterpret_cast<const std::uint8_t*>(pk.data.data()),
                                    reinterpret_cast<const std::uint8_t*>(sc.data.data()), q.rows, q.cols};
        }
      }
    }
    return p;
  }
  Result<const model::ExpertWeights*> Acquire(int layer, int expert) override {
    return &experts_[static_cast<std::size_t>(layer * E_ + expert)];
  }
  void Release(int, int) override {}

 private:
  MmapExpertProvider() = default;
  int E_ = 0;
  std::vector<model::ExpertWeights> experts_;
};

// Drops the checkpoint files' clean pages from the page cache (POSIX_FADV_DONTNEED). True when
// every file accepted it.
bool DropPageCache(const std::filesystem::path& dir) {
  bool ok = true;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".safetensors") continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      ok = false;
      continue;
    }
    ok = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && ok;
    ::close(fd);
  }
  return ok && !ec;
}

struct ConfigResult {
  std::string name;
  double budget_fraction = 1.0;
  double tokens_per_s = 0, stall_share = 0, hit_rate = 0, recall = 0, precision = 0, bound_tokens_per_s = 0;
  std::uint64_t bytes_read[kNumTiers] = {0, 0, 0};
  std::uint64_t speculative_bytes = 0, wasted_bytes = 0, misses_per_token_x1000 = 0;
  std::vector<double> layer_recall;
  std::vector<std::uint64_t> expert_load;  // whole run (prefill included): tokens routed to each expert id, summed over MoE layers
  std::vector<int> hot_experts;            // ids hot (load > hot_factor x the layer mean) in some MoE layer
};

// Prefill, then time `decode` greedy decode steps. `between` runs after the prefill (snapshots).
Result<double> TimedDecode(const model::Model& m, const std::vector<int>& prompt, int decode,
                           const model::ForwardOptions* hooks, const std::function<void()>& between) {
  model::Session s(m);
  if (hooks) s.set_hooks(*hooks);
  TERRACE_RETURN_IF_ERROR(s.Prefill(prompt).status());
  if (between) between();
  const auto t0 = SteadyClock::now();
  for (int i = 0; i < decode; ++i) TERRACE_RETURN_IF_ERROR(s.Decode(model::Argmax(s.last_logits())).status());
  return Seconds(t0);
}

int RunBenchExperts(const BenchExpertsArgs& a) {
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  if (Status s = CheckStoreDirArg(a.dir, "--dir"); !s.ok()) return FailUsage(s.message());
  std::vector<experts::CacheBudget> budgets;
  std::vector<double> fractions;
  for (std::size_t pos = 0; pos <= a.budgets.size();) {
    const std::size_t end = std::min(a.budgets.find(',', pos), a.budgets.size());
    auto b = experts::CacheBudget::Parse(a.budgets.substr(pos, end - pos));
    if (!b.ok()) return FailUsage("--budgets: " + b.status().message());
    if (b->bytes != 0) return FailUsage("--budgets takes percentages (e.g. 25%,50%)");
    budgets.push_back(*b);
    pos = end + 1;
  }
  model::ops::SetBlasThreads(a.threads);
  const std::filesystem::path dir(a.dir);
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    auto removed = RemoveOwnedStore(dir, kMarker, "--dir", "terrace bench experts");
    if (!removed.ok()) return FailUsage(removed.status().message());
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
  auto cleanup = [&] {
    if (!a.keep) (void)RemoveOwnedStore(dir, kMarker, "--dir", "terrace bench experts");
  };

  auto md = model::ModelDir::Open(a.model);
  if (!md.ok()) return Fail(md.status().ToString());
  const model::ModelConfig config = (*md)->config();
  if (config.num_experts <= 0) return FailUsage("--model: the model has no routed experts");
  std::vector<int> prompt;
  for (int i = 0; i < a.prompt; ++i) prompt.push_back((i * 37 + 5) % config.vocab_size);
  const std::uint64_t total = experts::ExpertOffload::TotalExpertBytes(config);
  LinkModel link;
  link.bandwidth_bytes_per_s = a.link_gbps * 1e9;
  auto progress = [&](const std::string& what) {
    if (!a.json) fmt::print(stderr, "bench experts: {}\n", what);
  };
  std::vector<ConfigResult> results;

  // All-resident: the compute cost of a token.
  progress("resident");
  double compute_s_per_token = 0;
  {
    auto m = model::Model::Load(config, **md);
    if (!m.ok()) return Fail(m.status().ToString());
    auto t = TimedDecode(**m, prompt, a.decode, nullptr, {});
    if (!t.ok()) return Fail(t.status().ToString());
    compute_s_per_token = *t / a.decode;
    ConfigResult r;
    r.name = "resident";
    r.tokens_per_s = a.decode / *t;
    r.hit_rate = 1;
    r.recall = 1;
    r.bound_tokens_per_s = r.tokens_per_s;
    results.push_back(r);
  }

  // The experts, once, onto the NVMe tier; then the drive's read rate over all of them.
  progress(fmt::format("storing {:.1f} MiB of routed experts on the NVMe tier", static_cast<double>(total) / (1 << 20)));
  double nvme_bytes_per_s = 0;
  std::uint64_t block_bytes = 0;
  {
    auto st = Store::Open(experts::ExpertOffload::OpenStoreOptions(total, total, a.dir, link));
    if (!st.ok()) return Fail(st.status().ToString());
    // Marked once the store exists (the NVMe tier wants an empty directory or a store).
    if (Status s = WriteMarker(dir, kMarker, "terrace bench experts"); !s.ok()) return Fail(s.ToString());
    experts::ExpertOffloadOptions o;
    o.home = TierId::kNvme;
    o.budget = *experts::CacheBudget::Parse("100%");
    auto off = experts::ExpertOffload::Create(config, **md, st->get(), std::move(o));
    if (!off.ok()) return Fail(off.status().ToString());
    if (Status s = (*st)->Flush(); !s.ok()) return Fail(s.ToString());
    std::vector<Store::GetItem> items;
    std::vector<std::vector<std::byte>> bufs;
    for (int l = 0; l < config.num_hidden_layers; ++l)
      for (int e = 0; e < config.num_experts; ++e)
        if (auto k = (*off)->key(l, e); k.ok()) items.push_back(Store::GetItem{*k, {}, {}});
    block_bytes = total / std::max<std::size_t>(items.size(), 1);
    bufs.resize(items.size(), std::vector<std::byte>(block_bytes));
    for (std::size_t i = 0; i < items.size(); ++i) items[i].out = bufs[i];
    const auto t0 = SteadyClock::now();
    for (std::size_t i = 0; i < items.size(); i += 256) {
      auto part = std::span(items).subspan(i, std::min<std::size_t>(256, items.size() - i));
      for (const Status& s : (*st)->GetBatch(part))
        if (!s.ok()) return Fail(s.ToString());
    }
    nvme_bytes_per_s = static_cast<double>(total) / std::max(Seconds(t0), 1e-9);
  }
  (void)DropPageCache(dir);

  struct Config {
    std::string name;
    experts::CachePolicyKind policy;
    experts::PredictorKind predictor;
  };
  const std::vector<Config> configs = {
      {"on-demand", experts::CachePolicyKind::kLru, experts::PredictorKind::kNone},
      {"lru+lookahead", experts::CachePolicyKind::kLru, experts::PredictorKind::kLookahead},
      {"utility+statistical", experts::CachePolicyKind::kUtility, experts::PredictorKind::kStatistical},
      {"oracle", experts::CachePolicyKind::kUtility, experts::PredictorKind::kOracle}};
  for (const auto& budget : budgets) {
    for (const Config& c : configs) {
      progress(fmt::format("{} at {}", c.name, budget.ToString()));
      // A cold cache: a fresh store over the same NVMe tier (the HBM and host tiers start empty).
      auto st = Store::Open(experts::ExpertOffload::OpenStoreOptions(total, budget.Resolve(total), a.dir, link));
      if (!st.ok()) return Fail(st.status().ToString());
      experts::ExpertOffloadOptions o;
      o.home = TierId::kNvme;
      o.budget = budget;
      o.policy = c.policy;
      auto off = experts::ExpertOffload::Create(config, **md, st->get(), std::move(o));
      if (!off.ok()) return Fail(off.status().ToString());
      auto m = model::Model::Load(config, **md, *off);
      if (!m.ok()) return Fail(m.status().ToString());
      experts::ExpertOffload& x = **off;
      if (c.predictor == experts::PredictorKind::kLookahead) x.SetPredictor(experts::MakeLookaheadPredictor(**m, {}));
      if (c.predictor == experts::PredictorKind::kStatistical) x.SetPredictor(experts::MakeStatisticalPredictor(config));
      if (c.predictor == experts::PredictorKind::kOracle) {
        model::ForwardOptions h;
        x.AttachHooks(&h);
        if (auto t = TimedDecode(**m, prompt, a.decode, &h, {}); !t.ok()) return Fail(t.status().ToString());
        auto trace = x.trace();
        if (Status s = x.Reset(); !s.ok()) return Fail(s.ToString());
        x.SetPredictor(experts::MakeOraclePredictor(std::move(trace)));
      }
      model::ForwardOptions hooks;
      x.AttachHooks(&hooks);
      experts::ExpertMetrics m0;
      StoreStats s0;
      auto t = TimedDecode(**m, prompt, a.decode, &hooks, [&] {
        m0 = x.Metrics();
        s0 = (*st)->Stats();
      });
      if (!t.ok()) return Fail(t.status().ToString());
      const experts::ExpertMetrics m1 = x.Metrics();
      const StoreStats s1 = (*st)->Stats();
      ConfigResult r;
      r.name = c.name;
      r.budget_fraction = budget.fraction;
      r.tokens_per_s = a.decode / *t;
      r.stall_share = static_cast<double>(m1.stall_ns - m0.stall_ns) / 1e9 / *t;
      const double hits = static_cast<double>(m1.hits - m0.hits);
      const double misses = static_cast<double>((m1.misses - m0.misses) + (m1.late_hits - m0.late_hits));
      r.hit_rate = hits + misses > 0 ? hits / (hits + misses) : 0;
      experts::PredictionCounts pc;
      pc.true_positive = m1.prediction.true_positive - m0.prediction.true_positive;
      pc.false_positive = m1.prediction.false_positive - m0.prediction.false_positive;
      pc.false_negative = m1.prediction.false_negative - m0.prediction.false_negative;
      r.recall = pc.recall();
      r.precision = pc.precision();
      for (const auto& l : m1.layers) {
        r.layer_recall.push_back(l.prediction.recall());
        if (r.expert_load.size() < l.expert_load.size()) r.expert_load.resize(l.expert_load.size());
        for (std::size_t e = 0; e < l.expert_load.size(); ++e) r.expert_load[e] += l.expert_load[e];
        for (int e : l.hot_experts)
          if (std::find(r.hot_experts.begin(), r.hot_experts.end(), e) == r.hot_experts.end()) r.hot_experts.push_back(e);
      }
      std::sort(r.hot_experts.begin(), r.hot_experts.end());
      for (int i = 0; i < kNumTiers; ++i) r.bytes_read[i] = s1.tiers[i].bytes_read - s0.tiers[i].bytes_read;
      // Whole run (prefill included): "wasted" counts blocks still unused, so a decode-only
      // difference could go negative.
      r.speculative_bytes = m1.speculative_bytes;
      r.wasted_bytes = m1.speculative_wasted_bytes;
      // The bound: compute plus what this hit rate's misses cost on the link and the drive.
      const double miss_bytes_per_token = misses * static_cast<double>(block_bytes) / a.decode;
      r.bound_tokens_per_s = 1.0 / (compute_s_per_token + miss_bytes_per_token / link.bandwidth_bytes_per_s +
                                    miss_bytes_per_token / std::max(nvme_bytes_per_s, 1.0));
      results.push_back(r);
    }
  }

  // mmap baseline: zero-copy reads of the checkpoint through the page cache.
  progress("mmap");
  md->reset();
  const bool dropped = DropPageCache(a.model);
  {
    auto md2 = model::ModelDir::Open(a.model);
    if (!md2.ok()) return Fail(md2.status().ToString());
    auto p = MmapExpertProvider::Create(**md2, config);
    if (!p.ok()) return Fail(p.status().ToString());
    auto m = model::Model::Load(config, **md2, std::shared_ptr<model::ExpertProvider>(std::move(p).value()));
    if (!m.ok()) return Fail(m.status().ToString());
    auto t = TimedDecode(**m, prompt, a.decode, nullptr, {});
    if (!t.ok()) return Fail(t.status().ToString());
    ConfigResult r;
    r.name = "mmap";
    r.tokens_per_s = a.decode / *t;
    results.push_back(r);
  }
  cleanup();

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["routed_expert_bytes"] = total;
    j["expert_block_bytes"] = block_bytes;
    j["prompt_tokens"] = a.prompt;
    j["decode_tokens"] = a.decode;
    j["link_bytes_per_s"] = link.bandwidth_bytes_per_s;
    j["nvme_read_bytes_per_s"] = nvme_bytes_per_s;
    j["compute_s_per_token"] = compute_s_per_token;
    j["mmap_page_cache_dropped"] = dropped;
    for (const auto& r : results) {
      nlohmann::json c;
      c["name"] = r.name;
      c["budget_fraction"] = r.budget_fraction;
      c["tokens_per_s"] = r.tokens_per_s;
      c["stall_share"] = r.stall_share;
      c["hit_rate"] = r.hit_rate;
      c["recall"] = r.recall;
      c["precision"] = r.precision;
      c["bound_tokens_per_s"] = r.bound_tokens_per_s;
      for (int i = 0; i < kNumTiers; ++i) c["bytes_read"][std::string(TierName(static_cast<TierId>(i)))] = r.bytes_read[i];
      c["speculative_bytes"] = r.speculative_bytes;
      c["speculative_wasted_bytes"] = r.wasted_bytes;
      c["layer_recall"] = r.layer_recall;
      c["expert_load"] = r.expert_load;
      c["hot_experts"] = r.hot_experts;
      j["configs"].push_back(c);
    }
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("routed experts {:.1f} MiB ({} B blocks); NVMe reads {:.2f} GB/s; link model {:.0f} GB/s; compute {:.2f} ms/token\n",
             static_cast<double>(total) / (1 << 20), block_bytes, nvme_bytes_per_s / 1e9, a.link_gbps,
             compute_s_per_token * 1e3);
  Table t({"config", "budget", "tokens/s", "bound tok/s", "stall", "hit rate", "recall", "nvme MiB", "host MiB"});
  for (const auto& r : results) {
    t.Add({r.name, fmt::format("{:.0f}%", r.budget_fraction * 100), fmt::format("{:.1f}", r.tokens_per_s),
              r.bound_tokens_per_s > 0 ? fmt::format("{:.1f}", r.bound_tokens_per_s) : "-",
              fmt::format("{:.1f}%", 100 * r.stall_share), fmt::format("{:.3f}", r.hit_rate),
              fmt::format("{:.3f}", r.recall), fmt::format("{:.1f}", static_cast<double>(r.bytes_read[2]) / (1 << 20)),
              fmt::format("{:.1f}", static_cast<double>(r.bytes_read[1]) / (1 << 20))});
  }
  fmt::print("{}", t.Render());
  fmt::print("mmap: page cache {}\n", dropped ? "dropped first (POSIX_FADV_DONTNEED)" : "could not be dropped");
  return 0;
}

}  // namespace

void RegisterBenchExperts(CLI::App* bench, Runner* run) {
  auto a = std::make_shared<BenchExpertsArgs>();
  auto* cmd = bench->add_subcommand("experts", "Decode speed with routed experts offloaded to NVMe, per cache policy and predictor");
  cmd->add_option("--model", a->model, "MXFP4 model directory (e.g. from terrace model init)")->required();
  cmd->add_option("--dir", a->dir, "NVMe tier directory for the expert store; created, marked "
                                   "(terrace-bench-experts.marker) and removed afterwards")
      ->capture_default_str();
  cmd->add_option("--budgets", a->budgets, "Fast-tier budgets, percentages of the routed expert bytes")->capture_default_str();
  AddIntOption(cmd, "--prompt", &a->prompt, 1, 65536, "Prompt tokens (prefilled, untimed)");
  AddIntOption(cmd, "--decode", &a->decode, 1, 65536, "Timed decode tokens per configuration");
  AddIntOption(cmd, "--threads", &a->threads, 1, 256, "OpenBLAS threads");
  cmd->add_option("--link-gbps", a->link_gbps, "Host-to-HBM link model, GB/s (emulated HBM tier)")->capture_default_str();
  cmd->add_flag("--json", a->json, "Print one JSON object with a configs list");
  cmd->add_flag("--keep", a->keep, "Keep the NVMe directory afterwards");
  cmd->callback([run, a] { *run = [a] { return RunBenchExperts(*a); }; });
}

}  // namespace terrace::cli
