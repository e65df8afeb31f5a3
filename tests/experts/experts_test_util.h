// Shared fixtures for the expert-offload tests: one k3-toy checkpoint with random MXFP4 experts,
// resident and offloaded runs of the same prompt (slow home tier wrappers: slow_tier.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "src/model/config.h"
#include "src/model/safetensors.h"
#include "src/model/weights_init.h"
#include "terrace/experts.h"
#include "terrace/model.h"
#include "terrace/store.h"
#include "slow_tier.h"
#include "test_util.h"

namespace terrace::experts::testing {

// A checkpoint of `c` in `dir` with random MXFP4 expert codes (seconds faster than quantising
// random fp32 experts), opened. `residual_scale`: InitOptions::residual_scale.
inline std::unique_ptr<model::ModelDir> InitRandomCodesDir(const model::ModelConfig& c, const std::filesystem::path& dir,
                                                           std::uint64_t seed, double residual_scale = 1.0) {
  model::InitOptions o;
  o.seed = seed;
  o.residual_scale = residual_scale;
  o.random_expert_codes = true;
  REQUIRE(model::InitWeights(c, dir, o).ok());
  auto d = model::ModelDir::Open(dir);
  REQUIRE(d.ok());
  return std::move(d).value();
}

inline const model::ModelDir& ToyDir() {
  static terrace::testing::TempDir dir("experts-k3toy");
  static std::unique_ptr<model::ModelDir> m = [] {
    auto config = model::Preset("k3-toy");
    REQUIRE(config.ok());
    model::InitOptions opt;
    opt.seed = 11;
    REQUIRE(model::InitWeights(*config, dir.path(), opt).ok());
    auto d = model::ModelDir::Open(dir.path());
    REQUIRE(d.ok());
    return std::move(d).value();
  }();
  return *m;
}

inline const std::vector<int>& Prompt() {
  static const std::vector<int> p{3, 141, 59, 265, 35, 89, 7};
  return p;
}
inline constexpr int kDecodeSteps = 5;

// Every logit of a prefill of Prompt() then kDecodeSteps greedy decode steps, and the ids.
struct RunOutput {
  std::vector<float> logits;
  std::vector<int> ids;
};

inline RunOutput Run(const model::Model& m, const model::ForwardOptions* hooks = nullptr) {
  model::Session s(m);
  if (hooks) s.set_hooks(*hooks);
  RunOutput out;
  auto pre = s.Prefill(Prompt());
  if (!pre.ok()) FAIL(pre.status().ToString());
  out.logits = pre->data;
  for (int i = 0; i < kDecodeSteps; ++i) {
    const int next = model::Argmax(s.last_logits());
    out.ids.push_back(next);
    auto l = s.Decode(next);
    if (!l.ok()) FAIL(l.status().ToString());
    out.logits.insert(out.logits.end(), l->begin(), l->end());
  }
  return out;
}

inline const RunOutput& ResidentRun() {
  static const RunOutput r = [] {
    auto m = model::Model::Load(ToyDir().config(), ToyDir());
    REQUIRE(m.ok());
    return Run(**m);
  }();
  return r;
}

// Bitwise equality (a NaN-safe, -0-sensitive comparison).
inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::uint64_t BlockBytes() {
  const auto& c = ToyDir().config();
  int moe = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) moe += c.IsDenseLayer(l) ? 0 : 1;
  return ExpertOffload::TotalExpertBytes(c) / static_cast<std::uint64_t>(moe * c.num_experts);
}

// ToyDir's first MoE layer.
inline int FirstMoeLayer() {
  const auto& c = ToyDir().config();
  for (int l = 0; l < c.num_hidden_layers; ++l)
    if (!c.IsDenseLayer(l)) return l;
  FAIL("k3-toy has no MoE layer");
  return -1;
}

// A store sized for ToyDir's experts, whose fast tier holds opt.budget (home on NVMe in `nvme_dir`
// when given, else in host memory), and an ExpertOffload over it with `opt`. FAILs the test when
// either cannot be opened.
struct ToyOffload {
  std::unique_ptr<Store> store;
  std::shared_ptr<ExpertOffload> offload;
};
inline ToyOffload OpenToyOffload(ExpertOffloadOptions opt, const std::string& nvme_dir = {}) {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  ToyOffload t;
  auto store = Store::Open(ExpertOffload::OpenStoreOptions(total, opt.budget.Resolve(total), nvme_dir));
  if (!store.ok()) FAIL(store.status().ToString());
  t.store = std::move(store).value();
  if (!nvme_dir.empty()) opt.home = TierId::kNvme;
  auto off = ExpertOffload::Create(config, ToyDir(), t.store.get(), std::move(opt));
  if (!off.ok()) FAIL(off.status().ToString());
  t.offload = *off;
  return t;
}

// Experts of `layer` whose copy is in t's fast tier.
inline int ResidentIn(const ToyOffload& t, int layer) {
  int n = 0;
  for (int e = 0; e < ToyDir().config().num_experts; ++e) {
    auto k = t.offload->key(layer, e);
    REQUIRE(k.ok());
    auto where = t.store->Lookup(std::span<const BlockKey>(&*k, 1));
    n += (!where.empty() && where[0].found && where[0].tier == TierId::kHbm) ? 1 : 0;
  }
  return n;
}

// `c` shrunk to a test-sized model (top-8 of 64 experts), its layer pattern and residuals kept.
inline model::ModelConfig SmallConfig(model::ModelConfig c) {
  c.hidden_size = 256;
  c.vocab_size = 512;
  c.num_experts = 64;
  c.moe_intermediate_size = 64;
  c.routed_expert_hidden_size = 256;
  c.shared_expert_intermediate_size = 64;
  c.intermediate_size = 256;
  c.kda.num_heads = 2;
  c.num_attention_heads = 2;
  return c;
}

// Same top-k, ids and weights (bitwise).
inline bool SameRouting(const model::Routing& a, const model::Routing& b) {
  return a.top_k == b.top_k && a.ids == b.ids && a.weights.size() == b.weights.size() &&
         std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)) == 0;
}

}  // namespace terrace::experts::testing
