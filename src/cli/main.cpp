// The `terrace` entry point: parses the command line (CLI11), runs the chosen command and maps every
// outcome onto the exit codes of command.h: 0 ok, 1 runtime failure, 2 usage error, never a crash
// code for an exception (one line "terrace: error: ..." and exit 1, also from a worker thread).
// Standard output is flushed and checked before the exit: output that could not be written (a full
// disk, a closed pipe) is "cannot write standard output: <cause>" and exit 1, never a silent 0 (nor
// a death by SIGPIPE, which the CLI ignores).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <malloc.h>
#include <unistd.h>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"

namespace terrace::cli {

int Fail(std::string_view message) {
  fmt::print(stderr, "terrace: error: {}\n", message);
  return kExitFailure;
}

int FailUsage(std::string_view message) {
  fmt::print(stderr, "terrace: error: {}\n", message);
  return kExitUsage;
}

namespace {

// glibc serves blocks above its mmap threshold (128 KiB, raised dynamically to at most 32 MiB) with
// mmap and unmaps them on free, and trims the heap top above 128 KiB, so each forward pass's
// working tensors arrive in fresh pages: ~25 000 minor faults (~97 MB) per 16k-context time to
// first token on a 2-core VM, 12% of it (docs/benchmarks.md). The CLI keeps freed memory for
// reuse instead: blocks up to 256 MiB come from the heap and up to 1 GiB of free heap is kept.
// A process policy, so the library leaves it to its embedder (docs/architecture.md).
void KeepFreedMemory() {
  (void)mallopt(M_MMAP_THRESHOLD, 256 << 20);
  (void)mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// The errno of the failed write to standard output that threw `e` (fmt's print throws
// std::system_error when fwrite fails); 0 when `e` is another error or stdout has not failed.
int StdoutWriteErrno(std::exception_ptr e) {
  if (std::ferror(stdout) == 0) return 0;
  try {
    std::rethrow_exception(e);
  } catch (const std::system_error& x) {
    const std::error_category& c = x.code().category();
    if (c == std::generic_category() || c == std::system_category()) return x.code().value() != 0 ? x.code().value() : EIO;
  } catch (...) {
  }
  return 0;
}

std::string DescribeException(std::exception_ptr e) {
  if (const int err = StdoutWriteErrno(e); err != 0) return StdoutErrorMessage(err);
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return "out of memory; try smaller sizes or counts";
  } catch (const std::exception& x) {
    return fmt::format("internal error: {}", x.what());
  } catch (...) {
    return "internal error: unknown exception";
  }
}

// An exception that leaves a thread (std::terminate): one line and exit 1 instead of SIGABRT.
[[noreturn]] void OnTerminate() {
  std::exception_ptr e = std::current_exception();
  const std::string what = e ? DescribeException(e) : "internal error: terminate called";
  const std::string line = fmt::format("terrace: error: {}\n", what);
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  std::_Exit(kExitFailure);
}

// `rc` once standard output is flushed; when that flush or an earlier write to it failed:
// StdoutErrorMessage and 1 (or `rc` when that is already a failure). `earlier_errno`: the errno
// right after the code that wrote last, the cause when the flush has nothing left to write (a
// failed write discards what was buffered). Said once: not after a command that failed on it.
int FinishStdout(int rc, int earlier_errno = 0) {
  if (rc != 0 && StdoutWriteFailed()) return rc;
  errno = 0;
  if (std::fflush(stdout) == 0 && std::ferror(stdout) == 0) return rc;
  const int failed = Fail(StdoutErrorMessage(errno != 0 ? errno : earlier_errno));
  return rc != 0 ? rc : failed;
}

// FinishStdout after CLI11 printed help or the version (through std::cout, which flushes as it goes).
int FinishPrinted(const CLI::App& app, const CLI::Error& e) {
  errno = 0;
  const int rc = app.exit(e);
  return FinishStdout(rc, errno);
}

// The deepest subcommand the parser entered ("terrace model ..." -> model).
const CLI::App* Deepest(const CLI::App* app) {
  for (const CLI::App* sub : app->get_subcommands()) return Deepest(sub);
  return app;
}

std::string CommandPath(const CLI::App* app) {
  std::string path;
  for (const CLI::App* a = app; a != nullptr; a = a->get_parent()) path = a->get_name() + (path.empty() ? "" : " " + path);
  return path;
}

// "unknown command 'frobnicate'" when a word that is not a flag sits where a subcommand must go.
std::string UnknownCommandMessage(const CLI::App& app, const CLI::ParseError& e) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr && dynamic_cast<const CLI::RequiredError*>(&e) == nullptr) {
    return "";
  }
  const CLI::App* at = Deepest(&app);
  const std::vector<std::string> rest = at->remaining();
  std::vector<std::string> names;
  for (const CLI::App* sub : at->get_subcommands([](const CLI::App* s) { return !s->get_group().empty(); })) {
    names.push_back(sub->get_name());
  }
  if (names.empty()) return "";
  if (rest.empty() && dynamic_cast<const CLI::RequiredError*>(&e) != nullptr && at->get_subcommands().empty()) {
    return fmt::format("'{}' needs a command: {} (run '{} --help')", CommandPath(at), fmt::join(names, ", "),
                       CommandPath(at));
  }
  if (rest.empty() || rest.front().empty() || rest.front()[0] == '-') return "";
  return fmt::format("unknown command '{}' for '{}'; commands: {} (run '{} --help')", rest.front(), CommandPath(at),
                     fmt::join(names, ", "), CommandPath(at));
}

// Edit distance between a and b, a swap of two neighbours counting one (optimal string alignment).
std::size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t sub = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + sub});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// The flag of `at` closest to `given` (e.g. --max-new for --max_new), when it is close: at most a
// third of its letters differ (at least one, at most three). Empty when none is.
std::string ClosestFlag(const CLI::App& at, std::string_view given) {
  std::string best;
  std::size_t best_distance = SIZE_MAX;
  for (const CLI::Option* o : at.get_options()) {
    for (const std::string& name : o->get_lnames()) {
      const std::string flag = "--" + name;
      const std::size_t dist = EditDistance(given, flag);
      if (dist < best_distance) {
        best_distance = dist;
        best = flag;
      }
    }
  }
  const std::size_t letters = given.size() - std::min<std::size_t>(2, given.find_first_not_of('-'));
  return best_distance <= std::clamp<std::size_t>(letters / 3, 1, 3) ? best : "";
}

// "unknown flag --max_new for 'terrace model run'; did you mean --max-new? (run 'terrace model run
// --help')" for the first unexpected argument that is a flag; "unexpected argument '3' ..." for a
// word where no positional argument goes. Empty for other errors.
std::string UnexpectedArgumentMessage(const CLI::App& app, const CLI::ParseError& e) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr) return "";
  const CLI::App* at = Deepest(&app);
  std::vector<std::string> rest = at->remaining();
  if (rest.empty()) rest = app.remaining();
  if (rest.empty()) return "";
  const std::string path = CommandPath(at);
  for (const std::string& arg : rest) {
    if (arg.size() < 2 || arg[0] != '-' || std::isdigit(static_cast<unsigned char>(arg[1])) != 0) continue;
    const std::string flag = arg.substr(0, arg.find('='));
    const std::string near = ClosestFlag(*at, flag);
    return fmt::format("unknown flag {} for '{}'{} (run '{} --help')", flag, path,
                       near.empty() ? "" : fmt::format("; did you mean {}?", near), path);
  }
  return fmt::format("unexpected argument '{}' for '{}' (run '{} --help')", rest.front(), path, path);
}

// CLI11's count messages in plain words: "--rate: At Most 1 required but received 2" -> "--rate
// given 2 times; give it once", "--rate: 1 required NUMBER missing" -> "--rate needs a value
// (NUMBER)". Empty for other errors.
std::string ArgumentCountMessage(const CLI::ParseError& e) {
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) == nullptr) return "";
  const std::string_view what = e.what();
  const std::size_t colon = what.find(": ");
  if (colon == std::string_view::npos || what.substr(0, 1) != "-") return "";
  const std::string_view flag = what.substr(0, colon);
  const std::string_view rest = what.substr(colon + 2);
  constexpr std::string_view kAtMost = "At Most 1 required but received ";
  if (rest.substr(0, kAtMost.size()) == kAtMost) {
    return fmt::format("{} given {} times; give it once", flag, rest.substr(kAtMost.size()));
  }
  constexpr std::string_view kOne = "1 required ";
  constexpr std::string_view kMissing = " missing";
  if (rest.substr(0, kOne.size()) == kOne && rest.size() > kOne.size() + kMissing.size() &&
      rest.substr(rest.size() - kMissing.size()) == kMissing) {
    return fmt::format("{} needs a value ({})", flag,
                       rest.substr(kOne.size(), rest.size() - kOne.size() - kMissing.size()));
  }
  return "";
}

}  // namespace
}  // namespace terrace::cli

int main(int argc, char** argv) {
  using namespace terrace::cli;
  std::set_terminate(OnTerminate);
  KeepFreedMemory();
  // A write past RLIMIT_FSIZE fails with EFBIG (reported as an I/O error) instead of killing us.
  std::signal(SIGXFSZ, SIG_IGN);
  // A write to a pipe whose reader has gone (`terrace ... | head -1`) fails with EPIPE instead of
  // killing us: standard output then takes the documented path ("cannot write standard output:
  // Broken pipe", exit 1; `store fill` says how many blocks are durable), and so does a helper
  // tool's pipe (rsvg-convert). Children inherit the ignored signal; none of them relies on it.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"Terrace: tiered storage for LLM inference state (KV blocks, recurrent state, MoE experts)\n"
               "across GPU HBM, pinned host RAM and NVMe.",
               "terrace"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "terrace 0.1.0");
  Runner run;
  try {
    RegisterDemo(app, &run);
    RegisterBench(app, &run);
    RegisterStore(app, &run);
    RegisterModel(app, &run);
    RegisterRef(app, &run);
    RegisterVerify(app, &run);
    RegisterPlan(app, &run);
    RegisterTrace(app, &run);
    RegisterReport(app, &run);
    RefuseEmptyValues(&app);
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return FinishPrinted(app, e);
  } catch (const CLI::CallForAllHelp& e) {
    return FinishPrinted(app, e);
  } catch (const CLI::CallForVersion& e) {
    return FinishPrinted(app, e);
  } catch (const CLI::ParseError& e) {
    std::string what = UnknownCommandMessage(app, e);
    if (what.empty()) what = UnexpectedArgumentMessage(app, e);
    if (!what.empty()) return FailUsage(what);
    what = ArgumentCountMessage(e);
    if (what.empty()) what = e.what();
    if (what.empty()) what = "invalid arguments";
    return FailUsage(fmt::format("{} (run '{} --help')", what, CommandPath(Deepest(&app))));
  } catch (...) {
    return Fail(DescribeException(std::current_exception()));
  }
  if (!run) return FailUsage("no command given; run 'terrace --help'");
  try {
    return FinishStdout(run());
  } catch (...) {
    // A failed write to stdout is told once (DescribeException names it); the rest is checked here.
    const std::exception_ptr e = std::current_exception();
    const int rc = Fail(DescribeException(e));
    return StdoutWriteErrno(e) != 0 ? rc : FinishStdout(rc);
  }
}
