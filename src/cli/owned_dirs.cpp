#include "src/cli/owned_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "src/cli/safe_files.h"
#include "src/cli/remove_on_signal.h"
#include "src/common/list_dir.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/lock_holders.h"
#include "tiers/nvme/nvme_paths.h"

namespace terrace::cli {
namespace {

namespace fs = std::filesystem;

// What WhyNotOwned found in a store directory.
struct StoreScan {
  std::size_t entries = 0;
  bool data = false;      // terrace.data (a Terrace data file)
  bool creating = false;  // terrace.data.creating (a creation a kill interrupted)
  bool mark = false;      // the marker
};

// NonStoreEntry, also saying in `scan` what `dir` holds.
std::string ScanStoreDir(const fs::path& dir, std::string_view marker, std::string_view flag, StoreScan* scan) {
  std::error_code ec;
  *scan = {};
  for (const auto& e : ListDir(dir, &ec)) {
    ++scan->entries;
    const std::string name = e.path().filename().string();
    if (name == kDataFile) {
      if (!IsStoreDataFile(e.path())) {
        return fmt::format("{} {}: '{}' is not the data file of a Terrace store (no TRRCNVME magic)", flag,
                           dir.string(), name);
      }
      scan->data = true;
    } else if (name == kIndexDir && IsKind(e.path(), S_IFDIR)) {
      if (auto foreign = ForeignIndexEntry(e.path())) {
        return fmt::format("{} {} holds '{}', which is not part of a Terrace store", flag, dir.string(),
                           foreign->lexically_relative(dir).string());
      }
    } else if (name == kCreatingFile && IsKind(e.path(), S_IFREG)) {
      scan->creating = true;
    } else if (name == marker && IsKind(e.path(), S_IFREG)) {
      scan->mark = true;
    } else {
      return fmt::format("{} {} holds '{}', which is not part of a Terrace store", flag, dir.string(), name);
    }
  }
  if (ec) return fmt::format("{} {}: cannot list it: {}", flag, dir.string(), ec.message());
  return "";
}

// Why `dir` is neither a store that `who` created nor what a stopped creation or removal of one left
// (the marker with some of index/ and terrace.data.creating); empty when it is one of those, or empty.
std::string WhyNotOwned(const fs::path& dir, std::string_view marker, std::string_view flag, std::string_view who,
                        StoreScan* scan) {
  if (std::string why = ScanStoreDir(dir, marker, flag, scan); !why.empty()) return why;
  if (scan->entries == 0 || scan->mark) return "";
  if (!scan->data) return fmt::format("{} {} holds no Terrace store (no terrace.data)", flag, dir.string());
  return fmt::format("{} {} holds a Terrace store that {} did not create (no {} in it)", flag, dir.string(), who,
                     marker);
}

bool IsEmptyRealDir(const fs::path& dir) {
  if (!IsKind(dir, S_IFDIR)) return false;
  std::error_code ec;
  return ListDir(dir, &ec).empty() && !ec;
}

}  // namespace

std::string NonStoreEntry(const fs::path& dir, std::string_view marker, std::string_view flag) {
  StoreScan scan;
  return ScanStoreDir(dir, marker, flag, &scan);
}

bool IsStoreDataFile(const fs::path& data) {
  if (!IsKind(data, S_IFREG)) return false;
  auto unit = ReadSuperblockUnit(data, /*follow_symlinks=*/false);
  if (!unit.ok()) return false;
  const std::vector<std::byte>& buf = *unit;
  if (buf.size() >= sizeof nvme::kSuperblockMagic &&
      std::memcmp(buf.data(), nvme::kSuperblockMagic, sizeof nvme::kSuperblockMagic) == 0) {
    return true;
  }
  return nvme::Superblock::DecodeUnit(buf, data.string()).ok();
}

std::optional<fs::path> ForeignIndexEntry(const fs::path& index, std::string_view marker) {
  if (!IsKind(index, S_IFDIR)) return index;
  std::error_code ec;
  for (fs::directory_iterator it(index, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    const std::string name = p.filename().string();
    const bool ours = nvme::IsIndexStoreFileName(name) || (!marker.empty() && name == marker);
    if (!ours || !IsKind(p, S_IFREG)) return p;
  }
  if (ec) return index;
  return std::nullopt;
}

Status CheckStoreDirArg(const fs::path& dir, std::string_view flag) {
  if (dir.empty()) return Status::InvalidArgument(fmt::format("{} is empty; give a directory", flag));
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (::lstat(dir.c_str(), &st) == 0) {
      return Status::InvalidArgument(fmt::format("{} {} is a symbolic link to nothing; give a directory", flag,
                                                 dir.string()));
    }
    return Status::Ok();
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("{} {} is {}; give a directory (created if missing)", flag,
                                               dir.string(), DescribePathKind(dir)));
  }
  std::error_code ec;
  if (fs::is_regular_file(dir / "config.json", ec) &&
      (fs::exists(dir / "model.safetensors", ec) || fs::exists(dir / "model.safetensors.index.json", ec))) {
    return Status::InvalidArgument(fmt::format(
        "{} {} is a model directory (it holds config.json and the model's weights); give the store a directory of its "
        "own (created if missing)",
        flag, dir.string()));
  }
  return Status::Ok();
}

Result<fs::path> ScratchDirPath(std::string_view prefix, std::string_view flag) {
  std::error_code ec;
  const fs::path tmp = fs::temp_directory_path(ec);  // the overload that throws ended the CLI in "internal error"
  if (ec) {
    // The variable temp_directory_path read (libstdc++ tries these in this order), else /tmp.
    std::string source = "/tmp (TMPDIR is not set)";
    for (const char* var : {"TMPDIR", "TMP", "TEMP", "TEMPDIR"}) {
      if (const char* v = std::getenv(var); v != nullptr) {
        source = fmt::format("{}={}", var, v);
        break;
      }
    }
    return Status::Unavailable(fmt::format("no temporary directory for the scratch files: {}: {}; set TMPDIR to an "
                                           "existing directory, or pass {}",
                                           source, ec.message(), flag));
  }
  std::random_device rd;
  return tmp / fmt::format("{}-{}-{:08x}", prefix, ProcessTag(), rd());
}

void RemoveDeadScratchDirs(const fs::path& parent, std::string_view prefix, std::initializer_list<std::string_view> names,
                           std::string_view marker, std::string_view who) {
  std::error_code ec;
  const std::string lead = std::string(prefix) + "-";
  for (const auto& e : ListDir(parent, &ec)) {
    const std::string name = e.path().filename().string();
    std::string_view rest;
    const std::optional<long> pid = DeadPidAfter(name, lead, &rest);
    if (!pid || rest.size() != 9 || rest[0] != '-' || rest.find_first_not_of("0123456789abcdef", 1) != std::string_view::npos)
      continue;
    if (!IsOwnRealDir(e.path())) continue;
    if (!HoldsOnlyOwnedStores(e.path(), names, marker, EmptySubDirs::kAccept)) continue;
    fmt::print(stderr, "{}: removing '{}', left behind by an earlier run (process {}) that did not finish\n", who,
               e.path().string(), *pid);
    if (RemoveOwnedSubStores(e.path(), names, marker, "--dir", who).ok()) fs::remove(e.path(), ec);
  }
}

bool StoreDataExists(const fs::path& dir) {
  struct stat st {};
  return ::lstat((dir / kDataFile).c_str(), &st) == 0;
}

bool RemoveOrphanedIndexCreation(const fs::path& dir, const fs::path& index, std::string_view who) {
  const std::string marker(nvme::kIndexCreatingMarker);
  struct stat st {};
  if (StoreDataExists(dir) || ::lstat((dir / kCreatingFile).c_str(), &st) == 0) return false;
  if (!IsKind(index, S_IFDIR) || ForeignIndexEntry(index)) return false;
  if (!IsKind(index / marker, S_IFREG) && !IsKind(index / (marker + ".tmp"), S_IFREG)) return false;
  fmt::print(stderr, "{}: removing '{}', the index of a store creation a stopped run left unfinished (its data file "
                     "terrace.data.creating is gone)\n", who, index.string());
  std::error_code ec;
  fs::remove_all(index, ec);
  return !ec;
}

bool IsOwnedStore(const fs::path& dir, std::string_view marker) {
  if (!IsKind(dir, S_IFDIR)) return false;
  StoreScan scan;
  return WhyNotOwned(dir, marker, "", "", &scan).empty() && scan.data && scan.mark && !scan.creating;
}

bool IsOwnedStoreOrLeftover(const fs::path& dir, std::string_view marker) {
  if (!IsKind(dir, S_IFDIR)) return false;
  StoreScan scan;
  return WhyNotOwned(dir, marker, "", "", &scan).empty() && scan.mark;
}

bool HoldsOnlyOwnedStores(const std::filesystem::path& dir, std::initializer_list<std::string_view> names,
                          std::string_view marker, EmptySubDirs empty) {
  std::error_code ec;
  bool any = false;
  for (const auto& e : ListDir(dir, &ec)) {
    const std::string name = e.path().filename().string();
    if (std::find(names.begin(), names.end(), name) == names.end()) return false;
    const bool empty_ok = empty == EmptySubDirs::kAccept && IsEmptyRealDir(e.path());
    if (!empty_ok && !IsOwnedStoreOrLeftover(e.path(), marker)) return false;
    any = true;
  }
  return any && !ec;
}

std::string WhyNotOnlyOwnedStores(const fs::path& dir, std::initializer_list<std::string_view> names,
                                  std::string_view marker, std::string_view flag) {
  std::error_code ec;
  for (const auto& e : ListDir(dir, &ec)) {
    const std::string name = e.path().filename().string();
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      return fmt::format("{} {} holds '{}', which the bench did not create", flag, dir.string(), name);
    }
    if (IsOwnedStoreOrLeftover(e.path(), marker)) continue;
    if (!IsKind(e.path(), S_IFDIR)) {
      return fmt::format("{} {} holds '{}' ({}), which the bench did not create", flag, dir.string(), name,
                         DescribePathKind(e.path()));
    }
    if (IsEmptyRealDir(e.path())) {
      return fmt::format("{} {} holds the empty folder '{}', which the bench removes with its marker, so it is not "
                         "the bench's",
                         flag, dir.string(), name);
    }
    if (std::string why = NonStoreEntry(e.path(), marker, flag); !why.empty()) return why;
    return fmt::format("{} {} holds a Terrace store without the bench's {}", flag, e.path().string(), marker);
  }
  if (ec) return fmt::format("{} {}: cannot list it: {}", flag, dir.string(), ec.message());
  return "";
}

// How long StoreInUse waits for a store's lock (the NVMe tier's default lock_wait).
constexpr std::chrono::milliseconds kInUseWait{2000};

std::optional<std::string> StoreInUse(const fs::path& dir) {
  for (const std::string_view name : {kDataFile, kCreatingFile}) {
    const fs::path file = dir / name;
    const int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    // An exclusive probe conflicts with every holder, a reader's shared lock included; it is let go
    // at once (close), so an opener that waits for the lock only waits a moment longer. It waits as
    // an opener does: a killed process's lock outlives it briefly (its io_uring's teardown in the
    // kernel still holds the file), a running one's does not end.
    const bool held = nvme::LockDataArea(fd, LOCK_EX, kInUseWait) == EWOULDBLOCK;
    const std::string by = held ? nvme::FlockHolderText(fd) : std::string();
    ::close(fd);
    if (!held) continue;
    return fmt::format("{} (it holds the lock on {})", by, file.string());
  }
  return std::nullopt;
}

std::optional<long> IndexLockHolder(const fs::path& index) {
  const int fd = ::open((index / "LOCK").c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct flock probe {};
  probe.l_type = F_WRLCK;  // conflicts with any lock; F_GETLK only asks, it takes nothing
  probe.l_whence = SEEK_SET;
  const bool asked = ::fcntl(fd, F_GETLK, &probe) == 0;
  ::close(fd);
  if (!asked || probe.l_type == F_UNLCK) return std::nullopt;
  return static_cast<long>(probe.l_pid);
}

namespace {

// RemoveOwnedStore's checks without the removal: true when `dir` holds an owned store no process
// uses (something to remove), false when it is absent or empty, its refusal otherwise.
Result<bool> OwnedStoreToRemove(const fs::path& dir, std::string_view marker, std::string_view flag,
                                std::string_view who) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return false;  // absent: nothing to remove
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("{} {} is {}; {} removes only a store directory it created, nothing "
                                               "was removed",
                                               flag, dir.string(), DescribePathKind(dir), who));
  }
  StoreScan scan;
  const std::string why = WhyNotOwned(dir, marker, flag, who, &scan);
  if (!why.empty()) {
    return Status::InvalidArgument(
        fmt::format("{}; {} removes only a store it created, so nothing was removed (delete the folder yourself if "
                    "you mean to, or give another {})",
                    why, who, flag));
  }
  if (scan.entries == 0) return false;
  if (const std::optional<std::string> user = StoreInUse(dir)) {
    return Status::InvalidArgument(fmt::format(
        "{} {} holds a store that {} is using right now; {} removes only a store no process uses, so nothing was "
        "removed (wait for that process to finish, or give another {})",
        flag, dir.string(), *user, who, flag));
  }
  return true;
}

}  // namespace

Result<bool> RemoveOwnedStore(const fs::path& dir, std::string_view marker, std::string_view flag,
                              std::string_view who) {
  TERRACE_ASSIGN_OR_RETURN(const bool some, OwnedStoreToRemove(dir, marker, flag, who));
  if (!some) return false;
  TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(dir, marker, flag));
  return true;
}

Status RemoveOwnedSubStores(const fs::path& dir, std::initializer_list<std::string_view> names,
                            std::string_view marker, std::string_view flag, std::string_view who,
                            std::string_view note) {
  std::vector<bool> some;  // every sub-folder is checked before any is removed
  for (const std::string_view name : names) {
    TERRACE_ASSIGN_OR_RETURN(const bool s, OwnedStoreToRemove(dir / name, marker, flag, who));
    some.push_back(s);
  }
  if (!note.empty()) fmt::print(stderr, "{}\n", note);
  std::size_t i = 0;
  for (const std::string_view name : names) {
    const StopSignalHold hold;  // the marker and its folder go together
    if (some[i++]) TERRACE_RETURN_IF_ERROR(RemoveStoreFiles(dir / name, marker, flag));
    std::error_code ec;
    fs::remove(dir / name, ec);  // only if empty
  }
  return Status::Ok();
}

Status RemoveStoreFiles(const fs::path& dir, std::string_view marker, std::string_view flag) {
  // The marker goes last: a run stopped part-way (a second Ctrl-C) leaves a marked leftover, which
  // the next run recognises and removes.
  std::error_code ec;
  for (const std::string_view f : {kDataFile, kCreatingFile}) {
    if (!ec) fs::remove(dir / f, ec);
  }
  if (!ec) fs::remove_all(dir / kIndexDir, ec);
  if (!ec) fs::remove(dir / marker, ec);
  if (ec) return Status::IoError(fmt::format("{} {}: cannot remove the store: {}", flag, dir.string(), ec.message()));
  return Status::Ok();
}

namespace {

// The capacity in the superblock of the regular file `data`; NotFound when there is none.
Result<std::uint64_t> RecordedCapacity(const fs::path& data) {
  if (!IsKind(data, S_IFREG)) {
    return Status::NotFound(fmt::format("'{}' holds no {}", data.parent_path().string(), data.filename().string()));
  }
  // The whole superblock unit: DecodeUnit picks the valid one of its two slots, as the tier does.
  TERRACE_ASSIGN_OR_RETURN(std::vector<std::byte> buf, ReadSuperblockUnit(data, /*follow_symlinks=*/false));
  TERRACE_ASSIGN_OR_RETURN(nvme::Superblock sb, nvme::Superblock::DecodeUnit(buf, data.string()));
  return sb.capacity_bytes;
}

}  // namespace

Result<std::uint64_t> ExistingStoreCapacity(const fs::path& dir) { return RecordedCapacity(dir / kDataFile); }

Result<std::uint64_t> InterruptedCreationCapacity(const fs::path& dir) {
  return RecordedCapacity(dir / kCreatingFile);
}

Result<std::vector<std::byte>> ReadSuperblockUnit(const fs::path& data, bool follow_symlinks) {
  const int fd = ::open(data.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | (follow_symlinks ? 0 : O_NOFOLLOW));
  if (fd < 0) {
    const int err = errno;
    const std::string msg = fmt::format("cannot open '{}': {}", data.string(), std::strerror(err));
    return err == ENOENT ? Status::NotFound(msg) : Status::IoError(msg);
  }
  struct stat st{};
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    ::close(fd);
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                                              : "not a regular file";
    return Status::InvalidArgument(fmt::format(
        "'{}' is {}, not a Terrace data file (a store's data file is a regular file, or a block device); Terrace "
        "did not make it and leaves it as it is: move it out of the way, or give the --dir of a Terrace store",
        data.string(), what));
  }
  std::vector<std::byte> buf(nvme::kSuperblockBytes);
  const ssize_t n = ::pread(fd, buf.data(), buf.size(), 0);
  const int err = errno;
  ::close(fd);
  if (n < 0) return Status::IoError(fmt::format("cannot read the superblock of '{}': {}", data.string(), std::strerror(err)));
  buf.resize(static_cast<std::size_t>(n));
  return buf;
}

Status WriteMarker(const fs::path& dir, std::string_view marker, std::string_view who) {
  return WriteOutputFile(dir / std::string(marker), "marker",
                         fmt::format("This Terrace store was created by '{}', which may remove it.\n", who));
}

}  // namespace terrace::cli
