// Synthetic request traces in the Mooncake format (trace.h): multi-turn sessions over shared
// prefixes with Zipf popularity (docs/plan.md, "Synthetic traces"). Deterministic for a seed.
//
// Each session draws one shared prefix (prefix_blocks blocks, `prefixes` of them, prefix i chosen
// with probability ~ 1/(i+1)^zipf) and has `turns` turns; turn t's prompt is the shared prefix then
// t * turn_blocks session blocks: the previous turn's prompt plus turn_blocks new ones, except that
// the previous prompt's last block, when partial (its length is a random 0..block-1 tokens short of
// full blocks), is a new block too (hash ids name full blocks, chained, as in Mooncake's traces). Sessions
// start as a Poisson process at rate / turns per second (about `rate` requests per second); turn t comes think_ms after
// turn t-1. Pure; thread-safe.
#pragma once

#include <cstdint>

#include "src/plan/trace.h"
#include "terrace/status.h"

namespace terrace::plan {

struct TraceGenOptions {
  std::uint64_t requests = 1000;
  std::uint64_t seed = 0;
  int prefixes = 100;            // distinct shared prefixes
  double zipf = 1.0;             // prefix popularity exponent (0 = uniform)
  int prefix_blocks = 8;         // blocks of each shared prefix
  int turn_blocks = 4;           // new blocks per turn
  int turns = 3;                 // turns per session (the last session may have fewer)
  double rate = 2.0;             // requests per second (sessions start at rate / turns)
  double think_ms = 30000;       // gap between a session's turns
  int block_tokens = 512;
  int output_mean = 150;         // output_length uniform in [1, 2 * output_mean - 1]
};

// InvalidArgument naming the `terrace trace gen` flag for a value out of range.
// The most blocks (hash ids over all requests) a generated trace may hold: about 10 bytes of text
// each, so its file stays under what `plan --trace` reads (8 GiB).
inline constexpr std::uint64_t kMaxTraceGenBlocks = 1ull << 28;
// The blocks (hash ids over all requests) GenerateTrace(options) writes; options must be valid
// but for this total.
std::uint64_t TraceGenBlocks(const TraceGenOptions& options);
Status ValidateTraceGenOptions(const TraceGenOptions& options);
Result<Trace> GenerateTrace(const TraceGenOptions& options);
// The expected prefix-hit ceiling (trace.h's ComputePrefixCeiling, restore_every_blocks 1) of
// GenerateTrace(options) over the seed: a session's first turn hits its shared prefix unless it is
// the first session to draw it; later turns hit the previous turn's prompt but for its last block
// when that was partial.
double ExpectedPrefixCeiling(const TraceGenOptions& options);

}  // namespace terrace::plan
