// Host tier put/get of fixed-size blocks vs plain memcpy of the same sizes between two buffers,
// in the same run. Prints GB/s (10^9 bytes/s) and the tier/memcpy ratio (goal: >= 0.8).
// Also prints Store::Get of the same blocks resident in a host-only Store, and memcpy + XXH3 (what a
// verifying Get must do at least) to show the checksum cost. Batched rows: GetBatch of --batch
// blocks into distinct buffers, with the tier's default (streaming stores once the batch's buffers
// reach a quarter of the last-level cache) and with cached stores only
// (HostTierOptions::stream_get_min_bytes = UINT64_MAX), through the tier and through
// Store::GetBatch; "+ read" rows then read every line of each block, as a consumer would next.
//
// The measurements run in R interleaved rounds (every row once per round, the rows in reverse order
// in odd rounds, so that no row always follows the baseline); each row prints its median GB/s over
// the rounds with the slowest and fastest round, and the median of its per-round ratio against the
// baseline measured in the same round (memcpy; "memcpy + read" for the "+ read" rows), with that
// ratio's range.
//
// Usage: bench_host_tier [--block-size BYTES] [--blocks N] [--passes P] [--rounds R] [--threads T]
//                        [--batch B]
// Defaults: 1 MiB blocks, 128 blocks (128 MiB working set, beyond the CPU caches), 2 passes per
// round, 5 rounds (median reported), 1 thread, batches of 32.
#include "tiers/host/fast_checksum.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "src/common/median.h"
#include "terrace/options.h"
#include "terrace/store.h"
#include "tiers/host/host_tier.h"

using namespace terrace;

namespace {

struct Args {
  std::size_t block = 1 << 20;
  std::size_t blocks = 128;
  int passes = 2;
  int rounds = 5;
  int threads = 1;
  std::size_t batch = 32;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string_view k = argv[i];
    long long v = std::atoll(argv[i + 1]);
    if (k == "--block-size") a.block = static_cast<std::size_t>(v);
    else if (k == "--blocks") a.blocks = static_cast<std::size_t>(v);
    else if (k == "--passes") a.passes = static_cast<int>(v);
    else if (k == "--threads") a.threads = static_cast<int>(v);
    else if (k == "--rounds") a.rounds = static_cast<int>(v);
    else if (k == "--batch") a.batch = static_cast<std::size_t>(std::max(v, 1LL));
    else {
      fmt::print(stderr, "bench_host_tier: unknown flag {}; flags: --block-size --blocks --passes --rounds --threads --batch\n", k);
      std::exit(2);
    }
  }
  return a;
}

BlockKey Key(std::size_t i) { return BlockKey{1, BlockKind::kKv, 0, ContentId{0, i}}; }

// Runs fn(thread, block index) over every block, passes times, split across threads; returns GB/s.
template <typename Fn>
double Measure(const Args& a, Fn fn) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < a.threads; ++t) {
    ts.emplace_back([&, t] {
      for (int p = 0; p < a.passes; ++p) {
        for (std::size_t i = static_cast<std::size_t>(t); i < a.blocks; i += static_cast<std::size_t>(a.threads)) fn(i);
      }
    });
  }
  for (auto& th : ts) th.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(a.block) * static_cast<double>(a.blocks) * a.passes / s / 1e9;
}

// The opened object, or null after printing why it could not be opened.
template <typename T>
std::unique_ptr<T> OrNull(Result<std::unique_ptr<T>> r) {
  if (r.ok()) return std::move(r).value();
  fmt::print(stderr, "bench_host_tier: {}\n", r.status().ToString());
  return nullptr;
}

// Runs fn(first block, count) over every block in batches of a.batch, passes times, on one
// thread; returns GB/s.
template <typename Fn>
double MeasureBatches(const Args& a, Fn fn) {
  auto t0 = std::chrono::steady_clock::now();
  for (int p = 0; p < a.passes; ++p) {
    for (std::size_t i = 0; i < a.blocks; i += a.batch) fn(i, std::min(a.batch, a.blocks - i));
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(a.block) * static_cast<double>(a.blocks) * a.passes / s / 1e9;
}

// Reads one word per cache line of `b` (what a consumer of the block does next, at least).
std::uint64_t ReadLines(const std::vector<std::byte>& b) {
  std::uint64_t acc = 0;
  for (std::size_t j = 0; j + sizeof(std::uint64_t) <= b.size(); j += 64) {
    std::uint64_t w;
    std::memcpy(&w, b.data() + j, sizeof w);
    acc += w;
  }
  return acc;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = Parse(argc, argv);
  std::vector<std::vector<std::byte>> src(a.blocks), dst(a.blocks);
  for (std::size_t i = 0; i < a.blocks; ++i) {
    src[i].resize(a.block);
    dst[i].resize(a.block);
    for (std::size_t j = 0; j < a.block; j += 64) src[i][j] = static_cast<std::byte>(i + j);
  }
  std::vector<BlockDesc> descs(a.blocks);
  for (std::size_t i = 0; i < a.blocks; ++i) descs[i] = DescribeBlock(src[i]);

  HostTierOptions o;
  o.capacity_bytes = (a.blocks + 8) * ((a.block + 4095) / 4096 * 4096) * 2;
  o.chunk_bytes = std::max<std::uint64_t>(64 * kMiB, a.block);
  HostTierOptions cached_o = o;
  cached_o.stream_get_min_bytes = UINT64_MAX;
  std::unique_ptr<HostTier> tier_owned = OrNull(HostTier::Create(o));
  std::unique_ptr<HostTier> cached_owned = OrNull(HostTier::Create(cached_o));
  if (!tier_owned || !cached_owned) return 1;
  HostTier& tier = *tier_owned;
  HostTier& cached = *cached_owned;
  // Warm-up: fault in both buffers and grow the arena, so every measured pass is steady state.
  for (std::size_t i = 0; i < a.blocks; ++i) {
    std::memcpy(dst[i].data(), src[i].data(), a.block);
    if (!tier.Put(Key(i), descs[i], src[i]).ok() || !cached.Put(Key(i), descs[i], src[i]).ok()) return 1;
  }
  // The same blocks through a Store whose only tier is a host tier (the directory, policy and the
  // store's end-to-end check on top of the tier's get).
  StoreOptions so;
  so.hbm.mode = HbmMode::kOff;
  so.host = o;
  std::unique_ptr<Store> store_owned = OrNull(Store::Open(so));
  if (!store_owned) return 1;
  Store& store = *store_owned;
  for (std::size_t i = 0; i < a.blocks; ++i) {
    if (!store.Put(Key(i), src[i]).ok()) return 1;
  }
  std::atomic<int> errors{0};
  std::atomic<std::uint64_t> sink{0};
  auto tier_batch = [&](HostTier& t, std::size_t first, std::size_t n, bool read) {
    std::vector<GetOp> ops;
    for (std::size_t k = 0; k < n; ++k) ops.push_back(GetOp{Key(first + k), dst[first + k], {}});
    for (const Status& st : t.GetBatch(ops)) errors += st.ok() ? 0 : 1;
    if (read) {
      for (std::size_t k = 0; k < n; ++k) sink += ReadLines(dst[first + k]);
    }
  };
  auto store_batch = [&](std::size_t first, std::size_t n) {
    std::vector<Store::GetItem> items;
    for (std::size_t k = 0; k < n; ++k) items.push_back(Store::GetItem{Key(first + k), dst[first + k], {}});
    for (const Status& st : store.GetBatch(items)) errors += st.ok() ? 0 : 1;
  };
  // The machine may be shared: the measurements are interleaved in rounds, and each row reports
  // its median round and its median ratio to the baseline of the same round, so that a burst of
  // outside load hurts one round of every row rather than one row.
  enum { kMemcpy, kPut, kGet, kHash, kStoreGet, kBatch, kBatchCached, kStoreBatch, kMemcpyRead, kBatchRead,
         kBatchCachedRead, kOps };
  std::vector<std::function<double()>> measure(kOps);
  measure[kMemcpy] = [&] { return Measure(a, [&](std::size_t i) { std::memcpy(dst[i].data(), src[i].data(), a.block); }); };
  measure[kPut] = [&] {
    return Measure(a, [&](std::size_t i) {
      if (!tier.Put(Key(i), descs[i], src[i]).ok()) ++errors;
    });
  };
  measure[kGet] = [&] {
    return Measure(a, [&](std::size_t i) {
      BlockDesc d;
      if (!tier.Get(Key(i), dst[i], &d).ok()) ++errors;
    });
  };
  measure[kStoreGet] = [&] {
    return Measure(a, [&](std::size_t i) {
      if (!store.Get(Key(i), dst[i]).ok()) ++errors;
    });
  };
  measure[kHash] = [&] {
    return Measure(a, [&](std::size_t i) {
      std::memcpy(dst[i].data(), src[i].data(), a.block);
      if (tiers::FastChecksum(dst[i].data(), a.block) == 0) ++errors;  // keeps the hash live
    });
  };
  measure[kBatch] = [&] { return MeasureBatches(a, [&](std::size_t i, std::size_t n) { tier_batch(tier, i, n, false); }); };
  measure[kBatchCached] = [&] {
    return MeasureBatches(a, [&](std::size_t i, std::size_t n) { tier_batch(cached, i, n, false); });
  };
  measure[kStoreBatch] = [&] { return MeasureBatches(a, store_batch); };
  measure[kMemcpyRead] = [&] {
    return Measure(a, [&](std::size_t i) {
      std::memcpy(dst[i].data(), src[i].data(), a.block);
      sink += ReadLines(dst[i]);
    });
  };
  measure[kBatchRead] = [&] { return MeasureBatches(a, [&](std::size_t i, std::size_t n) { tier_batch(tier, i, n, true); }); };
  measure[kBatchCachedRead] = [&] {
    return MeasureBatches(a, [&](std::size_t i, std::size_t n) { tier_batch(cached, i, n, true); });
  };
  std::vector<double> gbs[kOps];
  for (int round = 0; round < std::max(a.rounds, 1); ++round) {
    for (int k = 0; k < kOps; ++k) {
      const int op = round % 2 ? kOps - 1 - k : k;
      gbs[op].push_back(measure[op]());
    }
  }
  // Each row's per-round ratio against the baseline of the same round.
  auto ratios = [&](int op, int base) {
    std::vector<double> r;
    for (std::size_t i = 0; i < gbs[op].size(); ++i) r.push_back(gbs[op][i] / gbs[base][i]);
    return MedianSpreadOf(r);
  };
  auto print = [&](const std::string& what, int op, int base, const std::string& note = "") {
    const MedianSpread g = MedianSpreadOf(gbs[op]);
    fmt::print("  {:<38} {:>7.2f} GB/s ({:5.2f}-{:5.2f})", what, g.median, g.min, g.max);
    if (base >= 0) {
      const MedianSpread r = ratios(op, base);
      fmt::print("  ratio {:.2f}x ({:.2f}-{:.2f})", r.median, r.min, r.max);
    }
    fmt::print("{}\n", note.empty() ? "" : "  (" + note + ")");
  };
  fmt::print("host tier bench: {} KiB blocks x {} ({} MiB working set), {} passes x {} interleaved rounds (median "
             "round, slowest-fastest; ratio: median of each round's ratio to the baseline of that round, its range), "
             "{} thread(s); {}\n",
             a.block >> 10, a.blocks, (a.block * a.blocks) >> 20, a.passes, std::max(a.rounds, 1), a.threads,
             tier.PinSummary());
  print("memcpy buffer->buffer", kMemcpy, -1);
  print("host tier put", kPut, kMemcpy);
  print("host tier get (verifies checksum)", kGet, kMemcpy);
  print("Store::Get, host-resident", kStoreGet, kMemcpy);
  print("memcpy then XXH3 (unfused)", kHash, kMemcpy);
  const std::string b = fmt::format("GetBatch of {}", a.batch);
  print(b + ", default", kBatch, kMemcpy,
        tier.stream_get_bytes() == UINT64_MAX ? std::string("cached stores: no cache size known")
                                               : fmt::format("streams from {} KiB of buffers", tier.stream_get_bytes() >> 10));
  print(b + ", cached stores", kBatchCached, kMemcpy);
  print("Store::" + b + ", host-resident", kStoreBatch, kMemcpy);
  print("memcpy + read", kMemcpyRead, -1);
  print(b + ", default + read", kBatchRead, kMemcpyRead);
  print(b + ", cached + read", kBatchCachedRead, kMemcpyRead);
  if (sink.load() == 1) fmt::print(" ");  // keeps the reads live
  if (errors.load() != 0) {
    fmt::print(stderr, "bench_host_tier: {} operations failed\n", errors.load());
    return 1;
  }
  return 0;
}
