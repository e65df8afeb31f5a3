// Trace replay through the store's eviction policies, against hand-computed traces and an
// independent oracle (the prefix-hit ceiling of an infinite cache).
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include <catch2/catch.hpp>

#include "src/plan/replay.h"
#include "src/plan/trace.h"
#include "trace_fixture.h"
#include "src/plan/trace_gen.h"

using namespace terrace;
using namespace terrace::plan;

namespace {
Trace Make(std::vector<std::vector<std::uint64_t>> reqs) {
  Trace t;
  std::uint64_t ts = 0;
  for (auto& ids : reqs) {
    TraceRequest r;
    r.timestamp_ms = ts;
    ts += 1000;
    r.input_length = ids.size() * 4;
    r.hash_ids = std::move(ids);
    t.requests.push_back(std::move(r));
  }
  return t;
}

ReplayOptions OneTier(std::uint64_t blocks, ReplayPolicy p = ReplayPolicy::kLru) {
  ReplayOptions o;
  o.block_tokens = 4;
  o.block_bytes = 100;
  o.prefill_tokens_per_s = 1000;
  o.policy = p;
  o.tiers = {{"hbm", blocks * 100, 0}};
  return o;
}

Trace Fixture() { return terrace::plan::testing::MooncakeHead200(); }
}  // namespace

TEST_CASE("LRU hit rate on a tiny trace, computed by hand") {
  // Capacity 2 blocks. r1 [1 2]: miss, miss (LRU 1,2) | r2 [1 2]: hit, hit | r3 [3]: miss, evicts 1
  // (2,3) | r4 [1 2]: 1 missing -> no prefix hit; placing 1 evicts 2, placing 2 evicts 3 | r5 [1 2]:
  // hit, hit. 4 hits of 9 blocks; 3 evictions.
  const Trace t = Make({{1, 2}, {1, 2}, {3}, {1, 2}, {1, 2}});
  auto r = Replay(t, OneTier(2));
  REQUIRE(r.ok());
  CHECK(r->blocks == 9);
  CHECK(r->hit_blocks == 4);
  CHECK(r->hit_rate() == Approx(4.0 / 9.0));
  CHECK(r->tiers[0].evictions == 3);
  CHECK(r->restores == 2);
  CHECK(r->hit_tokens == 16);
  // Infinite capacity: the ceiling (r2, r4, r5 hit both blocks).
  auto inf = Replay(t, OneTier(1000));
  REQUIRE(inf.ok());
  CHECK(inf->hit_blocks == 6);
  CHECK(inf->hit_rate() == Approx(ComputePrefixCeiling(t, 1).fraction()));
}

TEST_CASE("LRU: a hit refreshes recency (FIFO would evict it), by hand") {
  // Capacity 2. r1 [1] | r2 [2] | r3 [1] hit, 1 becomes most recent | r4 [3] evicts 2 (FIFO: 1) |
  // r5 [1] hit (FIFO: miss) | r6 [2] miss. 2 hits of 6.
  auto r = Replay(Make({{1}, {2}, {1}, {3}, {1}, {2}}), OneTier(2));
  REQUIRE(r.ok());
  CHECK(r->hit_blocks == 2);
  CHECK(r->tiers[0].evictions == 2);
}

TEST_CASE("Two tiers: demotion into host, restores read over the host link, by hand") {
  // hbm 1 block, host 2. r1 [1 2]: 1 -> hbm; 2 evicts 1 into host (write). hbm {2}, host {1}.
  // r2 [1 2]: prefix 1 (host) + 2 (hbm): hits 1 + 1; 1 is read from host (100 B at 100 B/s = 1 s)
  // and promoted, demoting 2; then 2 is promoted, demoting 1. Host writes: 3 blocks.
  const Trace t = Make({{1, 2}, {1, 2}});
  ReplayOptions o = OneTier(1);
  o.tiers.push_back({"host", 200, 100.0});
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->tiers[0].hit_blocks == 1);
  CHECK(r->tiers[1].hit_blocks == 1);
  CHECK(r->tiers[1].bytes_read == 100);
  CHECK(r->tiers[1].bytes_written == 300);
  CHECK(r->bytes_moved() == 400);
  CHECK(r->restore_s == Approx(1.0));
  // 8 hit tokens recompute in 8 ms < 1 s restore: the planner counts it as slower than recompute.
  CHECK(r->restores_slower_than_recompute == 1);
  CHECK(r->ttft_saved_s == 0.0);
  o.tiers[1].read_bandwidth = 1e6;  // 0.1 ms restore: saves 8 ms - 0.1 ms
  r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->restores_slower_than_recompute == 0);
  CHECK(r->ttft_saved_s == Approx(0.008 - 1e-4));
}

TEST_CASE("A link is a FIFO server: a restore waits behind the previous one") {
  // hbm absent (0), host big, 100 B/s. Two requests at the same instant each restore 1 block.
  Trace t = Make({{1}, {2}, {1}, {2}});
  t.requests[3].timestamp_ms = t.requests[2].timestamp_ms;  // r3 and r4 arrive together
  ReplayOptions o = OneTier(0);
  o.tiers.push_back({"host", 1000, 100.0});
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->tiers[1].hit_blocks == 2);
  CHECK(r->restore_s == Approx(1.0 + 2.0));
  CHECK(r->queue_wait_s == Approx(1.0));
}

TEST_CASE("Infinite capacity equals the prefix-hit ceiling, for every policy, on the fixture and a generated trace") {
  TraceGenOptions g;
  g.requests = 2000;
  auto gen = GenerateTrace(g);
  REQUIRE(gen.ok());
  for (const Trace& t : {Fixture(), *gen}) {
    const PrefixCeiling c = ComputePrefixCeiling(t, 1);
    for (ReplayPolicy p : {ReplayPolicy::kLru, ReplayPolicy::kS3Fifo}) {
      auto r = Replay(t, OneTier(c.unique_blocks, p));
      REQUIRE(r.ok());
      CHECK(r->hit_blocks == c.hit_blocks);
      CHECK(r->tiers[0].evictions == 0);
    }
  }
}

TEST_CASE("With restore_every_blocks > 1, room for every block reaches the ceiling cut the same way") {
  // [1 2 3] then [1 2 3 4]: 3 blocks seen, a restore boundary every 2 blocks: 2 hits, in the
  // ceiling as in the replay.
  const Trace tiny = Make({{1, 2, 3}, {1, 2, 3, 4}});
  CHECK(ComputePrefixCeiling(tiny, 2).hit_blocks == 2);
  CHECK(ComputePrefixCeiling(tiny, 1).hit_blocks == 3);
  TraceGenOptions g;
  g.requests = 2000;
  g.prefix_blocks = 7;  // runs that are not whole multiples of the boundaries below
  g.turn_blocks = 3;
  auto gen = GenerateTrace(g);
  REQUIRE(gen.ok());
  for (const Trace& t : {Fixture(), *gen}) {
    for (std::uint64_t every : {2u, 3u, 16u}) {
      const PrefixCeiling c = ComputePrefixCeiling(t, every);
      for (ReplayPolicy p : {ReplayPolicy::kLru, ReplayPolicy::kS3Fifo}) {
        ReplayOptions o = OneTier(c.unique_blocks, p);
        o.restore_every_blocks = every;
        auto all = Replay(t, o);
        REQUIRE(all.ok());
        CHECK(all->hit_blocks == c.hit_blocks);
        o.tiers[0].capacity_bytes = c.unique_blocks / 4 * o.block_bytes;
        auto quarter = Replay(t, o);
        REQUIRE(quarter.ok());
        CHECK(quarter->hit_blocks <= c.hit_blocks);
      }
    }
  }
}

TEST_CASE("LRU hit rate never falls as capacity grows (LRU's inclusion property)") {
  const Trace t = Fixture();
  const PrefixCeiling c = ComputePrefixCeiling(t, 1);
  std::uint64_t last = 0;
  for (std::uint64_t cap = 1; cap <= c.unique_blocks; cap = cap * 3 / 2 + 1) {
    auto r = Replay(t, OneTier(cap));
    REQUIRE(r.ok());
    CHECK(r->hit_blocks >= last);
    last = r->hit_blocks;
  }
  CHECK(last <= c.hit_blocks);
}

TEST_CASE("S3-FIFO and LRU differ on a scan-polluted trace (the policies are really the store's)") {
  // A hot prefix [1 2] reused between one-hit scans of 3 fresh blocks; capacity 4. LRU lets each
  // scan evict the hot blocks; S3-FIFO promotes the re-read hot blocks to its main queue.
  std::vector<std::vector<std::uint64_t>> reqs;
  std::uint64_t fresh = 100;
  for (int i = 0; i < 40; ++i) {
    reqs.push_back({1, 2});
    reqs.push_back({fresh, fresh + 1, fresh + 2});
    fresh += 3;
  }
  const Trace t = Make(reqs);
  auto lru = Replay(t, OneTier(4, ReplayPolicy::kLru));
  auto s3 = Replay(t, OneTier(4, ReplayPolicy::kS3Fifo));
  REQUIRE(lru.ok());
  REQUIRE(s3.ok());
  CHECK(s3->hit_blocks > lru->hit_blocks);
}

TEST_CASE("Cluster: round-robin spreads evenly; prefix affinity keeps sessions together and hits more") {
  TraceGenOptions g;
  g.requests = 3000;
  g.turns = 4;
  auto t = GenerateTrace(g);
  REQUIRE(t.ok());
  ReplayOptions o = OneTier(1u << 20);
  o.nodes = 4;
  o.routing = Routing::kRoundRobin;
  auto rr = Replay(*t, o);
  REQUIRE(rr.ok());
  REQUIRE(rr->requests_per_node.size() == 4);
  for (auto n : rr->requests_per_node) CHECK(n == 750);
  o.routing = Routing::kPrefixAffinity;
  auto pa = Replay(*t, o);
  REQUIRE(pa.ok());
  CHECK(pa->hit_blocks > rr->hit_blocks);
  // One node of infinite capacity is the ceiling; affinity across nodes cannot beat it.
  CHECK(pa->hit_blocks <= ComputePrefixCeiling(*t, 1).hit_blocks);
}

TEST_CASE("Replay options are checked, naming the CLI flag") {
  const Trace t = Make({{1}});
  ReplayOptions o = OneTier(1);
  o.nodes = 0;
  auto r = Replay(t, o);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("--nodes"));
  o = OneTier(0);  // no tier can hold a block: nothing to replay into
  r = Replay(t, o);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("--kv-hbm"));
  o = OneTier(1);
  o.block_tokens = 0;
  r = Replay(t, o);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("--trace-block-tokens"));
}

TEST_CASE("Inclusive placement keeps the lower copy: evicting the upper one writes nothing, by hand") {
  // hbm 1 block, host 2, inclusive. r1 [1 2]: 1 -> hbm; 2 evicts 1 (no copy below: demoted, 1 write).
  // hbm {2}, host {1}. r2 [1 2]: hits host 1 + hbm 1, 100 B read. 1 is copied up (host keeps it),
  // evicting 2 (no copy below: demoted, write 2); 2 is copied up, evicting 1, which has a host copy:
  // dropped, no write. Host writes: 2 blocks (exclusive: 3, the test above).
  const Trace t = Make({{1, 2}, {1, 2}, {1, 2}});
  ReplayOptions o = OneTier(1);
  o.tiers.push_back({"host", 200, 1e6});
  o.placement = terrace::Placement::kInclusive;
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  // hbm {2}, host {1 2}. r3 [1 2]: hits 1 (host) + 2 (hbm), 100 B read; 1 copied up evicts 2 (host
  // copy: dropped), 2 copied up from host evicts 1 (host copy: dropped). Host writes stay 2 blocks;
  // host reads 100 + 100. Exclusive writes 5 blocks (r1 one demotion, r2 and r3 two each).
  CHECK(r->tiers[1].bytes_written == 200);
  CHECK(r->tiers[1].bytes_read == 200);
  CHECK(r->tiers[0].hit_blocks == 2);
  CHECK(r->tiers[1].hit_blocks == 2);
  o.placement = terrace::Placement::kExclusive;
  auto ex = Replay(t, o);
  REQUIRE(ex.ok());
  CHECK(ex->tiers[1].bytes_written == 500);
  CHECK(ex->hit_blocks == r->hit_blocks);
}

TEST_CASE("Inclusive placement refreshes the copy left below on a promotion, by hand") {
  // docs/plan.md: with kInclusive a promoted block keeps its copy below, and that copy counts the
  // read (OnAccess), as the store's does. hbm 1 block, host 2, LRU, inclusive. r1 [1]: hbm {1}.
  // r2 [2]: 2 evicts 1 (demoted): hbm {2}, host {1}. r3 [3]: 3 evicts 2 (demoted): host LRU order
  // 1, 2. r4 [1]: host hit; 1 copied up, its host copy refreshed (order 2, 1); 3 is demoted from
  // hbm and the host evicts its least recent copy, 2: host {1 3}. r5 [2]: a miss. Without the
  // refresh the host would have evicted 1 and r5 would hit.
  const Trace t = Make({{1}, {2}, {3}, {1}, {2}});
  ReplayOptions o = OneTier(1);
  o.tiers.push_back({"host", 200, 1e6});
  o.placement = terrace::Placement::kInclusive;
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->hit_blocks == 1);
  CHECK(r->tiers[1].hit_blocks == 1);
  CHECK(r->tiers[1].evictions == 1);
}

TEST_CASE("Write-through writes every new block to the lowest tier; a victim with that copy is dropped") {
  // hbm 1, host 2, write-through. r1 [1 2]: 1 -> hbm + host (write); 2 -> hbm evicts 1 (host copy:
  // no write), + host (write). Host writes 200; the hbm eviction count is 1.
  const Trace t = Make({{1, 2}});
  ReplayOptions o = OneTier(1);
  o.tiers.push_back({"host", 200, 1e6});
  o.write_policy = terrace::WritePolicy::kWriteThrough;
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->tiers[1].bytes_written == 200);
  CHECK(r->tiers[0].evictions == 1);
  CHECK(r->tiers[1].evictions == 0);
  o.write_policy = terrace::WritePolicy::kWriteBack;
  auto wb = Replay(t, o);
  REQUIRE(wb.ok());
  CHECK(wb->tiers[1].bytes_written == 100);  // only the demotion of 1
}

TEST_CASE("Every placement and write policy reaches the ceiling with room for everything") {
  const Trace t = Fixture();
  const PrefixCeiling c = ComputePrefixCeiling(t, 1);
  for (auto pl : {terrace::Placement::kExclusive, terrace::Placement::kInclusive}) {
    for (auto wp : {terrace::WritePolicy::kWriteBack, terrace::WritePolicy::kWriteThrough}) {
      ReplayOptions o = OneTier(c.unique_blocks / 4);
      o.tiers.push_back({"host", c.unique_blocks * 100, 1e9});
      o.placement = pl;
      o.write_policy = wp;
      auto r = Replay(t, o);
      REQUIRE(r.ok());
      CHECK(r->hit_blocks == c.hit_blocks);
      CHECK(r->tiers[0].hit_blocks + r->tiers[1].hit_blocks == r->hit_blocks);
    }
  }
}

TEST_CASE("Exclusive write-through: a promotion keeps the lowest tier's copy, as the store does, by hand") {
  // The store's scenario in tests/store/placement_rules_store_test.cpp. hbm 1, host 2 (the lowest),
  // exclusive, write-through. r1 [1]: hbm + host (write). r2 [2]: hbm evicts 1 (host copy: dropped),
  // + host (write). r3 [1]: host hit, promoted; host keeps its copy; hbm evicts 2 (host copy:
  // dropped). r4 [2]: the same. Host writes: 2 blocks, none a demotion.
  const Trace t = Make({{1}, {2}, {1}, {2}});
  ReplayOptions o = OneTier(1);
  o.tiers.push_back({"host", 200, 1e6});
  o.placement = terrace::Placement::kExclusive;
  o.write_policy = terrace::WritePolicy::kWriteThrough;
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->tiers[1].hit_blocks == 2);
  CHECK(r->tiers[1].bytes_read == 200);
  CHECK(r->tiers[1].bytes_written == 200);
  CHECK(r->tiers[0].evictions == 3);
}

TEST_CASE("KDA snapshots take tier room with their block and move with it; a restore reads one, by hand") {
  // Blocks of 100 B of KV and 300 B of snapshots: hbm 800 B holds 2 blocks (8 of KV alone), host
  // 800 B holds 2. The same trace as "Two tiers" above, hbm 1 block (400 B) and host 2 (800 B):
  // demotions write KV and snapshots (3 x 400 B); the restore reads block 1's KV (100 B) and the
  // one snapshot at the prefix's end (restore_extra_bytes, 50 B), not the blocks' 300 B.
  const Trace t = Make({{1, 2}, {1, 2}});
  ReplayOptions o = OneTier(1);
  o.snapshot_bytes_per_block = 300;
  o.restore_extra_bytes = 50;
  o.tiers = {{"hbm", 400, 0}, {"host", 800, 100.0}};
  REQUIRE(o.stored_block_bytes() == 400);
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  CHECK(r->tiers[0].capacity_blocks == 1);
  CHECK(r->tiers[1].capacity_blocks == 2);
  CHECK(r->tiers[1].hit_blocks == 1);
  CHECK(r->tiers[0].hit_blocks == 1);
  CHECK(r->tiers[1].bytes_written == 3 * 400);
  // Block 2's fastest copy is in hbm, so the prefix's end is read from there: no snapshot over the link.
  CHECK(r->tiers[1].bytes_read == 100);
  // With room for 8 blocks of KV but 2 with snapshots, LRU on [1] [2] [3] [1] misses r4's block.
  ReplayOptions small = OneTier(8);
  small.snapshot_bytes_per_block = 300;
  auto s = Replay(Make({{1}, {2}, {3}, {1}}), small);
  REQUIRE(s.ok());
  CHECK(s->tiers[0].capacity_blocks == 2);
  CHECK(s->hit_blocks == 0);
  CHECK(Replay(Make({{1}, {2}, {3}, {1}}), OneTier(8))->hit_blocks == 1);  // KV alone: a hit
  // A tier below one block with its snapshots holds none.
  small.tiers = {{"hbm", 399, 0}};
  auto none = Replay(Make({{1}}), small);
  REQUIRE_FALSE(none.ok());
  CHECK_THAT(none.status().message(), Catch::Contains("400-byte block") && Catch::Contains("--kv-hbm"));
}

TEST_CASE("A trace block is charged what the store holds for its tokens: whole chunks or its share of one") {
  // 512-token blocks of 256-token chunks of 1000 B, a 300 B snapshot after every chunk.
  auto two = ChargeTraceBlock(512, 256, 1000, 1, 300);
  REQUIRE(two.ok());
  CHECK(two->chunks_per_block == 2);
  CHECK(two->snapshots_per_block == 2);
  CHECK(two->kv_bytes == 2000);
  CHECK(two->snapshot_bytes == 600);
  CHECK(two->restore_every_blocks == 1);
  // 16-token blocks: 1/16 of a chunk and of a snapshot each (rounded to the byte), and a restore
  // boundary every 16 blocks. Used to be a whole chunk and a whole snapshot per block.
  auto sixteenth = ChargeTraceBlock(16, 256, 1000, 1, 300);
  REQUIRE(sixteenth.ok());
  CHECK(sixteenth->chunks_per_block == 1.0 / 16);
  CHECK(sixteenth->snapshots_per_block == 1.0 / 16);
  CHECK(sixteenth->kv_bytes == 63);         // 62.5
  CHECK(sixteenth->snapshot_bytes == 19);   // 18.75
  CHECK(sixteenth->restore_every_blocks == 16);
  // Per token both charge the chunk's bytes / chunk tokens, within the rounding.
  CHECK(static_cast<double>(sixteenth->kv_bytes) / 16 == Approx(1000.0 / 256).margin(0.5 / 16));
  CHECK(static_cast<double>(two->kv_bytes) / 512 == Approx(1000.0 / 256));
  // A snapshot every 4 chunks: half a snapshot per 512-token block, a restore boundary every 2 blocks.
  auto every4 = ChargeTraceBlock(512, 256, 1000, 4, 300);
  REQUIRE(every4.ok());
  CHECK(every4->snapshots_per_block == 0.5);
  CHECK(every4->snapshot_bytes == 150);
  CHECK(every4->restore_every_blocks == 2);
  auto same = ChargeTraceBlock(512, 512, 1000, 1, 300);
  REQUIRE(same.ok());
  CHECK(same->kv_bytes == 1000);
  CHECK(same->snapshot_bytes == 300);
}

TEST_CASE("A trace block that would hold parts of two chunks is refused, naming both flags") {
  for (auto [block, chunk] : {std::pair<std::uint64_t, std::uint64_t>{512, 384}, {512, 100}, {384, 512}}) {
    auto r = ChargeTraceBlock(block, chunk, 1000, 1, 300);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("--trace-block-tokens " + std::to_string(block)) &&
                                         Catch::Contains("--chunk-tokens " + std::to_string(chunk)) &&
                                         Catch::Contains("divides"));
  }
  CHECK_FALSE(ChargeTraceBlock(512, 256, 1000, 0, 300).ok());  // snapshots only at a request's end
}

TEST_CASE("A prefix hit counts in whole runs of restore_every_blocks blocks") {
  // [1 2 3] twice: 3 blocks resident, but with a restore boundary every 2 blocks only 2 are hits.
  ReplayOptions o = OneTier(8);
  o.restore_every_blocks = 2;
  auto r = Replay(Make({{1, 2, 3}, {1, 2, 3}}), o);
  REQUIRE(r.ok());
  CHECK(r->hit_blocks == 2);
  CHECK(r->hit_tokens == 2 * 4);
  CHECK(Replay(Make({{1, 2, 3}, {1, 2, 3}}), OneTier(8))->hit_blocks == 3);
  o.restore_every_blocks = 0;
  CHECK_FALSE(Replay(Make({{1}}), o).ok());
}

TEST_CASE("The checkpoint comes before the first request and after 4096 requests or 65536 blocks, whichever first") {
  // Five long requests of 40000 blocks: a checkpoint every second request by blocks, though far
  // fewer than 4096 requests (Ctrl-C went unheard through a whole replay of such a trace).
  std::vector<std::vector<std::uint64_t>> long_reqs(5);
  std::uint64_t id = 0;
  for (auto& ids : long_reqs)
    for (int i = 0; i < 40000; ++i) ids.push_back(id++);
  ReplayOptions o = OneTier(1000);
  std::vector<std::uint64_t> calls;
  o.checkpoint = [&](std::uint64_t done) {
    calls.push_back(done);
    return Status::Ok();
  };
  REQUIRE(Replay(Make(long_reqs), o).ok());
  CHECK(calls == std::vector<std::uint64_t>{0, 2, 4});

  // Many one-block requests: every 4096 requests.
  std::vector<std::vector<std::uint64_t>> short_reqs(9000, std::vector<std::uint64_t>{7});
  calls.clear();
  REQUIRE(Replay(Make(short_reqs), o).ok());
  CHECK(calls == std::vector<std::uint64_t>{0, 4096, 8192});

  // A checkpoint's error stops the replay and is returned.
  o.checkpoint = [&](std::uint64_t done) { return done >= 2 ? Status::Cancelled("stop") : Status::Ok(); };
  auto r = Replay(Make(long_reqs), o);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kCancelled);
}
