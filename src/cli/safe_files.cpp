#include "src/cli/safe_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/remove_on_signal.h"
#include "src/common/generator_mark.h"
#include "terrace/block.h"
#include "src/common/list_dir.h"

namespace terrace::cli {
namespace {

namespace fs = std::filesystem;

std::string KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISCHR(mode)) return "a character device";
  return "not a regular file";
}

fs::path ParentOf(const fs::path& path) {
  fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

constexpr std::string_view kTempPrefix = ".terrace-tmp-";

fs::path TempNameNextTo(const fs::path& path) {
  static std::atomic<unsigned> counter{0};
  return ParentOf(path) / fmt::format("{}{}-{}", kTempPrefix, ProcessTag(), counter.fetch_add(1));
}

// The name SafetensorsWriter gives its own temporary file while it writes `tmp` (safetensors.cpp).
fs::path WriterTempOf(const fs::path& tmp) { return tmp.string() + fmt::format(".tmp.{}", ::getpid()); }

// True when `s` is `lead` followed by 1 to 9 decimal digits and nothing else.
bool IsLeadDigits(std::string_view s, std::string_view lead) {
  if (!s.starts_with(lead)) return false;
  s.remove_prefix(lead.size());
  return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// Removes the temporaries of killed writers in `dir`: regular files of this user named
// .terrace-tmp-<pid>.<host tag>-<n>[.tmp.<pid>] whose <pid> no longer runs (DeadPidAfter).
void RemoveDeadTemps(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : ListDir(dir, &ec)) {
    const std::string name = e.path().filename().string();
    std::string_view rest;
    if (!DeadPidAfter(name, kTempPrefix, &rest)) continue;
    const std::size_t suffix = rest.find(".tmp.");
    if (!IsLeadDigits(rest.substr(0, suffix), "-")) continue;
    if (suffix != std::string_view::npos && !IsLeadDigits(rest.substr(suffix), ".tmp.")) continue;
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid()) {
      ::unlink(e.path().c_str());
    }
  }
}

// `what` failed on the temporary file `tmp`, for FileErrno on the target: the message names the flag
// and the target the user gave, then the temporary ("--out a.jsonl: cannot create a temporary file
// next to it (./.terrace-tmp-...): Permission denied").
std::string TempWhat(std::string_view what, const fs::path& tmp) { return fmt::format("{} ({})", what, tmp.string()); }

void SyncDir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

Status CheckTarget(const fs::path& path, std::string_view flag, const OutputRules* rules);

// Checks the temporary file produce() wrote, fsyncs it, re-checks the target and renames.
Status CommitTemp(const fs::path& tmp, const fs::path& path, std::string_view flag, const OutputRules* rules) {
  struct stat st {};
  if (::lstat(tmp.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return Status::Internal(fmt::format("{} {}: the temporary file '{}' was not written", flag, path.string(),
                                        tmp.string()));
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return FileErrno(errno, TempWhat("cannot reopen the temporary file", tmp), path, flag);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return FileErrno(err, TempWhat("cannot fsync the temporary file", tmp), path, flag);
  TERRACE_RETURN_IF_ERROR(CheckTarget(path, flag, rules));  // again: it may have changed while we wrote
  if (::rename(tmp.c_str(), path.c_str()) != 0) return FileErrno(errno, "cannot rename the output into place", path, flag);
  SyncDir(ParentOf(path));
  return Status::Ok();
}

// The plural noun for a format's files, for messages.
std::string_view FormatFiles(OutputFormat f) {
  switch (f) {
    case OutputFormat::kHtml: return "HTML reports";
    case OutputFormat::kSvg: return "SVG charts";
    case OutputFormat::kSafetensors: return "safetensors files";
    case OutputFormat::kPrometheus: return "Prometheus text files";
    case OutputFormat::kPng: return "PNG charts";
    case OutputFormat::kJson: return "JSON files";
    case OutputFormat::kTrace: return "request traces";
  }
  return "files";
}

// Up to kMarkProbeBytes from the start of the regular file `path` (not following a symlink, never
// blocking); empty when it cannot be read, which then counts as carrying no mark.
std::string ReadHead(const fs::path& path) {
  std::string head;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return head;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    head.resize(std::min<std::uint64_t>(static_cast<std::uint64_t>(st.st_size), kMarkProbeBytes));
    std::size_t got = 0;
    while (got < head.size()) {
      const ssize_t n = ::read(fd, head.data() + got, head.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    head.resize(got);
  }
  ::close(fd);
  return head;
}

// The rule of `rules` for the existing regular file `path`: never one of the command's inputs; else
// replaced with --force, or when Terrace's mark is in it and it is not a checkpoint Terrace wrote.
Status CheckOwnership(const fs::path& path, std::string_view flag, const OutputRules& rules) {
  struct stat out {};
  if (::stat(path.c_str(), &out) != 0) return Status::Ok();  // gone since lstat: a new file
  for (const OutputRules::Input& in : rules.inputs) {
    struct stat ist {};
    if (::stat(in.path.c_str(), &ist) == 0 && ist.st_dev == out.st_dev && ist.st_ino == out.st_ino) {
      return Status::InvalidArgument(fmt::format(
          "{} {} is the same file as the input {} {}; Terrace never writes over a command's own input, even "
          "with --force: choose another path",
          flag, path.string(), in.flag, in.path.string()));
    }
  }
  if (rules.force) return Status::Ok();
  const std::string head = ReadHead(path);
  if (rules.format == OutputFormat::kSafetensors && IsTerraceCheckpoint(head)) {
    return Status::InvalidArgument(fmt::format(
        "{} {} is a model checkpoint Terrace wrote (its metadata holds '{}'), not an output of this command, "
        "which replaces a checkpoint only when told to; choose another path or pass --force to replace it",
        flag, path.string(), kSafetensorsCheckpointKey));
  }
  if (HasTerraceMark(rules.format, head)) return Status::Ok();
  const bool markable = rules.format != OutputFormat::kTrace;
  return Status::InvalidArgument(fmt::format(
      "{} {} already exists and Terrace did not write it ({}); choose another path or pass --force to replace it",
      flag, path.string(),
      markable ? fmt::format("it lacks the mark Terrace writes in {}", FormatFiles(rules.format))
               : fmt::format("as far as it can tell: {} carry no mark of Terrace's", FormatFiles(rules.format))));
}

Status CheckTarget(const fs::path& path, std::string_view flag, const OutputRules* rules) {
  if (path.empty()) return Status::InvalidArgument(fmt::format("{} is empty; give the path of an output file", flag));
  if (!path.has_filename()) {
    return Status::InvalidArgument(
        fmt::format("{} {} names a directory; give the path of an output file", flag, path.string()));
  }
  struct stat st {};
  bool exists = false;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return Status::InvalidArgument(fmt::format(
          "{} {} is {}; Terrace writes output only to a new path or over a regular file, and leaves anything else "
          "as it is; give another path",
          flag, path.string(), KindOf(st.st_mode)));
    }
    exists = true;
  } else if (errno != ENOENT) {
    return Status::InvalidArgument(fmt::format("{} {}: {}", flag, path.string(), std::strerror(errno)));
  }
  const fs::path parent = ParentOf(path);
  struct stat pst {};
  if (::stat(parent.c_str(), &pst) != 0) {
    return Status::InvalidArgument(fmt::format("{} {}: the folder '{}' does not exist ({}); create it first", flag,
                                               path.string(), parent.string(), std::strerror(errno)));
  }
  if (!S_ISDIR(pst.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("{} {}: '{}' is {}, not a folder", flag, path.string(), parent.string(), KindOf(pst.st_mode)));
  }
  if (exists && rules != nullptr) return CheckOwnership(path, flag, *rules);
  return Status::Ok();
}

// WriteOutputFile with `rules` (null: no ownership rule).
Status WriteTarget(const fs::path& path, std::string_view flag, const OutputRules* rules,
                   const std::function<Status(const fs::path& tmp)>& produce) {
  TERRACE_RETURN_IF_ERROR(CheckTarget(path, flag, rules));
  // A temporary name nothing uses yet: on failure only what produce() made there is removed, never
  // a file that was there before (a leftover of a killed run whose pid repeats, or a user's).
  fs::path tmp;
  for (int attempt = 0; attempt < 64 && tmp.empty(); ++attempt) {
    fs::path candidate = TempNameNextTo(path);
    struct stat st {};
    if (::lstat(candidate.c_str(), &st) != 0 && errno == ENOENT) tmp = std::move(candidate);
  }
  if (tmp.empty())
    return Status::IoError(fmt::format("{} {}: no unused temporary name next to it (.terrace-tmp-<pid>-<n>)", flag,
                                       path.string()));
  RemoveDeadTemps(ParentOf(path));
  Status s;
  {
    const RemoveOnSignal tmp_guard(tmp), writer_tmp_guard(WriterTempOf(tmp));  // a Ctrl-C leaves neither behind
    s = produce(tmp);
    if (s.ok()) s = CommitTemp(tmp, path, flag, rules);
  }
  if (!s.ok()) {
    struct stat st {};
    if (::lstat(tmp.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(tmp.c_str());
  }
  return s;
}

// produce() for content in memory.
std::function<Status(const fs::path&)> WriteContent(std::string_view content, const fs::path& path,
                                                    std::string_view flag) {
  return [content, &path, flag](const fs::path& tmp) -> Status {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return FileErrno(errno, TempWhat("cannot create a temporary file next to it", tmp), path, flag);
    const char* p = content.data();
    std::size_t left = content.size();
    while (left > 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        return FileErrno(err, "cannot write", path, flag);
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0) return FileErrno(errno, "cannot write", path, flag);
    return Status::Ok();
  };
}

}  // namespace

Status CheckOutsideDir(const fs::path& path, std::string_view flag, const fs::path& dir, std::string_view dir_flag) {
  if (dir.empty()) return Status::Ok();
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  const fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec || std::mismatch(d.begin(), d.end(), p.begin(), p.end()).first != d.end()) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} {} is inside {} {}, where Terrace keeps that store's files; an output never goes there, even with "
      "--force: choose a path outside it",
      flag, path.string(), dir_flag, dir.string()));
}

std::optional<std::string> MarkedTerraceFileHead(const fs::path& path, OutputFormat format) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(path, ec))) return std::nullopt;
  std::string head = ReadHead(path);
  if (!HasTerraceMark(format, head)) return std::nullopt;
  return head;
}

bool IsMarkedTerraceFile(const fs::path& path, OutputFormat format) {
  return MarkedTerraceFileHead(path, format).has_value();
}

Status FileErrno(int err, std::string_view what, const fs::path& path, std::string_view flag) {
  std::string message = fmt::format("{} {}: {}: {}", flag, path.string(), what, std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return Status::OutOfCapacity(std::move(message));
  return Status::IoError(std::move(message));
}

std::string HostTag() {
  static const std::string tag = [] {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    struct stat st {};
    const unsigned long long ns = ::stat("/proc/self/ns/pid", &st) == 0 ? st.st_ino : 0;
    const std::string id = fmt::format("{}/{}", host, ns);
    return fmt::format("{:08x}", Checksum(std::as_bytes(std::span(id))) & 0xffffffffu);
  }();
  return tag;
}

std::string ProcessTag() { return fmt::format("{}.{}", ::getpid(), HostTag()); }

std::optional<long> DeadPidAfter(std::string_view name, std::string_view prefix, std::string_view* rest) {
  if (!name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  const std::size_t digits = std::min(name.find_first_not_of("0123456789"), name.size());
  if (digits == 0 || digits > 9) return std::nullopt;
  const std::string host = "." + HostTag();
  if (!name.substr(digits).starts_with(host)) return std::nullopt;  // another host's or pid namespace's pid
  const long pid = std::stol(std::string(name.substr(0, digits)));
  if (pid <= 0 || pid == ::getpid()) return std::nullopt;
  if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return std::nullopt;  // it runs (or may)
  *rest = name.substr(digits + host.size());
  return pid;
}

bool IsKind(const std::filesystem::path& path, unsigned kind) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && (st.st_mode & S_IFMT) == kind;
}

bool IsOwnRealDir(const std::filesystem::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::geteuid();
}

std::string DescribePathKind(const fs::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "missing";
  return KindOf(st.st_mode);
}

Status CheckOutputFile(const fs::path& path, std::string_view flag, const OutputRules& rules) {
  return CheckTarget(path, flag, &rules);
}

Status CheckOutputFile(const fs::path& path, std::string_view flag) { return CheckTarget(path, flag, nullptr); }

Status WriteOutputFile(const fs::path& path, std::string_view flag, const OutputRules& rules,
                       const std::function<Status(const fs::path& tmp)>& produce) {
  return WriteTarget(path, flag, &rules, produce);
}

Status WriteOutputFile(const fs::path& path, std::string_view flag, const OutputRules& rules,
                       std::string_view content) {
  return WriteTarget(path, flag, &rules, WriteContent(content, path, flag));
}

Status WriteOutputFileNamingTarget(const fs::path& path, std::string_view flag, const OutputRules& rules,
                                   std::string_view what, const std::function<Status(const fs::path& tmp)>& produce) {
  return WriteTarget(path, flag, &rules, [&](const fs::path& tmp) {
    const Status written = produce(tmp);
    return written.ok() ? written
                        : Reworded(written, fmt::format("{} {}: cannot write {}: {}", flag, path.string(), what,
                                                        written.message()));
  });
}

Status WriteOutputFile(const fs::path& path, std::string_view flag,
                       const std::function<Status(const fs::path& tmp)>& produce) {
  return WriteTarget(path, flag, nullptr, produce);
}

Status WriteOutputFile(const fs::path& path, std::string_view flag, std::string_view content) {
  return WriteTarget(path, flag, nullptr, WriteContent(content, path, flag));
}

Status CheckInputFile(const fs::path& path, std::string_view flag, std::uint64_t max_bytes) {
  if (path.empty()) return Status::InvalidArgument(fmt::format("{} is empty; give the path of an input file", flag));
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(fmt::format("{} {}: no such file", flag, path.string()));
    return Status::InvalidArgument(fmt::format("{} {}: {}", flag, path.string(), std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("{} {} is {}; give a regular file", flag, path.string(), KindOf(st.st_mode)));
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    return Status::InvalidArgument(fmt::format("{} {} is {} bytes, over the limit of {} bytes for this input", flag,
                                               path.string(), st.st_size, max_bytes));
  }
  return Status::Ok();
}

Result<std::string> ReadInputFile(const fs::path& path, std::string_view flag, std::uint64_t max_bytes) {
  TERRACE_RETURN_IF_ERROR(CheckInputFile(path, flag, max_bytes));
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return FileErrno(errno, "cannot open", path, flag);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {  // swapped since the check
    ::close(fd);
    return Status::InvalidArgument(fmt::format("{} {} is not a regular file; give a regular file", flag, path.string()));
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return FileErrno(err, "cannot read", path, flag);
    }
    if (n == 0) break;
    if (out.size() + static_cast<std::size_t>(n) > max_bytes) {
      ::close(fd);
      return Status::InvalidArgument(
          fmt::format("{} {} is over the limit of {} bytes for this input", flag, path.string(), max_bytes));
    }
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

Status CheckInputDir(const fs::path& path, std::string_view flag) {
  if (path.empty()) return Status::InvalidArgument(fmt::format("{} is empty; give a directory", flag));
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(fmt::format("{} {}: no such directory", flag, path.string()));
    return Status::InvalidArgument(fmt::format("{} {}: {}", flag, path.string(), std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("{} {} is {}; give a directory", flag, path.string(), KindOf(st.st_mode)));
  }
  return Status::Ok();
}

Status CheckModelDirInput(const fs::path& path, std::string_view flag) {
  TERRACE_RETURN_IF_ERROR(CheckInputDir(path, flag));
  std::error_code ec;
  for (const auto& entry : ListDir(path, &ec)) {
    const std::string ext = entry.path().extension().string();
    if (ext != ".safetensors" && ext != ".json") continue;
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) != 0) continue;  // a dangling link: the load reports it
    if (!S_ISREG(st.st_mode)) {
      return Status::InvalidArgument(fmt::format("{} {}: '{}' is {}; a model directory holds regular files", flag,
                                                 path.string(), entry.path().filename().string(), KindOf(st.st_mode)));
    }
  }
  if (ec) return Status::IoError(fmt::format("{} {}: cannot list: {}", flag, path.string(), ec.message()));
  struct stat st {};
  if (::lstat((path / "config.json").c_str(), &st) != 0 && errno == ENOENT) {
    // A demo's data directory holds its model in model/: the likely mix-up.
    const bool nested = ::stat((path / "model" / "config.json").c_str(), &st) == 0;
    return Status::InvalidArgument(fmt::format(
        "{} {}: no config.json in it, so it is not a model directory{}", flag, path.string(),
        nested ? fmt::format("; its folder 'model' holds one (a demo's data directory?): give {} to {}",
                             (path / "model").string(), flag)
               : "; give the folder 'terrace model init' wrote, or a checkpoint folder with config.json and "
                 "*.safetensors"));
  }
  return Status::Ok();
}

std::vector<OutputRules::Input> ModelDirInputs(const fs::path& path, std::string_view flag) {
  std::vector<OutputRules::Input> inputs;
  std::error_code ec;
  for (const auto& entry : ListDir(path, &ec)) {
    const std::string ext = entry.path().extension().string();
    if (ext == ".safetensors" || ext == ".json") inputs.push_back({std::string(flag), entry.path()});
  }
  return inputs;
}

}  // namespace terrace::cli
