// Request traces in the Mooncake format (docs/plan.md, "Trace format"): JSON lines, one request per
// line, {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [ids]}. Each
// hash id names one block of the prompt (a fixed number of tokens, 512 in Mooncake's release); equal
// ids mean equal prompt content including everything before it (the ids are chained). Pure functions,
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::plan {

struct TraceRequest {
  std::uint64_t timestamp_ms = 0;
  std::uint64_t input_length = 0;   // prompt tokens
  std::uint64_t output_length = 0;  // decoded tokens
  std::vector<std::uint64_t> hash_ids;  // one per prompt block, in prompt order
};

struct Trace {
  std::vector<TraceRequest> requests;  // in file order (timestamps non-decreasing)
};

// Limits that keep a hostile file from allocating without bound.
inline constexpr std::uint64_t kMaxTraceTokens = 1ull << 32;     // input_length / output_length
inline constexpr std::size_t kMaxTraceBlocksPerRequest = 1u << 22;

// Parses one line (without its newline). InvalidArgument naming `source`:`line_number` and the key
// on: not a JSON object, a key repeated in the object (not read last-wins), a missing or
// non-integer or negative field, a hash id that is not a non-negative integer, a value over the
// limits above; a syntax error names the column within the line, and a line holding a '\r' (a file
// with CR-only line endings) says so; bytes of the line that are not UTF-8 are shown as \xNN. -0
// reads as 0. Keys other than the four are ignored (other tools add e.g. session
// ids).
Result<TraceRequest> ParseTraceLine(std::string_view line, std::string_view source, std::size_t line_number);
// Parses a whole file's text. Blank lines are skipped. Timestamps must not decrease (InvalidArgument
// naming the line). An empty trace is InvalidArgument.
Result<Trace> ParseTrace(std::string_view text, std::string_view source);
// Reads and parses a file (IoError naming the path when it cannot be read).
Result<Trace> LoadTrace(const std::string& path);
// One line in the canonical format (no trailing newline); ParseTraceLine(FormatTraceLine(r)) == r.
std::string FormatTraceLine(const TraceRequest& request);

// The prefix of `ids` a cache can restore: the longest leading run of ids for which `resident(id)`
// holds, cut back to a whole multiple of `restore_every_blocks` (>= 1; a restore starts only at a
// boundary every that many blocks, replay.h's ReplayOptions::restore_every_blocks). The one rule
// both the replay and ComputePrefixCeiling count hits by.
template <class Resident>
std::size_t RestorablePrefix(const std::vector<std::uint64_t>& ids, std::uint64_t restore_every_blocks,
                             Resident&& resident) {
  std::size_t run = 0;
  while (run < ids.size() && resident(ids[run])) ++run;
  return run - run % restore_every_blocks;
}

// Share of prompt blocks whose whole prefix was seen before (an infinite prefix cache): for each
// request, RestorablePrefix over the hash ids seen in earlier requests, summed, over all blocks;
// restore_every_blocks (>= 1) as the replay's, so that a replay with room for every block reaches
// exactly this. 0 for a trace without blocks.
struct PrefixCeiling {
  std::uint64_t blocks = 0;       // prompt blocks in the trace
  std::uint64_t hit_blocks = 0;   // blocks in a reusable prefix
  std::uint64_t unique_blocks = 0;
  double fraction() const { return blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / static_cast<double>(blocks); }
};
PrefixCeiling ComputePrefixCeiling(const Trace& trace, std::uint64_t restore_every_blocks);

}  // namespace terrace::plan
