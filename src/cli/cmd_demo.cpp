// terrace demo: the store end to end on embedded defaults (./terrace-data, no server, no GPU).
//
// It plays a small hybrid-model workload at k3-toy shapes: sequences sharing prompt prefixes write
// MLA latent blocks and KDA state snapshots per 64-token chunk (keyed by the chained prefix hash),
// expert weights are stored and prefetched to HBM, and a second wave of requests reuses the
// prefixes. Capacities are small so blocks move between tiers. Every block read is verified.
#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/owned_dirs.h"
#include "terrace/hash.h"
#include "terrace/store.h"

namespace terrace::cli {
namespace {

struct DemoArgs {
  std::string dir = "terrace-data";
  unsigned sequences = 24;
  unsigned chunks = 8;     // 64-token chunks per sequence
  std::uint64_t seed = 1;
  bool fresh = false;
};

// k3-toy shapes (docs/model-format.md section 3).
constexpr int kChunkTokens = 64;
constexpr int kMlaLayers[] = {3, 7};                 // 0-based
constexpr int kKdaLayers[] = {0, 1, 2, 4, 5, 6};
constexpr std::size_t kMlaBlockBytes = kChunkTokens * 80 * 2;   // c_KV 64 + k_pe 16, bf16
constexpr std::size_t kKdaStateBytes = 4 * 64 * 64 * 4;         // 4 heads x 64 x 64 fp32
constexpr int kMoeLayers = 7, kExperts = 16;
constexpr std::size_t kExpertBytes = 96 * 64 * 2 + 96 * 4 * 2 + 128 * 48 + 128 * 3;  // MXFP4 w1,w3,w2 + scales
constexpr std::uint32_t kNs = 0x70e;  // namespace of the demo's model
constexpr std::uint64_t kDemoNvmeBytes = 512 * kMiB;
// The file that marks a store as created by `terrace demo` (only such a store may --fresh remove).
constexpr const char* kDemoMarker = "terrace-demo.marker";

std::vector<std::int32_t> ChunkTokens(unsigned seq, unsigned chunk, unsigned shared_chunks) {
  // The first `shared_chunks` chunks are a prompt prefix shared by groups of 4 sequences.
  unsigned owner = chunk < shared_chunks ? seq / 4 : 1000 + seq;
  std::vector<std::int32_t> t(kChunkTokens);
  for (int i = 0; i < kChunkTokens; ++i) t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((owner * 7919 + chunk * 131 + static_cast<unsigned>(i)) % 512);
  return t;
}

struct Tally {
  std::uint64_t puts = 0, reused = 0, reads = 0, bytes = 0;
};

Status PutVerified(Store& store, const BlockKey& key, std::size_t size, std::uint64_t seed, Tally* tally) {
  if (store.Contains(key)) {  // a prefix seen before: restore instead of recompute
    ++tally->reused;
    return Status::Ok();
  }
  std::vector<std::byte> buf(size);
  FillPattern(seed, key, buf);
  TERRACE_RETURN_IF_ERROR(store.Put(key, buf).WithContext(key.ToString()));
  ++tally->puts;
  tally->bytes += size;
  return Status::Ok();
}

Status ReadVerified(Store& store, const BlockKey& key, std::uint64_t seed, Tally* tally) {
  std::vector<std::byte> buf(std::max(kKdaStateBytes, kExpertBytes)), want;
  TERRACE_ASSIGN_OR_RETURN(BlockDesc d, store.Get(key, buf));
  want.resize(d.size);
  FillPattern(seed, key, want);
  if (!std::equal(want.begin(), want.end(), buf.begin())) {
    return Status::Corruption(fmt::format("demo block {} read back different bytes than were put", key.ToString()));
  }
  ++tally->reads;
  return Status::Ok();
}

Status PlaySequences(Store& store, const DemoArgs& a, unsigned first, Tally* tally) {
  for (unsigned s = first; s < first + a.sequences; ++s) {
    ContentId prefix = RootContentId(kNs);
    std::optional<ContentId> last_state;
    for (unsigned c = 0; c < a.chunks; ++c) {
      prefix = ChainContentId(prefix, ChunkTokens(s, c, a.chunks / 2));
      for (int l : kMlaLayers) {
        TERRACE_RETURN_IF_ERROR(PutVerified(store, {kNs, BlockKind::kKv, static_cast<std::uint32_t>(l), prefix},
                                            kMlaBlockBytes, a.seed, tally));
      }
      if (c % 4 == 3) {  // KDA state snapshots every 4 chunks (256 tokens), the joint restore boundary
        for (int l : kKdaLayers) {
          TERRACE_RETURN_IF_ERROR(PutVerified(store, {kNs, BlockKind::kState, static_cast<std::uint32_t>(l), prefix},
                                              kKdaStateBytes, a.seed, tally));
        }
        last_state = prefix;
      }
    }
    // Restore check: read back the sequence's latest MLA blocks and its latest state snapshot (a
    // sequence of fewer than 4 chunks has none).
    TERRACE_RETURN_IF_ERROR(ReadVerified(store, {kNs, BlockKind::kKv, 3, prefix}, a.seed, tally));
    if (last_state) {
      TERRACE_RETURN_IF_ERROR(ReadVerified(store, {kNs, BlockKind::kState, 0, *last_state}, a.seed, tally));
    }
  }
  return Status::Ok();
}

// NVMe bytes a run may write at most (no prefix shared), against the demo's fixed capacity.
std::uint64_t DemoBytesBound(const DemoArgs& a) {
  const std::uint64_t per_seq = std::uint64_t{a.chunks} * std::size(kMlaLayers) * kMlaBlockBytes +
                                std::uint64_t{a.chunks / 4} * std::size(kKdaLayers) * kKdaStateBytes;
  return std::uint64_t{a.sequences} * per_seq + std::uint64_t{kMoeLayers} * kExperts * kExpertBytes;
}

int RunDemo(const DemoArgs& a) {
  if (DemoBytesBound(a) > kDemoNvmeBytes / 10 * 9) {
    return FailUsage(fmt::format("--sequences {} x --chunks {} may write up to {}, more than the demo's {} NVMe "
                                 "store holds; lower --sequences or --chunks (their product up to about 4000)",
                                 a.sequences, a.chunks, FormatBytes(static_cast<double>(DemoBytesBound(a))),
                                 FormatBytes(static_cast<double>(kDemoNvmeBytes))));
  }
  if (Status s = CheckStoreDirArg(a.dir, "--dir"); !s.ok()) return FailUsage(s.message());
  if (a.fresh) {
    auto removed = RemoveOwnedStore(a.dir, kDemoMarker, "--dir", "terrace demo --fresh");
    if (!removed.ok()) {
      return removed.status().IsIoError() ? Fail(removed.status().message())
                                                              : FailUsage(removed.status().message());
    }
    if (*removed) fmt::print("terrace demo: --fresh removed the demo store at {}\n", a.dir);
  }
  const bool creating = !StoreDataExists(a.dir);
  if (!creating && !IsOwnedStore(a.dir, kDemoMarker)) {
    return FailUsage(fmt::format("--dir {} holds a Terrace store (or other files) that 'terrace demo' did not "
                                 "create; give a new or empty --dir for the demo",
                                 a.dir));
  }
  StoreOptions o;
  o.hbm.capacity_bytes = 4 * kMiB;   // emulated in host memory when there is no GPU
  o.host.capacity_bytes = 8 * kMiB;
  o.host.chunk_bytes = 2 * kMiB;
  o.write_policy = WritePolicy::kWriteThrough;  // every block also lands on NVMe: the next run reuses it
  o.nvme.path = a.dir;
  o.nvme.capacity_bytes = kDemoNvmeBytes;
  auto store_or = Store::Open(o);
  if (!store_or.ok()) return Fail(store_or.status().ToString());
  Store& store = **store_or;
  if (creating) {  // mark the store as the demo's, so a later --fresh may remove it
    if (Status s = WriteMarker(a.dir, kDemoMarker, "terrace demo"); !s.ok()) return Fail(s.message());
  }
  const std::uint64_t existing = store.Stats().blocks;
  fmt::print("terrace demo: store at {} (hbm {}, host {}, nvme {}); {} blocks from earlier runs\n",
             std::filesystem::absolute(a.dir).lexically_normal().string(),
             FormatBytes(static_cast<double>(o.hbm.capacity_bytes)), FormatBytes(static_cast<double>(o.host.capacity_bytes)),
             FormatBytes(static_cast<double>(o.nvme.capacity_bytes)), existing);
  auto start = std::chrono::steady_clock::now();
  Tally kv, experts;

  // 1. Expert weights: stored once, cold, then the router's picks are prefetched to HBM.
  for (int l = 1; l <= kMoeLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) {
      BlockKey key{kNs, BlockKind::kExpert, static_cast<std::uint32_t>(l), ContentId{0, static_cast<std::uint64_t>(e)}};
      if (Status s = PutVerified(store, key, kExpertBytes, a.seed, &experts); !s.ok()) return Fail(s.ToString());
    }
  }
  std::vector<BlockKey> picks;
  for (int l = 1; l <= kMoeLayers; ++l) {
    for (int e : {l % kExperts, (l * 5) % kExperts}) {
      picks.push_back({kNs, BlockKind::kExpert, static_cast<std::uint32_t>(l), ContentId{0, static_cast<std::uint64_t>(e)}});
    }
  }
  auto prefetch = store.Prefetch(picks, store.HasTier(TierId::kHbm) ? TierId::kHbm : TierId::kHost);
  // 2. Two waves of requests; the second reuses the first wave's shared prefixes.
  if (Status s = PlaySequences(store, a, 0, &kv); !s.ok()) return Fail(s.ToString());
  if (Status s = PlaySequences(store, a, 0, &kv); !s.ok()) return Fail(s.ToString());
  std::vector<Status> fetched = prefetch.get();
  std::size_t prefetched = 0;
  for (const Status& s : fetched) prefetched += s.ok();
  for (const BlockKey& k : picks) {
    if (Status s = ReadVerified(store, k, a.seed, &experts); !s.ok()) return Fail(s.ToString());
  }
  if (Status s = store.Flush(); !s.ok()) return Fail(s.ToString());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  StoreStats st = store.Stats();
  fmt::print("KV + state blocks: {} written ({}), {} reused by prefix hash, {} read back and verified\n", kv.puts,
             FormatBytes(static_cast<double>(kv.bytes)), kv.reused, kv.reads);
  fmt::print("expert blocks:     {} written ({}), {} of {} prefetched, {} read back and verified\n", experts.puts,
             FormatBytes(static_cast<double>(experts.bytes)), prefetched, picks.size(), experts.reads);
  std::vector<TierStatsSnapshot> tiers;
  for (int t = 0; t < kNumTiers; ++t) {
    if (st.present[static_cast<std::size_t>(t)]) tiers.push_back(st.tiers[static_cast<std::size_t>(t)]);
  }
  fmt::print("\n{}\n", TierTable(tiers).Render());
  for (const auto& t : tiers) {
    if (!t.detail.empty()) fmt::print("{}: {}\n", t.name, t.detail);
  }
  fmt::print("store: {} blocks, {} promotions, {} demotions, {} evictions ({}), {} dedup hits, {:.2f} s\n", st.blocks,
             st.promotions, st.demotions, st.evictions, st.eviction_policy, st.dedup_hits, secs);
  fmt::print("run 'terrace demo' again: the blocks persisted on NVMe are found and reused; '--fresh' starts over\n");
  return 0;
}

}  // namespace

void RegisterDemo(CLI::App& app, Runner* run) {
  auto a = std::make_shared<DemoArgs>();
  auto* demo = app.add_subcommand("demo", "Run the store end to end on embedded defaults and print a per-tier table");
  demo->add_option("--dir", a->dir, "Data directory (created if missing)")->capture_default_str();
  AddIntOption(demo, "--sequences", &a->sequences, 1u, 10000u, "Sequences per wave");
  AddIntOption(demo, "--chunks", &a->chunks, 1u, 1000u, "64-token chunks per sequence");
  AddIntOption<std::uint64_t>(demo, "--seed", &a->seed, 0, UINT64_MAX, "Seed of the block contents");
  demo->add_flag("--fresh", a->fresh,
                 "Delete the demo's store in --dir first (only a store 'terrace demo' created; anything else is "
                 "refused and left alone)");
  demo->callback([run, a] { *run = [a] { return RunDemo(*a); }; });
}

}  // namespace terrace::cli
