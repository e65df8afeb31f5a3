// Small helpers shared by the CLI commands: range-checked option parsing, size parsing and
// formatting, test-pattern blocks, and aligned text tables. Safe file access: safe_files.h.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "src/common/aligned_buffer.h"
#include "src/common/clock.h"
#include "src/common/reworded.h"
#include "src/common/size_parse.h"
#include "terrace/block.h"
#include "terrace/options.h"
#include "terrace/stats.h"
#include "terrace/status.h"

namespace terrace::cli {

// Sizes are read by terrace::ParseSize (src/common/size_parse.h): "4096", "4KiB", "1MiB", "2GiB",
// "1TiB" (binary), "4K"/"1M"/"2G" (binary too), "4KB"/"1MB"/"2GB" (decimal).
using terrace::FormatBytes;  // "1.5 MiB", "512 B"
using terrace::ParseSize;
using terrace::Reworded;  // src/common/reworded.h

// "cannot write standard output: <strerror(err)>" (err 0: the cause is no longer known): the one
// wording of a failed write to standard output, whichever command and writer met it.
std::string StdoutErrorMessage(int err);
// Writes `text` to standard output and flushes it: once this returns Ok a reader of the stream (a
// pipe, the file `store check --expect` reads) has it. IoError (StdoutErrorMessage) when a write or
// the flush failed, now or earlier (the stream's error flag); the caller reports it and fails.
Status WriteStdoutNow(std::string_view text);
// True once a WriteStdoutNow failed: main does not report the failure again when the command that
// met it failed.
bool StdoutWriteFailed();

// The tiers' names by index, as JSON keys and in text ("hbm", "host", "nvme": TierName).
inline constexpr const char* kTierNames[kNumTiers] = {"hbm", "host", "nvme"};

// The items of a comma-separated flag value, empty ones included ("a,,b" -> a, "", b; "" -> one
// empty item), for the caller to check.
std::vector<std::string> SplitCommas(std::string_view list);

// The next value of a splitmix64 stream (advances `state`): the CLI's deterministic pseudo-random
// numbers (test-pattern blocks, synthetic token ids), identical on every machine.
std::uint64_t SplitMix(std::uint64_t& state);

// "12.3%" for a fraction 0.123.
std::string FormatPercent(double fraction);

// The process's user and system CPU time so far (every thread), in seconds.
std::pair<double, double> ProcessCpuSeconds();

// Work on `threads` threads, timed without their start and join: each thread is started, then waits
// at a gate; once all are waiting, `at_open` runs on the calling thread and the gate opens (start);
// each thread then runs work(i) (i: 0 .. threads - 1) and notes when it returned; end is the last
// of those. When a thread cannot be started, status says so and the started ones skip `work`.
struct GatedRun {
  Status status;
  std::chrono::steady_clock::time_point start, end;
  double seconds() const { return std::chrono::duration<double>(end - start).count(); }
};
GatedRun RunGated(unsigned threads, std::string_view what, const std::function<void(unsigned)>& work,
                  const std::function<void()>& at_open = {});

// Writes zeros over the whole room of `b`, so that every page is mapped now and later writes into
// it take no page faults: a benchmark's read destination, faulted in before anything is timed.
void Prefault(AlignedBuffer& b);

// The process's minor page faults so far (every thread, getrusage RUSAGE_SELF).
long MinorFaults();

// `path` with "." and ".." components and a trailing separator removed, lexically ("x/.." -> ".",
// "a/../b" -> "b", "../b" stays): every decision the CLI makes about a directory it may create,
// write into or remove is made on the same path it then uses. (On the path as typed, "missing/.."
// does not exist, yet names an existing directory once "missing" is created.) Lexical: "link/.."
// is the link's own parent, not its target's.
std::string NormalizePath(std::string_view path);
// A CLI11 transform applying NormalizePath to a flag's value; for every flag naming a directory.
CLI::Validator NormalizedPath();

// Adds a size option that accepts ParseSize's suffixes. Values outside [min, max] are a usage error
// (exit 2) naming the flag and the accepted range; so is a negative number or one that overflows.
CLI::Option* AddSizeOption(CLI::App* app, const std::string& name, std::uint64_t* value, const std::string& help,
                           std::uint64_t min = 0, std::uint64_t max = UINT64_MAX);

// Integer options, range-checked. CLI11's own integer parsing wraps "-1" into an unsigned and does
// not bound values; these parse the whole text as a decimal integer (no sign for unsigned targets)
// and accept it only in [min, max]. Anything else throws CLI::ValidationError, which main turns into
// "terrace: error: --flag ..." and exit 2. The message names the flag, the value and the range.
Result<std::int64_t> ParseSignedInRange(std::string_view text, std::string_view flag, std::int64_t min,
                                        std::int64_t max);
Result<std::uint64_t> ParseUnsignedInRange(std::string_view text, std::string_view flag, std::uint64_t min,
                                           std::uint64_t max);

// Adds `name` storing into *value (an integral type); *value's current value is the shown default
// (none is shown when it lies outside [min, max], e.g. 0 for "automatic").
template <typename T>
CLI::Option* AddIntOption(CLI::App* app, const std::string& name, T* value, T min, T max, const std::string& help) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  return app
      ->add_option_function<std::string>(
          name,
          [value, name, min, max](const std::string& text) {
            if constexpr (std::is_signed_v<T>) {
              auto r = ParseSignedInRange(text, name, min, max);
              if (!r.ok()) throw CLI::ValidationError(r.status().message());
              *value = static_cast<T>(*r);
            } else {
              auto r = ParseUnsignedInRange(text, name, min, max);
              if (!r.ok()) throw CLI::ValidationError(r.status().message());
              *value = static_cast<T>(*r);
            }
          },
          help + " (" + std::to_string(min) + " to " + std::to_string(max) +
              (*value >= min && *value <= max ? "; default " + std::to_string(*value) : std::string()) + ")")
      ->type_name("INT");
}

// The same for a std::optional<T> that stays empty unless the flag is given.
template <typename T>
CLI::Option* AddOptionalIntOption(CLI::App* app, const std::string& name, std::optional<T>* value, T min, T max,
                                  const std::string& help) {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
  return app
      ->add_option_function<std::string>(
          name,
          [value, name, min, max](const std::string& text) {
            auto r = ParseSignedInRange(text, name, min, max);
            if (!r.ok()) throw CLI::ValidationError(r.status().message());
            *value = static_cast<T>(*r);
          },
          help + " (" + std::to_string(min) + " to " + std::to_string(max) + ")")
      ->type_name("INT");
}

// A finite floating-point option in [min, max] (NaN, inf and out-of-range values are usage errors).
// `why`, when given, is added to the out-of-range message (why the bounds are where they are).
CLI::Option* AddDoubleOption(CLI::App* app, const std::string& name, std::optional<double>* value, double min,
                             double max, const std::string& help, const std::string& why = {});
// A finite floating-point option in (0, max]: above zero, as config.json's keys of the same meaning.
CLI::Option* AddPositiveDoubleOption(CLI::App* app, const std::string& name, std::optional<double>* value, double max,
                                     const std::string& help);

// Makes an empty value ("--flag ''") a usage error for every option of `cmd` that takes a value
// ("--store: the value is empty; give one, or leave --store out"): an empty value is never read as
// "flag not given" (which silently dropped what the flag asked for, e.g. --store "" ran with no
// cache). Applies to `cmd`'s subcommands too; main calls it once on the whole command tree, after
// every option was added.
void RefuseEmptyValues(CLI::App* cmd);

// True when `a` and `b` name the same file: the same path once "." and ".." are resolved and the
// parts that exist have their symlinks resolved (so "d/../x" and "x", or a link and its target, are
// one file). For refusing two output flags given one file (one output would overwrite the other).
bool SameFile(const std::string& a, const std::string& b);

// The deterministic test pattern of block `key` under `seed`: `size` bytes from a splitmix64 stream
// seeded by (seed, key). `store fill` writes it and `store check` re-derives it.
void FillPattern(std::uint64_t seed, const BlockKey& key, std::span<std::byte> out);
// The key `store fill` uses for its i-th block under `seed`.
BlockKey FillKey(std::uint64_t seed, std::uint64_t i);

// --host-prefault of the benches (bench tiers, bench store): how a host tier faults its memory in.
// Adds the option (one of on / off / background / eager, default on) with `help`.
CLI::Option* AddHostPrefaultOption(CLI::App* app, std::string* value, const std::string& help);
// Sets `o`'s prefault and populate from a --host-prefault value: on / off set
// HostTierOptions::prefault (new chunks faulted on a background thread, or on the putting thread);
// background / eager populate the whole capacity from open (HostPopulate::kBackground / kAtOpen).
void ApplyHostPrefault(std::string_view value, HostTierOptions* o);
// --host-huge-pages of the benches (on / off; the callers default to off): HostTierOptions::huge_pages.
CLI::Option* AddHostHugePagesOption(CLI::App* app, std::string* value);
// --host-stream-gets of the benches (auto / on / off; default auto): HostTierOptions::
// stream_get_min_bytes 0 (a quarter of the last-level cache), 1 (every get of a block of at least
// 256 KiB) or UINT64_MAX (never), through ApplyHostStreamGets.
CLI::Option* AddHostStreamGetsOption(CLI::App* app, std::string* value);
void ApplyHostStreamGets(std::string_view value, HostTierOptions* o);

// True when `path` names a block device (following symlinks such as /dev/disk/by-id/...).
bool IsBlockDevice(const std::string& path);
// The size in bytes of block device `path` (BLKGETSIZE64); IoError naming it on failure.
Result<std::uint64_t> BlockDeviceBytes(const std::string& path);
// The NVMe paths of a command line: a block device --dir needs --index-dir (the tier keeps its
// RocksDB index there); InvalidArgument naming both flags otherwise.
Status CheckNvmePaths(const std::string& dir, const std::string& index_dir);

// A text table with right-aligned columns (except the first), printed to stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// One row per tier: name, capacity, used, blocks, hits, misses, in, out, read p50/p99, write p50/p99.
Table TierTable(std::span<const TierStatsSnapshot> tiers);

}  // namespace terrace::cli
