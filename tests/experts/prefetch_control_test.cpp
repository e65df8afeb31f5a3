// Prefetch control under a deliberately slow single-channel home tier: demand loads are served
// before queued speculation, stale prefetches (their layer passed) are cancelled, speculative bytes
// in flight stay under the cap; and corrupt or missing blocks are errors naming layer and expert,
// or re-reads from the slower copy, counted. The key cases run twice: with the home copies in the
// host tier and on the real NVMe tier (batched io_uring reads), each behind the slow wrapper.
#include <atomic>
#include <set>
#include <string>

#include <fmt/format.h>

#include "slow_rig.h"

namespace terrace::experts {
namespace {

using testing::BlockBytes;
using testing::ExpertOf;
using testing::Home;
using testing::HomeName;
using testing::LayerOf;
using testing::MakeSlowRig;
using testing::SlowRig;
using testing::ToyDir;

// Predicts a fixed set of experts of `target` after layer `after` ends.
class ScriptedPredictor final : public Predictor {
 public:
  ScriptedPredictor(int after, int target, std::vector<int> experts, double confidence = 0.9)
      : after_(after), target_(target), experts_(std::move(experts)), confidence_(confidence) {}
  std::string_view name() const override { return "scripted"; }
  void OnLayerEnd(std::int64_t step, int layer, std::span<const float>, std::int64_t,
                  std::vector<Prediction>* out) override {
    if (layer == after_) out->push_back(Prediction{step, target_, experts_, confidence_});
  }

 private:
  int after_, target_;
  std::vector<int> experts_;
  double confidence_;
};

// A slow rig (store reads take `delay`, `store_threads` store threads) whose scripted predictor
// asks, after layer 0, for experts 0..9 of layer `target`, with at most `inflight` prefetches and
// `cap_blocks` blocks of speculation in the store; layer 0 has ended, so the ten are issued or queued.
SlowRig TenPredictedAfterLayer0(Home home, int target, unsigned inflight, std::uint64_t cap_blocks,
                                unsigned store_threads, std::chrono::milliseconds delay) {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.max_inflight_prefetches = inflight;
  opt.max_speculative_bytes = cap_blocks * BlockBytes();
  opt.predictor = std::make_unique<ScriptedPredictor>(0, target, std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  SlowRig rig = MakeSlowRig(std::move(opt), store_threads, home);
  rig.slow->set_delay(delay);
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnLayerEnd(0, hidden, 1);
  return rig;
}

// Records every OnLoadBusyShare.
class BusyShareRecorder final : public Predictor {
 public:
  explicit BusyShareRecorder(std::vector<double>* shares) : shares_(shares) {}
  std::string_view name() const override { return "busy-share recorder"; }
  void OnLoadBusyShare(double share) override { shares_->push_back(share); }

 private:
  std::vector<double>* shares_;
};

TEST_CASE("demand loads go ahead of queued speculative prefetches", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.max_inflight_prefetches = 2;
  opt.max_inflight_confident_prefetches = 2;  // however confident, two in flight
  opt.max_speculative_bytes = 64 * BlockBytes();
  // After layer 1, eight experts of layer 3 are predicted.
  opt.predictor = std::make_unique<ScriptedPredictor>(1, 3, std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  // The store could run all eight at once (8 threads): only our queue keeps them back.
  SlowRig rig = MakeSlowRig(std::move(opt), 8, home);
  rig.slow->set_delay(std::chrono::milliseconds(30));
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnLayerEnd(1, hidden, 1);  // issues the speculation
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto lease = rig.offload->Lease(2, 9);  // layer 2 runs: a demand load
  REQUIRE(lease.ok());
  lease->Release();
  rig.offload->Quiesce();
  const auto reads = rig.slow->reads();
  std::size_t demand_pos = reads.size();
  for (std::size_t i = 0; i < reads.size(); ++i)
    if (LayerOf(reads[i]) == 2 && ExpertOf(*rig.offload, reads[i]) == 9) demand_pos = i;
  INFO("demand read at position " << demand_pos << " of " << reads.size());
  REQUIRE(demand_pos < reads.size());
  // At most the two prefetches already in flight were read before it.
  CHECK(demand_pos <= 2);
  // The rest of the speculation still ran afterwards (layer 3 has not passed).
  CHECK(reads.size() == 9);
  ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.misses == 1);
  CHECK(m.prefetches_issued == 8);
  CHECK(m.speculative_bytes == 8 * BlockBytes());
}

TEST_CASE("a confident prediction for the next layer keeps more prefetches in flight; an unsure one two", "[experts]") {
  for (const double confidence : {0.9, 0.5}) {
    ExpertOffloadOptions opt;
    opt.budget = *CacheBudget::Parse("100%");
    opt.max_inflight_prefetches = 2;
    opt.max_inflight_confident_prefetches = 6;
    opt.confident_prefetch_min = 0.75;
    opt.max_speculative_bytes = 64 * BlockBytes();
    opt.predictor = std::make_unique<ScriptedPredictor>(1, 3, std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}, confidence);
    SlowRig rig = MakeSlowRig(std::move(opt), 8);
    rig.slow->set_delay(std::chrono::milliseconds(30));
    const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
    rig.offload->OnLayerEnd(1, hidden, 1);
    INFO("confidence " << confidence);
    CHECK(rig.offload->Metrics().prefetches_issued == (confidence >= 0.75 ? 6u : 2u));
    rig.offload->Quiesce();
    ExpertMetrics m = rig.offload->Metrics();
    CHECK(m.prefetches_issued == 8);
    CHECK(m.speculative_bytes == 8 * BlockBytes());
    CHECK(rig.slow->reads().size() == 8);
  }
}

TEST_CASE("a landed prefetch frees its place for a queued one at the next acquire, a hit included", "[experts]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.max_inflight_prefetches = 2;
  opt.max_speculative_bytes = 64 * BlockBytes();
  opt.predictor = std::make_unique<ScriptedPredictor>(1, 3, std::vector<int>{0, 1, 2, 3, 4, 5}, 0.5);
  SlowRig rig = MakeSlowRig(std::move(opt), 8);
  const auto t0 = std::chrono::steady_clock::now();  // before every load the busy time counts
  {
    auto warm = rig.offload->Lease(2, 9);  // resident from here on: its next acquire is a hit
    REQUIRE(warm.ok());
  }
  rig.slow->set_delay(std::chrono::milliseconds(20));
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnLayerEnd(1, hidden, 1);
  CHECK(rig.offload->Metrics().prefetches_issued == 2);
  // Both land; nothing else pumps the queue until layer 2's hit.
  for (int i = 0; i < 200 && rig.slow->reads().size() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(terrace::testing::kSanitizedBuild ? 300 : 150));  // both 20 ms reads land
  auto hit = rig.offload->Lease(2, 9);
  REQUIRE(hit.ok());
  ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.hits == 1);
  CHECK(m.prefetches_issued == 4);
  hit->Release();
  rig.offload->Quiesce();
  m = rig.offload->Metrics();
  CHECK(m.prefetches_issued == 6);
  // Six 20 ms reads, two at a time, with one more warm-up read before them: the loads were
  // outstanding at least 60 ms and at most the time since the warm-up read was asked for (on a busy
  // machine that read alone can take tens of ms).
  const auto elapsed = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  CHECK(m.schedule.load_busy_ns >= 60'000'000ull);
  CHECK(m.schedule.load_busy_ns <= elapsed + 50'000'000ull);
  CHECK(m.schedule.spec_landed == 6);
}

TEST_CASE("load busy time counts a load in flight up to the snapshot: two snapshots differ by at most the time between them",
          "[experts]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.max_inflight_prefetches = 1;
  opt.max_speculative_bytes = 64 * BlockBytes();
  opt.predictor = std::make_unique<ScriptedPredictor>(1, 3, std::vector<int>{0}, 0.5);
  SlowRig rig = MakeSlowRig(std::move(opt), 8);
  rig.slow->set_delay(std::chrono::milliseconds(200));
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnLayerEnd(1, hidden, 1);  // one 200 ms prefetch of layer 3's expert 0
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const ExpertMetrics m0 = rig.offload->Metrics();  // the prefetch is still in flight
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(m0.schedule.load_busy_ns >= 90'000'000ull);  // counted up to now, not left out
  rig.offload->Quiesce();                             // waits for it to land
  const ExpertMetrics m1 = rig.offload->Metrics();
  const auto between = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  REQUIRE(m1.schedule.load_busy_ns >= m0.schedule.load_busy_ns);
  // Left out of m0, the load's first 100 ms would land in this difference.
  CHECK(m1.schedule.load_busy_ns - m0.schedule.load_busy_ns <= between + 5'000'000ull);
  CHECK(m1.schedule.spec_landed == 1);
}

TEST_CASE("the first expert of a layer's selection batch is usable before the rest of the batch is read", "[experts]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  SlowRig rig = MakeSlowRig(std::move(opt), 3);
  rig.slow->set_delay(std::chrono::milliseconds(terrace::testing::kSanitizedBuild ? 40 : 25));
  const std::vector<int> sel = {1, 2, 3, 4, 5, 6};
  rig.offload->Prefetch(2, sel);  // layer 2's routing: its six experts go to the store as one batch
  auto first = rig.offload->Lease(2, sel.front());
  REQUIRE(first.ok());
  const std::size_t read_then = rig.slow->reads().size();
  INFO(read_then << " of " << sel.size() << " experts of the batch were read when the first one was leased");
  CHECK(read_then < sel.size());  // the first one's compute can start while the rest load
  first->Release();
  for (std::size_t k = 1; k < sel.size(); ++k) {
    auto l = rig.offload->Lease(2, sel[k]);
    REQUIRE(l.ok());
  }
  CHECK(rig.slow->reads().size() == sel.size());  // each read once
  ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.misses == sel.size());
  CHECK(m.demand_bytes == sel.size() * BlockBytes());
}

TEST_CASE("prefetches whose layer has passed are cancelled, queued or in the store", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  // Ten prefetches for layer 1; reads far longer than the 10 ms before layer 1 passes.
  SlowRig rig = TenPredictedAfterLayer0(home, 1, 2, 64, 1, std::chrono::milliseconds(100));
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // Layer 1 ran without them (say its routing differed) and layer 2 starts: layer 1 has passed.
  const int sel2[] = {11};
  rig.offload->Prefetch(2, sel2);
  rig.offload->Quiesce();
  const auto reads = rig.slow->reads();
  std::size_t layer1 = 0;
  for (const auto& k : reads) layer1 += LayerOf(k) == 1 ? 1 : 0;
  INFO(layer1 << " of 10 stale prefetches were read");
  ExpertMetrics m = rig.offload->Metrics();
  if (home == Home::kHost) {
    // Only the one the store had already started (one store thread) may have been read.
    CHECK(layer1 <= 2);
    CHECK(m.prefetches_cancelled >= 8);
  } else {
    // The NVMe tier reads the items handed to the store as one batched request, which cannot be
    // recalled: at most those were read; they land nowhere (read, not moved: cancelled), and the
    // queued rest were dropped unread.
    CHECK(layer1 <= m.prefetches_issued);
    CHECK(m.prefetches_issued < 10);
    CHECK(m.prefetches_cancelled >= 10 - layer1);
  }
  CHECK(m.speculative_bytes <= 2 * BlockBytes());
}

TEST_CASE("prefetches for the layer that is starting are kept, not cancelled as stale", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  SlowRig rig = TenPredictedAfterLayer0(home, 1, 2, 64, 1, std::chrono::milliseconds(20));  // most still queued
  // Layer 1's routing arrives while they are in the store or queued: they are wanted now, not stale.
  const int sel1[] = {0, 1};
  rig.offload->Prefetch(1, sel1);
  rig.offload->Quiesce();
  ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.prefetches_cancelled == 0);
  std::size_t layer1 = 0;
  for (const auto& k : rig.slow->reads()) layer1 += LayerOf(k) == 1 ? 1 : 0;
  CHECK(layer1 == 10);  // every predicted expert of layer 1 was read, each once
}

TEST_CASE("speculative bytes in flight stay under the cap", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  SlowRig rig = TenPredictedAfterLayer0(home, 3, 16, 3, 16, std::chrono::milliseconds(20));
  CHECK(rig.offload->Metrics().prefetches_issued == 3);  // the cap's worth went to the store
  // The three reads start on store threads (late on a loaded machine); once they have, and have
  // had time to finish (20 ms each), nothing more is read until the next pump.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (rig.slow->reads().size() < 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  CHECK(rig.slow->reads().size() == 3);
  rig.offload->Quiesce();
  CHECK(rig.slow->reads().size() == 10);
  CHECK(rig.offload->Metrics().speculative_bytes == 10 * BlockBytes());
}

TEST_CASE("a corrupt fast-tier copy is re-read from the home copy and counted; outputs unchanged", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("25%");
  SlowRig rig = MakeSlowRig(std::move(opt), 2, home);
  // The next two copies into the fast tier rot there. Acquire re-copies from the home copy up to
  // (tiers + 1) times; the host-homed store has two tiers, the NVMe-homed one three, so the third
  // copy must come through.
  rig.hbm_faults->CorruptNextPuts(2);
  auto m = model::Model::Load(ToyDir().config(), ToyDir(), rig.offload);
  REQUIRE(m.ok());
  testing::RunOutput got = testing::Run(**m);
  CHECK(got.ids == testing::ResidentRun().ids);
  CHECK(testing::SameBits(got.logits, testing::ResidentRun().logits));
  const ExpertMetrics x = rig.offload->Metrics();
  CHECK(x.corrupt_copies_reread == 2);
  // Each miss read its home copy once (no predictor: nothing speculative), and each rotten
  // fast-tier copy once more, from the home tier (the NVMe-homed store's host tier holds nothing).
  CHECK(rig.slow->reads().size() == x.misses + 2);
  if (home == Home::kNvme) CHECK(rig.store->Stats().tiers[static_cast<int>(TierId::kHost)].blocks == 0);
}

TEST_CASE("a fast tier that refuses a load is an error without the lost-block remedy", "[experts]") {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("25%");
  SlowRig rig = MakeSlowRig(std::move(opt), 2);
  rig.hbm_faults->FailNextPuts(8, Status::OutOfCapacity("injected: the fast tier is full"));
  auto lease = rig.offload->Lease(3, 5);
  REQUIRE_FALSE(lease.ok());
  CHECK(lease.status().IsOutOfCapacity());
  CHECK(lease.status().message().find("expert 5 of layer 3") != std::string::npos);
  // Storing the experts again would not help: no such advice, and no CLI words in the library.
  CHECK(lease.status().message().find("fresh copy") == std::string::npos);
  CHECK(lease.status().message().find("--model") == std::string::npos);
}

TEST_CASE("a missing or corrupt home copy is an error naming the layer and expert", "[experts]") {
  const Home home = GENERATE(Home::kHost, Home::kNvme);
  INFO("home " << HomeName(home));
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("25%");
  SlowRig rig = MakeSlowRig(std::move(opt), 2, home);
  // Find expert 5 of layer 3's key through a lease, then remove its block.
  auto lease = rig.offload->Lease(3, 5);
  REQUIRE(lease.ok());
  lease->Release();
  const auto reads = rig.slow->reads();
  REQUIRE(reads.size() == 1);
  const BlockKey key = reads[0];
  REQUIRE(rig.offload->Reset().ok());  // drops the fast-tier copy
  REQUIRE(rig.store->Erase(key).ok());
  auto missing = rig.offload->Lease(3, 5);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().IsNotFound());
  CHECK(missing.status().message().find("expert 5 of layer 3") != std::string::npos);
  // The remedy for a lost block, in the library's words (the CLI adds its own).
  CHECK(missing.status().message().find(kLostExpertRemedy) != std::string::npos);
  CHECK(missing.status().message().find("--model") == std::string::npos);

  // A block that passes its checksum but is not an expert block (the magic is wrong).
  auto another = rig.offload->Lease(4, 2);
  REQUIRE(another.ok());
  another->Release();
  const BlockKey k2 = rig.slow->reads().back();
  REQUIRE(rig.offload->Reset().ok());
  std::vector<std::byte> bytes(static_cast<std::size_t>(BlockBytes()));
  REQUIRE(rig.store->Get(k2, bytes).ok());
  REQUIRE(rig.store->Erase(k2).ok());
  bytes[0] ^= std::byte{0xff};
  PutOptions po;
  po.tier = rig.home_tier;
  REQUIRE(rig.store->Put(k2, bytes, po).ok());
  auto bad = rig.offload->Lease(4, 2);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().IsCorruption());
  CHECK(bad.status().message().find("expert 2 of layer 4") != std::string::npos);

  // A home copy that rots at rest fails its checksum: no good copy is left.
  bytes[0] ^= std::byte{0xff};
  REQUIRE(rig.store->Erase(k2).ok());
  rig.PutRottenHomeCopy(k2, bytes);
  auto rotten = rig.offload->Lease(4, 2);
  REQUIRE_FALSE(rotten.ok());
  CHECK(rotten.status().IsCorruption());
  CHECK(rotten.status().message().find("expert 2 of layer 4") != std::string::npos);
  CHECK(rotten.status().message().find("checksum") != std::string::npos);
}

}  // namespace
}  // namespace terrace::experts

namespace terrace::experts {
namespace {

// Predicts eight experts of layer 3 after layer 0, then (a nearer prediction) two of them after
// layer 1, superseding the first.
class RefiningPredictor final : public Predictor {
 public:
  explicit RefiningPredictor(bool supersede) : supersede_(supersede) {}
  std::string_view name() const override { return "refining"; }
  void OnLayerEnd(std::int64_t step, int layer, std::span<const float>, std::int64_t,
                  std::vector<Prediction>* out) override {
    if (layer == 0) out->push_back(Prediction{step, 3, {0, 1, 2, 3, 4, 5, 6, 7}, 0.5});
    if (layer == 1) out->push_back(Prediction{step, 3, {6, 7}, 0.5, supersede_});
  }

 private:
  bool supersede_;
};

// A confident prediction of eight experts of layer 3 after layer 0, provisional or not, then a
// superseding one of two of them after layer 1.
class ProvisionalPredictor final : public Predictor {
 public:
  explicit ProvisionalPredictor(bool provisional) : provisional_(provisional) {}
  std::string_view name() const override { return "provisional"; }
  void OnLayerEnd(std::int64_t step, int layer, std::span<const float>, std::int64_t,
                  std::vector<Prediction>* out) override {
    if (layer == 0) out->push_back(Prediction{step, 3, {0, 1, 2, 3, 4, 5, 6, 7}, 0.9, true, provisional_});
    if (layer == 1) out->push_back(Prediction{step, 3, {6, 7}, 0.9, true});
  }

 private:
  bool provisional_;
};

TEST_CASE("a provisional prediction stays at the plain in-flight limit however confident", "[experts]") {
  for (bool provisional : {true, false}) {
    INFO("provisional " << provisional);
    ExpertOffloadOptions opt;
    opt.budget = *CacheBudget::Parse("100%");
    opt.max_inflight_prefetches = 2;
    opt.max_inflight_confident_prefetches = 8;
    opt.max_speculative_bytes = 64 * BlockBytes();
    opt.predictor = std::make_unique<ProvisionalPredictor>(provisional);
    SlowRig rig = MakeSlowRig(std::move(opt), 8);
    rig.slow->set_delay(std::chrono::milliseconds(20));
    const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
    rig.offload->OnLayerEnd(0, hidden, 1);
    rig.offload->OnLayerEnd(1, hidden, 1);
    rig.offload->Quiesce();
    std::set<int> read;
    for (const BlockKey& k : rig.slow->reads())
      if (LayerOf(k) == 3) read.insert(ExpertOf(*rig.offload, k));
    // Provisional: two handed to the store, the rest queued and superseded. Not provisional: a
    // confident prediction for the nearest target, all eight handed to the store at once.
    if (provisional) {
      CHECK(read.size() <= 4);
      CHECK(read.count(6) == 1);
      CHECK(read.count(7) == 1);
    } else {
      CHECK(read.size() == 8);
    }
  }
}

TEST_CASE("a superseding prediction drops the queued prefetches it leaves out", "[experts]") {
  for (bool supersede : {true, false}) {
    INFO("supersedes " << supersede);
    ExpertOffloadOptions opt;
    opt.budget = *CacheBudget::Parse("100%");
    opt.max_inflight_prefetches = 2;
    opt.max_inflight_confident_prefetches = 2;
    opt.max_speculative_bytes = 64 * BlockBytes();
    opt.predictor = std::make_unique<RefiningPredictor>(supersede);
    SlowRig rig = MakeSlowRig(std::move(opt), 8);
    rig.slow->set_delay(std::chrono::milliseconds(20));
    const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
    rig.offload->OnLayerEnd(0, hidden, 1);  // eight queued, two handed to the store
    rig.offload->OnLayerEnd(1, hidden, 1);  // the nearer prediction: 6 and 7
    rig.offload->Quiesce();
    std::set<int> read;
    for (const BlockKey& k : rig.slow->reads())
      if (LayerOf(k) == 3) read.insert(ExpertOf(*rig.offload, k));
    if (supersede) {
      // The two in flight before the refinement, and 6 and 7: at most four, 6 and 7 among them.
      CHECK(read.size() <= 4);
      CHECK(read.count(6) == 1);
      CHECK(read.count(7) == 1);
      CHECK(rig.offload->Metrics().prefetches_cancelled >= 4);
    } else {
      CHECK(read.size() == 8);
    }
  }
}

}  // namespace
}  // namespace terrace::experts

namespace terrace::experts {
namespace {

TEST_CASE("each new step tells the predictor the share of the last step a load was in flight", "[experts][lookahead]") {
  std::vector<double> shares;
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.predictor = std::make_unique<BusyShareRecorder>(&shares);
  SlowRig rig = MakeSlowRig(std::move(opt), 2);
  const std::vector<float> embedding(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnTokenStart(embedding, 1);  // step 0 starts the clock: nothing to report yet
  CHECK(shares.empty());
  rig.slow->set_delay(std::chrono::milliseconds(60));
  {
    auto lease = rig.offload->Lease(2, 9);  // one demand load of 60 ms: the step is nearly all load
    REQUIRE(lease.ok());
  }
  rig.offload->OnTokenStart(embedding, 1);  // step 1
  REQUIRE(shares.size() == 1);
  CHECK(shares[0] > 0.75);
  CHECK(shares[0] <= 1.0);
  rig.offload->OnLayerEnd(0, embedding, 1);                     // layer 1 of step 1, no loads at all
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  rig.offload->OnTokenStart(embedding, 1);  // step 2
  REQUIRE(shares.size() == 2);
  CHECK(shares[1] >= 0.0);
  CHECK(shares[1] < 0.25);
}

}  // namespace
}  // namespace terrace::experts

namespace terrace::experts {
namespace {

// Predicts expert 0 of layer 3 after layer 1 ends, and records every OnLoadBusyShare.
class OnePrefetchRecorder final : public Predictor {
 public:
  explicit OnePrefetchRecorder(std::vector<double>* shares) : shares_(shares) {}
  std::string_view name() const override { return "one prefetch"; }
  void OnLayerEnd(std::int64_t step, int layer, std::span<const float>, std::int64_t,
                  std::vector<Prediction>* out) override {
    if (layer == 1) out->push_back(Prediction{step, 3, {0}, 0.5});
  }
  void OnLoadBusyShare(double share) override { shares_->push_back(share); }

 private:
  std::vector<double>* shares_;
};

// A rig whose one prefetch (expert 0 of layer 3, issued after layer 1 of step 0) is a 20 ms read
// that has landed on return: the fast tier holds the copy, and the store's per-key report, which
// follows the copy, had time to come in. Nothing has booked it: no acquire, no snapshot.
SlowRig RigWithLandedPrefetch(std::vector<double>* shares) {
  ExpertOffloadOptions opt;
  opt.budget = *CacheBudget::Parse("100%");
  opt.max_speculative_bytes = 64 * BlockBytes();
  opt.predictor = std::make_unique<OnePrefetchRecorder>(shares);
  SlowRig rig = MakeSlowRig(std::move(opt), 8);
  rig.slow->set_delay(std::chrono::milliseconds(20));
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnTokenStart(hidden, 1);  // step 0 starts the busy-share clock
  rig.offload->OnLayerEnd(1, hidden, 1);
  auto key = rig.offload->key(3, 0);
  REQUIRE(key.ok());
  bool landed = false;
  for (int i = 0; i < 400 && !landed; ++i) {
    auto where = rig.store->Lookup(std::span<const BlockKey>(&*key, 1));
    landed = !where.empty() && where[0].found && where[0].tier == TierId::kHbm;
    if (!landed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  REQUIRE(landed);
  std::this_thread::sleep_for(std::chrono::milliseconds(terrace::testing::kSanitizedBuild ? 300 : 100));
  return rig;
}

TEST_CASE("a prefetch that landed before its layer's router chose it is used, not late", "[experts]") {
  std::vector<double> shares;
  SlowRig rig = RigWithLandedPrefetch(&shares);
  const int sel[] = {0};
  rig.offload->Prefetch(3, sel);  // layer 3 chooses the landed expert
  {
    auto lease = rig.offload->Lease(3, 0);
    REQUIRE(lease.ok());
  }
  const ExpertMetrics m = rig.offload->Metrics();
  CHECK(m.hits == 1);
  CHECK(m.late_hits == 0);
  CHECK(m.schedule.spec_used == 1);
  CHECK(m.schedule.spec_late == 0);
}

TEST_CASE("a landed prefetch no acquire has looked at counts as landed in a snapshot, its busy time ended", "[experts]") {
  std::vector<double> shares;
  SlowRig rig = RigWithLandedPrefetch(&shares);
  const ExpertMetrics m0 = rig.offload->Metrics();
  CHECK(m0.schedule.spec_landed == 1);
  CHECK(m0.speculative_bytes == BlockBytes());
  CHECK(m0.speculative_unused_bytes == BlockBytes());
  CHECK(m0.resident_bytes == BlockBytes());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Nothing is in flight: the busy time stays where the landing ended it.
  const ExpertMetrics m1 = rig.offload->Metrics();
  CHECK(m1.schedule.load_busy_ns == m0.schedule.load_busy_ns);
}

TEST_CASE("the step's busy share ends a landed prefetch at its landing, not at the next poll", "[experts][lookahead]") {
  std::vector<double> shares;
  SlowRig rig = RigWithLandedPrefetch(&shares);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the rest of step 0: no load in flight
  const std::vector<float> embedding(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnTokenStart(embedding, 1);  // step 1: reports step 0's share before anything books the load
  REQUIRE(shares.size() == 1);
  // One 20 ms read in a step of more than 300 ms.
  CHECK(shares[0] < 0.5);
}

}  // namespace
}  // namespace terrace::experts

namespace terrace::experts {
namespace {

TEST_CASE("wasted speculative bytes only grow (evicted unused); still-unused ones are a gauge apart from them",
          "[experts][metrics]") {
  ExpertOffloadOptions opt;
  opt.budget.bytes = 2 * BlockBytes();  // two experts
  opt.lead_protected_layers = 0;
  opt.predictor = std::make_unique<ScriptedPredictor>(1, 3, std::vector<int>{0, 1});
  SlowRig rig = MakeSlowRig(std::move(opt), 2);
  const std::vector<float> hidden(static_cast<std::size_t>(ToyDir().config().hidden_size), 0.5f);
  rig.offload->OnLayerEnd(1, hidden, 1);  // prefetches experts 0 and 1 of layer 3
  rig.offload->Quiesce();
  const ExpertMetrics m0 = rig.offload->Metrics();
  REQUIRE(m0.speculative_bytes == 2 * BlockBytes());
  CHECK(m0.speculative_unused_bytes == 2 * BlockBytes());
  CHECK(m0.speculative_wasted_bytes == 0);
  // Expert 1 is used; expert 0 is evicted unused by a demand load.
  const int sel[] = {1};
  rig.offload->Prefetch(3, sel);
  REQUIRE(rig.offload->Lease(3, 1).ok());
  const ExpertMetrics m1 = rig.offload->Metrics();
  CHECK(m1.speculative_unused_bytes == BlockBytes());
  CHECK(m1.speculative_wasted_bytes == 0);
  const int sel4[] = {5};
  rig.offload->Prefetch(4, sel4);
  REQUIRE(rig.offload->Lease(4, 5).ok());
  const ExpertMetrics m2 = rig.offload->Metrics();
  CHECK(m2.evictions >= 1);
  CHECK(m2.speculative_wasted_bytes == BlockBytes());
  CHECK(m2.speculative_unused_bytes == 0);
  // Prometheus: the counter is its own series; bytes_total's kinds partition the bytes loaded.
  const std::string prom = m2.PrometheusText();
  CHECK(prom.find(fmt::format("terrace_experts_speculative_wasted_bytes_total {}\n", BlockBytes())) != std::string::npos);
  CHECK(prom.find("terrace_experts_speculative_unused_bytes 0\n") != std::string::npos);
  CHECK(prom.find("kind=\"wasted\"") == std::string::npos);
  CHECK(prom.find(fmt::format("terrace_experts_bytes_total{{kind=\"demand\"}} {}\n", m2.demand_bytes)) != std::string::npos);
  CHECK(m2.demand_bytes + m2.speculative_bytes == 3 * BlockBytes());
}

}  // namespace
}  // namespace terrace::experts
