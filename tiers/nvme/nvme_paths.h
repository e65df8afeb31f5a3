// Where an NVMe store's files are, from its options: shared by open, scan and rebuild.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>

#include "terrace/options.h"
#include "terrace/status.h"

namespace terrace::nvme {

struct StorePaths {
  std::filesystem::path data;      // terrace.data, or the block device
  std::filesystem::path creating;  // terrace.data.creating (directory stores only)
  std::filesystem::path index;     // the RocksDB index directory
  bool block_device = false;
};

// Checks options.path (a directory or a block device; a block device needs index_dir). With
// `may_create`, a missing directory is created; otherwise it is NotFound.
Result<StorePaths> ResolveStorePaths(const NvmeTierOptions& options, bool may_create);

// The size of an open data area in bytes: a block device's (BLKGETSIZE64), else the file's
// (fstat). Returns 0 or the errno of the failed call.
int DataAreaBytes(int fd, bool block_device, std::uint64_t* bytes);

// flock(fd, op | LOCK_NB), retried for up to `patience` while it fails with EWOULDBLOCK: a
// process that just died may hold the lock a moment longer (io_uring drops its file references
// asynchronously). Returns 0 or the errno of the last attempt.
int LockDataArea(int fd, int op, std::chrono::milliseconds patience);

}  // namespace terrace::nvme
