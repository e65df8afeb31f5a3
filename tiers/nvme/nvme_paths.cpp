#include "tiers/nvme/nvme_paths.h"

#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>

#include "src/common/list_dir.h"
#include "tiers/nvme/index_store.h"

namespace terrace::nvme {

namespace fs = std::filesystem;

namespace {

// "a/idx/" as "a/idx": the index directory's siblings (<index>.damaged-*, <index>.rebuilding) are
// named by appending to it.
fs::path WithoutTrailingSeparator(const fs::path& p) {
  return p.has_filename() || !p.has_parent_path() ? p : p.parent_path();
}

}  // namespace

fs::path RebuildingIndexPath(const fs::path& index) {
  fs::path p = index;
  p += ".rebuilding";
  return p;
}

Result<StorePaths> ResolveStorePaths(const NvmeTierOptions& options, bool may_create) {
  const fs::path& path = options.path;
  if (path.empty()) {
    return Status::InvalidArgument("NVMe tier: options.path is empty; set it to a directory or a block device");
  }
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Status::IoError(fmt::format("NVMe tier path '{}' cannot be used: {}; choose a directory you can write",
                                       path.string(), ec.message()));
  }
  StorePaths p;
  if (!fs::exists(st)) {
    if (!may_create) {
      return Status::NotFound(fmt::format("NVMe tier directory '{}' does not exist; give the directory of an existing "
                                          "store (or create it / set create_if_missing=true for a new one)",
                                          path.string()));
    }
    fs::create_directories(path, ec);
    if (ec) {
      return Status::IoError(fmt::format("cannot create NVMe tier directory '{}': {}; choose a writable location",
                                         path.string(), ec.message()));
    }
  } else if (fs::is_block_file(st)) {
    if (options.index_dir.empty()) {
      return Status::InvalidArgument(fmt::format(
          "NVMe tier on block device '{}': set options.index_dir to a directory on a persistent file system for the "
          "index",
          path.string()));
    }
    p.data = path;
    p.index = WithoutTrailingSeparator(options.index_dir);
    p.block_device = true;
    return p;
  } else if (!fs::is_directory(st)) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier path '{}' is neither a directory nor a block device; point it at a directory (the tier creates "
        "terrace.data and index/ inside) or at a block device",
        path.string()));
  }
  p.data = path / "terrace.data";
  p.creating = path / "terrace.data.creating";
  p.index = options.index_dir.empty() ? path / "index" : WithoutTrailingSeparator(options.index_dir);
  return p;
}

int LockDataArea(int fd, int op, std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (true) {
    if (::flock(fd, op | LOCK_NB) == 0) return 0;
    int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK || std::chrono::steady_clock::now() >= deadline) return err;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int DataAreaBytes(int fd, bool block_device, std::uint64_t* bytes) {
  if (block_device) return ::ioctl(fd, BLKGETSIZE64, bytes) == 0 ? 0 : errno;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno;
  *bytes = static_cast<std::uint64_t>(st.st_size);
  return 0;
}

namespace {

Status ErrnoError(std::string_view what, const fs::path& path, int err, std::string_view advice) {
  return Status::IoError(fmt::format("{} '{}': {}; {}", what, path.string(), std::strerror(err), advice));
}

}  // namespace

Status ShorterThanCapacity(const StorePaths& paths, std::uint64_t size, std::uint64_t capacity) {
  const std::string data = paths.data.string();
  if (paths.block_device) {
    return Status::Corruption(fmt::format(
        "block device '{}' has {} bytes, fewer than the capacity {} of the store on it: it is not the device the "
        "store was made on, or it shrank; open the store on its own device",
        data, size, capacity));
  }
  return Status::Corruption(fmt::format(
      "NVMe data file '{}' is {} bytes, shorter than its capacity {}: it was truncated. Do not delete the store: the "
      "blocks in its first {} bytes are intact, each with a descriptor a scan finds. Restore the file from a backup "
      "if you have one; otherwise extend it back to its capacity (`truncate -s {} '{}'`; the missing part reads as "
      "zeros) and run `terrace store recover --dir {}` (with the store's --index-dir if it has one) to rebuild the "
      "index from the blocks left; blocks that lay past the cut are lost",
      data, size, capacity, size, capacity, data, paths.data.parent_path().string()));
}

Status SyncDirectory(const fs::path& path) {
  const fs::path dir = path.empty() ? fs::path(".") : path;  // the parent of a relative name
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return ErrnoError("cannot open directory", dir, errno, "check its permissions");
  int rc = ::fsync(dfd);
  int err = errno;
  ::close(dfd);
  if (rc != 0) return ErrnoError("cannot fsync directory", dir, err, "check the file system");
  return Status::Ok();
}

Status WriteIndexCreatingMarker(const fs::path& index, const std::string& uuid,
                                const std::function<void()>& before_rename) {
  const fs::path tmp = index / (std::string(kIndexCreatingMarker) + ".tmp"), final_path = index / kIndexCreatingMarker;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return ErrnoError("cannot create the index creation marker", tmp, errno, "check the index directory's permissions");
  }
  const std::string text = uuid + "\n";
  const bool wrote = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!wrote) return ErrnoError("cannot write the index creation marker", tmp, err, "check the file system");
  if (before_rename) before_rename();
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  if (ec) return Status::IoError(fmt::format("cannot rename '{}' to '{}': {}", tmp.string(), final_path.string(), ec.message()));
  return SyncDirectory(index);
}

bool IndexCreatingMarkerNames(const fs::path& index, const std::string& uuid) {
  std::ifstream in(index / kIndexCreatingMarker);
  std::string line;
  return in && std::getline(in, line) && line == uuid;
}

bool OnlyIndexCreatingMarkers(const fs::path& index) {
  std::error_code ec;
  for (const auto& e : ListDir(index, &ec))
    if (!e.path().filename().string().starts_with(kIndexCreatingMarker)) return false;
  return !ec;
}

bool OnlyOwnIndexCreatingMarkers(const fs::path& index, const std::string& uuid) {
  const std::string marker(kIndexCreatingMarker), tmp = marker + ".tmp";
  std::error_code ec;
  for (const auto& e : ListDir(index, &ec)) {
    const std::string name = e.path().filename().string();
    if ((name != marker && name != tmp) || !fs::is_regular_file(e.symlink_status(ec))) return false;
    std::ifstream in(e.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.eof() && !in) return false;
    if (text != uuid + "\n" && !(name == tmp && text.empty())) return false;
  }
  return !ec;
}

Status RemoveIndexCreatingMarkers(const fs::path& index) {
  for (const std::string& name : {std::string(kIndexCreatingMarker) + ".tmp", std::string(kIndexCreatingMarker)}) {
    std::error_code ec;
    fs::remove(index / name, ec);
    if (ec) return Status::IoError(fmt::format("cannot remove '{}': {}", (index / name).string(), ec.message()));
  }
  return Status::Ok();
}

}  // namespace terrace::nvme
