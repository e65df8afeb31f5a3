// terrace demo: the store end to end on embedded defaults (./terrace-data, no server, no GPU).
//
// It plays a small hybrid-model workload at k3-toy shapes (sizes from KvLayout, keys from the key
// schema, docs/keys.md): sequences sharing prompt prefixes write one MLA latent block per 64-token
// chunk and KDA state snapshots every 4 chunks (keyed by the tenant-salted chained prefix hash),
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
#include "terrace/keys.h"
#include "terrace/kv_layout.h"
#include "terrace/model_config.h"
#include "terrace/model_weights.h"
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

// The demo's model: k3-toy (docs/model-format.md section 3). It has no weights, so its model id
// covers the config alone; block sizes come from KvLayout, keys from terrace/keys.h (docs/keys.md).
constexpr int kChunkTokens = 64;
constexpr int kSnapshotEvery = 4;  // KDA snapshots every 4 chunks (256 tokens): the joint boundaries
constexpr std::uint64_t kDemoNvmeBytes = 512 * kMiB;

class NoWeights final : public model::WeightSource {
 public:
  Result<model::TensorView> Get(std::string_view name) const override {
    return Status::NotFound(fmt::format("the demo model has no tensor '{}'", name));
  }
  bool Has(std::string_view) const override { return false; }
  std::vector<std::string> Names() const override { return {}; }
};

struct DemoModel {
  model::ModelConfig config;
  kv::KvLayout layout;
  std::uint32_t kv_ns = 0, state_ns = 0, expert_ns = 0;
  std::size_t chunk_block_bytes = 0, state_block_bytes = 0, expert_bytes = 0;
  std::vector<int> moe_layers;
};

const DemoModel& Demo() {
  static const DemoModel m = [] {
    DemoModel d;
    d.config = *model::Preset("k3-toy");
    kv::KvLayoutOptions o;
    o.chunk_tokens = kChunkTokens;
    o.snapshot_every = kSnapshotEvery;
    d.layout = *kv::KvLayout::FromConfig(d.config, o);
    const ContentId id = keys::ModelId(d.config, NoWeights());
    d.kv_ns = keys::Namespace(id, d.layout.Id(), d.layout.kv_codec().Name(), keys::kKeySchemaVersion);
    d.state_ns = keys::Namespace(id, d.layout.Id(), d.layout.state_codec().Name(), keys::kKeySchemaVersion);
    d.expert_ns = keys::Namespace(id, "experts-mxfp4-v1", "mxfp4", keys::kKeySchemaVersion);
    d.chunk_block_bytes = d.layout.mla_chunk_block_bytes();
    d.state_block_bytes = d.layout.state_block_bytes();
    // An MXFP4 expert: w1, w3 [I, latent] and w2 [latent, I], 4 bits per value + one scale byte per 32.
    const std::size_t values = static_cast<std::size_t>(d.config.moe_intermediate_size) *
                               static_cast<std::size_t>(d.config.routed_expert_hidden_size);
    d.expert_bytes = 3 * (values / 2 + values / 32);
    for (int l = 0; l < d.config.num_hidden_layers; ++l)
      if (!d.config.IsDenseLayer(l)) d.moe_layers.push_back(l);
    return d;
  }();
  return m;
}

// The file that marks a store as created by `terrace demo` (only such a store may --fresh remove).
constexpr const char* kDemoMarker = "terrace-demo.marker";

// A sequence's tokens: the first `shared_chunks` chunks are a prompt prefix shared by groups of 4
// sequences.
std::vector<std::int32_t> SequenceTokens(unsigned seq, unsigned chunks, unsigned shared_chunks) {
  std::vector<std::int32_t> t;
  t.reserve(std::size_t{chunks} * kChunkTokens);
  for (unsigned chunk = 0; chunk < chunks; ++chunk) {
    const unsigned owner = chunk < shared_chunks ? seq / 4 : 1000 + seq;
    for (int i = 0; i < kChunkTokens; ++i)
      t.push_back(static_cast<std::int32_t>((owner * 7919 + chunk * 131 + static_cast<unsigned>(i)) % 512));
  }
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
  const DemoModel& m = Demo();
  std::vector<std::byte> buf(std::max({m.chunk_block_bytes, m.state_block_bytes, m.expert_bytes})), want;
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
  const DemoModel& m = Demo();
  for (unsigned s = first; s < first + a.sequences; ++s) {
    const auto ids = keys::ChunkIds(m.kv_ns, "", SequenceTokens(s, a.chunks, a.chunks / 2), kChunkTokens);
    std::optional<ContentId> last_state;
    for (unsigned c = 0; c < a.chunks; ++c) {
      const ContentId& id = ids[c];
      // One block per chunk holds every MLA layer's latents.
      TERRACE_RETURN_IF_ERROR(PutVerified(store, keys::KvChunkKey(m.kv_ns, id), m.chunk_block_bytes, a.seed, tally));
      if ((c + 1) % kSnapshotEvery == 0) {  // KDA snapshots: the joint restore boundaries
        for (int l : m.layout.kda_layers()) {
          TERRACE_RETURN_IF_ERROR(PutVerified(store, keys::StateKey(m.state_ns, l, id), m.state_block_bytes, a.seed, tally));
        }
        last_state = id;
      }
    }
    // Restore check: read back the sequence's latest KV chunk and its latest state snapshot (a
    // sequence of fewer than 4 chunks has none).
    TERRACE_RETURN_IF_ERROR(ReadVerified(store, keys::KvChunkKey(m.kv_ns, ids.back()), a.seed, tally));
    if (last_state) {
      TERRACE_RETURN_IF_ERROR(
          ReadVerified(store, keys::StateKey(m.state_ns, m.layout.kda_layers().front(), *last_state), a.seed, tally));
    }
  }
  return Status::Ok();
}

// NVMe bytes a run may write at most (no prefix shared), against the demo's fixed capacity.
std::uint64_t DemoBytesBound(const DemoArgs& a) {
  const DemoModel& m = Demo();
  const std::uint64_t per_seq = std::uint64_t{a.chunks} * m.chunk_block_bytes +
                                std::uint64_t{a.chunks / kSnapshotEvery} * m.layout.kda_layers().size() * m.state_block_bytes;
  return std::uint64_t{a.sequences} * per_seq +
         m.moe_layers.size() * static_cast<std::uint64_t>(m.config.num_experts) * m.expert_bytes;
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
  const DemoModel& m = Demo();
  const int experts_per_layer = m.config.num_experts;
  for (int l : m.moe_layers) {
    for (int e = 0; e < experts_per_layer; ++e) {
      if (Status s = PutVerified(store, keys::ExpertKey(m.expert_ns, l, e), m.expert_bytes, a.seed, &experts); !s.ok())
        return Fail(s.ToString());
    }
  }
  std::vector<BlockKey> picks;
  for (int l : m.moe_layers) {
    for (int e : {l % experts_per_layer, (l * 5) % experts_per_layer}) picks.push_back(keys::ExpertKey(m.expert_ns, l, e));
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
