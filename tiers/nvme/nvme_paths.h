// Where an NVMe store's files are, from its options: shared by open, scan and rebuild.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "terrace/options.h"
#include "terrace/status.h"

namespace terrace::nvme {

struct StorePaths {
  std::filesystem::path data;      // terrace.data, or the block device
  std::filesystem::path creating;  // terrace.data.creating (directory stores only)
  std::filesystem::path index;     // the RocksDB index directory
  bool block_device = false;
};

// Where RebuildIndex builds a new index before renaming it into place: "<index>.rebuilding", beside
// the index (same directory, so the rename is atomic).
std::filesystem::path RebuildingIndexPath(const std::filesystem::path& index);

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

// The Corruption for a data area of `size` bytes, shorter than the store's `capacity`: what is
// intact and how to get the blocks left back (for a file: extend it and rebuild the index).
Status ShorterThanCapacity(const StorePaths& paths, std::uint64_t size, std::uint64_t capacity);

// fsync of the directory `dir` (makes a rename or creation in it durable).
Status SyncDirectory(const std::filesystem::path& dir);

// The index creation marker (kIndexCreatingMarker, docs/nvme-format.md, "Creation"): written into
// an index directory, durable, before RocksDB creates anything there, and removed once the index is
// complete (a new store's: its manifest written; a rebuild's: its last record synced). It names
// the store (`uuid`, Superblock::UuidString), so Terrace removes an unfinished index's files only
// when it made them. Written through "<marker>.tmp" and a rename; the directory is synced.
// `before_rename` (optional; tests' kill points) runs once the .tmp is written, before its rename.
Status WriteIndexCreatingMarker(const std::filesystem::path& index, const std::string& uuid,
                                const std::function<void()>& before_rename = {});
// The marker in `index` exists and names the store `uuid`.
bool IndexCreatingMarkerNames(const std::filesystem::path& index, const std::string& uuid);
// `index` holds nothing but creation markers (an index killed before RocksDB made anything).
bool OnlyIndexCreatingMarkers(const std::filesystem::path& index);
// `index` is empty, or holds nothing but the marker and/or its .tmp, each naming the store `uuid`
// (the .tmp may also be empty: cut off between its creation and its write). An index directory of
// store `uuid` killed before the marker, or before RocksDB made anything.
bool OnlyOwnIndexCreatingMarkers(const std::filesystem::path& index, const std::string& uuid);
// Removes the marker (and its .tmp) from `index`; absent ones are fine.
Status RemoveIndexCreatingMarkers(const std::filesystem::path& index);

}  // namespace terrace::nvme
