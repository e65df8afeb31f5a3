// The prefix cache over faulty tiers: over a fault-injecting state tier (tiers/fault), failed
// snapshot writes are counted and never hit and a snapshot stored with a flipped bit falls back to
// the previous joint boundary, counted as corrupt; a KV chunk or a snapshot erased between the
// restore's lookup and its read falls back too, counted as missing. The output stays exact.
#include <catch2/catch.hpp>

#include <functional>
#include <mutex>
#include <thread>

#include "forwarding_tier.h"
#include "kv_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/host/host_tier.h"

namespace terrace::kv {
namespace {

using namespace testing;

// A store whose only tier is `host` (in the host slot; HBM off), with the rest of `so`.
std::unique_ptr<Store> StoreOnHostTier(std::unique_ptr<Tier> host, StoreOptions so = {}) {
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<std::size_t>(TierId::kHost)] = std::move(host);
  so.hbm.mode = HbmMode::kOff;
  auto s = Store::OpenWithTiers(so, std::move(tiers));
  REQUIRE(s.ok());
  return std::move(s).value();
}

TEST_CASE("failed snapshot writes are counted and never hit; a snapshot corrupt at rest falls back") {
  const auto& m = Toy();
  auto kv_store = HostStore();
  auto fault = std::make_unique<FaultInjectingTier>(SmallHostTier());
  FaultInjectingTier* f = fault.get();
  StoreOptions so;
  // One thread runs the state pool's PutAsync calls, so they reach the fault tier in the writer's
  // order and the armed faults hit the puts the test names (with two, boundary 7's first snapshot
  // could overtake boundary 6's last one: about 1 run in 12 under load).
  so.background_threads = 1;
  auto st_store = StoreOnHostTier(std::move(fault), so);
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  const int kda = static_cast<int>((*cache)->layout().kda_layers().size());

  // Five chunks stored cleanly.
  const auto p = Tokens(5 * 16 + 3);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  REQUIRE((*cache)->Stats().write_failures == 0);

  // Seven chunks: restores 5, computes chunks 6 and 7; the six snapshot writes of boundary 6 fail
  // and the first snapshot of boundary 7 is stored with a flipped bit (corruption at rest).
  const auto p7 = Extend(p, 5 * 16, 7 * 16 + 3, 1);
  f->FailNextPuts(kda, FaultInjectingTier::Eio(false));
  f->CorruptNextPuts(1);
  const Run r7 = Prefill(*m.model, **cache, p7, "");
  CHECK(r7.prefill.restored_tokens == 80);
  (*cache)->Flush();
  CHECK((*cache)->Stats().write_failures == static_cast<std::uint64_t>(kda));
  CHECK(f->injected().put_errors == static_cast<std::uint64_t>(kda));

  // A prompt that shares six chunks: boundary 6 was never written, so it restores 5, exactly.
  const auto p6 = Extend(p7, 6 * 16, 6 * 16 + 9, 2);
  CHECK((*cache)->Lookup(p6, "")->boundary_tokens == 80);
  const Run w6 = Prefill(*m.model, **cache, p6, "", {.restore = true, .write_back = false}, 2);
  const Run c6 = Prefill(*m.model, **cache, p6, "", {.restore = false, .write_back = false}, 2);
  CHECK(w6.prefill.restored_tokens == 80);
  CHECK(Bitwise(w6.prefill.logits.data, Rows(c6.prefill.logits, 80)));
  CHECK(Bitwise(w6.decode_logits.back(), c6.decode_logits.back()));

  // All seven chunks again: boundary 7 looks complete, but its corrupt snapshot fails the store's
  // checksum at read (dropped), so the restore falls back past the missing 6 to 5.
  const auto p7b = Extend(p7, 7 * 16, 7 * 16 + 5, 3);
  CHECK((*cache)->Lookup(p7b, "")->boundary_tokens == 112);
  const Run w7 = Prefill(*m.model, **cache, p7b, "", {.restore = true, .write_back = false}, 2);
  CHECK(w7.prefill.restored_tokens == 80);
  CHECK(w7.prefill.restore.fallbacks >= 1);
  CHECK(f->injected().corrupted_puts == 1);
  CHECK(st_store->Stats().corruptions_dropped == 1);
  // Counted as corrupt (the block failed its own check), not as missing: boundary 6, never
  // written, is no candidate, so the corrupt snapshot is this test's only fallback.
  const auto stats = (*cache)->Stats();
  CHECK(stats.fallbacks == 1);
  CHECK(stats.fallbacks_corrupt == 1);
  CHECK(stats.fallbacks_missing == 0);
  const Run c7 = Prefill(*m.model, **cache, p7b, "", {.restore = false, .write_back = false}, 2);
  CHECK(Bitwise(w7.prefill.logits.data, Rows(c7.prefill.logits, 80)));
  CHECK(Bitwise(w7.decode_logits.back(), c7.decode_logits.back()));
}

TEST_CASE("a failed write-back is counted as a failure only, never as a write or as bytes written") {
  const auto& m = Toy();
  // Two chunks, each written cleanly over fresh pools: what a full write-back counts.
  const auto p = Tokens(2 * 16 + 3);
  PrefixCacheStats clean;
  {
    auto kv_store = HostStore();
    auto st_store = HostStore();
    auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store.get());
    REQUIRE(cache.ok());
    Prefill(*m.model, **cache, p, "");
    (*cache)->Flush();
    clean = (*cache)->Stats();
  }
  REQUIRE(clean.write_failures == 0);
  REQUIRE(clean.chunk_writes == 2);
  REQUIRE(clean.bytes_written > 0);

  // The same prompt with every snapshot Put of the first boundary failing.
  auto kv_store = HostStore();
  auto fault = std::make_unique<FaultInjectingTier>(SmallHostTier());
  FaultInjectingTier* f = fault.get();
  StoreOptions so;
  so.background_threads = 1;  // the writer's order reaches the fault tier (see above)
  auto st_store = StoreOnHostTier(std::move(fault), so);
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  const int kda = static_cast<int>((*cache)->layout().kda_layers().size());
  REQUIRE(clean.state_writes == static_cast<std::uint64_t>(2 * kda));
  f->FailNextPuts(kda, FaultInjectingTier::Eio(false));
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const PrefixCacheStats s = (*cache)->Stats();
  CHECK(s.write_failures == static_cast<std::uint64_t>(kda));
  CHECK(s.chunk_writes == clean.chunk_writes);
  CHECK(s.state_writes == clean.state_writes - static_cast<std::uint64_t>(kda));  // Puts that completed OK only
  CHECK(s.bytes_written < clean.bytes_written);
  CHECK(s.bytes_written == kv_store->Stats().tiers[static_cast<std::size_t>(TierId::kHost)].used_bytes +
                               st_store->Stats().tiers[static_cast<std::size_t>(TierId::kHost)].used_bytes);
}

// A tier that lets one armed block vanish under a reader: when a Get of it arrives (the restore's
// lookup found it, its read has started), another thread erases it through the Store, as an
// eviction or a concurrent Erase would, and only then does the Get reach the tier.
class VanishingTier final : public terrace::testing::ForwardingTier {
 public:
  explicit VanishingTier(std::unique_ptr<Tier> inner) : ForwardingTier(std::move(inner)) {
    caps_.reserves = false;  // Reserve / Commit are not forwarded
  }
  // Arms `erase` (run on a thread of its own, joined before the Get goes on) for the next Get of `key`.
  void EraseOnGet(const BlockKey& key, std::function<void()> erase) {
    std::lock_guard lock(mu_);
    key_ = key;
    erase_ = std::move(erase);
  }
  int vanished() const {
    std::lock_guard lock(mu_);
    return vanished_;
  }
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    std::function<void()> erase;
    {
      std::lock_guard lock(mu_);
      if (erase_ && key == key_) std::swap(erase, erase_);
    }
    if (erase) {
      std::thread(erase).join();
      std::lock_guard lock(mu_);
      ++vanished_;
    }
    return inner_->Get(key, out, desc);
  }

 private:
  mutable std::mutex mu_;
  BlockKey key_;
  std::function<void()> erase_;
  int vanished_ = 0;
};

TEST_CASE("a KV chunk or snapshot erased between the restore's lookup and its read falls back, counted, exact") {
  const auto& m = Toy();
  for (const bool layerwise : {true, false}) {
    for (const bool snapshot : {false, true}) {
      CAPTURE(layerwise, snapshot);
      auto tier = std::make_unique<VanishingTier>(SmallHostTier());
      VanishingTier* v = tier.get();
      const auto owned = StoreOnHostTier(std::move(tier));
      Store* store = owned.get();
      // Snapshots every 2 chunks: at chunks 2, 4 and 5 (the request's last full chunk).
      auto cache = PrefixCache::Create(Layout(16, 2), m.id, store, store);
      REQUIRE(cache.ok());
      const auto p = Tokens(5 * 16 + 3);
      Prefill(*m.model, **cache, p, "");
      (*cache)->Flush();
      REQUIRE((*cache)->Stats().write_failures == 0);
      const auto p2 = Extend(p, 5 * 16 + 3, 5 * 16 + 10, 4);
      const auto req = (*cache)->Prepare(p2, "");
      REQUIRE((*cache)->Lookup(req)->boundary_tokens == 80);
      const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);

      // KV chunk 3 vanishing leaves chunks 0-2, so boundary 2 (no snapshot at 3); KDA layer
      // kda[2]'s snapshot at chunk 5 vanishing leaves boundary 4.
      const auto& L = (*cache)->layout();
      const BlockKey doomed = snapshot ? keys::StateKey((*cache)->state_namespace(), L.kda_layers()[2], req.chunk_ids[4])
                                       : keys::KvChunkKey((*cache)->kv_namespace(), req.chunk_ids[3]);
      const std::int64_t want = snapshot ? 64 : 32;
      Status erased = Status::Internal("the erase never ran");
      v->EraseOnGet(doomed, [&] { erased = store->Erase(doomed); });
      const Run warm =
          Prefill(*m.model, **cache, p2, "", {.restore = true, .write_back = false, .layerwise = layerwise}, 2);
      CHECK(v->vanished() == 1);
      CHECK(erased.ok());
      CHECK(warm.prefill.restore.lookup_boundary_tokens == 80);
      CHECK(warm.prefill.restored_tokens == want);
      CHECK(warm.prefill.restore.layerwise_voided == layerwise);  // a layer handed out failed: the pass restarted
      CHECK(warm.prefill.restore.fallbacks == 1);
      REQUIRE(warm.prefill.restore.fallback_reasons.size() == 1);
      CHECK(warm.prefill.restore.fallback_reasons[0].find("NotFound") != std::string::npos);
      const auto stats = (*cache)->Stats();
      CHECK(stats.fallbacks == 1);
      CHECK(stats.fallbacks_missing == 1);
      CHECK(stats.fallbacks_corrupt == 0);
      CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, want)));
      CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
      CHECK(!store->Contains(doomed));  // gone for good: the next lookup stops short of it
      CHECK((*cache)->Lookup(req)->boundary_tokens == want);
    }
  }
}

}  // namespace
}  // namespace terrace::kv
