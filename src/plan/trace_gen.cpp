#include "src/plan/trace_gen.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

namespace terrace::plan {
namespace {

std::vector<double> PrefixWeights(const TraceGenOptions& o) {
  std::vector<double> w(static_cast<std::size_t>(o.prefixes));
  double sum = 0;
  for (int i = 0; i < o.prefixes; ++i) sum += w[static_cast<std::size_t>(i)] = 1.0 / std::pow(i + 1.0, o.zipf);
  for (double& x : w) x /= sum;
  return w;
}

// Turns of each session, in session order.
std::vector<int> SessionTurns(const TraceGenOptions& o) {
  std::vector<int> turns;
  std::uint64_t left = o.requests;
  while (left > 0) {
    const int t = static_cast<int>(std::min<std::uint64_t>(left, static_cast<std::uint64_t>(o.turns)));
    turns.push_back(t);
    left -= static_cast<std::uint64_t>(t);
  }
  return turns;
}

}  // namespace

std::uint64_t TraceGenBlocks(const TraceGenOptions& o) {
  std::uint64_t total = 0;
  for (int t : SessionTurns(o)) {
    const auto turns = static_cast<std::uint64_t>(t);
    total += turns * static_cast<std::uint64_t>(o.prefix_blocks) +
             static_cast<std::uint64_t>(o.turn_blocks) * turns * (turns + 1) / 2;
  }
  return total;
}

Status ValidateTraceGenOptions(const TraceGenOptions& o) {
  if (o.requests == 0 || o.requests > 10'000'000) return Status::InvalidArgument("--requests must be 1 to 10000000");
  if (o.prefixes < 1 || o.prefixes > 10'000'000) return Status::InvalidArgument("--prefixes must be 1 to 10000000");
  if (!(o.zipf >= 0 && o.zipf <= 8)) return Status::InvalidArgument("--zipf must be 0 to 8");
  if (o.prefix_blocks < 0 || o.prefix_blocks > 100'000) return Status::InvalidArgument("--prefix-blocks must be 0 to 100000");
  if (o.turn_blocks < 1 || o.turn_blocks > 100'000) return Status::InvalidArgument("--turn-blocks must be 1 to 100000");
  if (o.turns < 1 || o.turns > 10'000) return Status::InvalidArgument("--turns must be 1 to 10000");
  if (const double longest = static_cast<double>(o.prefix_blocks) + static_cast<double>(o.turns) * o.turn_blocks;
      longest > kMaxTraceBlocksPerRequest) {
    return Status::InvalidArgument(fmt::format("--prefix-blocks + --turns x --turn-blocks is {:.0f}: a request would "
                                               "hold more than the {} blocks a trace request may; lower them",
                                               longest, kMaxTraceBlocksPerRequest));
  }
  if (const std::uint64_t total = TraceGenBlocks(o); total > kMaxTraceGenBlocks) {
    return Status::InvalidArgument(fmt::format(
        "the trace would hold {} blocks in all (its requests' prompts, each the session so far), more than the {} "
        "trace gen writes (about {} GiB of text, held in memory while written); lower --requests, --turns, "
        "--turn-blocks or --prefix-blocks",
        total, kMaxTraceGenBlocks, kMaxTraceGenBlocks * 10 >> 30));
  }
  if (!(o.rate > 0 && o.rate <= 1e6)) return Status::InvalidArgument("--rate must be in (0, 1e6] requests/s");
  if (!(o.think_ms >= 0 && o.think_ms <= 1e9)) return Status::InvalidArgument("--think-ms must be 0 to 1e9");
  if (o.block_tokens < 1 || o.block_tokens > 65536) return Status::InvalidArgument("--block-tokens must be 1 to 65536");
  if (o.output_mean < 1 || o.output_mean > 1'000'000) return Status::InvalidArgument("--output-mean must be 1 to 1000000");
  // The longest prompt's input_length must stay one `plan --trace` reads.
  if (const double tokens = (static_cast<double>(o.prefix_blocks) + static_cast<double>(o.turns) * o.turn_blocks) *
                            o.block_tokens;
      tokens > static_cast<double>(kMaxTraceTokens)) {
    return Status::InvalidArgument(fmt::format(
        "(--prefix-blocks + --turns x --turn-blocks) x --block-tokens is {:.0f}: a request's input_length would "
        "exceed the {} tokens a trace request may hold; lower them",
        tokens, kMaxTraceTokens));
  }
  return Status::Ok();
}

Result<Trace> GenerateTrace(const TraceGenOptions& o) {
  TERRACE_RETURN_IF_ERROR(ValidateTraceGenOptions(o));
  std::mt19937_64 rng(o.seed);
  const std::vector<double> w = PrefixWeights(o);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  const double session_rate = o.rate / o.turns;  // sessions per second
  std::exponential_distribution<double> gap(session_rate);
  std::uniform_int_distribution<int> out_len(1, 2 * o.output_mean - 1);
  std::uniform_int_distribution<int> short_by(0, o.block_tokens - 1);
  std::uint64_t next_id = static_cast<std::uint64_t>(o.prefixes) * static_cast<std::uint64_t>(o.prefix_blocks);

  struct Timed {
    double ms;
    std::uint64_t order;
    TraceRequest r;
  };
  std::vector<Timed> all;
  all.reserve(o.requests);
  double start_s = 0;
  std::uint64_t order = 0;
  for (int turns : SessionTurns(o)) {
    const int p = pick(rng);
    std::vector<std::uint64_t> prompt;
    for (int b = 0; b < o.prefix_blocks; ++b) {
      prompt.push_back(static_cast<std::uint64_t>(p) * static_cast<std::uint64_t>(o.prefix_blocks) +
                       static_cast<std::uint64_t>(b));
    }
    for (int t = 0; t < turns; ++t) {
      for (int b = 0; b < o.turn_blocks; ++b) prompt.push_back(next_id++);
      const auto short_tokens = static_cast<std::uint64_t>(short_by(rng));
      TraceRequest r;
      r.hash_ids = prompt;
      r.input_length = prompt.size() * static_cast<std::uint64_t>(o.block_tokens) - short_tokens;
      r.output_length = static_cast<std::uint64_t>(out_len(rng));
      all.push_back({start_s * 1000.0 + t * o.think_ms, order++, std::move(r)});
      // Only full blocks are shared: the next turn's prompt continues this one's text, so where
      // this prompt's last block is partial, the next prompt's block there holds more tokens and
      // is another block, with a fresh id (hash ids chain full blocks, as Mooncake's do).
      if (short_tokens > 0 && t + 1 < turns) prompt.back() = next_id++;
    }
    start_s += gap(rng);
  }
  std::stable_sort(all.begin(), all.end(), [](const Timed& a, const Timed& b) {
    return a.ms < b.ms || (a.ms == b.ms && a.order < b.order);
  });
  Trace trace;
  trace.requests.reserve(all.size());
  for (Timed& t : all) {
    t.r.timestamp_ms = static_cast<std::uint64_t>(std::llround(t.ms));
    trace.requests.push_back(std::move(t.r));
  }
  // Rounding may not reorder: llround is monotonic.
  return trace;
}

double ExpectedPrefixCeiling(const TraceGenOptions& o) {
  const std::vector<int> sessions = SessionTurns(o);
  const std::vector<double> w = PrefixWeights(o);
  const double s = static_cast<double>(sessions.size());
  double distinct = 0;
  for (double p : w) distinct += 1.0 - std::pow(1.0 - p, s);
  const double p_seen = (s - distinct) / s;  // a session's prefix was drawn by an earlier session
  const double L = o.prefix_blocks, u = o.turn_blocks;
  // A prompt's last block is partial (short by 1..block-1 tokens) with this probability; the next
  // turn then shares all but that block of the previous prompt.
  const double p_partial = static_cast<double>(o.block_tokens - 1) / o.block_tokens;
  double hits = 0, blocks = 0;
  for (int turns : sessions) {
    for (int t = 1; t <= turns; ++t) {
      blocks += L + t * u;
      hits += t == 1 ? L * p_seen : L + (t - 1) * u - p_partial;
    }
  }
  return blocks > 0 ? hits / blocks : 0.0;
}

}  // namespace terrace::plan
