// The persistent index of the NVMe tier: a RocksDB database in <dir>/index/ mapping
// BlockKey::EncodeTo (25 bytes) -> Record (48 bytes), plus the manifest under kManifestKey.
// RocksDB's types stay inside this file pair and group_commit; no exception escapes.
// Thread-safety: all methods may be called concurrently (RocksDB is thread-safe).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "terrace/block.h"
#include "terrace/status.h"
#include "tiers/nvme/format.h"

namespace rocksdb {
class DB;
class Env;
class WriteBatch;
}  // namespace rocksdb

namespace terrace::nvme {

class IndexStore {
 public:
  // Opens (or, with `create`, creates) the database at `dir`. `env`: null for rocksdb::Env::Default();
  // not owned, must outlive the IndexStore.
  static Result<std::unique_ptr<IndexStore>> Open(const std::filesystem::path& dir, bool create, rocksdb::Env* env);
  ~IndexStore();

  const std::filesystem::path& path() const { return dir_; }

  // The manifest bytes, or nullopt when the key is absent.
  Result<std::optional<std::string>> ReadManifest() const;
  Status WriteManifest(const Superblock& sb);

  // Applies `batch` atomically; with `sync`, the RocksDB WAL is fsync'ed before returning.
  Status Write(rocksdb::WriteBatch* batch, bool sync);

  // Deletes `keys` in one synced batch.
  Status DeleteKeys(std::span<const std::string> keys);

  // Visits every entry in key order (manifest included). Stops at the first RocksDB error.
  Status Scan(const std::function<void(std::string_view key, std::string_view value)>& fn) const;

  static std::string EncodeKey(const BlockKey& key);
  static std::string EncodeRecord(const Record& rec);

 private:
  IndexStore(std::filesystem::path dir, rocksdb::DB* db) : dir_(std::move(dir)), db_(db) {}
  Status FromRocks(const void* rocks_status, std::string_view what) const;

  std::filesystem::path dir_;
  rocksdb::DB* db_;  // owned
};

}  // namespace terrace::nvme
