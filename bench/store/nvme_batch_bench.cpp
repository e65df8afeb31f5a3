// Store reads of blocks that live only on NVMe: one Get per block vs GetBatch, in the same run.
// GetBatch hands the tier all the reads at once (one io_uring batch, queue depth used); single Gets
// go one at a time. Promotion is off so every read comes from NVMe.
//   bench_store_nvme_batch [--dir D] [--blocks N] [--block-size B] [--batch K] [--rounds R]
// Defaults: ./terrace-bench-store, 8192 blocks of 16 KiB, batches of 256, 5 rounds. Each round times
// both modes, single Gets first in even rounds and GetBatch first in odd ones; each mode prints its
// median round with the slowest and fastest, and the ratio is the median of each round's own
// (single time / batched time), with its range.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "src/common/median.h"
#include "terrace/store.h"

using namespace terrace;

namespace {

BlockKey Key(std::uint64_t i) { return BlockKey{9, BlockKind::kKv, 0, ContentId{i, ~i}}; }

std::vector<std::byte> Payload(std::uint64_t i, std::size_t n) {
  std::vector<std::byte> b(n);
  std::mt19937_64 rng(i);
  for (auto& x : b) x = static_cast<std::byte>(rng());
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "terrace-bench-store";
  std::uint64_t blocks = 8192, block_size = 16 * 1024;
  unsigned batch = 256, rounds = 5;
  CLI::App app{"Store reads from NVMe: single Gets vs GetBatch"};
  app.add_option("--dir", dir, "scratch directory for the NVMe tier (created, then removed)");
  app.add_option("--blocks", blocks, "blocks stored on NVMe")->check(CLI::PositiveNumber);
  app.add_option("--block-size", block_size, "bytes per block")->check(CLI::Range(1ull, 64ull << 20));
  app.add_option("--batch", batch, "items per GetBatch call")->check(CLI::Range(1u, 65536u));
  app.add_option("--rounds", rounds, "interleaved rounds; medians reported")->check(CLI::Range(1u, 100u));
  CLI11_PARSE(app, argc, argv);
  if (std::filesystem::exists(dir)) {
    fmt::print(stderr, "bench_store_nvme_batch: '{}' exists; pass an absent --dir (it is removed afterwards)\n", dir);
    return 2;
  }

  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = 64 * kMiB;
  o.host.pin = false;
  o.nvme.path = dir;
  o.nvme.capacity_bytes = std::max<std::uint64_t>(blocks * ((block_size + 4095) / 4096 * 4096) * 2, 64 * kMiB);
  o.promote_on_get = false;
  auto opened = Store::Open(o);
  if (!opened.ok()) {
    fmt::print(stderr, "bench_store_nvme_batch: {}\n", opened.status().ToString());
    return 1;
  }
  Store& store = **opened;
  for (std::uint64_t i = 0; i < blocks; ++i) {
    if (Status s = store.Put(Key(i), Payload(i, block_size), {Codec::kRaw, TierId::kNvme}); !s.ok()) {
      fmt::print(stderr, "put {}: {}\n", i, s.ToString());
      return 1;
    }
  }
  std::vector<std::uint64_t> order(blocks);
  for (std::uint64_t i = 0; i < blocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(7));
  std::vector<std::byte> out(static_cast<std::size_t>(block_size) * batch);
  std::uint64_t errors = 0;

  auto run_single = [&] {
    for (std::uint64_t i : order) errors += !store.Get(Key(i), std::span<std::byte>(out).first(block_size)).ok();
  };
  auto run_batch = [&] {
    std::vector<Store::GetItem> items;
    for (std::uint64_t b = 0; b < blocks; b += batch) {
      items.clear();
      for (std::uint64_t i = b; i < std::min<std::uint64_t>(b + batch, blocks); ++i) {
        items.push_back({Key(order[i]), std::span<std::byte>(out).subspan((i - b) * block_size, block_size), {}});
      }
      for (const Status& s : store.GetBatch(items)) errors += !s.ok();
    }
  };
  auto time_it = [](auto fn) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double n = static_cast<double>(blocks);
  std::vector<double> single_bps, batched_bps, ratio;  // blocks/s per round; single / batched time per round
  for (unsigned r = 0; r < rounds; ++r) {
    double single = 0, batched = 0;
    if (r % 2 == 0) {
      single = time_it(run_single);
      batched = time_it(run_batch);
    } else {
      batched = time_it(run_batch);
      single = time_it(run_single);
    }
    single_bps.push_back(n / single);
    batched_bps.push_back(n / batched);
    ratio.push_back(single / batched);
  }
  const MedianSpread s = MedianSpreadOf(single_bps), b = MedianSpreadOf(batched_bps), q = MedianSpreadOf(ratio);
  const double mb = static_cast<double>(block_size) / 1e6;  // MB per block
  fmt::print("store reads from NVMe: {} blocks of {} bytes, promotion off, {} interleaved rounds (median round, "
             "slowest-fastest)\n", blocks, block_size, rounds);
  fmt::print("  Get, one block per call     {:>9.0f} blocks/s ({:.0f}-{:.0f})  {:>7.1f} MB/s\n", s.median, s.min, s.max,
             s.median * mb);
  fmt::print("  GetBatch, {:>5} per call    {:>9.0f} blocks/s ({:.0f}-{:.0f})  {:>7.1f} MB/s  ratio {:.2f}x ({:.2f}-{:.2f})\n",
             batch, b.median, b.min, b.max, b.median * mb, q.median, q.min, q.max);
  opened->reset();
  std::filesystem::remove_all(dir);
  if (errors != 0) {
    fmt::print(stderr, "bench_store_nvme_batch: {} reads failed\n", errors);
    return 1;
  }
  return 0;
}
