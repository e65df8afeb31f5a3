// Layerwise restore and write-out (docs/prefix-cache.md, "Layerwise restore and write-out"):
// a layerwise restore equals a whole restore equals a full recompute, bitwise (f32); a layer is
// handed out while later layers' blocks are still in flight; a bad block of a later layer voids
// the layers already handed out and moves the boundary back (never a half restore); the per-layer
// write-out starts during the forward pass and never blocks it.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "forwarding_tier.h"
#include "kv_test_util.h"
#include "tiers/host/host_tier.h"

namespace terrace::kv {
namespace {

using namespace testing;
using namespace std::chrono_literals;

// A host tier posing as a slow, non-addressable (NVMe-kind) tier whose Puts and/or Gets wait at a
// gate until the test opens it (or `kGateTimeout` passes, so a broken build fails instead of
// hanging). Counts the calls that entered the gate.
class GatedTier final : public terrace::testing::ForwardingTier {
 public:
  static constexpr auto kGateTimeout = 20s;  // long: a loaded machine must not open a gate the test still holds
  explicit GatedTier(std::unique_ptr<Tier> inner) : ForwardingTier(std::move(inner)) { PoseAsNvme(&caps_); }
  void Close(bool puts, bool gets) {
    std::lock_guard lock(mu_);
    puts_closed_ = puts;
    gets_closed_ = gets;
  }
  void Open() {
    {
      std::lock_guard lock(mu_);
      puts_closed_ = gets_closed_ = false;
    }
    cv_.notify_all();
  }
  int puts_entered() const {
    std::lock_guard lock(mu_);
    return puts_entered_;
  }
  int gets_entered() const {
    std::lock_guard lock(mu_);
    return gets_entered_;
  }
  int gets_done() const {
    std::lock_guard lock(mu_);
    return gets_done_;
  }
  // Waits up to `d` until at least `n` Puts (or Gets) entered.
  bool WaitEntered(bool puts, int n, std::chrono::milliseconds d) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, d, [&] { return (puts ? puts_entered_ : gets_entered_) >= n; });
  }

  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override {
    Enter(true);
    return inner_->Put(key, desc, data);
  }
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    Enter(false);
    Status s = inner_->Get(key, out, desc);
    std::lock_guard lock(mu_);
    ++gets_done_;
    return s;
  }

 private:
  void Enter(bool put) {
    std::unique_lock lock(mu_);
    ++(put ? puts_entered_ : gets_entered_);
    cv_.notify_all();
    cv_.wait_for(lock, kGateTimeout, [&] { return !(put ? puts_closed_ : gets_closed_); });
  }
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool puts_closed_ = false, gets_closed_ = false;
  int puts_entered_ = 0, gets_entered_ = 0, gets_done_ = 0;
};

struct GatedStore {
  GatedTier* gate = nullptr;
  std::unique_ptr<Store> store;
};

GatedStore MakeGatedStore() {
  auto w = StoreOver(std::make_unique<GatedTier>(SmallHostTier()));
  return {w.tier, std::move(w.store)};
}

TEST_CASE("layerwise restore == whole restore == full recompute, bitwise (f32), across chunk sizes and intervals") {
  const auto& m = Toy();
  for (const auto& ce : {std::pair{16, 1}, std::pair{16, 2}, std::pair{8, 3}, std::pair{32, 0}}) {
    const int C = ce.first, every = ce.second;
    CAPTURE(C, every);
    auto store = HostStore();
    auto cache = PrefixCache::Create(Layout(C, every), m.id, store.get(), store.get());
    REQUIRE(cache.ok());
    const auto p = Tokens(4 * C + 5);
    Prefill(*m.model, **cache, p, "");  // layerwise write-out
    (*cache)->Flush();
    const auto p2 = Extend(p, 4 * C + 5, 4 * C + 5 + C / 2 + 3);
    const Run lw = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 2);
    const Run whole = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false, .layerwise = false}, 2);
    const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);
    CHECK(lw.prefill.restored_tokens == 4 * C);  // the request's last full chunk always has its snapshot
    CHECK(lw.prefill.restore.layerwise);
    CHECK(!lw.prefill.restore.layerwise_voided);
    CHECK(!whole.prefill.restore.layerwise);
    CHECK(lw.prefill.restored_tokens == whole.prefill.restored_tokens);
    CHECK(lw.prefill.restore.kv_bytes == whole.prefill.restore.kv_bytes);
    CHECK(Bitwise(lw.prefill.logits.data, whole.prefill.logits.data));
    CHECK(Bitwise(lw.prefill.logits.data, Rows(cold.prefill.logits, lw.prefill.restored_tokens)));
    CHECK(Bitwise(lw.decode_logits.back(), cold.decode_logits.back()));
    CHECK(Bitwise(whole.decode_logits.back(), cold.decode_logits.back()));
    CHECK((*cache)->Stats().layerwise_restores == 1);
  }
}

TEST_CASE("a layer is handed out while later layers' KV chunks are still being read; the result is the whole restore") {
  const auto& m = Toy();
  auto kv = MakeGatedStore();
  auto st = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv.store.get(), st.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  REQUIRE(!L.kda_layers().empty());
  REQUIRE(!L.mla_layers().empty());
  REQUIRE(L.kda_layers().front() < L.mla_layers().front());  // k3-toy: KDA layers come first
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const auto req = (*cache)->Prepare(p, "");

  // Direct API: KV Gets held at the gate; the first (KDA) layer is still handed out.
  kv.gate->Close(false, true);
  auto state = model::SequenceState::ForConfig(m.ckpt.config);
  auto restore = (*cache)->BeginRestore(req, &state);
  REQUIRE(restore.ok());
  CHECK((*restore)->boundary_tokens() == 80);
  REQUIRE(kv.gate->WaitEntered(false, 1, 10s));  // a KV read is in flight
  CHECK((*restore)->RetrieveLayer(L.kda_layers().front()).ok());
  CHECK(state.layer(L.kda_layers().front()).tokens == 80);
  CHECK(state.layer(L.mla_layers().front()).tokens == 0);  // not handed out: not there
  kv.gate->Open();
  for (int l = 0; l < L.num_layers(); ++l)
    if (l != L.kda_layers().front()) CHECK((*restore)->RetrieveLayer(l).ok());
  auto rep = (*restore)->Finish();
  REQUIRE(rep.ok());
  CHECK(rep->boundary_tokens == 80);
  CHECK(rep->layerwise);
  auto whole_state = model::SequenceState::ForConfig(m.ckpt.config);
  auto whole = (*cache)->Restore(req, &whole_state);
  REQUIRE(whole.ok());
  CHECK(SameState(state, whole_state));

  // Under a forward pass: the pass reaches the first MLA layer (the KDA layers before it were
  // computed) while the KV chunks are still held at the gate; the hook opens it there.
  const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 20);
  const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 1);
  kv.gate->Close(false, true);
  const int gets_before = kv.gate->gets_entered(), done_before = kv.gate->gets_done();
  bool reached_mla_with_reads_pending = false, first = true;
  model::Session s(*m.model);
  model::ForwardOptions hooks;
  hooks.on_layer_begin = [&](int layer, std::int64_t) {
    if (layer == L.mla_layers().front() && first) {
      first = false;
      // A KV read is held at the gate: none can have completed, yet the KDA layers before ran.
      reached_mla_with_reads_pending =
          kv.gate->WaitEntered(false, gets_before + 1, 10s) && kv.gate->gets_done() == done_before;
      kv.gate->Open();
    }
    return Status::Ok();
  };
  s.set_hooks(hooks);
  auto r = PrefillWithCache(&s, **cache, (*cache)->Prepare(p2, ""), {.restore = true, .write_back = false});
  kv.gate->Open();
  REQUIRE(r.ok());
  CHECK(reached_mla_with_reads_pending);
  CHECK(r->restored_tokens == 80);
  CHECK(r->restore.layerwise);
  CHECK(r->restore.wait_seconds > 0);  // the MLA layer waited for its chunks
  CHECK(r->restore.wait_seconds <= r->compute_seconds);
  CHECK(Bitwise(r->logits.data, Rows(cold.prefill.logits, 80)));
  CHECK(static_cast<bool>(s.hooks().on_layer_begin));  // the session's own hook was put back
  CHECK(!static_cast<bool>(s.hooks().on_layer_end));
  CHECK((*cache)->Stats().restore_wait_seconds >= r->restore.wait_seconds);
}

TEST_CASE("RetrieveLayer twice on one layer is refused and leaves the restore whole (it voided it, losing tokens)") {
  const auto& m = Toy();
  auto kv = HostStore();
  auto st = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv.get(), st.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const auto req = (*cache)->Prepare(p, "");
  auto state = model::SequenceState::ForConfig(m.ckpt.config);
  auto restore = (*cache)->BeginRestore(req, &state);
  REQUIRE(restore.ok());
  REQUIRE((*restore)->boundary_tokens() == 80);
  for (int layer : {L.mla_layers().front(), L.kda_layers().front()}) {
    INFO("layer " << layer);
    REQUIRE((*restore)->RetrieveLayer(layer).ok());
    const Status again = (*restore)->RetrieveLayer(layer);
    CHECK(again.IsInvalidArgument());
    CHECK_THAT(again.message(), Catch::Contains("already retrieved"));
  }
  auto rep = (*restore)->Finish();
  REQUIRE(rep.ok());
  CHECK(rep->boundary_tokens == 80);
  CHECK(rep->fallbacks == 0);
  CHECK_FALSE(rep->layerwise_voided);
  auto whole_state = model::SequenceState::ForConfig(m.ckpt.config);
  REQUIRE((*cache)->Restore(req, &whole_state).ok());
  CHECK(SameState(state, whole_state));
}

TEST_CASE("the KV chunks are read and decoded while the snapshots' read is still in flight") {
  // The snapshots have a thread of their own: a slow state pool never holds back the KV windows
  // (before, the decoder read the snapshots first and decoded no KV window until they landed).
  const auto& m = Toy();
  auto kv = HostStore();
  auto st = MakeGatedStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv.get(), st.store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  REQUIRE(!L.kda_layers().empty());
  REQUIRE(!L.mla_layers().empty());
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const auto req = (*cache)->Prepare(p, "");

  st.gate->Close(false, true);
  const int gets_before = st.gate->gets_entered(), done_before = st.gate->gets_done();
  auto state = model::SequenceState::ForConfig(m.ckpt.config);
  auto restore = (*cache)->BeginRestore(req, &state);
  REQUIRE(restore.ok());
  REQUIRE((*restore)->boundary_tokens() == 80);
  REQUIRE(st.gate->WaitEntered(false, gets_before + 1, 10s));  // a snapshot read is held
  for (int l : L.mla_layers()) CHECK((*restore)->RetrieveLayer(l).ok());
  CHECK(st.gate->gets_done() == done_before);  // every MLA layer was handed out before a snapshot landed
  for (int l : L.mla_layers()) CHECK(state.layer(l).tokens == 80);
  st.gate->Open();
  for (int l : L.kda_layers()) CHECK((*restore)->RetrieveLayer(l).ok());
  auto rep = (*restore)->Finish();
  REQUIRE(rep.ok());
  CHECK(rep->boundary_tokens == 80);
  CHECK(rep->fallbacks == 0);
  auto whole_state = model::SequenceState::ForConfig(m.ckpt.config);
  auto whole = (*cache)->Restore(req, &whole_state);
  REQUIRE(whole.ok());
  CHECK(SameState(state, whole_state));
}

TEST_CASE("a restore decodes MLA latents into the state's own cache, sized for the prompt: the suffix appends in place") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  const auto p = Tokens(5 * 16 + 3);
  const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 24);  // restores 80 tokens, computes [80, 96) and [96, 104)
  const auto [cold, req] = StoreThenRecompute(*m.model, **cache, p, p2);
  const auto W = static_cast<std::size_t>(L.mla_width());
  for (bool layerwise : {true, false}) {
    CAPTURE(layerwise);
    model::Session s(*m.model);
    std::unique_ptr<LayerwiseRestore> lw;
    if (layerwise) {
      auto r = (*cache)->BeginRestore(req, &s.state());
      REQUIRE(r.ok());
      lw = std::move(r).value();
      for (int l = 0; l < L.num_layers(); ++l) REQUIRE(lw->RetrieveLayer(l).ok());
      REQUIRE(lw->Finish().ok());
    } else {
      auto r = (*cache)->Restore(req, &s.state());
      REQUIRE(r.ok());
      REQUIRE(r->boundary_tokens == 80);
    }
    // Every MLA layer holds its 80 restored rows in a buffer with room for the whole prompt ...
    std::vector<const float*> where;
    for (int l : L.mla_layers()) {
      REQUIRE(s.state().layer(l).latents.size() == 80 * W);
      REQUIRE(s.state().layer(l).latents.capacity() >= p2.size() * W);
      where.push_back(s.state().layer(l).latents.data());
    }
    // ... so computing the suffix appends its rows there: the restored rows are never copied again.
    std::vector<float> logits;
    for (const auto& [b, e] : {std::pair{80, 96}, std::pair{96, 104}}) {
      auto piece = s.Prefill(std::span(p2).subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(e - b)));
      REQUIRE(piece.ok());
      logits.insert(logits.end(), piece->data.begin(), piece->data.end());
    }
    for (std::size_t j = 0; j < L.mla_layers().size(); ++j) {
      CHECK(s.state().layer(L.mla_layers()[j]).latents.size() == p2.size() * W);
      CHECK(s.state().layer(L.mla_layers()[j]).latents.data() == where[j]);
    }
    CHECK(Bitwise(logits, Rows(cold.prefill.logits, 80)));
  }
}

// Flips one byte of the block in `file` whose header starts with `magic` and carries `needle`
// (8 bytes) at `needle_at`: at `flip_at`, or (flip_at_entry_offset) at 100 bytes into the
// sub-range whose offset the KV chunk header's layer entry `entry` states.
bool FlipBlockByte(const std::filesystem::path& file, std::string_view magic, std::uint64_t needle,
                   std::size_t needle_at, std::size_t flip_at, int entry = -1) {
  std::ifstream in(file, std::ios::binary);
  std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (std::size_t pos = 0; pos + 4096 <= all.size(); pos += 512) {
    if (std::memcmp(all.data() + pos, magic.data(), 8) != 0) continue;
    std::uint64_t v = 0;
    std::memcpy(&v, all.data() + pos + needle_at, 8);
    if (v != needle) continue;
    std::size_t at = flip_at;
    if (entry >= 0) {
      std::uint64_t off = 0;
      std::memcpy(&off, all.data() + pos + 64 + 48 * static_cast<std::size_t>(entry) + 16, 8);
      at = static_cast<std::size_t>(off) + 100;
    }
    const int fd = ::open(file.c_str(), O_WRONLY);
    if (fd < 0) return false;
    char c = static_cast<char>(all[pos + at] ^ 0x5a);
    const bool ok = ::pwrite(fd, &c, 1, static_cast<off_t>(pos + at)) == 1 && ::fsync(fd) == 0;
    ::close(fd);
    return ok;
  }
  return false;
}

TEST_CASE("a bad block of a later layer voids the layers already handed out: the boundary moves back, output exact",
          "[no-tsan]") {
  const auto& m = Toy();
  terrace::testing::TempDir dir("kvlayer");
  auto kv_store = NvmeStore(dir.path() / "kv");
  auto st_store = NvmeStore(dir.path() / "state");
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  REQUIRE(kv_store->Flush().ok());
  REQUIRE(st_store->Flush().ok());
  const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 11);
  const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);

  // The snapshot at token 80 of a KDA layer after the first MLA layer: the layers before it (the
  // first MLA layer included) are handed out and computed on before it turns out corrupt.
  int late_kda = -1;
  for (int l : L.kda_layers())
    if (l > L.mla_layers().front()) late_kda = l;
  REQUIRE(late_kda > 0);
  const std::uint64_t needle = static_cast<std::uint64_t>(late_kda) | (80ull << 32);  // layer u32, boundary low u32
  REQUIRE(FlipBlockByte(dir.path() / "state" / "terrace.data", "TKDASNP1", needle, 12, 1000));
  const auto layers_begun = std::make_shared<std::vector<int>>();
  model::Session s(*m.model);
  model::ForwardOptions hooks;
  hooks.on_layer_begin = [layers_begun](int layer, std::int64_t) {
    layers_begun->push_back(layer);
    return Status::Ok();
  };
  s.set_hooks(hooks);
  auto r = PrefillWithCache(&s, **cache, (*cache)->Prepare(p2, ""), {.restore = true, .write_back = false});
  REQUIRE(r.ok());
  CHECK(r->restore.lookup_boundary_tokens == 80);
  CHECK(r->restore.layerwise_voided);
  CHECK(r->restored_tokens == 64);
  CHECK(r->restore.boundary_tokens == 64);
  CHECK(r->restore.fallbacks == 1);
  CHECK((*cache)->Stats().layerwise_voided == 1);
  CHECK((*cache)->Stats().fallbacks_corrupt == 1);  // the snapshot failed its checksum: corrupt, not missing
  CHECK((*cache)->Stats().fallbacks_missing == 0);
  CHECK(Bitwise(r->logits.data, Rows(cold.prefill.logits, 64)));
  // The discarded pass stopped at the corrupt layer (no later layer ran on the void state): the
  // next layer begun is layer 0 of the recompute from the earlier boundary.
  REQUIRE(layers_begun->size() > static_cast<std::size_t>(late_kda) + 1);
  CHECK((*layers_begun)[static_cast<std::size_t>(late_kda)] == late_kda);
  CHECK((*layers_begun)[static_cast<std::size_t>(late_kda) + 1] == 0);
  auto d = s.Decode(model::Argmax(s.last_logits()));
  REQUIRE(d.ok());
  CHECK(Bitwise(*d, cold.decode_logits.front()));

  // A corrupt MLA sub-range (second MLA layer's, if any, else the first) of KV chunk 2: boundary 32.
  auto req = (*cache)->Prepare(p2, "");
  const int entry = L.mla_layers().size() > 1 ? 1 : 0;
  REQUIRE(FlipBlockByte(dir.path() / "kv" / "terrace.data", "TKVCHNK1", req.chunk_ids[2].hi, 24, 0, entry));
  const Run w = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 2);
  CHECK(w.prefill.restored_tokens == 32);
  CHECK(w.prefill.restore.fallbacks >= 1);
  // The chunk failed its checksum: one more corrupt; the snapshot dropped above is gone at lookup now
  // (missing).
  CHECK((*cache)->Stats().fallbacks_corrupt == 2);
  CHECK((*cache)->Stats().fallbacks_missing == 1);
  CHECK(Bitwise(w.prefill.logits.data, Rows(cold.prefill.logits, 32)));
  CHECK(Bitwise(w.decode_logits.back(), cold.decode_logits.back()));
}

TEST_CASE("the per-layer write-out starts during the forward pass and never blocks it (slow state tier)") {
  const auto& m = Toy();
  auto kv_store = HostStore();
  auto st = MakeGatedStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st.store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  const int last_layer = L.num_layers() - 1;
  st.gate->Close(true, false);  // every snapshot Put waits at the gate until the test opens it
  const auto p = Tokens(3 * 16 + 5);
  bool write_started_in_pass = false;
  model::Session s(*m.model);
  model::ForwardOptions hooks;
  hooks.on_layer_end = [&](int layer, std::span<const float>, std::int64_t) {
    // The first piece [0, 16): by its last layer, the earlier KDA layers' snapshots are being put.
    if (layer == last_layer && s.state().layer(0).tokens == 16)
      write_started_in_pass = st.gate->WaitEntered(true, 1, 10s);
  };
  s.set_hooks(hooks);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = PrefillWithCache(&s, **cache, (*cache)->Prepare(p, ""));
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int puts_pending = st.gate->puts_entered();
  st.gate->Open();
  REQUIRE(r.ok());
  CHECK(write_started_in_pass);
  // Puts were held at the gate the whole time, yet the prefill returned: it never waited on one.
  CHECK(puts_pending >= 1);
  CHECK(prefill_s < std::chrono::duration<double>(GatedTier::kGateTimeout).count());
  (*cache)->Flush();
  const auto stats = (*cache)->Stats();
  CHECK(stats.write_failures == 0);
  CHECK(stats.state_writes == 3 * L.kda_layers().size());
  CHECK(stats.chunk_writes == 3);
  // What was written restores exactly.
  const auto p2 = Extend(p, 3 * 16 + 5, 3 * 16 + 9);
  const Run warm = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 1);
  const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 1);
  CHECK(warm.prefill.restored_tokens == 48);
  CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, 48)));
}


// Two threads that take turns, one model layer each: a thread's on_layer_begin hands the turn to
// the other and waits for it to come back, so thread 0 runs (and stores) layer l, then thread 1
// layer l, then thread 0 layer l + 1, and so on. Done() ends a thread's turns (the other then never
// waits). A wait longer than 20 s gives up and marks the run broken, so a bug fails the test
// instead of hanging it.
class TakeTurns {
 public:
  void Begin(int me) {
    std::unique_lock lock(mu_);
    if (started_[me]) {
      turn_ = 1 - me;
      cv_.notify_all();
    }
    started_[me] = true;
    if (!cv_.wait_for(lock, 20s, [&] { return turn_ == me || done_[1 - me]; })) broken_ = true;
  }
  void Done(int me) {
    {
      std::lock_guard lock(mu_);
      done_[me] = true;
      turn_ = 1 - me;
    }
    cv_.notify_all();
  }
  bool broken() const {
    std::lock_guard lock(mu_);
    return broken_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int turn_ = 0;
  bool started_[2] = {false, false}, done_[2] = {false, false}, broken_ = false;
};

// How many of `p`'s full chunks have their KV chunk block in `store`.
int KvChunksStored(PrefixCache& cache, Store& store, const std::vector<std::int32_t>& p) {
  int present = 0;
  for (const auto& id : cache.Prepare(p, "").chunk_ids)
    present += store.Contains(keys::KvChunkKey(cache.kv_namespace(), id)) ? 1 : 0;
  return present;
}

TEST_CASE("two layerwise prefills of the same prefix at once each write out every KV chunk block") {
  // The serving case of a shared system prompt: two requests compute the same chunks at the same
  // time, their per-layer write-outs (StoreLayer) interleaved layer by layer. Each pass assembles
  // its own rows of a chunk, so every chunk block is written (by the first pass to complete it)
  // and nothing is left pending once both prefills returned.
  const auto& m = Toy();
  const int C = 16, chunks = 20;
  const auto p = Tokens(chunks * C + 3);
  for (const bool take_turns : {true, false}) {
    CAPTURE(take_turns);
    auto store = HostStore();
    auto cache = PrefixCache::Create(Layout(C, 1), m.id, store.get(), store.get());
    REQUIRE(cache.ok());
    REQUIRE((*cache)->layout().mla_layers().size() >= 2);  // a chunk block needs rows of two layers
    TakeTurns turns;
    std::vector<Status> status(2);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t)
      threads.emplace_back([&, t] {
        model::Session s(*m.model);
        if (take_turns) {
          model::ForwardOptions hooks;
          hooks.on_layer_begin = [&turns, t](int, std::int64_t) {
            turns.Begin(t);
            return Status::Ok();
          };
          s.set_hooks(hooks);
        }
        auto r = PrefillWithCache(&s, **cache, (*cache)->Prepare(p, ""), {.restore = false});
        status[static_cast<std::size_t>(t)] = r.status();
        turns.Done(t);
      });
    for (auto& th : threads) th.join();
    CHECK(!turns.broken());
    CHECK(status[0].ok());
    CHECK(status[1].ok());
    (*cache)->Flush();
    const auto stats = (*cache)->Stats();
    CHECK(stats.write_failures == 0);
    CHECK(stats.chunks_pending == 0);
    CHECK(KvChunksStored(**cache, *store, p) == chunks);
    // Each pass completed every chunk: one of the two Puts wrote it, the other found it there (or,
    // when both checked before either Put, replaced it with the same bytes).
    CHECK(stats.chunk_writes + stats.chunk_already_stored == 2 * chunks);
    CHECK(stats.chunk_writes >= chunks);
    // What was written restores the whole prefix, exactly.
    const auto p2 = Extend(p, chunks * C + 3, chunks * C + 9);
    const Run warm = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 1);
    const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 1);
    CHECK(warm.prefill.restored_tokens == chunks * C);
    CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, chunks * C)));
    CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
  }
}

TEST_CASE("a prefill that stops between a chunk's MLA layers leaves no rows pending; the chunk is not written") {
  const auto& m = Toy();
  const int C = 16;
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(C, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto& L = (*cache)->layout();
  REQUIRE(L.mla_layers().size() >= 2);
  const int second_mla = L.mla_layers()[1];
  const auto p = Tokens(5 * C + 3);
  model::Session s(*m.model);
  model::ForwardOptions hooks;
  // The third piece [32, 48) fails as its second MLA layer begins: the first MLA layer's rows of
  // chunk 2 were stored, the second's never will be.
  hooks.on_layer_begin = [&s, second_mla](int layer, std::int64_t) {
    if (layer == second_mla && s.state().layer(0).tokens == 3 * 16)
      return Status::Internal("the test stops the pass here");
    return Status::Ok();
  };
  s.set_hooks(hooks);
  auto r = PrefillWithCache(&s, **cache, (*cache)->Prepare(p, ""));
  REQUIRE(!r.ok());
  CHECK(r.status().message().find("the test stops the pass here") != std::string::npos);
  (*cache)->Flush();
  CHECK((*cache)->Stats().chunks_pending == 0);
  CHECK(KvChunksStored(**cache, *store, p) == 2);  // chunks 0 and 1; chunk 2 never with a layer missing
  CHECK((*cache)->Stats().write_failures == 0);

  // The direct API: a pass's rows wait for its other MLA layers, and EndStoreLayers drops them.
  model::Session t(*m.model);
  REQUIRE(t.Prefill(std::span(p).subspan(0, 16)).ok());
  const auto req = (*cache)->Prepare(p, "");
  auto t2 = std::make_unique<model::SequenceState>(t.state());  // another pass of the same chunk
  REQUIRE((*cache)->StoreLayer(req, 1, L.mla_layers()[0], t.state(), false).ok());
  REQUIRE((*cache)->StoreLayer(req, 1, L.mla_layers()[0], *t2, false).ok());
  CHECK((*cache)->Stats().chunks_pending == 2);  // one per pass
  (*cache)->EndStoreLayers(*t2);
  CHECK((*cache)->Stats().chunks_pending == 1);
  (*cache)->EndStoreLayers(t.state());
  CHECK((*cache)->Stats().chunks_pending == 0);
}

// The bytes of `keys`' blocks in `store` (each must be there).
std::uint64_t BlocksBytes(Store& store, const std::vector<BlockKey>& keys) {
  std::uint64_t total = 0;
  for (const auto& r : store.Lookup(keys)) {
    REQUIRE(r.found);
    total += r.desc.size;
  }
  return total;
}

TEST_CASE("kv_bytes and state_bytes are the bytes of the blocks restored (not of every block read)", "[no-tsan]") {
  // A corrupt snapshot at the lookup's boundary and one at the next candidate, then a corrupt KV
  // chunk mid-prefix: what was read of the boundaries given up (their snapshots, the chunks past
  // the final boundary, the failed chunk's header and sub-ranges) counts in bytes_read only.
  const auto& m = Toy();
  const int C = 16, chunks = 10;
  const auto p = Tokens(chunks * C + 3);
  const auto p2 = Extend(p, chunks * C + 3, chunks * C + 11);
  struct Mode {
    const char* name;
    bool layerwise;
    RestoreReadOrder order;
  };
  for (const Mode& mode : {Mode{"whole", false, RestoreReadOrder::kChunks},
                           Mode{"layerwise, chunks", true, RestoreReadOrder::kChunks},
                           Mode{"layerwise, layers", true, RestoreReadOrder::kLayers}}) {
    CAPTURE(mode.name);
    terrace::testing::TempDir dir("kvbytes");
    auto kv_store = NvmeStore(dir.path() / "kv");
    auto st_store = NvmeStore(dir.path() / "state");
    auto cache = PrefixCache::Create(Layout(C, 1), m.id, kv_store.get(), st_store.get());
    REQUIRE(cache.ok());
    (*cache)->SetRestoreReadOrder(mode.order);
    const auto& L = (*cache)->layout();
    REQUIRE(L.mla_layers().size() >= 2);
    Prefill(*m.model, **cache, p, "");
    (*cache)->Flush();
    REQUIRE(kv_store->Flush().ok());
    REQUIRE(st_store->Flush().ok());
    const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false});
    const auto req = (*cache)->Prepare(p2, "");
    auto kv_bytes = [&](int k) {  // KV chunks [0, k)
      std::vector<BlockKey> keys;
      for (int i = 0; i < k; ++i) keys.push_back(keys::KvChunkKey((*cache)->kv_namespace(), req.chunk_ids[static_cast<std::size_t>(i)]));
      return BlocksBytes(*kv_store, keys);
    };
    auto state_bytes = [&](int k) {  // the snapshots at k chunks
      std::vector<BlockKey> keys;
      for (int l : L.kda_layers())
        keys.push_back(keys::StateKey((*cache)->state_namespace(), l, req.chunk_ids[static_cast<std::size_t>(k - 1)]));
      return BlocksBytes(*st_store, keys);
    };
    auto restore = [&] {
      return Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false, .layerwise = mode.layerwise});
    };
    auto read_total = [](const RestoreReport& r) {
      std::uint64_t n = 0;
      for (auto b : r.bytes_read) n += b;
      return n;
    };
    // Before the blocks are damaged: all of them restored, every byte read is a restored block's.
    const std::uint64_t kv8 = kv_bytes(8), st8 = state_bytes(8), kv5 = kv_bytes(5), st5 = state_bytes(5);

    // The snapshots at token 160 (the last KDA layer's) and 144 (the first KDA layer's) are
    // corrupt: the restore gives up 160, then candidate 144, and restores 128.
    const std::uint64_t at = 160, at2 = 144;
    REQUIRE(FlipBlockByte(dir.path() / "state" / "terrace.data", "TKDASNP1",
                          static_cast<std::uint64_t>(L.kda_layers().back()) | (at << 32), 12, 1000));
    REQUIRE(FlipBlockByte(dir.path() / "state" / "terrace.data", "TKDASNP1",
                          static_cast<std::uint64_t>(L.kda_layers().front()) | (at2 << 32), 12, 1000));
    const Run a = restore();
    CHECK(a.prefill.restore.lookup_boundary_tokens == 160);
    REQUIRE(a.prefill.restored_tokens == 128);
    CHECK(a.prefill.restore.fallbacks == 2);
    CHECK(a.prefill.restore.read_by_layer == (mode.order == RestoreReadOrder::kLayers && mode.layerwise));
    CHECK(a.prefill.restore.kv_bytes == kv8);
    CHECK(a.prefill.restore.state_bytes == st8);
    CHECK(read_total(a.prefill.restore) > a.prefill.restore.kv_bytes + a.prefill.restore.state_bytes);
    CHECK(Bitwise(a.prefill.logits.data, Rows(cold.prefill.logits, 128)));

    // KV chunk 5 is corrupt too (its second MLA layer's sub-range): the restore stops at 80.
    REQUIRE(FlipBlockByte(dir.path() / "kv" / "terrace.data", "TKVCHNK1", req.chunk_ids[5].hi, 24, 0, 1));
    const Run b = restore();
    REQUIRE(b.prefill.restored_tokens == 80);
    CHECK(b.prefill.restore.fallbacks >= 1);
    CHECK(b.prefill.restore.kv_bytes == kv5);
    CHECK(b.prefill.restore.state_bytes == st5);
    CHECK(read_total(b.prefill.restore) > b.prefill.restore.kv_bytes + b.prefill.restore.state_bytes);
    CHECK(Bitwise(b.prefill.logits.data, Rows(cold.prefill.logits, 80)));
  }
}

}  // namespace
TEST_CASE("SetRestorePromotion overrides the stores' promote_on_get for a restore's reads; output exact either way") {
  const auto& m = Toy();
  const int C = 16;
  const auto p = Tokens(4 * C + 5);
  // Writes the prefix into NVMe-only stores under `dir` (each case gets its own: under exclusive
  // placement a promotion moves a block out of NVMe into the volatile host tier).
  auto write_prefix = [&](const std::filesystem::path& dir) {
    auto kv = NvmeStore(dir / "kv");
    auto st = NvmeStore(dir / "state");
    auto cache = PrefixCache::Create(Layout(C, 1), m.id, kv.get(), st.get());
    REQUIRE(cache.ok());
    Prefill(*m.model, **cache, p, "");
    (*cache)->Flush();
  };
  const auto p2 = Extend(p, 4 * C + 5, 4 * C + 5 + 7);
  const Run cold = [&] {
    auto kv = HostStore();
    auto cache = PrefixCache::Create(Layout(C, 1), m.id, kv.get(), kv.get());
    REQUIRE(cache.ok());
    return Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 1);
  }();
  // (store default, override) -> whether the restore promotes.
  for (const auto& [store_default, override_with] :
       {std::pair{false, std::optional<bool>{}}, std::pair{false, std::optional<bool>{true}},
        std::pair{true, std::optional<bool>{}}, std::pair{true, std::optional<bool>{false}}}) {
    const bool promotes = override_with.value_or(store_default);
    CAPTURE(store_default, override_with.has_value(), promotes);
    terrace::testing::TempDir dir("kvpromote");
    write_prefix(dir.path());
    auto kv = HostNvmeStore(dir.path() / "kv", TierId::kHost, store_default, 16 * kMiB);
    auto st = HostNvmeStore(dir.path() / "state", TierId::kHost, store_default, 16 * kMiB);
    auto cache = PrefixCache::Create(Layout(C, 1), m.id, kv.get(), st.get());
    REQUIRE(cache.ok());
    (*cache)->SetRestorePromotion(override_with);
    const Run r = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 1);
    REQUIRE(r.prefill.restored_tokens == 4 * C);
    CHECK(Bitwise(r.prefill.logits.data, Rows(cold.prefill.logits, r.prefill.restored_tokens)));
    CHECK(Bitwise(r.decode_logits.back(), cold.decode_logits.back()));
    CHECK(r.prefill.restore.bytes_read[static_cast<std::size_t>(TierId::kNvme)] > 0);
    CHECK((kv->Stats().promotions > 0) == promotes);
    CHECK((st->Stats().promotions > 0) == promotes);
    // A second restore of the prefix reads what the first promoted from the host tier.
    const Run again = Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false}, 1);
    CHECK(Bitwise(again.decode_logits.back(), cold.decode_logits.back()));
    CHECK((again.prefill.restore.bytes_read[static_cast<std::size_t>(TierId::kNvme)] == 0) == promotes);
  }
}

}  // namespace terrace::kv
