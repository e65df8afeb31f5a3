// The CLI's shared helpers: range-checked integers and sizes against an independent 128-bit oracle,
// the safe output writer and input reader against FIFOs, symlinks, directories and failures, and the
// owned-store recogniser.
#include <fcntl.h>
#include <pthread.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/remove_on_signal.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/start_thread.h"
#include "test_util.h"

namespace fs = std::filesystem;
using terrace::Status;
using namespace terrace::cli;

namespace {

__extension__ typedef __int128 I128;  // the oracle's arithmetic: wider than any parsed value

// The oracle: a decimal integer with an optional leading '-' (signed only), digits only, value in
// [lo, hi] computed in 128 bits with saturation.
std::optional<I128> OracleParse(const std::string& s, bool allow_minus) {
  std::size_t i = 0;
  bool neg = false;
  if (allow_minus && i < s.size() && s[i] == '-') {
    neg = true;
    ++i;
  }
  if (i == s.size()) return std::nullopt;
  I128 v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return std::nullopt;
    v = v * 10 + (s[i] - '0');
    if (v > (static_cast<I128>(1) << 70)) v = static_cast<I128>(1) << 70;  // saturate: out of any range
  }
  return neg ? -v : v;
}

std::string RandomNumberText(std::mt19937_64& rng) {
  static const std::string kAlphabet = "0123456789-+ x.e";
  std::string s;
  const int kind = static_cast<int>(rng() % 4);
  if (kind == 0) {  // a boundary-ish value
    static const char* kEdges[] = {"0", "-0", "1", "-1", "9223372036854775807", "9223372036854775808",
                                   "-9223372036854775808", "-9223372036854775809", "18446744073709551615",
                                   "18446744073709551616", "4294967295", "4294967296", "", "-", "00", "0001"};
    return kEdges[rng() % std::size(kEdges)];
  }
  if (kind == 1) return std::to_string(static_cast<std::int64_t>(rng()));
  if (kind == 2) return std::to_string(rng());
  const std::size_t n = rng() % 24;
  for (std::size_t i = 0; i < n; ++i) s += kAlphabet[rng() % (i == 0 ? kAlphabet.size() : 10)];
  return s;
}

std::int64_t RandomBound(std::mt19937_64& rng) {
  static const std::int64_t kB[] = {INT64_MIN, -1000, -1, 0, 1, 2, 255, 256, 65536, INT32_MAX, INT64_MAX};
  return rng() % 2 ? kB[rng() % std::size(kB)] : static_cast<std::int64_t>(rng()) >> (rng() % 60);
}

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

bool NoTempFiles(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().starts_with(".terrace-tmp")) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("cli numbers: signed parsing agrees with a 128-bit oracle", "[cli]") {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20000; ++i) {
    const std::string text = RandomNumberText(rng);
    std::int64_t lo = RandomBound(rng), hi = RandomBound(rng);
    if (lo > hi) std::swap(lo, hi);
    const auto want = OracleParse(text, true);
    const bool accept = want && *want >= lo && *want <= hi;
    auto got = ParseSignedInRange(text, "--n", lo, hi);
    INFO("text '" << text << "' range [" << lo << ", " << hi << "]");
    REQUIRE(got.ok() == accept);
    if (accept) {
      REQUIRE(static_cast<I128>(*got) == *want);
    } else {
      REQUIRE(got.status().IsInvalidArgument());
      REQUIRE(got.status().message().starts_with("--n "));
    }
  }
}

TEST_CASE("cli numbers: unsigned parsing never wraps a negative value", "[cli]") {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 20000; ++i) {
    const std::string text = RandomNumberText(rng);
    std::uint64_t lo = rng() >> (rng() % 64), hi = rng() % 3 == 0 ? UINT64_MAX : rng() >> (rng() % 64);
    if (lo > hi) std::swap(lo, hi);
    const auto want = OracleParse(text, false);
    const bool accept = want && *want >= lo && *want <= hi;
    auto got = ParseUnsignedInRange(text, "--count", lo, hi);
    INFO("text '" << text << "' range [" << lo << ", " << hi << "]");
    REQUIRE(got.ok() == accept);
    if (accept) REQUIRE(static_cast<I128>(*got) == *want);
  }
  auto r = ParseUnsignedInRange("-1", "--count", 0, UINT64_MAX);
  REQUIRE_FALSE(r.ok());
  REQUIRE(r.status().message().find("negative") != std::string::npos);
}

TEST_CASE("cli numbers: sizes refuse overflow and negative values", "[cli]") {
  REQUIRE(*ParseSize("17179869183GiB") == (17179869183ull << 30));
  REQUIRE_FALSE(ParseSize("17179869184GiB").ok());  // 2^64
  REQUIRE_FALSE(ParseSize("16777216TiB").ok());     // 2^64
  REQUIRE(*ParseSize("18446744073709551615") == UINT64_MAX);
  REQUIRE(ParseSize("18446744073709551616").status().message().find("out of range") != std::string::npos);
  REQUIRE_FALSE(ParseSize("-1").ok());
  REQUIRE_FALSE(ParseSize("").ok());

  CLI::App app;
  std::uint64_t v = 7;
  AddSizeOption(&app, "--block-size", &v, "Block size", 1, 1ull << 30);
  for (const char* bad : {"0", "-4096", "2GiB", "1TiB", "18446744073709551616", "x"}) {
    const char* argv[] = {"t", "--block-size", bad};
    INFO(bad);
    REQUIRE_THROWS_AS(app.parse(3, argv), CLI::ValidationError);
  }
  const char* argv[] = {"t", "--block-size", "1GiB"};
  app.parse(3, argv);
  REQUIRE(v == (1ull << 30));
}

TEST_CASE("cli numbers: an int option rejects what CLI11 would wrap", "[cli]") {
  CLI::App app;
  unsigned threads = 1;
  AddIntOption(&app, "--threads", &threads, 1u, 256u, "Threads");
  for (const char* bad : {"-1", "0", "257", "100000", "4294967297", "1.5", "", "+1"}) {
    const char* argv[] = {"t", "--threads", bad};
    INFO(bad);
    REQUIRE_THROWS_AS(app.parse(3, argv), CLI::ValidationError);
    REQUIRE(threads == 1);
  }
  const char* argv[] = {"t", "--threads", "256"};
  app.parse(3, argv);
  REQUIRE(threads == 256);
}

TEST_CASE("cli files: the output writer refuses what is not a regular file and leaves it", "[cli]") {
  terrace::testing::TempDir tmp("cli-out");
  const fs::path victim = tmp.path() / "victim";
  Write(victim, "keep");
  const fs::path fifo = tmp.path() / "fifo", link = tmp.path() / "link", dir = tmp.path() / "dir";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  fs::create_symlink(victim, link);
  fs::create_directory(dir);
  for (const fs::path& p : {fifo, link, dir}) {
    INFO(p);
    Status s = WriteOutputFile(p, "--out", "new content");
    REQUIRE(s.IsInvalidArgument());
    REQUIRE(s.message().starts_with("--out "));
  }
  REQUIRE(fs::is_fifo(fs::symlink_status(fifo)));
  REQUIRE(fs::is_symlink(link));
  REQUIRE(fs::read_symlink(link) == victim);
  REQUIRE(Slurp(victim) == "keep");
  REQUIRE(fs::is_empty(dir));
  REQUIRE(WriteOutputFile(tmp.path() / "missing-dir" / "x", "--out", "x").IsInvalidArgument());
  REQUIRE(NoTempFiles(tmp.path()));
}

TEST_CASE("cli files: the output writer replaces a regular file only when the content is complete", "[cli]") {
  terrace::testing::TempDir tmp("cli-out2");
  const fs::path out = tmp.path() / "out";
  REQUIRE(WriteOutputFile(out, "--out", "first").ok());
  REQUIRE(Slurp(out) == "first");
  REQUIRE(WriteOutputFile(out, "--out", "second").ok());
  REQUIRE(Slurp(out) == "second");
  // A producer that fails half-way: the target keeps its old content, no temporary file is left.
  Status s = WriteOutputFile(out, "--out", [](const fs::path& t) {
    Write(t, "half");
    return Status::IoError("disk full");
  });
  REQUIRE(s.IsIoError());
  REQUIRE(Slurp(out) == "second");
  // The target turned into a FIFO while the content was produced: refused, FIFO left.
  s = WriteOutputFile(out, "--out", [&](const fs::path& t) {
    Write(t, "third");
    fs::remove(out);
    REQUIRE(::mkfifo(out.c_str(), 0600) == 0);
    return Status::Ok();
  });
  REQUIRE(s.IsInvalidArgument());
  REQUIRE(fs::is_fifo(fs::symlink_status(out)));
  REQUIRE(NoTempFiles(tmp.path()));
}

TEST_CASE("cli files: an output replaces a regular file only with its mark or --force, never an input", "[cli]") {
  terrace::testing::TempDir tmp("cli-own");
  const fs::path out = tmp.path() / "report.html", in = tmp.path() / "run.json";
  const std::string mine = "<!DOCTYPE html>\n<p>my page</p>\n";
  const std::string ours = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><meta name=\"generator\" "
                           "content=\"terrace\"><title>t</title></head></html>\n";
  Write(out, mine);
  Write(in, "{}");
  OutputRules rules{.format = OutputFormat::kHtml, .inputs = {{"RUN.json", in}}};
  Status s = WriteOutputFile(out, "-o", rules, ours);
  REQUIRE(s.IsInvalidArgument());
  REQUIRE(s.message().starts_with("-o " + out.string() + " already exists and Terrace did not write it"));
  REQUIRE(s.message().ends_with("choose another path or pass --force to replace it"));
  REQUIRE(Slurp(out) == mine);
  REQUIRE(WriteOutputFile(out, "-o", OutputRules{.format = OutputFormat::kHtml, .force = true}, ours).ok());
  REQUIRE(WriteOutputFile(out, "-o", rules, ours).ok());  // now it is Terrace's own
  // Without a mark in the format, even Terrace's own earlier output needs --force.
  REQUIRE(WriteOutputFile(out, "-o", rules.As(OutputFormat::kPng), ours).IsInvalidArgument());
  // The input itself (or another name for it) is refused even with --force.
  rules.force = true;
  fs::create_hard_link(in, tmp.path() / "again.json");
  for (const fs::path& p : {in, tmp.path() / "again.json"}) {
    s = CheckOutputFile(p, "-o", rules);
    REQUIRE(s.IsInvalidArgument());
    REQUIRE(s.message().find("the same file as the input RUN.json") != std::string::npos);
  }
  REQUIRE(Slurp(in) == "{}");
  REQUIRE(NoTempFiles(tmp.path()));
}

TEST_CASE("cli files: Terrace's marks are recognised only where it writes them", "[cli]") {
  using F = OutputFormat;
  REQUIRE(HasTerraceMark(F::kSvg, "<svg width=\"1\"><!-- generator: terrace --><title>x</title></svg>"));
  REQUIRE_FALSE(HasTerraceMark(F::kSvg, "<svg width=\"1\"><title>x</title><!-- generator: terrace --></svg>"));
  REQUIRE(HasTerraceMark(F::kPrometheus, "# generator: terrace\n# TYPE x gauge\nx 1\n"));
  REQUIRE_FALSE(HasTerraceMark(F::kPrometheus, "x 1\n# generator: terrace\n"));
  REQUIRE_FALSE(HasTerraceMark(F::kHtml, "<p><meta name=\"generator\" content=\"terrace\"></p>"));
  const auto safetensors = [](const std::string& header) {
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
    return f + header;
  };
  REQUIRE(HasTerraceMark(F::kSafetensors, safetensors(R"({"__metadata__":{"generator":"terrace"}})")));
  // The pair inside another metadata value (escaped quotes) is not the mark; nor is a header cut short.
  const std::string quoted = safetensors(R"({"__metadata__":{"note":"\"generator\":\"terrace\""}})");
  REQUIRE_FALSE(HasTerraceMark(F::kSafetensors, quoted));
  const std::string marked = safetensors(R"({"__metadata__":{"generator":"terrace"}})");
  REQUIRE_FALSE(HasTerraceMark(F::kSafetensors, std::string_view(marked).substr(0, 30)));
  REQUIRE_FALSE(HasTerraceMark(F::kTrace, "{\"generator\":\"terrace\"}\n"));
}

TEST_CASE("cli files: inputs that are FIFOs, devices or directories are refused without blocking", "[cli]") {
  terrace::testing::TempDir tmp("cli-in");
  const fs::path fifo = tmp.path() / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const auto start = std::chrono::steady_clock::now();
  for (const fs::path& p : {fifo, fs::path("/dev/zero"), tmp.path()}) {
    INFO(p);
    REQUIRE(ReadInputFile(p, "--config", 1 << 20).status().IsInvalidArgument());
    REQUIRE(CheckInputFile(p, "--config").IsInvalidArgument());
  }
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  REQUIRE(ReadInputFile(tmp.path() / "nope", "--config", 10).status().IsNotFound());
  const fs::path f = tmp.path() / "f";
  Write(f, std::string(100, 'a'));
  REQUIRE(*ReadInputFile(f, "--config", 100) == std::string(100, 'a'));
  REQUIRE(ReadInputFile(f, "--config", 99).status().IsInvalidArgument());
  fs::create_symlink(f, tmp.path() / "link");  // inputs follow symlinks
  REQUIRE(ReadInputFile(tmp.path() / "link", "--config", 100).ok());
}

TEST_CASE("cli dirs: only a marked Terrace store is removed", "[cli]") {
  terrace::testing::TempDir tmp("cli-own");
  const fs::path d = tmp.path() / "store";
  fs::create_directories(d / "index");
  Write(d / "terrace.data", std::string("TRRCNVME") + std::string(100, '\0'));
  // No marker: refused, untouched.
  auto r = RemoveOwnedStore(d, "m.marker", "--dir", "demo");
  REQUIRE(r.status().IsInvalidArgument());
  REQUIRE(fs::exists(d / "terrace.data"));
  Write(d / "m.marker", "x");
  Write(d / "user.txt", "mine");  // a foreign entry: refused, untouched
  REQUIRE(RemoveOwnedStore(d, "m.marker", "--dir", "demo").status().message().find("user.txt") != std::string::npos);
  REQUIRE(Slurp(d / "user.txt") == "mine");
  REQUIRE(fs::exists(d / "terrace.data"));
  fs::remove(d / "user.txt");
  // index/ holds what RocksDB writes; anything else in it is foreign, and so nothing is removed.
  for (const char* f : {"CURRENT", "IDENTITY", "LOCK", "LOG", "MANIFEST-000005", "OPTIONS-000007", "000004.log",
                        "000009.sst", "TERRACE-INDEX-CREATING"})
    Write(d / "index" / f, "x");
  REQUIRE(IsOwnedStore(d, "m.marker"));
  Write(d / "index" / "precious.txt", "mine");
  REQUIRE(RemoveOwnedStore(d, "m.marker", "--dir", "demo").status().message().find("index/precious.txt") !=
          std::string::npos);
  REQUIRE(Slurp(d / "index" / "precious.txt") == "mine");
  fs::remove(d / "index" / "precious.txt");
  fs::create_directories(d / "index" / "000010.sst");  // a folder, whatever its name
  REQUIRE_FALSE(IsOwnedStore(d, "m.marker"));
  REQUIRE(*ForeignIndexEntry(d / "index") == d / "index" / "000010.sst");
  fs::remove(d / "index" / "000010.sst");
  REQUIRE_FALSE(ForeignIndexEntry(d / "index"));
  REQUIRE(*ForeignIndexEntry(d / "terrace.data") == d / "terrace.data");  // not a directory
  Write(d / "terrace.data", "NOTMAGIC");  // wrong magic: refused
  REQUIRE_FALSE(RemoveOwnedStore(d, "m.marker", "--dir", "demo").ok());
  Write(d / "terrace.data", std::string("TRRCNVME") + std::string(100, '\0'));
  REQUIRE(IsOwnedStore(d, "m.marker"));
  r = RemoveOwnedStore(d, "m.marker", "--dir", "demo");
  REQUIRE(r.ok());
  REQUIRE(*r);
  REQUIRE(fs::is_directory(d));
  REQUIRE(fs::is_empty(d));
  REQUIRE_FALSE(*RemoveOwnedStore(d, "m.marker", "--dir", "demo"));               // empty: nothing to do
  REQUIRE_FALSE(*RemoveOwnedStore(tmp.path() / "none", "m.marker", "--dir", "demo"));  // absent
  Write(tmp.path() / "file", "x");
  REQUIRE(RemoveOwnedStore(tmp.path() / "file", "m.marker", "--dir", "demo").status().IsInvalidArgument());
  fs::create_symlink(d, tmp.path() / "link");
  REQUIRE(RemoveOwnedStore(tmp.path() / "link", "m.marker", "--dir", "demo").status().IsInvalidArgument());
}

TEST_CASE("cli dirs: a folder of owned stores holding any other entry is not a killed run's leftover", "[cli]") {
  terrace::testing::TempDir tmp("cli-only-owned");
  const fs::path d = tmp.path() / "bench";
  fs::create_directories(d / "nvme");
  Write(d / "nvme" / "m.marker", "x");  // a killed run's leftover: its marker only
  REQUIRE(IsOwnedStoreOrLeftover(d / "nvme", "m.marker"));
  REQUIRE(HoldsOnlyOwnedStores(d, {"nvme"}, "m.marker", EmptySubDirs::kRefuse));
  for (const EmptySubDirs empty : {EmptySubDirs::kRefuse, EmptySubDirs::kAccept}) {
    // A user's file next to it, whatever its name or where it sorts, makes the folder the user's.
    for (const char* name : {"precious.txt", "a.txt", "zz", "nvme2"}) {
      Write(d / name, "mine");
      CAPTURE(name);
      REQUIRE_FALSE(HoldsOnlyOwnedStores(d, {"nvme"}, "m.marker", empty));
      fs::remove(d / name);
    }
    fs::create_directories(d / "notes");  // an empty folder not in the list, even where empty ones are accepted
    REQUIRE_FALSE(HoldsOnlyOwnedStores(d, {"nvme"}, "m.marker", empty));
    fs::remove(d / "notes");
  }
  REQUIRE(HoldsOnlyOwnedStores(d, {"nvme"}, "m.marker", EmptySubDirs::kRefuse));
  fs::remove(d / "nvme" / "m.marker");
  fs::remove(d / "nvme");
  Write(d / "precious.txt", "mine");  // only foreign entries: refused too
  REQUIRE_FALSE(HoldsOnlyOwnedStores(d, {"nvme"}, "m.marker", EmptySubDirs::kRefuse));
  REQUIRE(Slurp(d / "precious.txt") == "mine");
}

namespace {

// The process's thread count (/proc/self/status "Threads:"); -1 when unreadable.
int ProcessThreads() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

}  // namespace

TEST_CASE("cli gated run: the timed interval starts after every worker started and ends at the last return",
          "[cli]") {
  using Clock = std::chrono::steady_clock;
  constexpr unsigned kWorkers = 3;
  const int base = ProcessThreads();
  REQUIRE(base > 0);
  int threads_at_open = 0;
  std::vector<Clock::time_point> entered(kWorkers), returned(kWorkers);
  const GatedRun run = RunGated(
      kWorkers, "test worker",
      [&](unsigned i) {
        entered[i] = Clock::now();
        returned[i] = Clock::now();
      },
      [&] { threads_at_open = ProcessThreads(); });
  REQUIRE(run.status.ok());
  // Every worker existed (started, waiting at the gate) when the interval began.
  CHECK(threads_at_open == base + static_cast<int>(kWorkers));
  for (unsigned i = 0; i < kWorkers; ++i) {
    CHECK(entered[i] >= run.start);
    CHECK(returned[i] <= run.end);
  }
  CHECK(run.seconds() >= 0);
  CHECK(ProcessThreads() == base);  // joined
}

TEST_CASE("cli gated run: a worker that cannot start voids the run and the others skip the work", "[cli]") {
  terrace::thread_internal::FailThreadStartsAfter(1);
  std::atomic<int> ran{0};
  const GatedRun run = RunGated(3, "test worker", [&](unsigned) { ran.fetch_add(1); });
  terrace::thread_internal::FailThreadStartsAfter(-1);
  CHECK_FALSE(run.status.ok());
  CHECK(run.status.message().find("test worker 2 of 3") != std::string::npos);
  CHECK(ran.load() == 0);
}

// A signal that would end the process while a StopSignalHold lives (here one a RemoveOnSignal's
// handler takes on another thread) ends it only when the hold ends: the work inside finishes.
TEST_CASE("StopSignalHold defers a fatal signal to the end of the hold", "[cli][signals]") {
  terrace::testing::TempDir dir("stop-hold");
  const fs::path done = dir.path() / "done";
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::signal(SIGINT, SIG_DFL);  // Catch2's own handler otherwise
    const RemoveOnSignal guard(dir.path() / "guarded");  // installs the fatal handler for SIGINT
    std::atomic<bool> go{false};
    std::thread t([&] {  // created before the hold: SIGINT is not blocked on it
      while (!go.load()) std::this_thread::yield();
      ::pthread_kill(::pthread_self(), SIGINT);
      go.store(false);
    });
    {
      const StopSignalHold hold;
      go.store(true);
      while (go.load()) std::this_thread::yield();  // the signal was taken and held
      t.join();
      std::ofstream(done) << "finished";
    }
    ::_exit(0);  // not reached: the hold's end raises SIGINT
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGINT);
  CHECK(fs::exists(done));
}

// stop_signals.cpp's FailUnlessStopped reports through the CLI's Fail (command.cpp, not linked here).
namespace terrace::cli {
int Fail(std::string_view message) {
  fmt::print(stderr, "{}\n", message);
  return 1;
}
}  // namespace terrace::cli

TEST_CASE("StopSignals: the first signal is recorded, a second one ends the process saying so", "[cli][signals]") {
  const int sig = GENERATE(SIGINT, SIGTERM);
  int err_pipe[2];
  REQUIRE(::pipe(err_pipe) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::close(err_pipe[0]);
    const StopSignals stop;
    ::raise(sig);
    if (StopSignalReceived() != sig) ::_exit(3);  // the first is only recorded
    ::raise(sig);
    ::_exit(4);  // not reached
  }
  ::close(err_pipe[1]);
  std::string err;
  char buf[256];
  for (ssize_t n; (n = ::read(err_pipe[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<std::size_t>(n));
  ::close(err_pipe[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO(err);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == sig);
  CHECK(err.find(fmt::format("a second stop signal ({}): stopping at once", StopSignalName(sig))) != std::string::npos);
}

TEST_CASE("FileErrno: a full file system or quota is OutOfCapacity, other errors IoError") {
  for (const int err : {ENOSPC, EDQUOT}) {
    const Status s = FileErrno(err, "cannot write", "/x/out.json", "--out");
    REQUIRE(s.IsOutOfCapacity());
    REQUIRE(s.message() == fmt::format("--out /x/out.json: cannot write: {}", std::strerror(err)));
  }
  REQUIRE(FileErrno(EIO, "cannot write", "/x/out.json", "--out").IsIoError());
  REQUIRE(FileErrno(EFBIG, "cannot write", "/x/out.json", "--out").IsIoError());
}
