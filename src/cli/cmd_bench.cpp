// terrace bench tiers: throughput, IOPS and latency of one tier, driven through the Tier interface.
//
// Each of --threads workers issues batches of --batch operations (PutBatch / GetBatch); the NVMe
// tier keeps --queue-depth I/Os in flight through a batch. Buffers are 4 KiB-aligned, as an engine's
// pinned buffers are, so O_DIRECT I/O needs no staging copy. Latency percentiles are the NVMe
// tier's own per-I/O figures (submit to completion, as fio's clat); for memory tiers, an operation's
// latency is that of the batch that carried it (use --batch 1 for per-operation latency).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "terrace/options.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli {
namespace {

struct BenchArgs {
  std::string tier = "host";
  std::string op = "write";
  std::uint64_t block_size = 1 * kMiB;
  unsigned queue_depth = 32;
  std::uint64_t total_bytes = 1 * kGiB;
  std::string dir;
  std::string index_dir;
  bool json = false;
  std::string durability = "async";
  unsigned threads = 1;
  unsigned batch = 0;  // 0: BatchSize() picks
  bool keep = false;
  // NVMe default: at least 8 queues' worth and up to 64 MiB per call (at most 4096 blocks), so the
  // drain at the end of each call costs little; memory tiers: one queue's worth.
  unsigned BatchSize() const {
    if (batch) return batch;
    if (tier != "nvme") return queue_depth;
    const std::uint64_t by_bytes = std::min<std::uint64_t>(4096, (64ull << 20) / std::max<std::uint64_t>(block_size, 1));
    return static_cast<unsigned>(std::max<std::uint64_t>(8ull * queue_depth, by_bytes));
  }
};

// 4 KiB-aligned bytes.
struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t n)
      : size(n), data(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::span<std::byte> span() const { return {data, size}; }
  std::size_t size;
  std::byte* data;
};

struct BenchResult {
  double seconds = 0;
  std::uint64_t ops = 0;
  double p50_us = 0, p99_us = 0;
  double flush_seconds = 0;
};

using Clock = std::chrono::steady_clock;

std::uint64_t RoundUp(std::uint64_t v, std::uint64_t unit) { return (v + unit - 1) / unit * unit; }

// Directories the bench creates (--dir, --index-dir), removed when it ends. Only paths that did not
// exist before the run are recorded, and only directories are removed: never a block device, a
// file, or a directory the user already had.
class RemoveCreatedDirs {
 public:
  RemoveCreatedDirs() = default;
  RemoveCreatedDirs(const RemoveCreatedDirs&) = delete;
  RemoveCreatedDirs& operator=(const RemoveCreatedDirs&) = delete;
  ~RemoveCreatedDirs() { Run(); }
  void AddIfMissing(const std::filesystem::path& p) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) paths_.push_back(p);
  }
  void Run() {
    for (const auto& p : paths_) {
      std::error_code ec;
      if (!std::filesystem::is_directory(std::filesystem::symlink_status(p, ec))) continue;
      std::filesystem::remove_all(p, ec);
      if (ec) fmt::print(stderr, "bench: cannot remove '{}': {}\n", p.string(), ec.message());
    }
    paths_.clear();
  }

 private:
  std::vector<std::filesystem::path> paths_;
};

Result<std::unique_ptr<Tier>> MakeTier(const BenchArgs& a, const std::filesystem::path& dir) {
  std::uint64_t blocks = a.total_bytes / a.block_size;
  std::uint64_t need = blocks * RoundUp(a.block_size, 4 * kKiB);
  std::uint64_t capacity = RoundUp(need + need / 8 + 64 * kMiB, 4 * kKiB);
  if (a.tier == "host") {
    HostTierOptions o;
    o.capacity_bytes = capacity;
    o.chunk_bytes = std::max<std::uint64_t>(RoundUp(a.block_size, 4 * kKiB), 256 * kMiB);
    TERRACE_ASSIGN_OR_RETURN(auto t, HostTier::Create(o));
    return std::unique_ptr<Tier>(std::move(t));
  }
  if (a.tier == "hbm") {
    HbmTierOptions o;
    o.capacity_bytes = capacity;
    return CreateHbmTier(o);
  }
  NvmeTierOptions o;
  o.path = dir;
  o.index_dir = a.index_dir;
  if (IsBlockDevice(dir.string())) {
    // The whole device (rounded down to 4 KiB): the same capacity on every run, whatever
    // --total-bytes, so a later run reopens the format the first one wrote.
    TERRACE_ASSIGN_OR_RETURN(std::uint64_t dev_bytes, BlockDeviceBytes(dir.string()));
    if (dev_bytes / (4 * kKiB) * (4 * kKiB) < need + 4 * kKiB) {
      return Status::OutOfCapacity(fmt::format("block device '{}' has {}, too small for {} blocks of {}; lower "
                                               "--total-bytes",
                                               dir.string(), FormatBytes(static_cast<double>(dev_bytes)), blocks,
                                               FormatBytes(static_cast<double>(a.block_size))));
    }
    capacity = dev_bytes / (4 * kKiB) * (4 * kKiB);
  }
  o.capacity_bytes = capacity;
  o.queue_depth = a.queue_depth;
  o.io_threads = std::clamp(a.threads, 1u, 64u);  // one ring per worker: concurrent calls do not queue on one ring
  o.durability = a.durability == "sync" ? Durability::kSync : Durability::kAsync;
  TERRACE_ASSIGN_OR_RETURN(auto t, NvmeTier::Open(o));
  return std::unique_ptr<Tier>(std::move(t));
}

BlockKey BenchKey(std::uint64_t i) { return BlockKey{0xbe4c, BlockKind::kOther, 0, ContentId{0, i}}; }

// Runs `ops` operations as batches of `batch` spread over `threads` workers. `index(i)` maps the
// i-th operation to a block index.
template <typename IndexFn>
Result<BenchResult> RunOps(Tier& tier, const BenchArgs& a, bool write, std::uint64_t ops, IndexFn index,
                           std::span<const std::byte> payload, const BlockDesc& desc) {
  BenchResult r;
  LatencyHistogram latency;
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> failed{false};
  Status first_error;
  std::mutex err_mu;
  auto worker = [&] {
    std::vector<PutOp> puts;
    std::vector<GetOp> gets;
    const unsigned batch = a.BatchSize();
    AlignedBuffer out(write ? 0 : RoundUp(a.block_size, 4 * kKiB) * batch);
    while (!failed.load(std::memory_order_relaxed)) {
      std::uint64_t begin = next.fetch_add(batch);
      if (begin >= ops) break;
      std::uint64_t end = std::min<std::uint64_t>(begin + batch, ops);
      auto t0 = Clock::now();
      std::vector<Status> st;
      if (write) {
        puts.clear();
        for (std::uint64_t i = begin; i < end; ++i) puts.push_back(PutOp{BenchKey(index(i)), desc, payload});
        st = tier.PutBatch(puts);
      } else {
        gets.clear();
        for (std::uint64_t i = begin; i < end; ++i) {
          gets.push_back(GetOp{BenchKey(index(i)),
                               out.span().subspan((i - begin) * RoundUp(a.block_size, 4 * kKiB), a.block_size), {}});
        }
        st = tier.GetBatch(gets);
      }
      auto ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
      for (const Status& s : st) {
        if (!s.ok() && !failed.exchange(true)) {
          std::lock_guard<std::mutex> l(err_mu);
          first_error = s;
        }
        latency.Record(ns);
      }
    }
  };
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < std::max(1u, a.threads); ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.ops = ops;
  r.p50_us = static_cast<double>(latency.Percentile(0.5)) / 1e3;
  r.p99_us = static_cast<double>(latency.Percentile(0.99)) / 1e3;
  if (failed) return first_error;
  if (write) {
    auto f0 = Clock::now();
    TERRACE_RETURN_IF_ERROR(tier.Flush());
    r.flush_seconds = std::chrono::duration<double>(Clock::now() - f0).count();
  }
  return r;
}

int RunBenchTiers(const BenchArgs& a) {
  if (a.block_size == 0 || a.total_bytes < a.block_size) {
    return Fail("--total-bytes must be at least one --block-size");
  }
  if (a.queue_depth == 0) return Fail("--queue-depth must be at least 1");
  std::filesystem::path dir = a.dir.empty() ? std::filesystem::path("terrace-bench") : std::filesystem::path(a.dir);
  if (a.tier == "nvme") {
    if (Status s = CheckNvmePaths(dir.string(), a.index_dir); !s.ok()) return Fail(s.ToString());
  }
  // Declared before the tier, so it runs after the tier is closed, on every return path.
  RemoveCreatedDirs cleanup;
  if (a.tier == "nvme" && !a.keep) {
    cleanup.AddIfMissing(dir);
    if (!a.index_dir.empty()) cleanup.AddIfMissing(a.index_dir);
  }
  auto tier_or = MakeTier(a, dir);
  if (!tier_or.ok()) return Fail(tier_or.status().ToString());
  std::unique_ptr<Tier> tier = std::move(*tier_or);

  const std::uint64_t blocks = a.total_bytes / a.block_size;
  AlignedBuffer payload_buf(a.block_size);
  std::span<const std::byte> payload = payload_buf.span();
  FillPattern(7, BenchKey(0), payload_buf.span());
  BlockDesc desc = DescribeBlock(payload);
  if (!a.json) {
    fmt::print(stderr, "bench: {} tier{}, {} {} x {} blocks, queue depth {}, {} thread(s)\n", a.tier,
               tier->caps().emulated ? " (emulated)" : "", a.op, blocks, FormatBytes(static_cast<double>(a.block_size)),
               a.queue_depth, a.threads);
  }
  auto seq = [](std::uint64_t i) { return i; };
  std::vector<std::uint64_t> order(a.op == "randread" ? blocks : 0);
  std::mt19937_64 rng(1);
  for (auto& o : order) o = rng() % blocks;
  auto run_op = [&]() -> Result<BenchResult> {
    if (a.op == "write") return RunOps(*tier, a, true, blocks, seq, payload, desc);
    if (!a.json) fmt::print(stderr, "bench: writing {} blocks first (not timed)\n", blocks);
    TERRACE_RETURN_IF_ERROR(RunOps(*tier, a, true, blocks, seq, payload, desc).status());
    if (a.op == "read") return RunOps(*tier, a, false, blocks, seq, payload, desc);
    return RunOps(*tier, a, false, blocks, [&](std::uint64_t i) { return order[i]; }, payload, desc);
  };
  Result<BenchResult> r = run_op();
  TierStatsSnapshot stats = tier->Stats();
  tier.reset();
  cleanup.Run();
  if (!r.ok()) return Fail(r.status().ToString());

  const double bytes = static_cast<double>(r->ops * a.block_size);
  const double mbps = bytes / 1e6 / r->seconds, iops = static_cast<double>(r->ops) / r->seconds;
  double p50 = r->p50_us, p99 = r->p99_us;
  if (a.tier == "nvme") {  // the tier's per-I/O latency (the prep writes do not enter the read histogram)
    const bool w = a.op == "write";
    p50 = static_cast<double>(w ? stats.write_p50_ns : stats.read_p50_ns) / 1e3;
    p99 = static_cast<double>(w ? stats.write_p99_ns : stats.read_p99_ns) / 1e3;
  }
  if (a.json) {
    nlohmann::json j = {{"tier", a.tier},         {"op", a.op},
                        {"block_size", a.block_size}, {"queue_depth", a.queue_depth},
                        {"threads", a.threads}, {"batch", a.BatchSize()},   {"total_bytes", r->ops * a.block_size},
                        {"seconds", r->seconds},  {"mb_per_s", mbps},
                        {"iops", iops},           {"p50_us", p50},
                        {"p99_us", p99},          {"emulated", stats.emulated},
                        {"durability", a.durability}, {"flush_seconds", r->flush_seconds},
                        {"detail", stats.detail}};
    fmt::print("{}\n", j.dump());
  } else {
    Table t({"tier", "op", "block", "qd", "MB/s", "IOPS", "p50 us", "p99 us"});
    t.Add({stats.emulated ? a.tier + " (emulated)" : a.tier, a.op, FormatBytes(static_cast<double>(a.block_size)),
           std::to_string(a.queue_depth), fmt::format("{:.0f}", mbps), fmt::format("{:.0f}", iops),
           fmt::format("{:.1f}", p50), fmt::format("{:.1f}", p99)});
    fmt::print("{}", t.Render());
    if (!stats.detail.empty()) fmt::print("{}: {}\n", a.tier, stats.detail);
  }
  return 0;
}

}  // namespace

void RegisterBench(CLI::App& app, Runner* run) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto a = std::make_shared<BenchArgs>();
  auto* tiers = bench->add_subcommand("tiers", "Throughput, IOPS and p50/p99 latency of one tier");
  tiers->add_option("--tier", a->tier, "host | nvme | hbm")->check(CLI::IsMember({"host", "nvme", "hbm"}))
      ->capture_default_str();
  tiers->add_option("--op", a->op, "write | read | randread (reads write the data first, untimed)")
      ->check(CLI::IsMember({"write", "read", "randread"}))->capture_default_str();
  AddSizeOption(tiers, "--block-size", &a->block_size, "Block size");
  tiers->add_option("--queue-depth", a->queue_depth, "NVMe I/Os in flight (ring depth); for memory tiers the default batch size")
      ->check(CLI::Range(1u, 4096u))->capture_default_str();
  AddSizeOption(tiers, "--total-bytes", &a->total_bytes, "Bytes moved");
  tiers->add_option("--dir", a->dir, "NVMe tier directory or block device (default ./terrace-bench). On a block device "
                                     "the tier uses the whole device and needs --index-dir; its contents are "
                                     "overwritten. A directory the bench created is removed afterwards");
  tiers->add_option("--index-dir", a->index_dir, "NVMe index (RocksDB) directory on a persistent file system; "
                                                 "required when --dir is a block device (default: <dir>/index). "
                                                 "Removed afterwards if the bench created it");
  tiers->add_option("--durability", a->durability, "NVMe durability: async | sync")
      ->check(CLI::IsMember({"async", "sync"}))->capture_default_str();
  tiers->add_option("--batch", a->batch, "Operations per PutBatch / GetBatch call (default for nvme: 8 x queue depth or 64 MiB, "
                                         "up to 4096 blocks; else --queue-depth)")->check(CLI::Range(1u, 65536u));
  tiers->add_option("--threads", a->threads, "Concurrent workers (nvme: one io_uring ring each)")->check(CLI::Range(1u, 256u))->capture_default_str();
  tiers->add_flag("--keep", a->keep, "Keep the NVMe directory and index directory the bench created");
  tiers->add_flag("--json", a->json, "Print one JSON object (mb_per_s, iops, p50_us, p99_us, ...)");
  tiers->callback([run, a] { *run = [a] { return RunBenchTiers(*a); }; });
}

}  // namespace terrace::cli
