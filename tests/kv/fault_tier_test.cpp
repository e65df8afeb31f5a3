// The prefix cache over a fault-injecting state tier (tiers/fault): failed snapshot writes are
// counted and never hit; a snapshot stored with a flipped bit falls back to the previous joint
// boundary; the output stays exact.
#include <catch2/catch.hpp>

#include "kv_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/host/host_tier.h"

namespace terrace::kv {
namespace {

using namespace testing;

std::vector<std::int32_t> Extend(std::vector<std::int32_t> base, int keep, int n, int salt) {
  base.resize(static_cast<std::size_t>(keep));
  for (int i = keep; i < n; ++i) base.push_back((i * 29 + salt) % 512);
  return base;
}

TEST_CASE("failed snapshot writes are counted and never hit; a snapshot corrupt at rest falls back") {
  const auto& m = Toy();
  auto kv_store = HostStore();
  auto fault = std::make_unique<FaultInjectingTier>(SmallHostTier());
  FaultInjectingTier* f = fault.get();
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<std::size_t>(TierId::kHost)] = std::move(fault);
  StoreOptions so;
  so.hbm.mode = HbmMode::kOff;
  // One thread runs the state pool's PutAsync calls, so they reach the fault tier in the writer's
  // order and the armed faults hit the puts the test names (with two, boundary 7's first snapshot
  // could overtake boundary 6's last one: about 1 run in 12 under load).
  so.background_threads = 1;
  auto st_store = Store::OpenWithTiers(so, std::move(tiers));
  REQUIRE(st_store.ok());
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, kv_store.get(), st_store->get());
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
  CHECK((*cache)->Lookup(p6, "").boundary_tokens == 80);
  const Run w6 = Prefill(*m.model, **cache, p6, "", {.restore = true, .write_back = false}, 2);
  const Run c6 = Prefill(*m.model, **cache, p6, "", {.restore = false, .write_back = false}, 2);
  CHECK(w6.prefill.restored_tokens == 80);
  CHECK(Bitwise(w6.prefill.logits.data, Rows(c6.prefill.logits, 80)));
  CHECK(Bitwise(w6.decode_logits.back(), c6.decode_logits.back()));

  // All seven chunks again: boundary 7 looks complete, but its corrupt snapshot fails the store's
  // checksum at read (dropped), so the restore falls back past the missing 6 to 5.
  const auto p7b = Extend(p7, 7 * 16, 7 * 16 + 5, 3);
  CHECK((*cache)->Lookup(p7b, "").boundary_tokens == 112);
  const Run w7 = Prefill(*m.model, **cache, p7b, "", {.restore = true, .write_back = false}, 2);
  CHECK(w7.prefill.restored_tokens == 80);
  CHECK(w7.prefill.restore.fallbacks >= 1);
  CHECK(f->injected().corrupted_puts == 1);
  CHECK((*st_store)->Stats().corruptions_dropped == 1);
  const Run c7 = Prefill(*m.model, **cache, p7b, "", {.restore = false, .write_back = false}, 2);
  CHECK(Bitwise(w7.prefill.logits.data, Rows(c7.prefill.logits, 80)));
  CHECK(Bitwise(w7.decode_logits.back(), c7.decode_logits.back()));
}

}  // namespace
}  // namespace terrace::kv
