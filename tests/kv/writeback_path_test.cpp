// The non-layerwise path of PrefillWithCache (PrefillOptions::layerwise = false: Restore() whole
// before computing, WriteBack() after each piece) against a cold recompute: what it writes
// restores exactly (f32 codecs), whole or layerwise, across chunk sizes and snapshot intervals,
// over chained turns and with blocks missing; and it writes the same blocks, byte for byte, as the
// layerwise write-out (StoreLayer).
#include <catch2/catch.hpp>

#include "kv_test_util.h"

namespace terrace::kv {
namespace {

using namespace testing;

const PrefillOptions kWholeWrite{.restore = true, .write_back = true, .layerwise = false};

TEST_CASE("non-layerwise write-back + restore (whole or layerwise) == cold recompute, bitwise (f32)") {
  const auto& m = Toy();
  for (int C : {8, 16}) {
    for (int every : {1, 3, 0}) {
      CAPTURE(C, every);
      auto store = HostStore();
      auto cache = PrefixCache::Create(Layout(C, every), m.id, store.get(), store.get());
      REQUIRE(cache.ok());
      const int n1 = 7 * C + 5;
      const auto p1 = Tokens(n1);
      const Run first = Prefill(*m.model, **cache, p1, "", kWholeWrite);
      CHECK(first.prefill.restored_tokens == 0);
      CHECK(first.prefill.computed_tokens == n1);
      (*cache)->Flush();
      CHECK((*cache)->Stats().write_failures == 0);
      CHECK((*cache)->Stats().chunk_writes == 7);
      for (int shared : {n1, 3 * C + 1}) {
        const int n2 = n1 + C + 3;
        CAPTURE(shared);
        const auto p2 = Diverge(p1, shared, n2);
        const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 2);
        for (bool restore_layerwise : {false, true}) {
          CAPTURE(restore_layerwise);
          const Run warm = Prefill(*m.model, **cache, p2, "",
                                   {.restore = true, .write_back = false, .layerwise = restore_layerwise}, 2);
          CHECK(warm.prefill.restored_tokens == ExpectedBoundary(n1, shared, n2, C, every));
          CHECK(warm.prefill.restored_tokens + warm.prefill.computed_tokens == n2);
          CHECK(warm.prefill.restore.fallbacks == 0);
          CHECK(warm.prefill.restore.layerwise == (restore_layerwise && warm.prefill.restored_tokens > 0));
          CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, warm.prefill.restored_tokens)));
          for (std::size_t i = 0; i < 2; ++i) CHECK(Bitwise(warm.decode_logits[i], cold.decode_logits[i]));
        }
      }
    }
  }
}

TEST_CASE("WriteBack and StoreLayer write the same blocks, byte for byte (f32)") {
  const auto& m = Toy();
  const int C = 16;
  const auto p = Tokens(5 * C + 7);
  auto whole_store = HostStore(), layer_store = HostStore();
  auto whole = PrefixCache::Create(Layout(C, 2), m.id, whole_store.get(), whole_store.get());
  auto layer = PrefixCache::Create(Layout(C, 2), m.id, layer_store.get(), layer_store.get());
  REQUIRE(whole.ok());
  REQUIRE(layer.ok());
  Prefill(*m.model, **whole, p, "", {.restore = false, .layerwise = false});
  Prefill(*m.model, **layer, p, "", {.restore = false, .layerwise = true});
  (*whole)->Flush();
  (*layer)->Flush();
  const auto a = (*whole)->Stats(), b = (*layer)->Stats();
  CHECK(a.chunk_writes == 5);
  CHECK(a.state_writes == 3 * (*whole)->layout().kda_layers().size());  // chunks 2, 4 and the last, 5
  CHECK(a.chunk_writes == b.chunk_writes);
  CHECK(a.state_writes == b.state_writes);
  CHECK(a.bytes_written == b.bytes_written);
  CHECK(a.write_failures + b.write_failures == 0);
  const auto req = (*whole)->Prepare(p, "");
  std::vector<BlockKey> keys;
  for (const auto& id : req.chunk_ids) {
    keys.push_back(keys::KvChunkKey((*whole)->kv_namespace(), id));
    for (int l : (*whole)->layout().kda_layers()) keys.push_back(keys::StateKey((*whole)->state_namespace(), l, id));
  }
  int compared = 0;
  for (const auto& key : keys) {
    CAPTURE(key.ToString());
    const bool in_whole = whole_store->Contains(key);
    CHECK(in_whole == layer_store->Contains(key));
    if (!in_whole) continue;
    std::vector<std::byte> x(8 << 20), y(8 << 20);
    auto gx = whole_store->Get(key, x);
    auto gy = layer_store->Get(key, y);
    REQUIRE(gx.ok());
    REQUIRE(gy.ok());
    x.resize(gx->size);
    y.resize(gy->size);
    CHECK(x == y);
    ++compared;
  }
  CHECK(compared == static_cast<int>(a.chunk_writes + a.state_writes));
}

TEST_CASE("chained turns through the non-layerwise path: each turn restores the last one's blocks and writes its own") {
  const auto& m = Toy();
  const int C = 16;
  for (int every : {1, 0}) {
    CAPTURE(every);
    auto store = HostStore();
    auto cache = PrefixCache::Create(Layout(C, every), m.id, store.get(), store.get());
    REQUIRE(cache.ok());
    std::vector<std::int32_t> p = Tokens(2 * C + 3);
    for (int turn = 0; turn < 3; ++turn) {
      CAPTURE(turn);
      const Run warm = Prefill(*m.model, **cache, p, "", kWholeWrite, 1);
      (*cache)->Flush();
      const Run cold = Prefill(*m.model, **cache, p, "", {.restore = false, .write_back = false}, 1);
      CHECK(warm.prefill.restored_tokens + warm.prefill.computed_tokens == static_cast<std::int64_t>(p.size()));
      // Each turn's prompt extends the last past its last full chunk, which was snapshotted.
      if (turn > 0) CHECK(warm.prefill.restored_tokens == (static_cast<std::int64_t>(p.size()) - C - 5) / C * C);
      CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, warm.prefill.restored_tokens)));
      CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
      p = Extend(p, static_cast<int>(p.size()), static_cast<int>(p.size()) + C + 5, turn + 1);
    }
  }
}

TEST_CASE("non-layerwise path with blocks missing: an earlier boundary, exact") {
  const auto& m = Toy();
  const int C = 16;
  for (int every : {1, 2}) {
    CAPTURE(every);
    auto store = HostStore();
    auto cache = PrefixCache::Create(Layout(C, every), m.id, store.get(), store.get());
    REQUIRE(cache.ok());
    const auto p = Tokens(6 * C + 3);
    Prefill(*m.model, **cache, p, "", kWholeWrite);
    (*cache)->Flush();
    const auto p2 = Extend(p, 6 * C + 3, 6 * C + 20);
    const auto req = (*cache)->Prepare(p2, "");
    const auto& L = (*cache)->layout();
    const PrefillOptions o{.restore = true, .write_back = false, .layerwise = false};
    const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 1);
    CHECK((*cache)->Lookup(p2, "")->boundary_tokens == 6 * C);
    // The snapshots at chunk 4 erased: the top boundary (6) is still whole.
    for (int l : L.kda_layers()) (void)store->Erase(keys::StateKey((*cache)->state_namespace(), l, req.chunk_ids[3]));
    const Run w1 = Prefill(*m.model, **cache, p2, "", o, 1);
    CHECK(w1.prefill.restored_tokens == 6 * C);
    CHECK(Bitwise(w1.prefill.logits.data, Rows(cold.prefill.logits, 6 * C)));
    // One KDA layer's snapshot at the top erased: back to the previous snapshot (5, or 2 as 4 is gone).
    (void)store->Erase(keys::StateKey((*cache)->state_namespace(), L.kda_layers()[1], req.chunk_ids[5]));
    const Run w2 = Prefill(*m.model, **cache, p2, "", o, 1);
    const std::int64_t want2 = every == 1 ? 5 * C : 2 * C;
    CHECK(w2.prefill.restored_tokens == want2);
    CHECK(w2.prefill.restore.fallbacks == 1);  // the partial boundary 6
    CHECK(Bitwise(w2.prefill.logits.data, Rows(cold.prefill.logits, want2)));
    CHECK(Bitwise(w2.decode_logits.back(), cold.decode_logits.back()));
    // KV chunk 1 erased: only boundary 1 is left (every 1), none otherwise.
    (void)store->Erase(keys::KvChunkKey((*cache)->kv_namespace(), req.chunk_ids[1]));
    const Run w3 = Prefill(*m.model, **cache, p2, "", o, 1);
    CHECK(w3.prefill.restored_tokens == (every == 1 ? C : 0));
    CHECK(Bitwise(w3.prefill.logits.data, Rows(cold.prefill.logits, w3.prefill.restored_tokens)));
    CHECK(Bitwise(w3.decode_logits.back(), cold.decode_logits.back()));
  }
}

}  // namespace
}  // namespace terrace::kv
