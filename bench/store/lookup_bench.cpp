// Lookup throughput of resident keys on one thread: Store::Contains (one key per call) and
// Store::Lookup (batches of 1024), over N keys resident in the host tier, probed in random order.
//   bench_store_lookup [keys=1000000] [probes=10000000]
#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "terrace/store.h"

using namespace terrace;

int main(int argc, char** argv) {
  const std::uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'000;
  const std::uint64_t probes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 10'000'000;
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

  t0 = std::chrono::steady_clock::now();
  std::uint64_t found = 0;
  for (const BlockKey& k : order) found += (*store)->Contains(k);
  double single = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  t0 = std::chrono::steady_clock::now();
  std::uint64_t found_batch = 0;
  constexpr std::size_t kBatch = 1024;
  for (std::size_t i = 0; i < order.size(); i += kBatch) {
    auto res = (*store)->Lookup(std::span<const BlockKey>(order).subspan(i, std::min(kBatch, order.size() - i)));
    for (const auto& r : res) found_batch += r.found;
  }
  double batch = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (found != probes || found_batch != probes) {
    fmt::print(stderr, "lookup missed resident keys: {} / {} / {}\n", found, found_batch, probes);
    return 1;
  }
  fmt::print("{} resident keys (filled in {:.2f} s), {} random probes on one thread\n", n, fill, probes);
  fmt::print("Contains: {:.2f} M lookups/s\n", static_cast<double>(probes) / single / 1e6);
  fmt::print("Lookup (batches of {}): {:.2f} M lookups/s\n", kBatch, static_cast<double>(probes) / batch / 1e6);
  return 0;
}
