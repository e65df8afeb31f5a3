#include "src/cli/cli_util.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <thread>
#include <type_traits>
#include <vector>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include "src/common/start_thread.h"
#include "tiers/nvme/nvme_paths.h"

namespace terrace::cli {
namespace {

std::string FormatLatency(std::uint64_t ns) {
  if (ns == 0) return "-";
  const double d = static_cast<double>(ns);
  if (ns < 1'000) return fmt::format("{}ns", ns);
  if (ns < 1'000'000) return fmt::format("{:.1f}us", d / 1e3);
  return fmt::format("{:.1f}ms", d / 1e6);
}

}  // namespace

std::uint64_t SplitMix(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<std::string> SplitCommas(std::string_view list) {
  std::vector<std::string> out;
  for (std::size_t pos = 0; pos <= list.size();) {
    const std::size_t end = std::min(list.find(',', pos), list.size());
    out.emplace_back(list.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

std::string NormalizePath(std::string_view path) {
  if (path.empty()) return std::string();
  std::filesystem::path n = std::filesystem::path(path).lexically_normal();
  if (n.has_relative_path() && !n.has_filename()) n = n.parent_path();  // "dir/" -> "dir"
  return n.empty() ? std::string(".") : n.string();
}

CLI::Validator NormalizedPath() {
  return CLI::Validator(
      [](std::string& value) {
        value = NormalizePath(value);
        return std::string();
      },
      "", "normalized path");
}

std::string FormatPercent(double fraction) { return fmt::format("{:.1f}%", 100.0 * fraction); }

std::string StdoutErrorMessage(int err) {
  return fmt::format("cannot write standard output: {}", err != 0 ? std::strerror(err) : "an earlier write to it failed");
}

namespace {
std::atomic<bool> stdout_write_failed{false};
}  // namespace

Status WriteStdoutNow(std::string_view text) {
  errno = 0;
  const bool written = std::fwrite(text.data(), 1, text.size(), stdout) == text.size();
  if (written && std::fflush(stdout) == 0 && std::ferror(stdout) == 0) return Status::Ok();
  stdout_write_failed = true;
  return Status::IoError(StdoutErrorMessage(errno));
}

bool StdoutWriteFailed() { return stdout_write_failed; }

CLI::Option* AddSizeOption(CLI::App* app, const std::string& name, std::uint64_t* value, const std::string& help,
                           std::uint64_t min, std::uint64_t max) {
  std::string range;
  if (min > 0 || max < UINT64_MAX) {
    range = fmt::format("{} to {}; ", FormatBytes(static_cast<double>(min)), FormatBytes(static_cast<double>(max)));
  }
  return app->add_option_function<std::string>(
               name,
               [value, name, min, max](const std::string& text) {
                 if (!text.empty() && text[0] == '-') {
                   throw CLI::ValidationError(fmt::format("{} '{}': a size cannot be negative", name, text));
                 }
                 auto r = ParseSize(text, name);
                 if (!r.ok()) throw CLI::ValidationError(r.status().message());
                 if (*r < min || *r > max) {
                   throw CLI::ValidationError(fmt::format("{} {} is out of range: accepted {} ({} bytes) to {} ({} bytes)",
                                                          name, text, FormatBytes(static_cast<double>(min)), min,
                                                          FormatBytes(static_cast<double>(max)), max));
                 }
                 *value = *r;
               },
               help + fmt::format(" (e.g. 4KiB, 1MiB, 2GiB; {}default {})", range,
                                  FormatBytes(static_cast<double>(*value))))
      ->type_name("SIZE");
}

namespace {

// from_chars into T, then the range check; the messages name `flag` and the accepted range.
template <typename T>
Result<T> ParseIntegerInRange(std::string_view text, std::string_view flag, T min, T max) {
  if constexpr (std::is_unsigned_v<T>) {
    if (!text.empty() && text[0] == '-') {
      return Status::InvalidArgument(
          fmt::format("{} {} is out of range: it cannot be negative; accepted {} to {}", flag, text, min, max));
    }
  }
  T v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool malformed = ec != std::errc::result_out_of_range &&
                         (ec != std::errc() || p != text.data() + text.size() || text.empty());
  if (malformed) {
    return Status::InvalidArgument(
        fmt::format("{} '{}' is not an integer; give a whole number from {} to {}", flag, text, min, max));
  }
  if (ec == std::errc::result_out_of_range || v < min || v > max) {
    return Status::InvalidArgument(fmt::format("{} {} is out of range: accepted {} to {}", flag, text, min, max));
  }
  return v;
}

}  // namespace

Result<std::int64_t> ParseSignedInRange(std::string_view text, std::string_view flag, std::int64_t min,
                                        std::int64_t max) {
  return ParseIntegerInRange<std::int64_t>(text, flag, min, max);
}

Result<std::uint64_t> ParseUnsignedInRange(std::string_view text, std::string_view flag, std::uint64_t min,
                                           std::uint64_t max) {
  return ParseIntegerInRange<std::uint64_t>(text, flag, min, max);
}

namespace {
// A finite double option in [min, max], or (0, max] when `above_zero`.
CLI::Option* AddBoundedDoubleOption(CLI::App* app, const std::string& name, std::optional<double>* value, double min,
                                    double max, bool above_zero, const std::string& help, const std::string& why = {}) {
  const std::string range = above_zero ? fmt::format("above 0, at most {}", max) : fmt::format("{} to {}", min, max);
  return app
      ->add_option_function<std::string>(
          name,
          [value, name, min, max, above_zero, range, why](const std::string& text) {
            double v = 0;
            auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            if (ec != std::errc() || p != text.data() + text.size() || text.empty() || !std::isfinite(v)) {
              throw CLI::ValidationError(fmt::format("{} '{}' is not a finite number; give a value {}", name, text,
                                                     above_zero ? range : "from " + range));
            }
            if (above_zero ? !(v > 0 && v <= max) : (v < min || v > max)) {
              throw CLI::ValidationError(fmt::format("{} {} is out of range: accepted {}{}", name, text, range,
                                                     why.empty() ? "" : " (" + why + ")"));
            }
            *value = v;
          },
          help + " (" + range + ")")
      ->type_name("NUMBER");
}
}  // namespace

CLI::Option* AddDoubleOption(CLI::App* app, const std::string& name, std::optional<double>* value, double min,
                             double max, const std::string& help, const std::string& why) {
  return AddBoundedDoubleOption(app, name, value, min, max, /*above_zero=*/false, help, why);
}

CLI::Option* AddPositiveDoubleOption(CLI::App* app, const std::string& name, std::optional<double>* value, double max,
                                     const std::string& help) {
  return AddBoundedDoubleOption(app, name, value, 0.0, max, /*above_zero=*/true, help);
}

void RefuseEmptyValues(CLI::App* cmd) {
  for (CLI::Option* o : cmd->get_options()) {
    if (o->get_type_size_min() <= 0 || o->get_expected_min() <= 0) continue;  // a flag: takes no value
    // CLI11 names an option of the hidden group "" with an empty name in its message: name it here.
    const std::string name = !o->get_lnames().empty()   ? "--" + o->get_lnames().front()
                             : !o->get_snames().empty() ? "-" + o->get_snames().front()
                                                        : o->get_name(/*positional=*/true);
    const std::string prefix = o->get_name().empty() ? name + ": " : "";
    const bool required = o->get_required();
    // First of the option's validators (transform() inserts at the front), so a set of allowed
    // values does not answer "not in {...}" for an empty one.
    o->transform(CLI::Validator(
        [name, prefix, required](std::string& value) {
          if (!value.empty()) return std::string();
          return required ? fmt::format("{}the value is empty; give one", prefix)
                          : fmt::format("{}the value is empty; give one, or leave {} out", prefix, name);
        },
        ""));
  }
  for (CLI::App* sub : cmd->get_subcommands(std::function<bool(CLI::App*)>{})) RefuseEmptyValues(sub);
}

bool SameFile(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const std::filesystem::path pa = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ea), ea);
  const std::filesystem::path pb = std::filesystem::weakly_canonical(std::filesystem::absolute(b, eb), eb);
  if (!ea && !eb) return pa == pb;
  return std::filesystem::absolute(a, ea).lexically_normal() == std::filesystem::absolute(b, eb).lexically_normal();
}

void FillPattern(std::uint64_t seed, const BlockKey& key, std::span<std::byte> out) {
  std::uint64_t state = seed ^ key.Hash();
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    std::uint64_t v = SplitMix(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  if (i < out.size()) {
    std::uint64_t v = SplitMix(state);
    std::memcpy(out.data() + i, &v, out.size() - i);
  }
}

BlockKey FillKey(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t state = seed * 0x2545F4914F6CDD1Dull + i;
  BlockKey k;
  k.ns = 0x7e57;
  k.kind = BlockKind::kOther;
  k.layer = 0;
  k.id = ContentId{SplitMix(state), i};
  return k;
}

std::string Table::Render() const {
  std::vector<std::size_t> width;
  for (const auto& row : rows_) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    for (std::size_t c = 0; c < rows_[r].size(); ++c) {
      const std::string& cell = rows_[r][c];
      std::string pad(width[c] - cell.size(), ' ');
      out += c == 0 ? cell + pad : "  " + pad + cell;
    }
    out += '\n';
  }
  return out;
}

Table TierTable(std::span<const TierStatsSnapshot> tiers) {
  Table t({"tier", "capacity", "used", "blocks", "hits", "misses", "bytes in", "bytes out", "read p50", "read p99",
           "write p50", "write p99"});
  for (const auto& s : tiers) {
    t.Add({s.emulated ? s.name + " (emulated)" : s.name, FormatBytes(static_cast<double>(s.capacity_bytes)),
           FormatBytes(static_cast<double>(s.used_bytes)), std::to_string(s.blocks), std::to_string(s.hits),
           std::to_string(s.misses), FormatBytes(static_cast<double>(s.bytes_written)),
           FormatBytes(static_cast<double>(s.bytes_read)), FormatLatency(s.read_p50_ns), FormatLatency(s.read_p99_ns),
           FormatLatency(s.write_p50_ns), FormatLatency(s.write_p99_ns)});
  }
  return t;
}

bool IsBlockDevice(const std::string& path) {
  std::error_code ec;
  return !path.empty() && std::filesystem::is_block_file(path, ec);
}

Result<std::uint64_t> BlockDeviceBytes(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError(fmt::format("cannot open block device '{}': {}", path, std::strerror(errno)));
  std::uint64_t bytes = 0;
  const int err = nvme::DataAreaBytes(fd, /*block_device=*/true, &bytes);
  ::close(fd);
  if (err != 0) return Status::IoError(fmt::format("cannot read the size of block device '{}': {}", path, std::strerror(err)));
  return bytes;
}

Status CheckNvmePaths(const std::string& dir, const std::string& index_dir) {
  if (IsBlockDevice(dir) && index_dir.empty()) {
    return Status::InvalidArgument(fmt::format(
        "--dir '{}' is a block device: give --index-dir DIR, a directory on a persistent file system for the "
        "NVMe tier's index (use the same one on every run against this device)",
        dir));
  }
  return Status::Ok();
}

CLI::Option* AddHostPrefaultOption(CLI::App* app, std::string* value, const std::string& help) {
  return app->add_option("--host-prefault", *value, help)
      ->check(CLI::IsMember({"on", "off", "background", "eager"}))
      ->capture_default_str();
}

void ApplyHostPrefault(std::string_view value, HostTierOptions* o) {
  o->prefault = value != "off";
  if (value == "background") o->populate = HostPopulate::kBackground;
  if (value == "eager") o->populate = HostPopulate::kAtOpen;
}

CLI::Option* AddHostHugePagesOption(CLI::App* app, std::string* value) {
  return app->add_option("--host-huge-pages", *value,
                         "Host tier: back its chunks with transparent huge pages (madvise(MADV_HUGEPAGE)) where "
                         "/sys/kernel/mm/transparent_hugepage/enabled allows (on), or use 4 KiB pages (off)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
}

CLI::Option* AddHostStreamGetsOption(CLI::App* app, std::string* value) {
  return app->add_option("--host-stream-gets", *value,
                         "Host tier: write gets into the caller's buffers with streaming stores when those buffers "
                         "(one get's, or a batch's together) reach a quarter of the last-level cache (auto), for "
                         "every block of at least 256 KiB (on), or never (off: cached stores)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
}

void ApplyHostStreamGets(std::string_view value, HostTierOptions* o) {
  o->stream_get_min_bytes = value == "on" ? 1 : value == "off" ? UINT64_MAX : 0;
}

std::pair<double, double> ProcessCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
  return {sec(u.ru_utime), sec(u.ru_stime)};
}

GatedRun RunGated(unsigned threads, std::string_view what, const std::function<void(unsigned)>& work,
                  const std::function<void()>& at_open) {
  GatedRun run;
  std::atomic<unsigned> waiting{0};
  std::atomic<bool> open{false}, cancelled{false};
  std::vector<std::chrono::steady_clock::time_point> ends(threads);
  std::vector<std::thread> started;
  for (unsigned i = 0; i < threads; ++i) {
    auto t = StartThread(fmt::format("{} {} of {}", what, i + 1, threads), [&, i] {
      waiting.fetch_add(1, std::memory_order_acq_rel);
      // Spins (yielding) rather than sleeping, so the workers run the moment the gate opens.
      while (!open.load(std::memory_order_acquire)) std::this_thread::yield();
      if (!cancelled.load(std::memory_order_relaxed)) work(i);
      ends[i] = std::chrono::steady_clock::now();
    });
    if (!t.ok()) {
      run.status = t.status();
      cancelled.store(true, std::memory_order_relaxed);
      break;
    }
    started.push_back(std::move(t).value());
  }
  while (waiting.load(std::memory_order_acquire) < started.size()) std::this_thread::yield();
  if (run.status.ok() && at_open) at_open();
  run.start = std::chrono::steady_clock::now();
  open.store(true, std::memory_order_release);
  for (auto& t : started) t.join();
  run.end = run.start;
  for (unsigned i = 0; i < started.size(); ++i) run.end = std::max(run.end, ends[i]);
  return run;
}

void Prefault(AlignedBuffer& b) {
  if (b.data() != nullptr) std::memset(b.data(), 0, b.capacity());
}

long MinorFaults() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

}  // namespace terrace::cli
