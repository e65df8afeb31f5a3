// terrace store fill | check: a recovery drill. `fill` puts test-pattern blocks in sync durability
// and prints "durable <key>" as each put is acknowledged; kill it at any moment, then `check
// --expect` proves every acknowledged block survived intact.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "terrace/store.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli {
namespace {

struct StoreArgs {
  std::string dir;
  std::string index_dir;
  std::uint64_t count = 0;
  std::uint64_t block_size = 64 * kKiB;
  std::uint64_t seed = 1;
  std::uint64_t capacity = 1 * kGiB;
  unsigned threads = 4;
  std::string expect;
};

NvmeTierOptions NvmeOptions(const StoreArgs& a, Durability durability) {
  NvmeTierOptions o;
  o.path = a.dir;
  o.index_dir = a.index_dir;
  o.capacity_bytes = a.capacity;
  o.durability = durability;
  return o;
}

int RunFill(const StoreArgs& a) {
  if (a.count == 0) return Fail("--count must be at least 1");
  if (a.block_size == 0) return Fail("--block-size must be at least 1 byte");
  if (Status s = CheckNvmePaths(a.dir, a.index_dir); !s.ok()) return Fail(s.ToString());
  if (a.count * a.block_size > a.capacity) {
    return Fail(fmt::format("{} blocks of {} do not fit in --capacity {}; raise --capacity (the same value must be "
                            "given to 'store check')",
                            a.count, FormatBytes(static_cast<double>(a.block_size)),
                            FormatBytes(static_cast<double>(a.capacity))));
  }
  StoreOptions so;
  so.hbm.mode = HbmMode::kOff;
  so.host.capacity_bytes = 64 * kMiB;
  so.host.chunk_bytes = 16 * kMiB;
  so.nvme = NvmeOptions(a, Durability::kSync);
  so.put_tier = TierId::kNvme;
  auto store = Store::Open(so);
  if (!store.ok()) return Fail(store.status().ToString());

  std::mutex out_mu;
  std::atomic<std::uint64_t> next{0}, failed{0};
  std::string first_error;
  auto start = std::chrono::steady_clock::now();
  auto worker = [&] {
    std::vector<std::byte> buf(a.block_size);
    for (std::uint64_t i; (i = next.fetch_add(1)) < a.count;) {
      BlockKey key = FillKey(a.seed, i);
      FillPattern(a.seed, key, buf);
      Status s = (*store)->Put(key, buf);
      std::lock_guard<std::mutex> l(out_mu);
      if (s.ok()) {
        std::fputs(fmt::format("durable {}\n", key.ToString()).c_str(), stdout);
        std::fflush(stdout);
      } else if (failed.fetch_add(1) == 0) {
        first_error = fmt::format("put of {} failed: {}", key.ToString(), s.ToString());
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < std::max(1u, a.threads); ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::uint64_t ok = a.count - failed.load();
  fmt::print(stderr, "store fill: {} of {} blocks durable ({}) in {:.2f} s, {:.1f} MB/s, sync durability\n", ok,
             a.count, FormatBytes(static_cast<double>(ok * a.block_size)), secs,
             static_cast<double>(ok * a.block_size) / 1e6 / secs);
  if (failed.load()) return Fail(fmt::format("{} puts failed; first: {}", failed.load(), first_error));
  return 0;
}

Result<std::vector<BlockKey>> ReadExpect(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(fmt::format("--expect file '{}' cannot be opened", path));
  std::vector<BlockKey> keys;
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    constexpr std::string_view kPrefix = "durable ";
    if (line.rfind(kPrefix, 0) != 0) {
      return Status::InvalidArgument(
          fmt::format("{}:{}: expected 'durable <key>' as 'store fill' prints it, got '{}'", path, lineno, line));
    }
    auto key = BlockKey::Parse(std::string_view(line).substr(kPrefix.size()));
    if (!key.ok()) return key.status().WithContext(fmt::format("{}:{}", path, lineno));
    keys.push_back(*key);
  }
  return keys;
}

int RunCheck(const StoreArgs& a) {
  std::vector<BlockKey> expected;
  if (!a.expect.empty()) {
    auto keys = ReadExpect(a.expect);
    if (!keys.ok()) return Fail(keys.status().ToString());
    expected = std::move(*keys);
  }
  if (Status s = CheckNvmePaths(a.dir, a.index_dir); !s.ok()) return Fail(s.ToString());
  if (std::error_code ec; !a.index_dir.empty() && !std::filesystem::exists(a.index_dir, ec)) {
    // The tier would start an empty index there (as after a crash while creating a store) and report
    // no blocks; a checker should say the index is not where it was told to look.
    return Fail(fmt::format("--index-dir '{}' does not exist; give the index directory that 'store fill' used",
                            a.index_dir));
  }
  NvmeTierOptions o = NvmeOptions(a, Durability::kSync);
  o.create_if_missing = false;
  auto tier = NvmeTier::Open(o);
  if (!tier.ok()) return Fail(tier.status().ToString());
  const RecoveryReport& report = (*tier)->recovery_report();
  std::vector<std::pair<BlockKey, BlockDesc>> blocks;
  (*tier)->ForEach([&](const BlockKey& k, const BlockDesc& d) { blocks.emplace_back(k, d); });

  std::uint64_t ok = 0, corrupt = 0, missing = 0;
  std::unordered_set<BlockKey> good;
  std::vector<std::byte> buf, want;
  for (const auto& [key, desc] : blocks) {
    buf.resize(desc.size);
    want.resize(desc.size);
    BlockDesc got;
    Status s = (*tier)->Get(key, buf, &got);
    FillPattern(a.seed, key, want);
    if (s.ok() && buf == want) {
      ++ok;
      good.insert(key);
    } else {
      ++corrupt;
      fmt::print(stderr, "corrupt {}: {}\n", key.ToString(),
                 s.ok() ? "content differs from the pattern of --seed" : s.ToString());
    }
  }
  for (const BlockKey& k : expected) {
    if (!good.contains(k)) {
      ++missing;
      if (missing <= 10) fmt::print(stderr, "missing {}\n", k.ToString());
    }
  }
  fmt::print("store check: {} blocks: ok {}  missing {}  corrupt {}  (recovery dropped {} incomplete records)\n",
             blocks.size(), ok, missing, corrupt, report.dropped());
  return (missing || corrupt) ? 1 : 0;
}

}  // namespace

void RegisterStore(CLI::App& app, Runner* run) {
  auto* store = app.add_subcommand("store", "Recovery drill: fill a store with test blocks, then check it");
  store->require_subcommand(1);
  auto args = std::make_shared<StoreArgs>();

  auto* fill = store->add_subcommand("fill", "Put test-pattern blocks in sync durability, printing 'durable <key>' "
                                             "for each acknowledged put");
  fill->add_option("--dir", args->dir, "Store directory (created if missing) or block device (its contents are "
                                       "overwritten; needs --index-dir)")->required();
  fill->add_option("--index-dir", args->index_dir, "NVMe index directory on a persistent file system; required when "
                                                   "--dir is a block device (default: <dir>/index; give the same to "
                                                   "'check')");
  fill->add_option("--count", args->count, "Number of blocks")->required();
  AddSizeOption(fill, "--block-size", &args->block_size, "Block size");
  fill->add_option("--seed", args->seed, "Seed of the keys and contents")->capture_default_str();
  AddSizeOption(fill, "--capacity", &args->capacity, "NVMe tier capacity (give the same to 'check')");
  fill->add_option("--threads", args->threads, "Concurrent writers (their puts share group commits)")
      ->capture_default_str();
  fill->callback([run, args] { *run = [args] { return RunFill(*args); }; });

  auto* check = store->add_subcommand("check", "Verify every block against the pattern of --seed; with --expect, "
                                               "require every key listed");
  check->add_option("--dir", args->dir, "Store directory or block device")->required();
  check->add_option("--index-dir", args->index_dir, "NVMe index directory given to 'fill' (required when --dir is a "
                                                    "block device)");
  check->add_option("--seed", args->seed, "Seed given to 'fill'")->capture_default_str();
  check->add_option("--expect", args->expect, "File of 'durable <key>' lines as 'fill' printed them");
  AddSizeOption(check, "--capacity", &args->capacity, "NVMe tier capacity given to 'fill'");
  check->callback([run, args] { *run = [args] { return RunCheck(*args); }; });
}

}  // namespace terrace::cli
