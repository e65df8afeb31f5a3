// What an embedder (an engine adapter, a Python binding) sees: only the public headers. Opens the
// transformers-written fixture, runs it through Model and Session, and checks it against the
// expected logits, with a custom ExpertProvider wrapped around the default one.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "terrace/model.h"  // the only Terrace header of this file

namespace {

namespace tm = terrace::model;
namespace fs = std::filesystem;

fs::path FixtureDir() {
  const char* src = std::getenv("TERRACE_SOURCE_DIR");
  return fs::path(src ? src : ".") / "tests" / "kimi_linear";
}

// Serves experts from another provider and counts what the forward pass asked for.
class CountingExperts : public tm::ExpertProvider {
 public:
  explicit CountingExperts(tm::ExpertProvider* inner) : inner_(inner) {}
  terrace::Result<const tm::ExpertWeights*> Acquire(int layer, int expert) override {
    ++acquired;
    return inner_->Acquire(layer, expert);
  }
  void Release(int layer, int expert) override {
    ++released;
    inner_->Release(layer, expert);
  }
  void Prefetch(int, std::span<const int> experts) override { prefetched += static_cast<int>(experts.size()); }
  std::atomic<int> acquired{0}, released{0}, prefetched{0};

 private:
  tm::ExpertProvider* inner_;
};

}  // namespace

TEST_CASE("the public model API runs a checkpoint end to end", "[kimi_linear][api]") {
  auto ckpt = tm::OpenCheckpoint(FixtureDir() / "checkpoint");
  INFO(ckpt.status().ToString());
  REQUIRE(ckpt.ok());
  CHECK(ckpt->config.hidden_act == tm::Activation::kSilu);
  CHECK(!ckpt->config_keys.read.empty());

  // The default provider, then a wrapper around it passed to Load.
  auto resident = tm::Model::Load(ckpt->config, *ckpt->weights);
  REQUIRE(resident.ok());
  auto counting = std::make_shared<CountingExperts>((*resident)->experts());
  auto model = tm::Model::Load(ckpt->config, *ckpt->weights, counting);
  REQUIRE(model.ok());

  tm::Session a(**resident), b(**model);
  const std::vector<int> prompt{3, 14, 15, 9, 26, 5, 35, 8, 9, 7};
  auto la = a.Prefill(prompt);
  auto lb = b.Prefill(prompt);
  REQUIRE(la.ok());
  REQUIRE(lb.ok());
  CHECK(la->data == lb->data);
  CHECK(counting->acquired > 0);
  CHECK(counting->acquired == counting->released);
  CHECK(counting->prefetched > 0);

  // Decode continues the same sequence; the state is exportable per layer.
  auto next = b.Decode(tm::Argmax(b.last_logits()));
  REQUIRE(next.ok());
  CHECK(b.state().num_tokens() == static_cast<std::int64_t>(prompt.size()) + 1);
  CHECK(tm::ValidateJointBoundary(b.state()).ok());
  auto bytes = b.state().ExportLayer(1);
  REQUIRE(bytes.ok());
  CHECK(!bytes->empty());
}
