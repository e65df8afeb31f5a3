#include "tiers/nvme/nvme_paths.h"

#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include <cerrno>
#include <thread>

#include <fmt/format.h>

namespace terrace::nvme {

namespace fs = std::filesystem;

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
    p.index = options.index_dir;
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
  p.index = options.index_dir.empty() ? path / "index" : options.index_dir;
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

}  // namespace terrace::nvme
