#include "tiers/nvme/index_store.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <exception>

#include <fmt/format.h>

namespace terrace::nvme {

Status IndexStore::FromRocks(const void* rocks_status, std::string_view what) const {
  const auto& s = *static_cast<const rocksdb::Status*>(rocks_status);
  if (s.ok()) return Status::Ok();
  std::string msg = fmt::format("NVMe index {} at '{}': {}", what, dir_.string(), s.ToString());
  if (s.IsCorruption()) return Status::Corruption(msg + "; the index is damaged: restore it or delete the store directory");
  if (s.IsIOError()) return Status::IoError(msg, s.IsTryAgain() || s.IsBusy());
  return Status::IoError(msg);
}

Result<std::unique_ptr<IndexStore>> IndexStore::Open(const std::filesystem::path& dir, bool create, rocksdb::Env* env) {
  rocksdb::Options opts;
  if (env) opts.env = env;
  opts.create_if_missing = create;
  opts.error_if_exists = false;
  opts.paranoid_checks = true;
  opts.compression = rocksdb::kNoCompression;
  opts.max_open_files = 256;
  opts.info_log_level = rocksdb::WARN_LEVEL;
  opts.keep_log_file_num = 2;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s;
  try {
    s = rocksdb::DB::Open(opts, dir.string(), &db);
  } catch (const std::exception& e) {
    return Status::IoError(fmt::format("NVMe index at '{}': RocksDB threw: {}", dir.string(), e.what()));
  }
  if (!s.ok()) {
    std::string msg = fmt::format("NVMe index at '{}' cannot be opened: {}", dir.string(), s.ToString());
    if (s.IsCorruption() || s.IsInvalidArgument()) {
      return Status::Corruption(msg + "; this is not a valid Terrace index (damaged or foreign files): "
                                      "restore it from a backup or delete the store directory to start empty");
    }
    return Status::IoError(msg + "; check that the directory exists, is writable and is not opened by another process");
  }
  return std::unique_ptr<IndexStore>(new IndexStore(dir, db));
}

IndexStore::~IndexStore() { delete db_; }

Result<std::optional<std::string>> IndexStore::ReadManifest() const {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(kManifestKey.data(), kManifestKey.size()), &value);
  if (s.IsNotFound()) return std::optional<std::string>();
  TERRACE_RETURN_IF_ERROR(FromRocks(&s, "manifest read"));
  return std::optional<std::string>(std::move(value));
}

Status IndexStore::WriteManifest(const Superblock& sb) {
  std::string v(kSuperblockHeaderBytes, '\0');
  sb.EncodeTo(reinterpret_cast<std::byte*>(v.data()));
  rocksdb::WriteBatch batch;
  batch.Put(rocksdb::Slice(kManifestKey.data(), kManifestKey.size()), v);
  return Write(&batch, /*sync=*/true);
}

Status IndexStore::Write(rocksdb::WriteBatch* batch, bool sync) {
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status s = db_->Write(wo, batch);
  return FromRocks(&s, "write");
}

Status IndexStore::DeleteKeys(std::span<const std::string> keys) {
  rocksdb::WriteBatch batch;
  for (const std::string& k : keys) batch.Delete(k);
  return Write(&batch, /*sync=*/true);
}

Status IndexStore::Scan(const std::function<void(std::string_view, std::string_view)>& fn) const {
  rocksdb::ReadOptions ro;
  ro.fill_cache = false;
  ro.readahead_size = 2 * 1024 * 1024;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    rocksdb::Slice k = it->key(), v = it->value();
    fn(std::string_view(k.data(), k.size()), std::string_view(v.data(), v.size()));
  }
  rocksdb::Status s = it->status();
  return FromRocks(&s, "scan");
}

std::string IndexStore::EncodeKey(const BlockKey& key) {
  std::string out(BlockKey::kEncodedSize, '\0');
  key.EncodeTo(reinterpret_cast<std::byte*>(out.data()));
  return out;
}

std::string IndexStore::EncodeRecord(const Record& rec) {
  std::string out(kRecordBytes, '\0');
  rec.EncodeTo(reinterpret_cast<std::byte*>(out.data()));
  return out;
}

}  // namespace terrace::nvme
