// `terrace trace gen`: synthetic Mooncake-format request traces (docs/plan.md, "Synthetic traces").
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/plan/trace.h"
#include "src/plan/trace_gen.h"

namespace terrace::cli {
namespace {

struct GenArgs {
  plan::TraceGenOptions o;
  std::optional<double> zipf, rate, think_ms;
  std::string out;
  bool force = false;
  bool prefixes_given = false;  // --prefixes on the command line (refused with --prefix-blocks 0)
};

// A trace has no room for Terrace's mark: an existing file is replaced only with --force.
OutputRules TraceRules(const GenArgs& a) { return {.format = OutputFormat::kTrace, .force = a.force}; }

// True for a /dev or /proc name of this process's standard output (/dev/stdout, /dev/fd/1,
// /proc/self/fd/1: symlinks, which an output file may not be).
bool NamesStdout(const std::string& path) {
  if (!path.starts_with("/dev/") && !path.starts_with("/proc/")) return false;
  struct stat named {}, out {};
  return ::stat(path.c_str(), &named) == 0 && ::fstat(STDOUT_FILENO, &out) == 0 && named.st_dev == out.st_dev &&
         named.st_ino == out.st_ino;
}

int RunGen(const GenArgs& a) {
  plan::TraceGenOptions o = a.o;
  if (a.zipf) o.zipf = *a.zipf;
  if (a.rate) o.rate = *a.rate;
  if (a.think_ms) o.think_ms = *a.think_ms;
  // Flags that shape what a trace without them would not have: refused rather than ignored.
  if (o.prefix_blocks == 0 && (a.zipf || a.prefixes_given)) {
    return FailUsage(fmt::format("{} shapes the shared prefixes, and --prefix-blocks 0 makes none; drop {} or give "
                                 "--prefix-blocks 1 or more",
                                 a.zipf ? "--zipf" : "--prefixes", a.zipf ? "--zipf" : "--prefixes"));
  }
  if (o.turns == 1 && a.think_ms) {
    return FailUsage("--think-ms is the gap between a session's turns, and --turns 1 has one turn; drop --think-ms "
                     "or give --turns 2 or more");
  }
  if (Status s = plan::ValidateTraceGenOptions(o); !s.ok()) return FailUsage(s.message());
  const bool to_stdout = a.out.empty() || a.out == "-" || NamesStdout(a.out);
  if (!to_stdout) {
    if (Status s = CheckOutputFile(a.out, "--out", TraceRules(a)); !s.ok()) return FailUsage(s.message());
  }
  auto trace = plan::GenerateTrace(o);
  if (!trace.ok()) return FailUsage(trace.status().message());
  std::string text;
  for (const plan::TraceRequest& r : trace->requests) {
    text += plan::FormatTraceLine(r);
    text += '\n';
  }
  if (to_stdout) {
    fmt::print("{}", text);
    return 0;
  }
  if (Status s = WriteOutputFile(a.out, "--out", TraceRules(a), text); !s.ok()) return Fail(s.ToString());
  const plan::PrefixCeiling c = plan::ComputePrefixCeiling(*trace, /*restore_every_blocks=*/1);
  const std::size_t n = trace->requests.size();
  fmt::print("wrote {}: {} request{}, {} block{} of {} tokens, prefix-hit ceiling {:.1f}% (expected {:.1f}%)\n", a.out,
             n, n == 1 ? "" : "s", c.blocks, c.blocks == 1 ? "" : "s", o.block_tokens, 100.0 * c.fraction(),
             100.0 * plan::ExpectedPrefixCeiling(o));
  return 0;
}

}  // namespace

void RegisterTrace(CLI::App& app, Runner* run) {
  auto* t = app.add_subcommand("trace", "Request traces in the Mooncake JSONL format");
  t->require_subcommand(1);
  auto a = std::make_shared<GenArgs>();
  auto* g = t->add_subcommand("gen", "Write a synthetic trace: multi-turn sessions over Zipf-popular shared prefixes");
  g->add_option("-o,--out", a->out, "Output file (default, - or /dev/stdout: standard output)");
  g->add_flag("--force", a->force,
              "Replace an existing --out file (a trace carries no mark of Terrace's, so any existing file needs it)");
  AddIntOption<std::uint64_t>(g, "--requests", &a->o.requests, 1, 10'000'000, "Requests");
  AddIntOption<std::uint64_t>(g, "--seed", &a->o.seed, 0, UINT64_MAX, "Random seed");
  AddIntOption(g, "--prefixes", &a->o.prefixes, 1, 10'000'000, "Distinct shared prefixes")
      ->each([a](const std::string&) { a->prefixes_given = true; });
  AddDoubleOption(g, "--zipf", &a->zipf, 0, 8, "Prefix popularity exponent, 0 = uniform (default 1)");
  AddIntOption(g, "--prefix-blocks", &a->o.prefix_blocks, 0, 100'000, "Blocks of each shared prefix");
  AddIntOption(g, "--turn-blocks", &a->o.turn_blocks, 1, 100'000, "New blocks per turn");
  AddIntOption(g, "--turns", &a->o.turns, 1, 10'000, "Turns per session");
  AddDoubleOption(g, "--rate", &a->rate, 1e-6, 1e6, "Requests per second (default 2)");
  AddDoubleOption(g, "--think-ms", &a->think_ms, 0, 1e9, "Gap between a session's turns in ms (default 30000)");
  AddIntOption(g, "--block-tokens", &a->o.block_tokens, 1, 65536, "Tokens per hash id");
  AddIntOption(g, "--output-mean", &a->o.output_mean, 1, 1'000'000, "Mean output tokens");
  g->callback([run, a] { *run = [a] { return RunGen(*a); }; });
}

}  // namespace terrace::cli
