// bench_nvme_tier: NVMe tier throughput and latency, comparable with fio (io_uring, O_DIRECT).
//   seqwrite / seqread: --block-size blocks (default 1 MiB) over --file-size, PutBatch / GetBatch
//   randread: 4 KiB blocks filling --file-size, random GetBatch for --seconds
//   reopen: an index of --reopen-records records, then time NvmeTier::Open
// MB/s are 10^6 bytes per second; latencies are per device I/O (the tier's histograms). randread
// also reports the reading thread's CPU time per I/O, user and kernel (getrusage RUSAGE_THREAD):
// on a shared machine a steadier measure of the per-I/O cost than IOPS.
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <rocksdb/write_batch.h>

#include "src/common/aligned_buffer.h"
#include "terrace/options.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/nvme_tier.h"

using namespace terrace;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

BlockKey Key(std::uint64_t i) { return BlockKey{9, BlockKind::kOther, 0, ContentId{0, i}}; }

struct BenchResult {
  std::string name;
  double seconds = 0;
  std::uint64_t ops = 0, bytes = 0;
  TierStatsSnapshot stats;
  double user_us_per_op = -1, sys_us_per_op = -1;  // < 0: not measured
};

// This thread's user and kernel CPU time, seconds.
std::pair<double, double> ThreadCpuSplit() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return {s(ru.ru_utime), s(ru.ru_stime)};
}

void Print(const BenchResult& r, bool read, bool json) {
  double mbps = static_cast<double>(r.bytes) / r.seconds / 1e6;
  double iops = static_cast<double>(r.ops) / r.seconds;
  double p50 = (read ? r.stats.read_p50_ns : r.stats.write_p50_ns) / 1e3;
  double p99 = (read ? r.stats.read_p99_ns : r.stats.write_p99_ns) / 1e3;
  const bool cpu = r.user_us_per_op >= 0;
  if (json) {
    std::string extra = cpu ? fmt::format(",\"user_us_per_io\":{:.2f},\"sys_us_per_io\":{:.2f}", r.user_us_per_op,
                                          r.sys_us_per_op)
                            : "";
    fmt::print("{{\"op\":\"{}\",\"mb_per_s\":{:.1f},\"iops\":{:.0f},\"p50_us\":{:.1f},\"p99_us\":{:.1f},\"seconds\":{:.3f}{}}}\n",
               r.name, mbps, iops, p50, p99, r.seconds, extra);
  } else {
    fmt::print("{:<22} {:>9.1f} MB/s {:>10.0f} IOPS  p50 {:>8.1f} us  p99 {:>8.1f} us  ({:.2f} s)", r.name, mbps, iops,
               p50, p99, r.seconds);
    if (cpu) fmt::print("  CPU/IO user {:.2f} us sys {:.2f} us", r.user_us_per_op, r.sys_us_per_op);
    fmt::print("\n");
  }
}

std::unique_ptr<NvmeTier> OpenOrDie(const NvmeTierOptions& o) {
  auto t = NvmeTier::Open(o);
  if (!t.ok()) {
    fmt::print(stderr, "bench_nvme_tier: {}\n", t.status().ToString());
    std::exit(1);
  }
  return std::move(*t);
}

// Writes `n` blocks of `bs` bytes (keys 0..n-1), `batch` per PutBatch.
BenchResult Fill(NvmeTier& tier, std::uint64_t n, std::uint64_t bs, std::size_t batch, std::byte* arena, const char* name) {
  std::vector<BlockDesc> descs(batch);
  for (std::size_t s = 0; s < batch; ++s) descs[s] = DescribeBlock({arena + s * bs, bs});
  std::vector<PutOp> ops;
  BenchResult r{name};
  auto before = tier.Stats();
  auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; i += batch) {
    ops.clear();
    for (std::uint64_t j = i; j < std::min(n, i + batch); ++j) {
      std::size_t s = j - i;
      ops.push_back(PutOp{Key(j), descs[s], {arena + s * bs, bs}});
    }
    for (const Status& s : tier.PutBatch(ops)) {
      if (!s.ok()) {
        fmt::print(stderr, "put failed: {}\n", s.ToString());
        std::exit(1);
      }
    }
  }
  Status f = tier.Flush();
  if (!f.ok()) std::exit(1);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ops = n;
  r.bytes = n * bs;
  r.stats = tier.Stats();
  (void)before;
  return r;
}

BenchResult ReadKeys(NvmeTier& tier, const std::vector<std::uint64_t>& keys, std::uint64_t bs, std::size_t batch,
                std::byte* arena, const char* name) {
  std::vector<GetOp> ops;
  BenchResult r{name};
  auto t0 = Clock::now();
  for (std::size_t i = 0; i < keys.size(); i += batch) {
    ops.clear();
    for (std::size_t j = i; j < std::min(keys.size(), i + batch); ++j) {
      ops.push_back(GetOp{Key(keys[j]), {arena + (j - i) * bs, bs}, {}});
    }
    for (const Status& s : tier.GetBatch(ops)) {
      if (!s.ok()) {
        fmt::print(stderr, "get failed: {}\n", s.ToString());
        std::exit(1);
      }
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ops = keys.size();
  r.bytes = keys.size() * bs;
  r.stats = tier.Stats();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"NVMe tier benchmark (compare with fio --ioengine=io_uring --direct=1)"};
  std::string dir = "bench-nvme-data", mode = "async", ops_s = "seqwrite,seqread,randread";
  std::uint64_t file_size = 2ull << 30, bs = 1 << 20, reopen_records = 0;
  unsigned qd = 32;
  std::size_t batch = 256;
  double seconds = 10;
  bool json = false, keep = false;
  app.add_option("--dir", dir, "scratch directory (created, removed unless --keep)");
  app.add_option("--file-size", file_size, "bytes covered by each test (default 2 GiB)");
  app.add_option("--block-size", bs, "block size for seqwrite / seqread (default 1 MiB)");
  app.add_option("--queue-depth", qd, "io_uring queue depth (default 32)");
  app.add_option("--batch", batch, "blocks per PutBatch / GetBatch (default 256)");
  app.add_option("--mode", mode, "async | sync durability")->check(CLI::IsMember({"async", "sync"}));
  app.add_option("--ops", ops_s, "comma list of seqwrite, seqread, randread, reopen");
  app.add_option("--seconds", seconds, "randread duration (default 10)");
  app.add_option("--reopen-records", reopen_records, "index records for the reopen test (default 0: skip)");
  app.add_flag("--json", json, "one JSON object per line");
  app.add_flag("--keep", keep, "keep the scratch directory");
  CLI11_PARSE(app, argc, argv);

  auto has = [&](const char* op) { return ("," + ops_s + ",").find(std::string(",") + op + ",") != std::string::npos; };
  NvmeTierOptions o;
  o.queue_depth = qd;
  o.io_threads = 1;
  o.durability = mode == "sync" ? Durability::kSync : Durability::kAsync;
  const bool seq = has("seqwrite") || has("seqread");
  std::size_t arena_bytes = batch * (seq ? bs : 4096);
  arena_bytes = std::max<std::size_t>(arena_bytes, 1024 * 4096);  // the 4 KiB fill uses 1024 per batch
  AlignedBuffer arena_buffer(arena_bytes);
  if (!arena_buffer.ok()) {
    fmt::print(stderr, "bench_nvme_tier: no memory for a {}-byte I/O arena\n", arena_bytes);
    return 1;
  }
  std::byte* arena = arena_buffer.data();
  std::mt19937_64 rng(1);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;  // xorshift64: fast incompressible filler
  for (std::size_t i = 0; i < arena_bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(arena + i, &x, 8);
  }

  if (has("seqwrite") || has("seqread")) {
    fs::remove_all(fs::path(dir) / "seq");
    o.path = fs::path(dir) / "seq";
    // Each extent is the block rounded up to 4 KiB plus its 4 KiB descriptor unit.
    o.capacity_bytes = (file_size / bs + 1) * ((bs + 4095) / 4096 * 4096 + 4096) + 4096 * 2;
    auto tier = OpenOrDie(o);
    std::uint64_t n = file_size / bs;
    BenchResult w = Fill(*tier, n, bs, batch, arena, mode == "sync" ? "seqwrite(sync)" : "seqwrite(async)");
    if (has("seqwrite")) Print(w, false, json);
    if (has("seqread")) {
      tier.reset();
      tier = OpenOrDie(o);  // fresh histograms
      std::vector<std::uint64_t> keys(n);
      for (std::uint64_t i = 0; i < n; ++i) keys[i] = i;
      Print(ReadKeys(*tier, keys, bs, batch, arena, "seqread"), true, json);
    }
  }
  if (has("randread")) {
    fs::remove_all(fs::path(dir) / "rand");
    o.path = fs::path(dir) / "rand";
    o.capacity_bytes = (file_size / 4096) * 8192 + 8192;  // 4 KiB of data + its descriptor unit each
    auto tier = OpenOrDie(o);
    std::uint64_t n = file_size / 4096;
    BenchResult fill = Fill(*tier, n, 4096, 1024, arena, "fill4k");
    if (!json) Print(fill, false, json);
    tier.reset();
    tier = OpenOrDie(o);
    std::vector<std::uint64_t> keys;
    BenchResult total{"randread4k"};
    const auto cpu0 = ThreadCpuSplit();
    auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
      keys.resize(batch * 64);
      for (auto& k : keys) k = rng() % n;
      BenchResult part = ReadKeys(*tier, keys, 4096, batch, arena, "randread4k");
      total.ops += part.ops;
      total.bytes += part.bytes;
    }
    total.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto cpu1 = ThreadCpuSplit();
    total.user_us_per_op = (cpu1.first - cpu0.first) * 1e6 / static_cast<double>(total.ops);
    total.sys_us_per_op = (cpu1.second - cpu0.second) * 1e6 / static_cast<double>(total.ops);
    total.stats = tier->Stats();
    Print(total, true, json);
  }
  if (has("reopen") && reopen_records > 0) {
    fs::remove_all(fs::path(dir) / "reopen");
    o.path = fs::path(dir) / "reopen";
    o.capacity_bytes = (reopen_records + 2) * 2 * 4096;  // 4 KiB of data + its descriptor unit each
    OpenOrDie(o).reset();  // create
    {
      auto index = nvme::IndexStore::Open(o.path / "index", nvme::IndexOpenOptions{});
      if (!index.ok()) return 1;
      for (std::uint64_t i = 0; i < reopen_records; i += 10000) {
        rocksdb::WriteBatch b;
        for (std::uint64_t j = i; j < std::min(reopen_records, i + 10000); ++j) {
          nvme::Record rec{nvme::kDataStart + j * 2 * 4096, 4096, 0, j + 1, Codec::kRaw};
          b.Put(nvme::IndexStore::EncodeKey(Key(j)), nvme::IndexStore::EncodeRecord(rec));
        }
        if (!(*index)->Write(&b, false).ok()) return 1;
      }
    }
    auto t0 = Clock::now();
    auto tier = OpenOrDie(o);
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (json) {
      fmt::print("{{\"op\":\"reopen\",\"records\":{},\"blocks\":{},\"seconds\":{:.3f}}}\n", reopen_records,
                 tier->block_count(), s);
    } else {
      fmt::print("reopen of {} records: {} blocks in {:.3f} s\n", reopen_records, tier->block_count(), s);
    }
  }
  if (!keep) fs::remove_all(dir);
  return 0;
}
