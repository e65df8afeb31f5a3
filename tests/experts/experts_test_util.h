// Shared fixtures for the expert-offload tests: one k3-toy checkpoint with random MXFP4 experts,
// resident and offloaded runs of the same prompt, and a slow single-channel tier wrapper.
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
#include "forwarding_tier.h"
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

// A tier wrapper that serves Gets one at a time, in arrival order, each taking `delay`: a slow
// single-channel device. Records the keys it read, in order. Thread-safe.
class SlowTier final : public terrace::testing::ForwardingTier {
 public:
  SlowTier(std::unique_ptr<Tier> inner, std::chrono::milliseconds delay) : ForwardingTier(std::move(inner)), delay_(delay) {}
  void set_delay(std::chrono::milliseconds d) {
    std::lock_guard lock(mu_);
    delay_ = d;
  }
  std::vector<BlockKey> reads() const {
    std::lock_guard lock(mu_);
    return reads_;
  }
  void clear_reads() {
    std::lock_guard lock(mu_);
    reads_.clear();
  }

  // No zero-copy access: every read of this tier goes through Get and pays the delay (else a move
  // up into HBM copies straight from the inner host arena).
  const std::byte* ResidentPtr(const BlockKey&) const override { return nullptr; }

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    std::unique_lock lock(mu_);
    const std::uint64_t ticket = next_ticket_++;
    cv_.wait(lock, [&] { return serving_ == ticket; });
    reads_.push_back(key);
    const auto d = delay_;
    lock.unlock();
    std::this_thread::sleep_for(d);
    Status s = inner_->Get(key, out, desc);
    lock.lock();
    ++serving_;
    lock.unlock();
    cv_.notify_all();
    return s;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds delay_;
  std::uint64_t next_ticket_ = 0, serving_ = 0;
  std::vector<BlockKey> reads_;
};

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
