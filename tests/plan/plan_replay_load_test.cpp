// The replay's timing with absolute timestamps, its per-node write and recompute counts (what
// `terrace plan --trace` checks against the hardware), and the trace parser's error texts.
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include <catch2/catch.hpp>

#include "src/plan/replay.h"
#include "src/plan/trace.h"
#include "trace_fixture.h"

using namespace terrace;
using namespace terrace::plan;

namespace load_test {
Trace LoadFixture() { return terrace::plan::testing::MooncakeHead200(); }

// Three tiers small enough that the fixture's blocks are demoted into host and NVMe and restored
// from both, over links slow enough that restores queue.
ReplayOptions LoadThreeTiers(double read_bandwidth) {
  ReplayOptions o;
  o.block_tokens = 512;
  o.block_bytes = 1 << 20;
  o.prefill_tokens_per_s = 20000;
  o.tiers = {{"hbm", 64ull << 20, 0}, {"host", 256ull << 20, read_bandwidth}, {"nvme", 4ull << 30, read_bandwidth / 4}};
  return o;
}

Trace LoadShifted(Trace t, std::uint64_t offset) {
  for (TraceRequest& r : t.requests) r.timestamp_ms += offset;
  return t;
}
}  // namespace load_test
using namespace load_test;

TEST_CASE("Replay timing does not depend on a constant timestamp offset") {
  const Trace base = LoadFixture();
  for (double bw : {1e9, 1e7}) {  // restores that rarely queue, and ones that queue
    const ReplayOptions o = LoadThreeTiers(bw);
    auto r0 = Replay(base, o);
    REQUIRE(r0.ok());
    REQUIRE(r0->restore_s > 0);
    for (std::uint64_t offset : {1'700'000'000'000ull, 1'700'000'000'000'000ull, 1'700'000'000'000'000'000ull}) {
      INFO("bandwidth " << bw << ", offset " << offset);
      auto r = Replay(LoadShifted(base, offset), o);
      REQUIRE(r.ok());
      CHECK(r->restore_s == r0->restore_s);
      CHECK(r->queue_wait_s == r0->queue_wait_s);
      CHECK(r->ttft_saved_s == r0->ttft_saved_s);
      CHECK(r->restores_slower_than_recompute == r0->restores_slower_than_recompute);
      CHECK(r->duration_ms == r0->duration_ms);
    }
  }
}

TEST_CASE("A restore that waits for no other has no queue wait, not a rounding residue") {
  // Requests 1 s apart, each restoring a few MB over a 1 GB/s link: no restore overlaps another.
  Trace t;
  for (std::uint64_t i = 0; i < 50; ++i) {
    TraceRequest r;
    r.timestamp_ms = 1'700'000'000'123ull + i * 1000;
    r.input_length = 3 * 512;
    r.hash_ids = {i % 5, 100 + i % 5, 200 + i % 5};
    t.requests.push_back(r);
  }
  ReplayOptions o = LoadThreeTiers(1e9);
  o.tiers[0].capacity_bytes = 2 << 20;  // hbm holds two blocks: most hits come from host
  auto r = Replay(t, o);
  REQUIRE(r.ok());
  REQUIRE(r->tiers[1].bytes_read > 0);
  CHECK(r->queue_wait_s == 0.0);
  // The fixture's restores over links fast enough that none waits (the old code summed 1e-15 s of
  // rounding residue here).
  auto fixture = Replay(LoadFixture(), LoadThreeTiers(1e12));
  REQUIRE(fixture.ok());
  REQUIRE(fixture->restores > 0);
  CHECK(fixture->queue_wait_s == 0.0);
}

TEST_CASE("Replay counts each node's writes per tier and its recomputed tokens") {
  const Trace t = LoadFixture();
  ReplayOptions o = LoadThreeTiers(1e9);
  auto one = Replay(t, o);
  REQUIRE(one.ok());
  CHECK(one->duration_ms == t.requests.back().timestamp_ms - t.requests.front().timestamp_ms);
  CHECK(one->max_node_recomputed_tokens == one->prompt_tokens - one->hit_tokens);
  for (const TierReplayStats& s : one->tiers) CHECK(s.max_node_bytes_written == s.bytes_written);
  REQUIRE(one->tiers[2].bytes_written > 0);
  o.nodes = 4;
  o.routing = Routing::kRoundRobin;
  auto four = Replay(t, o);
  REQUIRE(four.ok());
  // The busiest node's share: at least the mean, at most the whole.
  CHECK(four->max_node_recomputed_tokens * 4 >= four->prompt_tokens - four->hit_tokens);
  CHECK(four->max_node_recomputed_tokens < four->prompt_tokens - four->hit_tokens);
  for (const TierReplayStats& s : four->tiers) {
    CHECK(s.max_node_bytes_written * 4 >= s.bytes_written);
    CHECK(s.max_node_bytes_written <= s.bytes_written);
  }
}

TEST_CASE("Trace syntax errors give the column of the file's line, name CR line endings, escape bad bytes") {
  const std::string good = R"({"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1]})";
  auto col = ParseTrace(good + "\n" + R"({"timestamp": 2, "input_length": 3, x})" + "\n", "t.jsonl");
  REQUIRE_FALSE(col.ok());
  CHECK_THAT(col.status().message(), Catch::Contains("t.jsonl:2: ") && Catch::Contains("column 37 of that line") &&
                                         !Catch::Contains("line 1,"));

  auto cr = ParseTrace(good + "\r" + good + "\r", "mac.jsonl");
  REQUIRE_FALSE(cr.ok());
  CHECK_THAT(cr.status().message(), Catch::Contains("mac.jsonl:1: ") && Catch::Contains("the file uses CR line endings"));
  // CRLF is fine, and an error in such a file carries no CR hint.
  REQUIRE(ParseTrace(good + "\r\n" + good + "\r\n", "dos.jsonl").ok());
  auto dos = ParseTrace(good + "\r\n{x}\r\n", "dos.jsonl");
  REQUIRE_FALSE(dos.ok());
  CHECK_THAT(dos.status().message(), !Catch::Contains("CR line endings"));

  auto bytes = ParseTrace("{\"timestamp\": 2, \"input_length\": \xe9\xff}\n", "latin1.jsonl");
  REQUIRE_FALSE(bytes.ok());
  const std::string m = bytes.status().message();
  CHECK(m.find('\xe9') == std::string::npos);
  CHECK(m.find('\xff') == std::string::npos);
  CHECK_THAT(m, Catch::Contains("\\xe9"));
  // Valid UTF-8 stays as it is.
  auto utf8 = ParseTrace(R"({"timestamp": 2, "input_length": 3, "output_length": 1, "hash_ids": [")" "\xc3\xa9" R"("]})" "\n",
                         "utf8.jsonl");
  REQUIRE_FALSE(utf8.ok());
  CHECK_THAT(utf8.status().message(), Catch::Contains("\xc3\xa9") && !Catch::Contains("\\xc3"));
}
