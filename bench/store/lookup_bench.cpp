// Lookup throughput of resident keys on one thread: Store::Contains (one key per call) and
// Store::Lookup (batches of 1024), over N keys resident in the host tier, probed in random order.
// The two run in R interleaved rounds (Contains first in even rounds, Lookup first in odd ones);
// each prints its median round with the slowest and fastest.
//   bench_store_lookup [keys=1000000] [probes=10000000] [rounds=5]
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "src/common/median.h"
#include "terrace/store.h"

using namespace terrace;

int main(int argc, char** argv) {
  const std::uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'000;
  const std::uint64_t probes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 10'000'000;
  const std::uint64_t rounds = std::max<std::uint64_t>(argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 5, 1);
  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = (n + 1024) * 4 * kKiB;  // one 4 KiB page per block
  o.host.chunk_bytes = 256 * kMiB;
  o.host.pin = false;
  auto store = Store::Open(o);
  if (!store.ok()) {
    fmt::print(stderr, "{}\n", store.status().ToString());
    return 1;
  }
  std::vector<BlockKey> keys(n);
  std::byte payload[64] = {};
  auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    keys[i] = BlockKey{1, BlockKind::kKv, static_cast<std::uint32_t>(i % 24), ContentId{i * 0x9E3779B97F4A7C15ull, i}};
    if (Status s = (*store)->Put(keys[i], payload); !s.ok()) {
      fmt::print(stderr, "put {}: {}\n", i, s.ToString());
      return 1;
    }
  }
  double fill = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<BlockKey> order(probes);
  std::mt19937_64 rng(1);
  for (auto& k : order) k = keys[rng() % n];

  // Each pass returns lookups/s (millions) and fails the run if a resident key is missed.
  bool missed = false;
  auto contains_pass = [&] {
    const auto t = std::chrono::steady_clock::now();
    std::uint64_t found = 0;
    for (const BlockKey& k : order) found += (*store)->Contains(k);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    missed = missed || found != probes;
    return static_cast<double>(probes) / s / 1e6;
  };
  constexpr std::size_t kBatch = 1024;
  auto lookup_pass = [&] {
    const auto t = std::chrono::steady_clock::now();
    std::uint64_t found = 0;
    for (std::size_t i = 0; i < order.size(); i += kBatch) {
      auto res = (*store)->Lookup(std::span<const BlockKey>(order).subspan(i, std::min(kBatch, order.size() - i)));
      for (const auto& r : res) found += r.found;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    missed = missed || found != probes;
    return static_cast<double>(probes) / s / 1e6;
  };
  std::vector<double> single, batch;
  for (std::uint64_t r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      single.push_back(contains_pass());
      batch.push_back(lookup_pass());
    } else {
      batch.push_back(lookup_pass());
      single.push_back(contains_pass());
    }
  }
  if (missed) {
    fmt::print(stderr, "lookup missed resident keys\n");
    return 1;
  }
  const MedianSpread c = MedianSpreadOf(single), l = MedianSpreadOf(batch);
  fmt::print("{} resident keys (filled in {:.2f} s), {} random probes on one thread, {} interleaved rounds (median "
             "round, slowest-fastest)\n", n, fill, probes, rounds);
  fmt::print("Contains: {:.2f} M lookups/s ({:.2f}-{:.2f})\n", c.median, c.min, c.max);
  fmt::print("Lookup (batches of {}): {:.2f} M lookups/s ({:.2f}-{:.2f})\n", kBatch, l.median, l.min, l.max);
  return 0;
}
