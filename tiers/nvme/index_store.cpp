#include "tiers/nvme/index_store.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <cstdarg>
#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include "src/common/list_dir.h"

namespace terrace::nvme {
namespace {

// RocksDB's info log, forwarded to the tier's logger (warnings and worse only).
class ForwardingRocksLogger final : public rocksdb::Logger {
 public:
  ForwardingRocksLogger(std::shared_ptr<terrace::Logger> logger, std::string dir)
      : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL), logger_(std::move(logger)), dir_(std::move(dir)) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override { Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap); }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
    char buf[1024];
    std::vsnprintf(buf, sizeof buf, format, ap);
    logger_->Log(level >= rocksdb::InfoLogLevel::ERROR_LEVEL ? LogLevel::kError : LogLevel::kWarning, "nvme",
                 fmt::format("index '{}' (RocksDB): {}", dir_, buf));
  }

 private:
  std::shared_ptr<terrace::Logger> logger_;
  std::string dir_;
};

}  // namespace

Status IndexStore::FromRocks(const void* rocks_status, std::string_view what) const {
  const auto& s = *static_cast<const rocksdb::Status*>(rocks_status);
  if (s.ok()) return Status::Ok();
  std::string msg = fmt::format("NVMe index {} at '{}': {}", what, dir_.string(), s.ToString());
  if (s.IsCorruption()) {
    return Status::Corruption(msg + "; the index is damaged");  // NvmeTier adds the exact recover command
  }
  if (s.IsNoSpace() || s.ToString().find("No space left") != std::string::npos) {
    return Status::IoError(msg + fmt::format("; the file system holding '{}' is full: free space on it", dir_.string()));
  }
  if (s.IsIOError()) return Status::IoError(msg, s.IsTryAgain() || s.IsBusy());
  return Status::IoError(msg);
}

Result<std::unique_ptr<IndexStore>> IndexStore::Open(const std::filesystem::path& dir, const IndexOpenOptions& o) {
  rocksdb::Options opts;
  if (o.env) opts.env = o.env;
  opts.create_if_missing = o.create && !o.read_only;
  opts.error_if_exists = false;
  opts.paranoid_checks = true;
  opts.compression = rocksdb::kNoCompression;
  opts.max_open_files = 256;
  // Table files are opened on the calling thread: RocksDB's default starts up to 16 threads for it
  // at open, and a refused thread (a process or thread limit) ends in std::terminate inside it.
  opts.max_file_opening_threads = 1;
  opts.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  opts.avoid_flush_during_recovery = true;
  // Sized for an index of 73-byte records, not RocksDB's defaults: no fallocate (the default
  // preallocates each log to 1.1 x write_buffer_size and each table to 1.1 x target_file_size_base,
  // ~74 MB apiece, and holds a failed preallocation's blocks while the file is open, filling a small
  // file system for other programs too), and 4 MiB memtables and tables, so a flush needs a few MiB.
  opts.allow_fallocate = false;
  opts.write_buffer_size = kIndexBufferBytes;
  opts.target_file_size_base = kIndexBufferBytes;
  opts.info_log = std::make_shared<ForwardingRocksLogger>(LoggerOrDefault(o.logger), dir.string());
  rocksdb::DB* db = nullptr;
  rocksdb::Status s;
  try {
    if (o.read_only) {
      s = rocksdb::DB::OpenForReadOnly(opts, dir.string(), &db, /*error_if_wal_file_exists=*/false);
    } else {
      s = rocksdb::DB::Open(opts, dir.string(), &db);
    }
  } catch (const std::exception& e) {
    return Status::IoError(fmt::format("NVMe index at '{}': RocksDB threw: {}", dir.string(), e.what()));
  }
  if (!s.ok()) {
    std::string msg = fmt::format("NVMe index at '{}' cannot be opened: {}", dir.string(), s.ToString());
    if (s.IsCorruption() || s.IsInvalidArgument()) {
      return Status::Corruption(msg + "; the index is damaged (or holds foreign files)");
    }
    if (s.IsNoSpace() || s.ToString().find("No space left") != std::string::npos) {
      return Status::IoError(msg + fmt::format("; the file system holding '{}' is full: free space on it (a read-only "
                                               "open needs none)",
                                               dir.string()));
    }
    return Status::IoError(msg + "; check that the directory exists, is writable and is not opened by another process");
  }
  return std::unique_ptr<IndexStore>(new IndexStore(dir, db, o.read_only));
}

IndexStore::~IndexStore() {
  (void)Close();
}

Status IndexStore::Close() {
  if (!db_) return Status::Ok();
  Status result;
  if (!read_only_ && !failed_.load()) {
    rocksdb::FlushOptions fo;
    fo.wait = true;
    rocksdb::Status s = db_->Flush(fo);
    result = FromRocks(&s, "flush at close");
    if (result.ok()) result = RetireRecoveredLogs();
  }
  rocksdb::Status c = db_->Close();
  if (result.ok() && !c.ok() && !failed_.load()) result = FromRocks(&c, "close");
  delete db_;
  db_ = nullptr;
  return result;
}

Result<std::optional<std::string>> IndexStore::ReadOptional(std::string_view key, std::string_view what) const {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(key.data(), key.size()), &value);
  if (s.IsNotFound()) return std::optional<std::string>();
  TERRACE_RETURN_IF_ERROR(FromRocks(&s, what));
  return std::optional<std::string>(std::move(value));
}

Result<std::optional<std::string>> IndexStore::ReadManifest() const { return ReadOptional(kManifestKey, "manifest read"); }

Result<std::optional<std::string>> IndexStore::ReadRedo() const { return ReadOptional(kRedoKey, "redo record read"); }

Result<std::optional<Record>> IndexStore::ReadRecord(const BlockKey& key) const {
  TERRACE_ASSIGN_OR_RETURN(auto value, ReadOptional(EncodeKey(key), "record read"));
  if (!value) return std::optional<Record>();
  TERRACE_ASSIGN_OR_RETURN(Record r, Record::Decode(std::as_bytes(std::span(value->data(), value->size()))));
  return std::optional<Record>(r);
}

Status IndexStore::RetireRecoveredLogs() {
  // A flush retires the logs it covers, but RocksDB skips the flush of an empty memtable: a
  // session that recovered logs (kept by avoid_flush_during_recovery) and wrote nothing would
  // leave them, one more per open. Rewriting the commit counter with its own value gives the
  // flush something to cover; the index's content does not change. The logs are counted in the
  // directory: GetSortedWalFiles leaves the recovered ones out.
  std::size_t logs = 0;
  std::error_code ec;
  for (const auto& e : ListDir(dir_, &ec)) logs += e.path().extension() == ".log" ? 1 : 0;
  if (ec || logs <= 1) return Status::Ok();
  std::string value;
  const rocksdb::Slice key(kCommitKey.data(), kCommitKey.size());
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &value);
  if (s.IsNotFound()) return Status::Ok();
  if (!s.ok()) return FromRocks(&s, "read the commit counter at close");
  s = db_->Put(rocksdb::WriteOptions(), key, value);
  if (!s.ok()) return FromRocks(&s, "rewrite the commit counter at close");
  rocksdb::FlushOptions fo;
  fo.wait = true;
  s = db_->Flush(fo);
  return FromRocks(&s, "flush at close");
}

Result<std::uint64_t> IndexStore::ReadCommit() const {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(kCommitKey.data(), kCommitKey.size()), &value);
  if (s.IsNotFound()) return std::uint64_t{0};
  TERRACE_RETURN_IF_ERROR(FromRocks(&s, "commit counter read"));
  if (value.size() != 8) {
    return Status::Corruption(fmt::format("NVMe index at '{}': the commit counter has {} bytes, expected 8",
                                          dir_.string(), value.size()));
  }
  return GetLe(reinterpret_cast<const std::byte*>(value.data()), 8);
}

std::string IndexStore::EncodeCommit(std::uint64_t commit) {
  std::string out(8, '\0');
  PutLe(reinterpret_cast<std::byte*>(out.data()), commit, 8);
  return out;
}

Status IndexStore::WriteManifest(const Superblock& sb) {
  Superblock identity = sb;  // the manifest records who the store is, not its changing state
  identity.sequence = identity.indexed_commit = identity.generation_limit = 0;
  std::string v(kManifestBytes, '\0');
  identity.EncodeTo(reinterpret_cast<std::byte*>(v.data()));
  rocksdb::WriteBatch batch;
  batch.Put(rocksdb::Slice(kManifestKey.data(), kManifestKey.size()), v);
  return Write(&batch, /*sync=*/true);
}

Status IndexStore::Write(rocksdb::WriteBatch* batch, bool sync) {
  if (failed_.load()) {
    MutexLock l(&failure_mu_);
    return failure_;
  }
  if (read_only_) {
    return Status::InvalidArgument(fmt::format("NVMe index at '{}' is open read-only", dir_.string()));
  }
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status s = db_->Write(wo, batch);
  Status st = FromRocks(&s, "write");
  if (!st.ok()) {
    MutexLock l(&failure_mu_);
    if (!failed_.load()) {
      failure_ = st;
      failed_.store(true);
    }
  }
  return st;
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

bool IsIndexStoreFileName(std::string_view name) {
  auto ends = [&](std::string_view e) { return name.ends_with(e); };
  return name == "CURRENT" || name == "IDENTITY" || name == "LOCK" || name.starts_with("LOG") ||
         name.starts_with("MANIFEST-") || name.starts_with("OPTIONS-") || name.starts_with(kIndexCreatingMarker) ||
         ends(".log") || ends(".sst") || ends(".blob") || ends(".dbtmp") || ends(".tmp") || ends(".ldb");
}

Status DestroyIndexFiles(const std::filesystem::path& dir) {
  rocksdb::Options opts;
  opts.info_log = std::make_shared<ForwardingRocksLogger>(LoggerOrDefault(nullptr), dir.string());
  rocksdb::Status s = rocksdb::DestroyDB(dir.string(), opts);
  if (!s.ok()) {
    return Status::IoError(fmt::format("cannot remove the half-created NVMe index '{}': {}", dir.string(), s.ToString()));
  }
  return Status::Ok();
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

std::string EncodedKeyText(std::string_view encoded_key) {
  auto key = BlockKey::Decode(std::as_bytes(std::span(encoded_key.data(), encoded_key.size())));
  if (key.ok()) return key->ToString();
  std::string s;
  for (char c : encoded_key) s += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return s;
}

bool OtherVersionRecords::Note(const Status& decoded, std::string_view encoded_key) {
  if (!decoded.IsInvalidArgument()) return false;
  if (count_++ == 0) first_ = decoded.WithContext("the first, key " + EncodedKeyText(encoded_key));
  return true;
}

std::string OtherVersionRecords::Describe() const {
  return fmt::format("holds {} block records written by another Terrace version ({})", count_, first_.message());
}

}  // namespace terrace::nvme
