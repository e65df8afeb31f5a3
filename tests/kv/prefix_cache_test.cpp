// The prefix cache on k3-toy random weights: restore-then-suffix == full recompute (bitwise with
// f32 passthrough) across prefix lengths, chunk sizes and snapshot intervals; decode after a
// restore == decode after a recompute; missing / corrupt / evicted blocks fall back to the
// previous joint boundary with exact output; tenants, models, layouts and codecs never share blocks.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "kv_test_util.h"

namespace terrace::kv {
namespace {

using namespace testing;

TEST_CASE("the chunked cold prefill equals one plain prefill (the segmentation is harmless)") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(70);
  const Run cold = Prefill(*m.model, **cache, p, "", {.restore = false, .write_back = false});
  model::Session plain(*m.model);
  auto l = plain.Prefill(p);
  REQUIRE(l.ok());
  REQUIRE(cold.prefill.logits.shape == l->shape);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < l->data.size(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(cold.prefill.logits.data[i] - l->data[i])));
    den = std::max(den, static_cast<double>(std::abs(l->data[i])));
  }
  CHECK(num / den < 1e-5);
  CHECK(cold.prefill.restored_tokens == 0);
  CHECK(cold.prefill.computed_tokens == 70);
}

TEST_CASE("restore then compute the suffix == full recompute, bitwise (f32), for every prefix, chunk size and interval") {
  const auto& m = Toy();
  // Sanitizer builds run every prefix at one chunk size and two intervals, TSan the prefixes on and
  // either side of a chunk edge at one interval (the full matrix takes minutes under TSan); the
  // normal build runs all of it.
  using terrace::testing::kSanitizedBuild, terrace::testing::kThreadSanitizedBuild;
  const std::vector<int> chunk_sizes = kSanitizedBuild ? std::vector<int>{16} : std::vector<int>{16, 32};
  const std::vector<int> intervals = kThreadSanitizedBuild ? std::vector<int>{3}
                                     : kSanitizedBuild     ? std::vector<int>{3, 0}
                                                           : std::vector<int>{1, 2, 3, 0};
  for (int C : chunk_sizes) {
    for (int every : intervals) {
      const int n1 = 5 * C + 3;
      const auto p1 = Tokens(n1);
      const std::vector<int> shared_lengths = kThreadSanitizedBuild ? std::vector<int>{0, C - 1, C, C + 1, n1}
                                                                    : std::vector<int>{0, 1, C - 1, C, C + 1, 2 * C, 3 * C + 5, n1};
      for (int shared : shared_lengths) {
        for (int n2 : {shared + 1, shared + C + 7}) {
          CAPTURE(C, every, shared, n2);
          auto store = HostStore();
          auto cache = PrefixCache::Create(Layout(C, every), m.id, store.get(), store.get());
          REQUIRE(cache.ok());
          const Run first = Prefill(*m.model, **cache, p1, "");
          CHECK(first.prefill.restored_tokens == 0);
          (*cache)->Flush();
          CHECK((*cache)->Stats().write_failures == 0);
          const auto p2 = Diverge(p1, shared, n2);
          const std::int64_t want = ExpectedBoundary(n1, shared, n2, C, every);
          CHECK((*cache)->Lookup(p2, "")->boundary_tokens == want);
          const Run warm = Prefill(*m.model, **cache, p2, "", {}, 3);
          const Run cold = Prefill(*m.model, **cache, p2, "", {.restore = false, .write_back = false}, 3);
          CHECK(warm.prefill.restored_tokens == want);
          CHECK(warm.prefill.computed_tokens == n2 - want);
          CHECK(warm.prefill.restore.fallbacks == 0);
          CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, want)));
          REQUIRE(warm.decode_logits.size() == 3);
          for (int i = 0; i < 3; ++i) CHECK(Bitwise(warm.decode_logits[static_cast<std::size_t>(i)], cold.decode_logits[static_cast<std::size_t>(i)]));
        }
      }
    }
  }
}

TEST_CASE("the same prompt again restores all but its last token's chunk; nothing is restored twice into a used state") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  for (int n : {16, 17, 48, 49}) {
    CAPTURE(n);
    const auto p = Tokens(n, n);
    Prefill(*m.model, **cache, p, "");
    (*cache)->Flush();
    const PrefixCacheStats before = (*cache)->Stats();
    const Run again = Prefill(*m.model, **cache, p, "", {}, 2);
    (*cache)->Flush();
    const PrefixCacheStats after = (*cache)->Stats();
    CHECK(again.prefill.restored_tokens == (n - 1) / 16 * 16);
    CHECK(again.prefill.computed_tokens >= 1);
    // A prompt of whole chunks computes its last chunk again: its blocks are found stored, not
    // written (they were counted as writes before).
    const std::uint64_t recomputed = n % 16 == 0 ? 1 : 0;
    CHECK(after.chunk_writes == before.chunk_writes);
    CHECK(after.state_writes == before.state_writes);
    CHECK(after.bytes_written == before.bytes_written);
    CHECK(after.chunk_already_stored - before.chunk_already_stored == recomputed);
    const std::uint64_t kda_layers = (*cache)->layout().kda_layers().size();
    CHECK(after.state_already_stored - before.state_already_stored == recomputed * kda_layers);
    const Run cold = Prefill(*m.model, **cache, p, "", {.restore = false, .write_back = false}, 2);
    CHECK(Bitwise(again.prefill.logits.data, Rows(cold.prefill.logits, again.prefill.restored_tokens)));
    CHECK(Bitwise(again.decode_logits.back(), cold.decode_logits.back()));
  }
  model::Session used(*m.model);
  REQUIRE(used.Prefill(Tokens(3)).ok());
  auto req = (*cache)->Prepare(Tokens(40), "");
  CHECK(!PrefillWithCache(&used, **cache, req).ok());
}

TEST_CASE("a request that does not hold together is refused before anything is read or computed") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(96);  // six full chunks: five restorable, the last token's chunk computed
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  const PrefixRequest good = (*cache)->Prepare(p, "");
  REQUIRE(good.restorable_chunks == 5);
  REQUIRE(good.chunk_ids.size() == 6);

  auto refused = [&](PrefixRequest r, const char* field) {
    CAPTURE(field, r.restorable_chunks, r.chunk_ids.size());
    auto lookup = (*cache)->Lookup(r);
    CHECK(lookup.status().IsInvalidArgument());
    CHECK(lookup.status().message().find(field) != std::string::npos);
    auto state = model::SequenceState::ForConfig(m.ckpt.config);
    Result<RestoreReport> restored = Status::Ok();
    REQUIRE_NOTHROW(restored = (*cache)->Restore(r, &state));
    CHECK(restored.status().IsInvalidArgument());
    CHECK(state.num_tokens() == 0);
    CHECK((*cache)->BeginRestore(r, &state).status().IsInvalidArgument());
    for (bool layerwise : {true, false}) {
      model::Session s(*m.model);
      auto prefill = PrefillWithCache(&s, **cache, r, {.write_back = false, .layerwise = layerwise});
      CHECK(prefill.status().IsInvalidArgument());
      CHECK(s.state().num_tokens() == 0);
    }
  };
  PrefixRequest whole = good;
  whole.restorable_chunks = 6;  // would restore the last token too: nothing left to compute
  refused(whole, "restorable_chunks");
  PrefixRequest negative = good;
  negative.restorable_chunks = -1;
  refused(negative, "restorable_chunks");
  PrefixRequest huge = good;
  huge.restorable_chunks = std::int64_t{1} << 40;
  refused(huge, "restorable_chunks");
  PrefixRequest extra = good;
  extra.chunk_ids.push_back(extra.chunk_ids.back());  // seven ids for six full chunks
  refused(extra, "chunk_ids");
}

TEST_CASE("a request whose tokens or tenant were changed after Prepare is refused, never restored from another prompt") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto a = Tokens(70), b = Tokens(70, 3);  // same length, another prompt
  REQUIRE(a != b);
  Prefill(*m.model, **cache, a, "tenantA");
  (*cache)->Flush();
  REQUIRE((*cache)->Lookup(a, "tenantA")->boundary_tokens == 64);
  const auto writes = [&] { const auto st = (*cache)->Stats(); return st.chunk_writes + st.state_writes; };
  const std::uint64_t written = writes();

  PrefixRequest other_tenant = (*cache)->Prepare(a, "tenantA");
  other_tenant.tenant = "tenantB";  // tenant A's chunk ids under tenant B's name
  PrefixRequest other_tokens = (*cache)->Prepare(a, "tenantA");
  other_tokens.tokens = b;  // prompt a's chunk ids with prompt b's tokens
  PrefixRequest one_token = (*cache)->Prepare(a, "tenantA");
  one_token.tokens[40] += 1;  // chunk 2 differs; chunks 0 and 1 still match
  PrefixRequest other_cache = (*cache)->Prepare(a, "tenantA");
  auto cache32 = PrefixCache::Create(Layout(32, 1), m.id, store.get(), store.get());
  REQUIRE(cache32.ok());
  other_cache.chunk_ids = (*cache32)->Prepare(a, "tenantA").chunk_ids;  // another namespace's (and chunk's) ids

  for (const auto& [name, r, first_bad] : {std::tuple{"tenant", &other_tenant, 0}, std::tuple{"tokens", &other_tokens, 0},
                                           std::tuple{"one token", &one_token, 2},
                                           std::tuple{"another cache's ids", &other_cache, 0}}) {
    CAPTURE(name);
    const std::string id = fmt::format("chunk_ids[{}]", first_bad);
    auto named = [&](const Status& s) {
      CHECK(s.IsInvalidArgument());
      CHECK(s.message().find(id) != std::string::npos);
      CHECK(s.message().find("tenant") != std::string::npos);
      CHECK(s.message().find("Prepare") != std::string::npos);
    };
    named((*cache)->Lookup(*r).status());
    auto state = model::SequenceState::ForConfig(m.ckpt.config);
    named((*cache)->Restore(*r, &state).status());
    CHECK(state.num_tokens() == 0);
    named((*cache)->BeginRestore(*r, &state).status());
    CHECK(state.num_tokens() == 0);
    for (bool layerwise : {true, false}) {
      model::Session s(*m.model);
      auto prefill = PrefillWithCache(&s, **cache, *r, {.layerwise = layerwise});
      named(prefill.status());
      CHECK(s.state().num_tokens() == 0);
    }
    // The write-out paths check the ids they would write under: chunks [0, chunks).
    const auto upto = [&](int chunks) {
      auto s = std::make_unique<model::Session>(*m.model);
      REQUIRE(s->Prefill(std::span(r->tokens).first(static_cast<std::size_t>(chunks) * 16)).ok());
      return s;
    };
    const auto computed = upto(first_bad + 1);
    named((*cache)->WriteBack(*r, first_bad + 1, computed->state(), true));
    named((*cache)->StoreLayer(*r, first_bad + 1, 0, computed->state(), true));
    if (first_bad > 0)  // the chunks before the changed one still hold together (already stored: not written)
      CHECK((*cache)->WriteBack(*r, first_bad, upto(first_bad)->state(), false).ok());
  }
  (*cache)->Flush();
  CHECK(writes() == written);  // nothing was written under a borrowed id
  // The prompt that was stored still restores (and a cut request still passes the check).
  PrefixRequest cut = (*cache)->Prepare(a, "tenantA");
  cut.chunk_ids.resize(2);
  CHECK((*cache)->Lookup(cut)->boundary_tokens == 32);
}

TEST_CASE("a pass writing its chunks in order is checked link by link: a chunk changed before it is written is refused") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto a = Tokens(70);
  PrefixRequest req = (*cache)->Prepare(a, "");
  model::Session s(*m.model);
  const std::span<const std::int32_t> all(req.tokens);
  for (int k = 1; k <= 2; ++k) {  // chunks 1 and 2: checked in full, then by their link
    REQUIRE(s.Prefill(all.subspan(static_cast<std::size_t>(k - 1) * 16, 16)).ok());
    CHECK((*cache)->WriteBack(req, k, s.state(), true).ok());
    CHECK((*cache)->StoreLayer(req, k, 0, s.state(), true).ok());  // another layer of a chunk already checked
  }
  req.tokens[2 * 16 + 5] += 1;  // chunk 3 of the request no longer matches its id
  REQUIRE(s.Prefill(std::span<const std::int32_t>(req.tokens).subspan(32, 16)).ok());
  const Status bad = (*cache)->WriteBack(req, 3, s.state(), true);
  CHECK(bad.IsInvalidArgument());
  CHECK(bad.message().find("chunk_ids[2]") != std::string::npos);
  CHECK((*cache)->StoreLayer(req, 3, 0, s.state(), true).IsInvalidArgument());
  // A request whose earlier ids changed is checked in full again: a changed tenant fails at chunk 0.
  PrefixRequest other = (*cache)->Prepare(a, "");
  other.tenant = "someone else";
  const Status tenant = (*cache)->WriteBack(other, 2, s.state(), false);
  CHECK(tenant.IsInvalidArgument());
  CHECK(tenant.message().find("chunk_ids[0]") != std::string::npos);
}

TEST_CASE("a request whose chunk_ids were cut looks up, restores and writes only that prefix") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(100);
  Prefill(*m.model, **cache, p, "");
  (*cache)->Flush();
  PrefixRequest cut = (*cache)->Prepare(p, "");
  REQUIRE(cut.restorable_chunks == 6);
  cut.chunk_ids = std::vector<ContentId>(cut.chunk_ids.begin(), cut.chunk_ids.begin() + 2);  // no room past the 2
  auto lookup = (*cache)->Lookup(cut);
  REQUIRE(lookup.ok());
  CHECK(lookup->restorable_chunks == 2);
  CHECK(lookup->kv_chunks_present == 2);
  CHECK(lookup->boundary_tokens == 32);
  const Run cold = Prefill(*m.model, **cache, p, "", {.restore = false, .write_back = false});
  for (bool layerwise : {true, false}) {
    model::Session s(*m.model);
    auto prefill = PrefillWithCache(&s, **cache, cut, {.write_back = false, .layerwise = layerwise});
    REQUIRE(prefill.ok());
    CHECK(prefill->restored_tokens == 32);
    CHECK(prefill->computed_tokens == 68);
    CHECK(Bitwise(prefill->logits.data, Rows(cold.prefill.logits, 32)));
  }
}

TEST_CASE("PrefixCache::Create refuses a layout that was not built from a config") {
  const auto& m = Toy();
  auto store = HostStore();
  auto cache = PrefixCache::Create(KvLayout{}, m.id, store.get(), store.get());
  REQUIRE(!cache.ok());
  CHECK(cache.status().IsInvalidArgument());
  CHECK(cache.status().message().find("FromConfig") != std::string::npos);
}

// Writes prompt p (5 chunks of 16, snapshots every chunk) into the cache, then returns the
// restore of a prompt extending it.
struct Fixture {
  const ToyModel& m = Toy();
  std::vector<std::int32_t> p = Tokens(5 * 16 + 3);
  std::vector<std::int32_t> p2 = Diverge(p, 5 * 16 + 3, 5 * 16 + 10);
};

TEST_CASE("a missing (evicted) snapshot layer moves the boundary back one snapshot, counted, output exact") {
  Fixture f;
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 2), f.m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  Prefill(*f.m.model, **cache, f.p, "");
  (*cache)->Flush();
  // Snapshots at chunks 2, 4 and 5 (the request's last full chunk).
  CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 80);
  auto req = (*cache)->Prepare(f.p2, "");
  const int kda_layer = (*cache)->layout().kda_layers()[2];
  REQUIRE(store->Erase(keys::StateKey((*cache)->state_namespace(), kda_layer, req.chunk_ids[4])).ok());
  CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 64);
  const Run warm = Prefill(*f.m.model, **cache, f.p2, "", {.restore = true, .write_back = false}, 2);
  CHECK(warm.prefill.restored_tokens == 64);
  CHECK(warm.prefill.restore.fallbacks == 1);
  // The lookup promised 64 and passed over the partly present boundary 80.
  CHECK(warm.prefill.restore.lookup_boundary_tokens == 64);
  CHECK(warm.prefill.restore.partial_boundary_tokens == 80);
  REQUIRE(warm.prefill.restore.fallback_reasons.size() == 1);
  CHECK(warm.prefill.restore.fallback_reasons[0].find(fmt::format("layer {} at token 80", kda_layer)) != std::string::npos);
  CHECK((*cache)->Stats().fallbacks_missing == 1);
  CHECK((*cache)->Stats().fallbacks_corrupt == 0);  // erased, not damaged
  const Run cold = Prefill(*f.m.model, **cache, f.p2, "", {.restore = false, .write_back = false}, 2);
  CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, 64)));
  CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
  // A missing KV chunk: no boundary at or after it.
  REQUIRE(store->Erase(keys::KvChunkKey((*cache)->kv_namespace(), req.chunk_ids[2])).ok());
  CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 32);
  const Run warm2 = Prefill(*f.m.model, **cache, f.p2, "", {.restore = true, .write_back = false});
  CHECK(warm2.prefill.restored_tokens == 32);
  CHECK(warm2.prefill.restore.partial_boundary_tokens == 0);  // no snapshot past the missing chunk is looked at
  CHECK(Bitwise(warm2.prefill.logits.data, Rows(cold.prefill.logits, 32)));
}

// Flips one byte in the data file at the first occurrence of a block whose header starts with
// `magic` and carries `needle` (8 bytes) at `needle_at`, `flip_at` bytes into the block.
bool FlipInFile(const std::filesystem::path& file, std::string_view magic, std::uint64_t needle, std::size_t needle_at,
                std::size_t flip_at) {
  std::ifstream in(file, std::ios::binary);
  std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (std::size_t pos = 0; pos + 4096 <= all.size(); pos += 512) {
    if (std::memcmp(all.data() + pos, magic.data(), 8) != 0) continue;
    std::uint64_t v = 0;
    std::memcpy(&v, all.data() + pos + needle_at, 8);
    if (v != needle) continue;
    const int fd = ::open(file.c_str(), O_WRONLY);
    if (fd < 0) return false;
    char c = static_cast<char>(all[pos + flip_at] ^ 0x5a);
    const bool ok = ::pwrite(fd, &c, 1, static_cast<off_t>(pos + flip_at)) == 1 && ::fsync(fd) == 0;
    ::close(fd);
    return ok;
  }
  return false;
}

TEST_CASE("a corrupted snapshot or KV chunk on the NVMe tier falls back to the previous joint boundary, exact, counted as corrupt",
          "[no-tsan]") {
  // Both restore paths: layer by layer under the forward pass, and whole before it.
  for (const bool layerwise : {true, false}) {
    CAPTURE(layerwise);
    Fixture f;
    terrace::testing::TempDir dir("kvnvme");
    auto kv_store = NvmeStore(dir.path() / "kv");
    auto st_store = NvmeStore(dir.path() / "state");
    auto cache = PrefixCache::Create(Layout(16, 1), f.m.id, kv_store.get(), st_store.get());
    REQUIRE(cache.ok());
    Prefill(*f.m.model, **cache, f.p, "");
    (*cache)->Flush();
    REQUIRE(kv_store->Flush().ok());
    REQUIRE(st_store->Flush().ok());
    CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 80);
    const Run cold = Prefill(*f.m.model, **cache, f.p2, "", {.restore = false, .write_back = false}, 2);
    const PrefillOptions warm_options{.restore = true, .write_back = false, .layerwise = layerwise};

    // The snapshot at token 80 (state header: boundary tokens at byte 16), one byte inside its payload.
    REQUIRE(FlipInFile(dir.path() / "state" / "terrace.data", "TKDASNP1", 80, 16, 1000));
    const Run warm = Prefill(*f.m.model, **cache, f.p2, "", warm_options, 2);
    CHECK(warm.prefill.restored_tokens == 64);
    CHECK(warm.prefill.restore.fallbacks == 1);
    // The store drops the corrupt copy and its GetBatch says Corruption ("stored but lost",
    // include/terrace/store.h): the cache counts it as corrupt, not missing.
    CHECK(st_store->Stats().corruptions_dropped == 1);
    REQUIRE(warm.prefill.restore.fallback_reasons.size() == 1);
    CHECK(warm.prefill.restore.fallback_reasons[0].find("Corruption") != std::string::npos);
    const PrefixCacheStats s1 = (*cache)->Stats();
    CHECK(s1.fallbacks == 1);
    CHECK(s1.fallbacks_corrupt == 1);
    CHECK(s1.fallbacks_missing == 0);
    CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, 64)));
    CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));

    // KV chunk 1 (chunk id hi at byte 24 of its header), a byte inside its first layer's sub-range.
    auto req = (*cache)->Prepare(f.p2, "");
    REQUIRE(FlipInFile(dir.path() / "kv" / "terrace.data", "TKVCHNK1", req.chunk_ids[1].hi, 24, 4096 + 100));
    const Run warm2 = Prefill(*f.m.model, **cache, f.p2, "", warm_options, 2);
    CHECK(warm2.prefill.restored_tokens == 16);
    // Two fallbacks: the snapshot at token 80 dropped above is now gone at lookup (missing), and KV
    // chunk 1 fails the store's checksum (corrupt).
    CHECK(warm2.prefill.restore.fallbacks == 2);
    const PrefixCacheStats s2 = (*cache)->Stats();
    CHECK(s2.fallbacks == 3);
    CHECK(s2.fallbacks_corrupt == 2);
    CHECK(s2.fallbacks_missing == 1);
    CHECK(Bitwise(warm2.prefill.logits.data, Rows(cold.prefill.logits, 16)));
    CHECK(Bitwise(warm2.decode_logits.back(), cold.decode_logits.back()));
  }
}

TEST_CASE("a state pool under pressure: failed snapshot writes are counted and never hit") {
  Fixture f;
  auto kv_store = HostStore();
  const KvLayout layout = Layout(16, 1);
  // Room for two boundaries' snapshots (and part of a third) only.
  const std::uint64_t per_boundary = layout.state_block_bytes() * layout.kda_layers().size();
  auto st_store = HostStore(per_boundary * 5 / 2);
  auto cache = PrefixCache::Create(layout, f.m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  Prefill(*f.m.model, **cache, f.p, "");
  (*cache)->Flush();
  const auto stats = (*cache)->Stats();
  CHECK(stats.write_failures > 0);
  CHECK(stats.chunk_writes == 5);  // the KV stream, in its own pool, is unaffected
  // Which boundaries' snapshots got the room depends on the order the store's pool threads ran the
  // writes in (two at a time): the restore reaches the largest boundary whose every snapshot was
  // written - the one the lookup names, never one with a failed write - and its output is exact.
  const std::int64_t looked_up = (*cache)->Lookup(f.p2, "")->boundary_tokens;
  const Run warm = Prefill(*f.m.model, **cache, f.p2, "", {.restore = true, .write_back = false}, 2);
  CHECK(warm.prefill.restored_tokens == looked_up);
  CHECK(warm.prefill.restored_tokens % 16 == 0);
  CHECK(warm.prefill.restored_tokens >= 16);  // the first boundary's writes ran before any that failed
  const Run cold = Prefill(*f.m.model, **cache, f.p2, "", {.restore = false, .write_back = false}, 2);
  CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, warm.prefill.restored_tokens)));
  CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
}

TEST_CASE("pools opened as caches (lowest_tier_evicts) keep admitting prompts; every restore is exact") {
  Fixture f;
  const KvLayout layout = Layout(16, 1);
  // Each pool has room for about two prompts' blocks: later prompts evict earlier ones' blocks.
  const std::uint64_t kv_room = layout.mla_chunk_block_bytes() * 11;
  const std::uint64_t state_room = layout.state_block_bytes() * layout.kda_layers().size() * 11;
  auto cache_store = [](std::uint64_t capacity) {
    StoreOptions o;
    o.hbm.mode = HbmMode::kOff;
    o.host.capacity_bytes = capacity;
    o.host.pin = false;
    o.host.chunk_bytes = capacity;
    o.lowest_tier_evicts = true;
    auto s = Store::Open(o);
    REQUIRE(s.ok());
    return std::move(s).value();
  };
  auto kv_store = cache_store(kv_room), st_store = cache_store(state_room);
  auto cache = PrefixCache::Create(layout, f.m.id, kv_store.get(), st_store.get());
  REQUIRE(cache.ok());
  constexpr int kPrompts = 6;
  std::vector<std::vector<std::int32_t>> prompts;
  for (int i = 0; i < kPrompts; ++i) prompts.push_back(Tokens(5 * 16 + 3, 100 + i));
  for (const auto& p : prompts) {
    Prefill(*f.m.model, **cache, p, "");
    (*cache)->Flush();
  }
  CHECK((*cache)->Stats().write_failures == 0);  // full pools evict instead of failing writes
  CHECK(kv_store->Stats().dropped_blocks > 0);
  CHECK(st_store->Stats().dropped_blocks > 0);
  int restored_prompts = 0;
  for (int i = 0; i < kPrompts; ++i) {
    INFO("prompt " << i);
    const Run warm = Prefill(*f.m.model, **cache, prompts[i], "", {.restore = true, .write_back = false}, 2);
    const Run cold = Prefill(*f.m.model, **cache, prompts[i], "", {.restore = false, .write_back = false}, 2);
    const std::int64_t b = warm.prefill.restored_tokens;
    CHECK(b % 16 == 0);
    restored_prompts += b > 0 ? 1 : 0;
    CHECK(Bitwise(warm.prefill.logits.data, Rows(cold.prefill.logits, b)));
    CHECK(Bitwise(warm.decode_logits.back(), cold.decode_logits.back()));
  }
  CHECK(restored_prompts >= 1);
  // The newest prompt was admitted whole: all but its last token's chunk restores.
  CHECK(Prefill(*f.m.model, **cache, prompts.back(), "", {.restore = true, .write_back = false}).prefill.restored_tokens
        == 5 * 16);
}

TEST_CASE("tenants are isolated; a model, layout or codec change never hits old blocks") {
  Fixture f;
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), f.m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  Prefill(*f.m.model, **cache, f.p, "alice");
  (*cache)->Flush();
  CHECK((*cache)->Lookup(f.p2, "alice")->boundary_tokens == 80);
  CHECK((*cache)->Lookup(f.p2, "bob")->boundary_tokens == 0);
  CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 0);
  const Run bob = Prefill(*f.m.model, **cache, f.p2, "bob", {.restore = true, .write_back = false});
  CHECK(bob.prefill.restored_tokens == 0);

  const auto& other = Toy(8);
  REQUIRE(other.id != f.m.id);
  auto c_model = PrefixCache::Create(Layout(16, 1), other.id, store.get(), store.get());
  auto c_chunk = PrefixCache::Create(Layout(32, 1), f.m.id, store.get(), store.get());
  auto c_kv = PrefixCache::Create(Layout(16, 1, "bf16"), f.m.id, store.get(), store.get());
  auto c_state = PrefixCache::Create(Layout(16, 1, "f32", "bf16"), f.m.id, store.get(), store.get());
  for (auto* c : {&c_model, &c_chunk, &c_kv, &c_state}) {
    REQUIRE(c->ok());
    CHECK((**c)->Lookup(f.p2, "alice")->boundary_tokens == 0);
    CHECK((**c)->Lookup(f.p2, "alice")->kv_chunks_present == 0);
  }
  CHECK((*c_kv)->kv_namespace() != (*cache)->kv_namespace());
  CHECK((*c_state)->state_namespace() != (*cache)->state_namespace());
}

TEST_CASE("a lookup moves no data") {
  Fixture f;
  auto store = HostStore();
  auto cache = PrefixCache::Create(Layout(16, 1), f.m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  Prefill(*f.m.model, **cache, f.p, "");
  (*cache)->Flush();
  const auto before = store->Stats();
  CHECK((*cache)->Lookup(f.p2, "")->boundary_tokens == 80);
  const auto after = store->Stats();
  for (int t = 0; t < kNumTiers; ++t) CHECK(after.tiers[static_cast<std::size_t>(t)].hits == before.tiers[static_cast<std::size_t>(t)].hits);
}


TEST_CASE("a chunk block is assembled from one pass's MLA rows, never two passes' mixed") {
  const auto& m = Toy();
  auto store = HostStore();
  const KvLayout layout = Layout(16, 1);
  auto cache = PrefixCache::Create(layout, m.id, store.get(), store.get());
  REQUIRE(cache.ok());
  const auto p = Tokens(16);  // one chunk
  const auto req = (*cache)->Prepare(p, "");
  // Two passes over the same chunk whose MLA rows differ (as after restores from different
  // boundaries with a lossy codec): b's are a's plus one.
  model::Session a(*m.model), b(*m.model);
  REQUIRE(a.Prefill(p).ok());
  REQUIRE(b.Prefill(p).ok());
  const auto& mla = layout.mla_layers();
  REQUIRE(mla.size() >= 2);
  for (int l : mla)
    for (float& v : b.state().layer(l).latents) v += 1.0f;
  for (int l : layout.kda_layers()) REQUIRE((*cache)->StoreLayer(req, 1, l, a.state(), /*snapshot=*/true).ok());
  // Interleaved: a's first MLA layer, b's, a's second (with mixing, the block would be complete
  // here, b's first layer beside a's second), then a's first again.
  REQUIRE((*cache)->StoreLayer(req, 1, mla[0], a.state(), false).ok());
  REQUIRE((*cache)->StoreLayer(req, 1, mla[0], b.state(), false).ok());
  for (std::size_t j = 1; j < mla.size(); ++j) REQUIRE((*cache)->StoreLayer(req, 1, mla[j], a.state(), false).ok());
  REQUIRE((*cache)->StoreLayer(req, 1, mla[0], a.state(), false).ok());
  (*cache)->Flush();
  // One more token so the restore stops at the chunk boundary (a restore leaves a token to compute).
  auto longer = p;
  longer.push_back(3);
  model::Session c(*m.model);
  auto r = (*cache)->Restore((*cache)->Prepare(longer, ""), &c.state());
  REQUIRE(r.ok());
  REQUIRE(r->boundary_tokens == 16);
  for (int l : mla) {
    INFO("MLA layer " << l);
    CHECK(Bitwise(c.state().layer(l).latents, a.state().layer(l).latents));
  }
}


// A state of another model (a narrower MLA latent, or its MLA layers elsewhere), filled with the
// rows of one chunk: every call that reads or writes a state at the layout's offsets refuses it
// before touching a row (WriteBack read past a narrower state's latents and stored the bytes it
// found there as a KV block later restores hit; a state with MLA layers elsewhere crashed it).
TEST_CASE("a state shaped for another model is refused by WriteBack and StoreLayer and Restore: nothing written") {
  const auto& m = Toy();
  const int C = 4;
  auto kv = HostStore(), st = HostStore();
  auto cache = PrefixCache::Create(Layout(C, 1), m.id, kv.get(), st.get());
  REQUIRE(cache.ok());
  const auto req = (*cache)->Prepare(Tokens(9, 1), "");
  const model::ModelConfig& config = m.ckpt.config;
  model::ModelConfig narrow = config;
  narrow.kv_lora_rank = config.kv_lora_rank / 2;
  model::ModelConfig moved = config;  // every full-attention layer one earlier (layer 1 to 2)
  for (int& x : moved.kda.full_attn_layers) x = x == 1 ? 2 : x - 1;
  moved.kda.kda_layers.clear();
  for (int i = 1; i <= config.num_hidden_layers; ++i) {
    const auto& f = moved.kda.full_attn_layers;
    if (std::find(f.begin(), f.end(), i) == f.end()) moved.kda.kda_layers.push_back(i);
  }
  for (const auto* other : {&narrow, &moved}) {
    REQUIRE(model::ValidateConfig(*other).ok());
    auto s = model::SequenceState::ForConfig(*other);
    for (int l = 0; l < s.num_layers(); ++l) {
      model::LayerState& layer = s.layer(l);
      layer.tokens = C;
      if (layer.is_mla) layer.latents.assign(static_cast<std::size_t>(C * other->MlaCacheWidth()), 1.0f);
    }
    const Status wb = (*cache)->WriteBack(req, 1, s, true);
    INFO(wb.ToString());
    CHECK(wb.IsInvalidArgument());
    CHECK(wb.message().find("not shaped for this cache's model") != std::string::npos);
    for (int l = 0; l < s.num_layers(); ++l) {
      const Status sl = (*cache)->StoreLayer(req, 1, l, s, true);
      INFO("layer " << l << ": " << sl.ToString());
      CHECK(sl.IsInvalidArgument());
    }
    (*cache)->EndStoreLayers(s);
    auto r = (*cache)->Restore(req, &s);
    CHECK(r.status().IsInvalidArgument());
  }
  (*cache)->Flush();
  const PrefixCacheStats stats = (*cache)->Stats();
  CHECK(stats.chunk_writes == 0);
  CHECK(stats.state_writes == 0);
}

}  // namespace
}  // namespace terrace::kv
