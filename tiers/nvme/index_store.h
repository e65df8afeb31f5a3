// The persistent index of the NVMe tier: a RocksDB database (default <dir>/index/) mapping
// BlockKey::EncodeTo (25 bytes) -> Record (48 bytes), plus the manifest under kManifestKey and
// the commit counter under kCommitKey. It is a cache of the data file's descriptors: the data
// file alone can rebuild it (NvmeTier::RebuildIndex).
//
// Deliberate RocksDB settings (docs/nvme-format.md, "The index"):
// - WAL recovery mode kTolerateCorruptedTailRecords: an incomplete record at the end of the log (a
//   write torn by a crash, never acknowledged) is dropped; any other damage makes Open fail with
//   Corruption instead of silently truncating history (RocksDB's default point-in-time mode).
// - avoid_flush_during_recovery: Open never rewrites or deletes the log it recovered from, so a
//   refused index keeps its evidence. The memtable is flushed on Close instead, and a read-write
//   Close retires the recovered logs even when nothing was written (RetireRecoveredLogs), so the
//   logs do not pile up one per open.
// - allow_fallocate off, 4 MiB memtables and table files (kIndexBufferBytes): RocksDB's defaults
//   preallocate ~74 MB per log and table, enough to fill a small file system.
// - RocksDB's own LOG goes to the tier's logger, not a file in the index directory: on a full
//   file system a failed LOG write makes RocksDB 7.x abort on the next one.
// After a write error the store is marked failed: no further call reaches RocksDB except the
// final close (without a flush).
// RocksDB's types stay inside this file pair and group_commit; no exception escapes.
// Thread-safety: all methods may be called concurrently (RocksDB is thread-safe).
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "src/common/mutex.h"
#include "terrace/block.h"
#include "terrace/log.h"
#include "terrace/status.h"
#include "tiers/nvme/format.h"

namespace rocksdb {
class DB;
class Env;
class WriteBatch;
}  // namespace rocksdb

namespace terrace::nvme {

// The index's RocksDB memtable and table file size (write_buffer_size, target_file_size_base).
// With allow_fallocate off, this bounds the free space a flush needs (docs/nvme-format.md, "RocksDB
// settings, and why").
inline constexpr std::uint64_t kIndexBufferBytes = 4ull << 20;

struct IndexOpenOptions {
  bool create = false;     // create the database if it does not exist
  bool read_only = false;  // rocksdb::DB::OpenForReadOnly: nothing is written to the directory
  rocksdb::Env* env = nullptr;     // null: rocksdb::Env::Default(); not owned, must outlive the store
  std::shared_ptr<Logger> logger;  // receives RocksDB's warnings and errors; null: LoggerOrDefault
};

class IndexStore {
 public:
  static Result<std::unique_ptr<IndexStore>> Open(const std::filesystem::path& dir, const IndexOpenOptions& options);
  ~IndexStore();  // Close() if not yet closed; errors are logged

  const std::filesystem::path& path() const { return dir_; }

  // The manifest bytes, or nullopt when the key is absent.
  Result<std::optional<std::string>> ReadManifest() const;
  Status WriteManifest(const Superblock& sb);
  // The commit counter (0 when absent).
  Result<std::uint64_t> ReadCommit() const;
  // The last group commit's redo record (kRedoKey), or nullopt when absent (a store whose commits
  // predate redo records).
  Result<std::optional<std::string>> ReadRedo() const;
  // The record of `key`, or nullopt when the index has none.
  Result<std::optional<Record>> ReadRecord(const BlockKey& key) const;

  // Applies `batch` atomically; with `sync`, the RocksDB WAL is fsync'ed before returning.
  // After a failure the store is failed: this and every later write return that failure.
  Status Write(rocksdb::WriteBatch* batch, bool sync);

  // Deletes `keys` in one synced batch.
  Status DeleteKeys(std::span<const std::string> keys);

  // Visits every entry in key order (manifest and commit counter included). Stops at the first
  // RocksDB error.
  Status Scan(const std::function<void(std::string_view key, std::string_view value)>& fn) const;

  // Flushes the memtable (unless read-only or failed) and closes the database. Idempotent.
  Status Close();
  bool failed() const { return failed_.load(); }

  static std::string EncodeKey(const BlockKey& key);
  static std::string EncodeRecord(const Record& rec);
  static std::string EncodeCommit(std::uint64_t commit);

 private:
  IndexStore(std::filesystem::path dir, rocksdb::DB* db, bool read_only)
      : dir_(std::move(dir)), db_(db), read_only_(read_only) {}
  Status FromRocks(const void* rocks_status, std::string_view what) const;
  // Close's step after its flush: when more than one write-ahead log is live (logs recovered at
  // open and kept), makes a flush retire them. The index's content is unchanged.
  Status RetireRecoveredLogs();
  // The value of `key`, or nullopt when absent; `what` names the read in errors.
  Result<std::optional<std::string>> ReadOptional(std::string_view key, std::string_view what) const;

  std::filesystem::path dir_;
  rocksdb::DB* db_;  // owned; null once closed
  bool read_only_;
  std::atomic<bool> failed_{false};
  mutable Mutex failure_mu_;
  Status failure_ TERRACE_GUARDED_BY(failure_mu_);  // the first write failure
};

// True for the index keys that hold no block record: the manifest, the commit counter, the redo record.
inline bool IsBookkeepingKey(std::string_view key) {
  return key == kManifestKey || key == kCommitKey || key == kRedoKey;
}

// An encoded block key (an index key) for messages: BlockKey::ToString, or hex when it does not decode.
std::string EncodedKeyText(std::string_view encoded_key);

// The intact block records of another record_version met while reading an index (Record::Decode's
// InvalidArgument): another Terrace version wrote them, so whoever meets one refuses and changes
// nothing (never drops, skips or overwrites such a record, nor reuses its extent).
class OtherVersionRecords {
 public:
  // True when `decoded`, Record::Decode's status for the value at `encoded_key`, is that of an
  // intact record of another version: it is counted, and the first one kept for Describe.
  bool Note(const Status& decoded, std::string_view encoded_key);
  std::uint64_t count() const { return count_; }
  // "holds N block records written by another Terrace version (<the first: its version, the
  // version this build reads, its key>)".
  std::string Describe() const;

 private:
  std::uint64_t count_ = 0;
  Status first_;
};

// The marker an index directory holds while its store is being created (docs/nvme-format.md,
// "Creation"), written through "<marker>.tmp".
inline constexpr std::string_view kIndexCreatingMarker = "TERRACE-INDEX-CREATING";

// True for the name of a file an index directory may hold: one RocksDB writes (CURRENT, IDENTITY,
// LOCK, LOG*, MANIFEST-*, OPTIONS-*, *.log, *.sst, *.blob, *.ldb, *.dbtmp, *.tmp) or Terrace's
// creation marker. Every other name in an index directory was put there by someone else. Decides
// on the name alone: the caller checks that the entry is a regular file.
bool IsIndexStoreFileName(std::string_view name);

// Removes the RocksDB files in `dir` (rocksdb::DestroyDB): only for an index Terrace itself
// half-created (an interrupted store creation).
Status DestroyIndexFiles(const std::filesystem::path& dir);

}  // namespace terrace::nvme
