// Shared fixtures of the prefix-cache tests: k3-toy models with random weights, host-only and NVMe
// stores, cold and cached prefills.
#pragma once

#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "src/model/weights_init.h"
#include "terrace/keys.h"
#include "terrace/prefix_cache.h"
#include "terrace/store.h"
#include "test_util.h"
#include "tiers/host/host_tier.h"

namespace terrace::kv::testing {

struct ToyModel {
  model::Checkpoint ckpt;
  std::unique_ptr<model::Model> model;
  ContentId id;
};

// One k3-toy checkpoint per seed, shared by every test case of the binary.
inline const ToyModel& Toy(std::uint64_t seed = 7) {
  static terrace::testing::TempDir dir("kvtoy");
  static std::map<std::uint64_t, std::unique_ptr<ToyModel>> models;
  auto& slot = models[seed];
  if (!slot) {
    auto config = model::Preset("k3-toy");
    REQUIRE(config.ok());
    const auto path = dir.path() / std::to_string(seed);
    model::InitOptions opt;
    opt.seed = seed;
    REQUIRE(model::InitWeights(*config, path, opt).ok());
    auto ckpt = model::OpenCheckpoint(path);
    REQUIRE(ckpt.ok());
    slot = std::make_unique<ToyModel>();
    slot->ckpt = std::move(ckpt).value();
    auto m = model::Model::Load(slot->ckpt.config, *slot->ckpt.weights);
    REQUIRE(m.ok());
    slot->model = std::move(m).value();
    slot->id = keys::ModelId(slot->ckpt.config, *slot->ckpt.weights);
  }
  return *slot;
}

// A 64 MiB unpinned host tier (4 MiB chunks) for a test to wrap (gate, inject faults) and hand to
// a store as another tier.
inline std::unique_ptr<HostTier> SmallHostTier() {
  HostTierOptions ho;
  ho.capacity_bytes = 64 * kMiB;
  ho.pin = false;
  ho.chunk_bytes = 4 * kMiB;
  auto host = HostTier::Create(ho);
  REQUIRE(host.ok());
  return std::move(host).value();
}

// Makes a wrapping test tier's caps those of a slow, non-addressable (NVMe-kind) tier, so a store
// puts it in the NVMe slot and reads it as it reads NVMe.
inline void PoseAsNvme(TierCaps* caps) {
  caps->id = TierId::kNvme;
  caps->name = "nvme";
  caps->memory = MemoryKind::kNone;
  caps->reserves = false;
}

// A store whose only tier is `tier` (a test wrapper posing as NVMe: PoseAsNvme), put there, never
// promoted from; `tier` points at it for the test to drive.
template <class T>
struct WrappedStore {
  T* tier = nullptr;
  std::unique_ptr<Store> store;
};

template <class T>
WrappedStore<T> StoreOver(std::unique_ptr<T> tier) {
  WrappedStore<T> out;
  out.tier = tier.get();
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<std::size_t>(TierId::kNvme)] = std::move(tier);
  StoreOptions so;
  so.hbm.mode = HbmMode::kOff;
  so.put_tier = TierId::kNvme;
  so.promote_on_get = false;
  auto s = Store::OpenWithTiers(so, std::move(tiers));
  REQUIRE(s.ok());
  out.store = std::move(s).value();
  return out;
}

inline std::unique_ptr<Store> HostStore(std::uint64_t capacity = 256 * kMiB) {
  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = capacity;
  o.host.pin = false;
  o.host.chunk_bytes = 4 * kMiB;
  auto s = Store::Open(o);
  REQUIRE(s.ok());
  return std::move(s).value();
}

// A host tier over an NVMe tier on a file in `dir` (recovering what the file holds).
inline std::unique_ptr<Store> HostNvmeStore(const std::filesystem::path& dir, TierId put_tier, bool promote_on_get,
                                            std::uint64_t host_capacity, std::uint64_t nvme_capacity = 64 * kMiB) {
  StoreOptions o;
  o.hbm.mode = HbmMode::kOff;
  o.host.capacity_bytes = host_capacity;
  o.host.pin = false;
  o.host.chunk_bytes = 4 * kMiB;
  o.nvme.path = dir;
  o.nvme.capacity_bytes = nvme_capacity;
  o.put_tier = put_tier;
  o.promote_on_get = promote_on_get;
  auto s = Store::Open(o);
  REQUIRE(s.ok());
  return std::move(s).value();
}

// An NVMe-only store on a file in `dir` (blocks are written straight to the data file).
inline std::unique_ptr<Store> NvmeStore(const std::filesystem::path& dir, std::uint64_t capacity = 64 * kMiB) {
  return HostNvmeStore(dir, TierId::kNvme, /*promote_on_get=*/false, 4 * kMiB, capacity);
}

inline std::vector<std::int32_t> Tokens(int n, int salt = 0) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = (i * 37 + salt * 11 + 5) % 512;
  return p;
}

// `base`'s first `keep` tokens, then a pattern (one per salt) up to n tokens: a prompt that shares
// exactly a prefix with `base` where the pattern differs from it.
inline std::vector<std::int32_t> Extend(std::vector<std::int32_t> base, int keep, int n, int salt = 0) {
  base.resize(static_cast<std::size_t>(keep));
  for (int i = keep; i < n; ++i) base.push_back((i * 31 + 3 + 7 * salt) % 512);
  return base;
}

inline KvLayout Layout(int chunk, int every, const char* kv_codec = "f32", const char* state_codec = "f32") {
  KvLayoutOptions o;
  o.chunk_tokens = chunk;
  o.snapshot_every = every;
  o.kv_codec = *codec::CodecSpec::Parse(kv_codec);
  o.state_codec = *codec::CodecSpec::Parse(state_codec);
  auto l = KvLayout::FromConfig(Toy().ckpt.config, o);
  REQUIRE(l.ok());
  return *l;
}

struct Run {
  CachedPrefill prefill;
  std::vector<std::vector<float>> decode_logits;  // after the prompt, greedy
};

// Prefill through `cache` (restore / write-back per `o`), then `decode` greedy steps.
inline Run Prefill(const model::Model& m, PrefixCache& cache, const std::vector<std::int32_t>& tokens,
                   const std::string& tenant, PrefillOptions o = {}, int decode = 0) {
  model::Session s(m);
  auto req = cache.Prepare(tokens, tenant);
  auto r = PrefillWithCache(&s, cache, req, o);
  REQUIRE(r.ok());
  Run out;
  out.prefill = std::move(r).value();
  for (int i = 0; i < decode; ++i) {
    auto l = s.Decode(model::Argmax(s.last_logits()));
    REQUIRE(l.ok());
    out.decode_logits.push_back(*l);
  }
  return out;
}

// `stored` prefilled through `cache` and flushed (its chunks and snapshots written), then `next`
// computed cold (nothing restored or written: what a restore of it must equal), and the request
// that restores `next`; `decode` greedy steps after the cold prompt.
struct StoredThenCold {
  Run cold;
  PrefixRequest req;
};
inline StoredThenCold StoreThenRecompute(const model::Model& m, PrefixCache& cache,
                                         const std::vector<std::int32_t>& stored,
                                         const std::vector<std::int32_t>& next, int decode = 0) {
  Prefill(m, cache, stored, "");
  cache.Flush();
  return {Prefill(m, cache, next, "", {.restore = false, .write_back = false}, decode), cache.Prepare(next, "")};
}

// Rows [from, n) of a cold run's logits.
inline std::vector<float> Rows(const model::Tensor& t, std::int64_t from) {
  return std::vector<float>(t.data.begin() + from * t.dim(1), t.data.end());
}

inline bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The boundary (tokens) a restore of prompt 2 must reach after prompt 1 (n1 tokens) was computed
// cold with write-back, when the prompts agree on their first `shared` tokens.
inline std::int64_t ExpectedBoundary(int n1, int shared, int n2, int C, int every) {
  const int written = n1 / C;
  std::int64_t best = 0;
  for (int k = 1; k <= written; ++k) {
    const bool snap = every == 0 ? k == written : (k % every == 0 || k == written);
    if (snap && k <= (n2 - 1) / C && k <= shared / C) best = k;
  }
  return best * C;
}

// Prompt 2 of n2 tokens: p1's first `shared` tokens (then p1's tokens, or a pattern past p1's end),
// changed from position `shared` on.
inline std::vector<std::int32_t> Diverge(const std::vector<std::int32_t>& p1, int shared, int n2) {
  std::vector<std::int32_t> p2(static_cast<std::size_t>(n2));
  for (int i = 0; i < n2; ++i) {
    const auto u = static_cast<std::size_t>(i);
    const std::int32_t base = i < static_cast<int>(p1.size()) ? p1[u] : (i * 13 + 1) % 512;
    p2[u] = i < shared ? base : (base + 1 + i) % 512;
  }
  return p2;
}

// Whether two states hold the same bytes in every layer and cover the same tokens.
inline bool SameState(const model::SequenceState& a, const model::SequenceState& b) {
  if (a.num_layers() != b.num_layers()) return false;
  for (int l = 0; l < a.num_layers(); ++l) {
    auto x = a.ExportLayer(l), y = b.ExportLayer(l);
    if (!x.ok() || !y.ok() || *x != *y || a.layer(l).tokens != b.layer(l).tokens) return false;
  }
  return true;
}

}  // namespace terrace::kv::testing
