// The Mooncake trace parser, the prefix-hit ceiling and the synthetic trace generator.
#include <algorithm>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <catch2/catch.hpp>

#include "src/plan/trace.h"
#include "src/plan/trace_gen.h"

using namespace terrace;
using namespace terrace::plan;

namespace {
std::string Line(std::uint64_t ts, std::vector<std::uint64_t> ids, std::uint64_t in = 0) {
  TraceRequest r;
  r.timestamp_ms = ts;
  r.input_length = in ? in : ids.size() * 512;
  r.output_length = 7;
  r.hash_ids = std::move(ids);
  return FormatTraceLine(r) + "\n";
}
}  // namespace

TEST_CASE("Parser reads the Mooncake format and round-trips FormatTraceLine") {
  const std::string text = R"({"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2]})"
                           "\n\n"
                           R"({"timestamp": 40, "input_length": 5, "output_length": 4, "hash_ids": [9], "session": "x"})"
                           "\r\n";
  auto t = ParseTrace(text, "t.jsonl");
  REQUIRE(t.ok());
  REQUIRE(t->requests.size() == 2);
  CHECK(t->requests[0].input_length == 40160);
  CHECK(t->requests[0].output_length == 6);
  CHECK(t->requests[0].hash_ids == std::vector<std::uint64_t>{0, 1, 2});
  CHECK(t->requests[1].timestamp_ms == 40);
  auto again = ParseTrace(FormatTraceLine(t->requests[0]) + "\n" + FormatTraceLine(t->requests[1]), "u");
  REQUIRE(again.ok());
  CHECK(again->requests[1].hash_ids == t->requests[1].hash_ids);
  CHECK(again->requests[0].input_length == t->requests[0].input_length);
}

TEST_CASE("Parser errors name the file, the line and the field") {
  const std::string good = Line(0, {1, 2});
  struct Case {
    std::string line;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "expected a JSON object"},
      {R"({"input_length": 1, "output_length": 1, "hash_ids": []})", "missing \"timestamp\""},
      {R"({"timestamp": 1, "input_length": -3, "output_length": 1, "hash_ids": []})", "\"input_length\" is negative"},
      {R"({"timestamp": 1, "input_length": 1.5, "output_length": 1, "hash_ids": []})", "whole number"},
      {R"({"timestamp": 1, "input_length": "7", "output_length": 1, "hash_ids": []})", "must be a number"},
      {R"({"timestamp": 1, "input_length": 1, "output_length": 1})", "missing \"hash_ids\""},
      {R"({"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": 5})", "must be a list"},
      {R"({"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, -2]})", "\"hash_ids\"[1]"},
      {R"({"timestamp": 1, "input_length": 99999999999, "output_length": 1, "hash_ids": []})", "over the limit"},
      // A whole number too large for an integer parses as a float: still named as over the limit.
      {R"({"timestamp": 1, "input_length": 99999999999999999999999, "output_length": 1, "hash_ids": []})",
       "\"input_length\" is 1e+23, over the limit 4294967296 (2^32)"},
      // A repeated key is refused (nlohmann alone keeps the last value: 5 tokens, not 1000).
      {R"({"timestamp": 1, "input_length": 1000, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]})",
       "duplicate key \"input_length\""},
      {R"({"timestamp": 1, "input_length": 1e400, "output_length": 1, "hash_ids": []})", "out of range"},
  };
  for (const Case& c : cases) {
    auto t = ParseTrace(good + good + c.line + "\n", "bad.jsonl");
    INFO(c.line);
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == Code::kInvalidArgument);
    CHECK_THAT(t.status().message(), Catch::StartsWith("bad.jsonl:3: ") && Catch::Contains(c.expect));
  }
  auto back = ParseTrace(Line(10, {1}) + Line(5, {2}), "b.jsonl");
  REQUIRE_FALSE(back.ok());
  CHECK_THAT(back.status().message(), Catch::Contains("b.jsonl:2") && Catch::Contains("sort the file"));
  auto empty = ParseTrace("\n\n", "e.jsonl");
  REQUIRE_FALSE(empty.ok());
  CHECK_THAT(empty.status().message(), Catch::Contains("empty"));
}

TEST_CASE("-0 reads as 0 (a timestamp, a length, a hash id)") {
  auto t = ParseTrace(R"({"timestamp": -0, "input_length": 5, "output_length": -0.0, "hash_ids": [-0]})", "z.jsonl");
  REQUIRE(t.ok());
  CHECK(t->requests[0].timestamp_ms == 0);
  CHECK(t->requests[0].output_length == 0);
  CHECK(t->requests[0].hash_ids == std::vector<std::uint64_t>{0});
}

TEST_CASE("Prefix-hit ceiling of a hand-made trace, computed by hand") {
  // r1 [1 2 3]: 0 | r2 [1 2 4]: 1, 2 seen -> 2 | r3 [5]: 0 | r4 [1 2 3 6]: 3 | r5 [7 2]: 7 unseen -> 0.
  // 5 of 13 blocks; 7 unique ids.
  auto t = ParseTrace(Line(0, {1, 2, 3}) + Line(1, {1, 2, 4}) + Line(2, {5}) + Line(3, {1, 2, 3, 6}) + Line(4, {7, 2}),
                      "h");
  REQUIRE(t.ok());
  const PrefixCeiling c = ComputePrefixCeiling(*t, 1);
  CHECK(c.blocks == 13);
  CHECK(c.hit_blocks == 5);
  CHECK(c.unique_blocks == 7);
  CHECK(c.fraction() == Approx(5.0 / 13.0));
}

TEST_CASE("The shared-trace fixture parses: 200 requests of 512-token blocks") {
  std::ifstream in(std::string(PLAN_TEST_DATA) + "/mooncake_head200.jsonl");
  REQUIRE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = ParseTrace(ss.str(), "fixture");
  REQUIRE(t.ok());
  CHECK(t->requests.size() == 200);
  for (const TraceRequest& r : t->requests) CHECK(r.hash_ids.size() == (r.input_length + 511) / 512);
}

TEST_CASE("trace gen: seeded, parseable, and its ceiling matches the generator's parameters") {
  TraceGenOptions o;
  o.requests = 3000;
  o.seed = 7;
  auto a = GenerateTrace(o), b = GenerateTrace(o);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::string ta, tb;
  for (const auto& r : a->requests) ta += FormatTraceLine(r) + "\n";
  for (const auto& r : b->requests) tb += FormatTraceLine(r) + "\n";
  CHECK(ta == tb);
  o.seed = 8;
  auto c = GenerateTrace(o);
  REQUIRE(c.ok());
  std::string tc;
  for (const auto& r : c->requests) tc += FormatTraceLine(r) + "\n";
  CHECK(ta != tc);
  auto parsed = ParseTrace(ta, "gen");
  REQUIRE(parsed.ok());
  REQUIRE(parsed->requests.size() == 3000);
  for (const auto& r : parsed->requests) CHECK(r.hash_ids.size() == (r.input_length + 511) / 512);

  struct P {
    int prefixes, prefix_blocks, turn_blocks, turns;
    double zipf;
  };
  for (P p : {P{100, 8, 4, 3, 1.0}, P{1000, 16, 2, 1, 0.0}, P{20, 4, 8, 5, 1.5}, P{5000, 32, 1, 1, 0.8}}) {
    TraceGenOptions g;
    g.requests = 4000;
    g.seed = 3;
    g.prefixes = p.prefixes;
    g.prefix_blocks = p.prefix_blocks;
    g.turn_blocks = p.turn_blocks;
    g.turns = p.turns;
    g.zipf = p.zipf;
    auto t = GenerateTrace(g);
    REQUIRE(t.ok());
    const double measured = ComputePrefixCeiling(*t, 1).fraction();
    const double expected = ExpectedPrefixCeiling(g);
    INFO("prefixes " << p.prefixes << " turns " << p.turns << " zipf " << p.zipf);
    CHECK(measured == Approx(expected).margin(0.03));
  }
  // Single-turn, uniform, no shared prefix: nothing to reuse.
  TraceGenOptions none;
  none.prefix_blocks = 0;
  none.turns = 1;
  auto t = GenerateTrace(none);
  REQUIRE(t.ok());
  CHECK(ComputePrefixCeiling(*t, 1).hit_blocks == 0);
  CHECK(ExpectedPrefixCeiling(none) == 0.0);
}

namespace {
// Mooncake's hash ids name 512-token blocks chained from the prompt's start, so an id stands for
// the same tokens wherever it appears: a block that was partial (the prompt's last, short of
// full) can recur only with the same length (the same prompt again), never as a fuller block.
// Returns the first id that breaks this, or -1.
std::int64_t IdWithTwoLengths(const Trace& t, std::uint64_t block_tokens) {
  std::unordered_map<std::uint64_t, std::uint64_t> tokens;  // id -> tokens of its block
  for (const TraceRequest& r : t.requests) {
    for (std::size_t i = 0; i < r.hash_ids.size(); ++i) {
      const std::uint64_t start = i * block_tokens;
      const std::uint64_t n = r.input_length > start ? std::min(block_tokens, r.input_length - start) : 0;
      auto [it, fresh] = tokens.emplace(r.hash_ids[i], n);
      if (!fresh && it->second != n) return static_cast<std::int64_t>(r.hash_ids[i]);
    }
  }
  return -1;
}
}  // namespace

TEST_CASE("trace gen shares only full blocks: a turn's partial last block is a new block in the next turn") {
  // The reviewer's repro: one prefix block, one block per turn, two turns. Turn 1 is [0, 1] with its
  // block 1 partial; turn 2 extends that prompt, so its block 1 holds more tokens: not id 1.
  TraceGenOptions o;
  o.requests = 2;
  o.prefixes = 1;
  o.prefix_blocks = 1;
  o.turn_blocks = 1;
  o.turns = 2;
  o.seed = 3;
  auto t = GenerateTrace(o);
  REQUIRE(t.ok());
  REQUIRE(t->requests.size() == 2);
  const TraceRequest& a = t->requests[0];
  const TraceRequest& b = t->requests[1];
  REQUIRE(a.hash_ids.size() == 2);
  REQUIRE(b.hash_ids.size() == 3);
  REQUIRE(a.input_length % 512 != 0);  // seed 3: turn 1 is 738 tokens, its block 1 partial
  CHECK(b.hash_ids[0] == a.hash_ids[0]);
  CHECK(b.hash_ids[1] != a.hash_ids[1]);
  CHECK(ComputePrefixCeiling(*t, 1).hit_blocks == 1);
  // Over many sessions and shapes: no id ever stands for blocks of two lengths (the real trace's
  // property; tests/plan/test_plan_cli.py checks it on the Mooncake fixture too).
  for (int turns : {2, 3, 8}) {
    for (int block_tokens : {512, 16, 1}) {
      TraceGenOptions g;
      g.requests = 2000;
      g.seed = 11;
      g.turns = turns;
      g.block_tokens = block_tokens;
      auto gt = GenerateTrace(g);
      REQUIRE(gt.ok());
      INFO("turns " << turns << " block tokens " << block_tokens);
      CHECK(IdWithTwoLengths(*gt, static_cast<std::uint64_t>(block_tokens)) == -1);
      CHECK(ComputePrefixCeiling(*gt, 1).fraction() == Approx(ExpectedPrefixCeiling(g)).margin(0.03));
    }
  }
}

TEST_CASE("trace gen options out of range name the flag") {
  TraceGenOptions o;
  o.turns = 0;
  auto t = GenerateTrace(o);
  REQUIRE_FALSE(t.ok());
  CHECK_THAT(t.status().message(), Catch::Contains("--turns"));
}

TEST_CASE("trace gen counts its blocks before generating, and refuses a trace past what plan reads") {
  for (auto [requests, turns, prefix_blocks, turn_blocks] :
       {std::tuple{1ull, 1, 0, 1}, {7ull, 3, 2, 5}, {100ull, 4, 8, 3}, {10ull, 10, 0, 2}}) {
    TraceGenOptions o;
    o.requests = requests;
    o.turns = turns;
    o.prefix_blocks = prefix_blocks;
    o.turn_blocks = turn_blocks;
    auto t = GenerateTrace(o);
    REQUIRE(t.ok());
    std::uint64_t blocks = 0;
    for (const auto& r : t->requests) blocks += r.hash_ids.size();
    CHECK(TraceGenBlocks(o) == blocks);
  }
  // Within every flag's range, but about 150 GB of text: refused before any memory is taken.
  TraceGenOptions big;
  big.requests = 10'000;
  big.turns = 10'000;
  big.turn_blocks = 419;
  const Status s = ValidateTraceGenOptions(big);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains(std::to_string(TraceGenBlocks(big)) + " blocks") &&
                              Catch::Contains("--requests, --turns, --turn-blocks or --prefix-blocks"));
  big.turns = 1'000;
  big.prefix_blocks = 0;
  big.turn_blocks = 5'000;  // 5e6 blocks in its longest request: over the per-request limit, named with its value
  const Status per_request = ValidateTraceGenOptions(big);
  REQUIRE_FALSE(per_request.ok());
  CHECK_THAT(per_request.message(), Catch::Contains("is 5000000"));
}
