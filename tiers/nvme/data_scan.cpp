// NvmeTier::ScanDataFile and NvmeTier::RebuildIndex: the data file read as the source of truth.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <rocksdb/write_batch.h>

#include <fmt/format.h>

#include "src/common/clock.h"
#include "src/common/list_dir.h"
#include "tiers/nvme/group_commit.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/lock_holders.h"
#include "tiers/nvme/nvme_paths.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace {

namespace fs = std::filesystem;
using nvme::kUnit;

namespace {

constexpr std::uint64_t kScanChunk = 8 << 20;  // bytes read per pread
// What a scan or a rebuild that refused changed: a refusal's status ends with it.
constexpr std::string_view kNothingChanged = "; nothing was changed";
// What to do with a store part of which another Terrace version wrote.
constexpr std::string_view kUseWritingVersion =
    "use the Terrace version that wrote this store to open, scan or recover it";

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

struct Found {
  BlockKey key;
  nvme::Record rec;
};

Status ErrnoStatus(std::string_view what, const fs::path& p, int err) {
  return Status::IoError(fmt::format("{} '{}': {}", what, p.string(), std::strerror(err)));
}

// Opens and locks the data area, reads its superblock.
Status OpenData(const nvme::StorePaths& paths, bool exclusive, std::chrono::milliseconds lock_wait, Fd* fd,
                nvme::Superblock* sb, std::uint64_t* size) {
  fd->fd = ::open(paths.data.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd->fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      return Status::NotFound(fmt::format("'{}' does not exist: there is no Terrace store to scan there",
                                          paths.data.string()));
    }
    return ErrnoStatus("cannot open the NVMe data file", paths.data, err);
  }
  if (int err = nvme::LockDataArea(fd->fd, exclusive ? LOCK_EX : LOCK_SH, lock_wait); err != 0) {
    if (err == EWOULDBLOCK) return nvme::DataAreaInUse(paths.data, fd->fd, "", "close that process first");
    return ErrnoStatus("cannot lock the NVMe data file", paths.data, err);
  }
  if (int err = nvme::DataAreaBytes(fd->fd, paths.block_device, size); err != 0) {
    return ErrnoStatus(paths.block_device ? "cannot read the size of" : "cannot stat", paths.data, err);
  }
  std::vector<std::byte> unit(nvme::kSuperblockBytes);
  ssize_t got = ::pread(fd->fd, unit.data(), unit.size(), 0);
  if (got < 0) return ErrnoStatus("cannot read the superblock of", paths.data, errno);
  unit.resize(static_cast<std::size_t>(got));
  TERRACE_ASSIGN_OR_RETURN(*sb, nvme::Superblock::DecodeUnit(unit, paths.data.string()));
  if (*size < sb->capacity_bytes) return nvme::ShorterThanCapacity(paths, *size, sb->capacity_bytes);
  return Status::Ok();
}

Status ReadFull(int fd, std::byte* buf, std::uint64_t len, std::uint64_t offset, const fs::path& p) {
  std::uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, buf + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(fmt::format("cannot read {} bytes at offset {} of", len, offset + done), p, errno);
    if (n == 0) return Status::IoError(fmt::format("unexpected end of '{}' at offset {}", p.string(), offset + done));
    done += static_cast<std::uint64_t>(n);
  }
  return Status::Ok();
}

// True when `r` (an index record: untrusted) lies in `sb`'s data area and its block bytes read
// back from `fd` and match its checksum (`buf`: scratch).
bool BlockReadsBack(int fd, const fs::path& path, const nvme::Superblock& sb, const nvme::Record& r,
                    std::vector<std::byte>* buf) {
  if (!r.FitsDataArea(sb.data_start, sb.capacity_bytes)) return false;
  buf->resize(r.length);
  return ReadFull(fd, buf->data(), r.length, r.offset, path).ok() && Checksum(*buf) == r.checksum;
}

// Why a scan stops at `at` of `path`: an intact descriptor of another desc_version, `version`. Its
// extent is not free space, so neither a scan's report nor an index rebuilt from it may leave it out.
Status OtherVersionDescriptor(const fs::path& path, std::uint64_t at, std::uint16_t version) {
  return Status::InvalidArgument(
      fmt::format("NVMe data file '{}' holds an extent descriptor written by another Terrace version (at byte offset "
                  "{}: desc_version {}, its desc_check valid; this build reads desc_version {}), so this build cannot "
                  "tell which of its space is free; {}{}",
                  path.string(), at, version, nvme::kDescVersion, kUseWritingVersion, kNothingChanged));
}

// The scan proper: every valid descriptor of `sb`'s store whose data matches, resolved to the
// newest extent per key. Fills `report` (except seconds). InvalidArgument, at the first intact
// descriptor of another desc_version with this store's uuid (OtherVersionDescriptor); one with
// another uuid is counted as foreign.
Status Scan(int fd, const fs::path& path, const nvme::Superblock& sb, const ScanProgressFn& progress,
            std::vector<Found>* out, DataScanReport* report) {
  const std::uint64_t begin = sb.data_start, end = sb.capacity_bytes;
  ::posix_fadvise(fd, static_cast<off_t>(begin), static_cast<off_t>(end - begin), POSIX_FADV_SEQUENTIAL);
  std::vector<std::byte> chunk(kScanChunk), spill;
  std::vector<Found> cands;
  for (std::uint64_t pos = begin; pos < end; pos += kScanChunk) {
    const std::uint64_t n = std::min<std::uint64_t>(kScanChunk, end - pos);
    TERRACE_RETURN_IF_ERROR(ReadFull(fd, chunk.data(), n, pos, path));
    report->bytes_scanned += n;
    for (std::uint64_t u = 0; u < n; u += kUnit) {
      const std::span<const std::byte> unit(chunk.data() + u, kUnit);
      if (auto other = nvme::Descriptor::OtherVersion(unit)) {
        if (other->uuid == sb.uuid) return OtherVersionDescriptor(path, pos + u, other->version);
        ++report->foreign;
        continue;
      }
      auto d = nvme::Descriptor::Decode(unit);
      if (!d) {
        if (nvme::Descriptor::HasMagic(unit)) ++report->damaged;
        continue;
      }
      if (d->uuid != sb.uuid) {
        ++report->foreign;
        continue;
      }
      ++report->descriptors;
      const std::uint64_t at = pos + u;
      const nvme::Record& r = d->rec;
      auto note_corrupt = [&] {
        ++report->corrupt;
        if (report->corrupt_keys.size() < DataScanReport::kMaxKeys) report->corrupt_keys.push_back(d->key.ToString());
      };
      if (r.offset % kUnit != 0 || r.offset < begin || r.length > end || r.descriptor_offset() != at) {
        note_corrupt();  // a descriptor that does not describe the extent it ends
        continue;
      }
      std::uint64_t sum;
      if (r.offset >= pos) {
        sum = Checksum(std::span<const std::byte>(chunk.data() + (r.offset - pos), r.length));
      } else {
        spill.resize(r.length);
        TERRACE_RETURN_IF_ERROR(ReadFull(fd, spill.data(), r.length, r.offset, path));
        sum = Checksum(spill);
      }
      if (sum != r.checksum) {
        note_corrupt();
        continue;
      }
      report->max_generation = std::max(report->max_generation, r.generation);
      cands.push_back({d->key, r});
    }
    if (progress) progress(pos + n - begin, end - begin);
  }
  // Overlapping extents: the newer one was written into space released by the older one (whose
  // descriptor should have been cleared); keep the higher generation.
  std::sort(cands.begin(), cands.end(), [](const Found& a, const Found& b) { return a.rec.offset < b.rec.offset; });
  std::vector<Found> kept;
  kept.reserve(cands.size());
  for (Found& f : cands) {
    bool keep = true;
    while (!kept.empty() && f.rec.offset < kept.back().rec.offset + kept.back().rec.extent_bytes()) {
      ++report->superseded;
      if (kept.back().rec.generation < f.rec.generation) {
        kept.pop_back();
      } else {
        keep = false;
        break;
      }
    }
    if (keep) kept.push_back(f);
  }
  // Newest generation per key.
  std::unordered_map<BlockKey, std::size_t> newest;
  newest.reserve(kept.size());
  out->clear();
  for (Found& f : kept) {
    auto [it, inserted] = newest.try_emplace(f.key, out->size());
    if (inserted) {
      out->push_back(f);
      continue;
    }
    ++report->superseded;
    if ((*out)[it->second].rec.generation < f.rec.generation) (*out)[it->second] = f;
  }
  report->blocks = out->size();
  for (const Found& f : *out) report->bytes_in_blocks += f.rec.length;
  return Status::Ok();
}

}  // namespace

std::string DataScanReport::ToString() const {
  std::string s = fmt::format(
      "{} blocks ({} bytes) in {} descriptors; {} corrupt extents skipped, {} superseded, {} of another store, "
      "{} damaged descriptors; {} bytes scanned in {:.2f} s",
      blocks, bytes_in_blocks, descriptors, corrupt, superseded, foreign, damaged, bytes_scanned, seconds);
  if (!corrupt_keys.empty()) s += fmt::format("; first corrupt: {}", fmt::join(corrupt_keys, ", "));
  return s;
}

std::string RebuildReport::ToString() const {
  return fmt::format("rebuilt the index with {} blocks; {} corrupt extents skipped; {} bytes scanned; {:.2f} s{}{}{}{}",
                     blocks_indexed, corrupt_skipped, bytes_scanned, seconds,
                     kept_from_old_index == 0
                         ? std::string()
                         : fmt::format("; {} blocks kept from the old index (descriptor damaged or missing, data good)",
                                       kept_from_old_index),
                     (lost_from_old_index == 0 ? std::string()
                                               : fmt::format("; {} blocks the old index listed are {} (that version "
                                                             "intact nowhere in the data file): {}",
                                                             lost_from_old_index,
                                                             old_index_stale ? "possibly lost (the old index is behind "
                                                                               "the data file: erased since, or lost)"
                                                                             : "lost",
                                                             fmt::join(lost_keys, ", "))) +
                         (old_records_unreadable == 0
                              ? std::string()
                              : fmt::format("; {} records of the old index unreadable", old_records_unreadable)),
                     cut_commit_entries == 0
                         ? std::string()
                         : fmt::format("; {} entries from the old index's last commit, cut short before its "
                                       "descriptors",
                                       cut_commit_entries),
                     moved_aside.empty() ? std::string()
                                         : fmt::format("; the old index was moved to '{}'", moved_aside.string()));
}

Result<DataScanReport> NvmeTier::ScanDataFile(
    const NvmeTierOptions& options,
    const std::function<void(const BlockKey&, const BlockDesc&, std::uint64_t generation, std::uint64_t offset)>&
        on_block,
    const ScanProgressFn& progress) {
  const auto start = std::chrono::steady_clock::now();
  TERRACE_ASSIGN_OR_RETURN(nvme::StorePaths paths, nvme::ResolveStorePaths(options, /*may_create=*/false));
  Fd fd;
  nvme::Superblock sb;
  std::uint64_t size = 0;
  TERRACE_RETURN_IF_ERROR(OpenData(paths, /*exclusive=*/false, options.lock_wait, &fd, &sb, &size));
  if (options.capacity_bytes != 0 && options.capacity_bytes != sb.capacity_bytes) {
    return Status::InvalidArgument(fmt::format("Terrace store '{}' has capacity {} but the options give {}; give the "
                                               "original capacity (or 0: as recorded)",
                                               paths.data.string(), sb.capacity_bytes, options.capacity_bytes));
  }
  DataScanReport report;
  std::vector<Found> found;
  TERRACE_RETURN_IF_ERROR(Scan(fd.fd, paths.data, sb, progress, &found, &report));
  if (on_block) {
    for (const Found& f : found) {
      on_block(f.key, BlockDesc{f.rec.length, f.rec.codec, f.rec.checksum}, f.rec.generation, f.rec.offset);
    }
  }
  report.seconds = SecondsSince(start);
  return report;
}

namespace {

// True when another process holds `dir`'s RocksDB LOCK (it has that index open read-write).
bool IndexLockHeld(const fs::path& dir) {
  const fs::path lock = dir / "LOCK";
  Fd f;
  f.fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (f.fd < 0) return false;
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  return ::fcntl(f.fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

// What the index directory held before a rebuild.
struct OldIndex {
  enum class Kind {
    kNone,        // absent, or an empty directory
    kOurs,        // a RocksDB index whose manifest names this store (`idx`: open read-only)
    kOtherStore,  // a RocksDB index whose manifest names another store (`owner`)
    kOtherCopy,   // this store's manifest, but more than one commit ahead of the data file
                  // (`commit`): the index of a copy of the store that went on alone
    kUnreadable,  // anything else: damaged, no manifest, not RocksDB, not a directory
  };
  Kind kind = Kind::kNone;
  std::unique_ptr<nvme::IndexStore> idx;
  std::string owner;
  std::uint64_t commit = 0;
};

OldIndex LookAtOldIndex(const fs::path& dir, const nvme::Superblock& sb, const std::shared_ptr<Logger>& logger) {
  OldIndex old;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (!fs::exists(st)) return old;
  old.kind = OldIndex::Kind::kUnreadable;
  if (!fs::is_directory(st)) return old;
  if (fs::is_empty(dir, ec) && !ec) {
    old.kind = OldIndex::Kind::kNone;
    return old;
  }
  nvme::IndexOpenOptions io;
  io.read_only = true;  // writes nothing into a directory that may not be this store's
  io.logger = logger;
  auto idx = nvme::IndexStore::Open(dir, io);
  if (!idx.ok()) return old;
  auto m = (*idx)->ReadManifest();
  if (!m.ok() || !m->has_value()) return old;
  auto ms = nvme::Superblock::Decode(std::as_bytes(std::span((*m)->data(), (*m)->size())), "manifest");
  if (!ms.ok()) return old;
  if (!ms->SameStore(sb)) {
    old.kind = OldIndex::Kind::kOtherStore;
    old.owner = ms->UuidString();
    return old;
  }
  // A store's commits never leave its index two ahead of its superblock (nvme_open.cpp).
  if (auto commit = (*idx)->ReadCommit(); commit.ok() && *commit > sb.indexed_commit + 1) {
    old.kind = OldIndex::Kind::kOtherCopy;
    old.commit = *commit;
    return old;
  }
  old.kind = OldIndex::Kind::kOurs;
  old.idx = std::move(*idx);
  return old;
}

using RebuildRefusal = NvmeTier::RebuildRefusal;

// What to give instead of an index directory a rebuild refuses.
constexpr std::string_view kGiveIndexDir = "give this store's index directory, or a new or empty one";

// A refusal of `path` (`in_the_way`: see RebuildRefusal) for `reason`, its status `make` (a Status
// factory) of "<reason>; <fix>; nothing was changed".
RebuildRefusal Refusal(Status (*make)(std::string), fs::path path, bool in_the_way, std::string reason,
                       std::string_view fix, std::vector<fs::path> strays = {}) {
  Status status = make(fmt::format("{}; {}{}", reason, fix, kNothingChanged));
  return RebuildRefusal{std::move(path), in_the_way, std::move(reason), std::move(status), std::move(strays)};
}

// Why the existing, non-empty `dir` may not be moved aside as this store's old index; nullopt when
// it may: a directory of nothing but files an index (RocksDB) writes, not another store's index (by
// its manifest), held open by no other process, and - when it does not open as this store's index -
// with a RocksDB CURRENT or MANIFEST file. InvalidArgument (Unavailable when open elsewhere);
// `strays` lists every entry an index never writes when moving them out is all it takes.
std::optional<RebuildRefusal> IndexDirRefusal(const fs::path& dir, const OldIndex& old, const nvme::Superblock& sb) {
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(dir, ec))) {
    return Refusal(Status::InvalidArgument, dir, false,
                   fmt::format("the index path '{}' is not a directory, so it is not a Terrace index", dir.string()),
                   kGiveIndexDir);
  }
  if (old.kind == OldIndex::Kind::kOtherStore) {
    return Refusal(Status::InvalidArgument, dir, false,
                   fmt::format("the index directory '{}' holds the index of another store ({}), not of this one ({})",
                               dir.string(), old.owner, sb.UuidString()),
                   kGiveIndexDir);
  }
  if (old.kind == OldIndex::Kind::kOtherCopy) {
    return Refusal(Status::InvalidArgument, dir, false,
                   fmt::format("the index directory '{}' holds {} group commits but this data file recorded {}: "
                               "it is the index of a copy of this store (copies keep the store's uuid) that was "
                               "used on its own, not this data file's",
                               dir.string(), old.commit, sb.indexed_commit),
                   kGiveIndexDir);
  }
  bool rocksdb_files = false, index_files = false;
  std::vector<fs::path> strays;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!nvme::IsIndexStoreFileName(name) || !fs::is_regular_file(it->symlink_status(ec))) {
      strays.push_back(it->path());
      continue;
    }
    index_files = true;
    rocksdb_files = rocksdb_files || name == "CURRENT" || name.starts_with("MANIFEST-");
  }
  if (ec) {
    const std::string reason = fmt::format("cannot list the index directory '{}': {}", dir.string(), ec.message());
    return RebuildRefusal{dir, false, reason, Status::IoError(reason), {}};
  }
  const bool recognised = old.kind == OldIndex::Kind::kOurs || rocksdb_files;
  if (!strays.empty()) {
    // Moved out, they leave an index this check accepts, or an empty directory.
    const bool moving_lifts = (recognised || !index_files) && !IndexLockHeld(dir);
    std::string reason = fmt::format(
        "the index directory '{}' holds '{}', which an index never writes, so it is not a Terrace index",
        dir.string(), strays.front().filename().string());
    if (!moving_lifts) strays.clear();
    return Refusal(Status::InvalidArgument, dir, false, std::move(reason), kGiveIndexDir, std::move(strays));
  }
  if (!recognised) {
    return Refusal(Status::InvalidArgument, dir, false,
                   fmt::format("the index directory '{}' has no RocksDB CURRENT or MANIFEST file, so it is not "
                               "recognisably an index",
                               dir.string()),
                   fmt::format("{} (if it is this store's damaged index, move it aside yourself first)",
                               kGiveIndexDir));
  }
  if (IndexLockHeld(dir)) {
    return Refusal(Status::Unavailable, dir, false,
                   fmt::format("the index directory '{}' is open in another process (its LOCK is held)", dir.string()),
                   "close that process first");
  }
  return std::nullopt;
}

// Why the old index `old` (this store's, open) refuses a rebuild: it holds intact block records of
// another record_version, which a rebuild would leave out (InvalidArgument); nullopt when it holds
// none it could read (an index that cannot be read through is not used by the rebuild).
std::optional<RebuildRefusal> OtherVersionRecordsRefusal(const fs::path& dir, const OldIndex& old) {
  if (!old.idx) return std::nullopt;
  nvme::OtherVersionRecords other;
  (void)old.idx->Scan([&](std::string_view k, std::string_view v) {
    if (nvme::IsBookkeepingKey(k)) return;
    other.Note(nvme::Record::Decode(std::as_bytes(std::span(v.data(), v.size()))).status(), k);
  });
  if (other.count() == 0) return std::nullopt;
  RebuildRefusal r = Refusal(Status::InvalidArgument, dir, false,
                             fmt::format("the index directory '{}' {}", dir.string(), other.Describe()),
                             kUseWritingVersion);
  r.another_version = true;
  return r;
}

// Every reason the index directory `dir`, where LookAtOldIndex found `old`, refuses a rebuild.
std::vector<RebuildRefusal> OldIndexRefusals(const fs::path& dir, const OldIndex& old, const nvme::Superblock& sb) {
  std::vector<RebuildRefusal> out;
  if (old.kind == OldIndex::Kind::kNone) return out;
  if (auto r = IndexDirRefusal(dir, old, sb)) out.push_back(std::move(*r));
  if (auto r = OtherVersionRecordsRefusal(dir, old)) out.push_back(std::move(*r));
  return out;
}

// A group commit the old index holds but the data file's superblock does not (cut short between
// its index write and its descriptors, with no read-write open since, which would have finished
// it): its puts' descriptors may be missing and its released extents' descriptors still there.
// When the old index is one commit ahead with a redo record, the scan's result is brought to that
// commit: blocks found at the released extents are dropped, and each key it put takes the old
// index's record, if that record's data reads back good. `redo` keeps the record so the new index
// stays one commit ahead with it (the next read-write open then writes the descriptors, as it
// would have for the old index); `changed` counts the entries that changed. Anything unreadable:
// nothing is changed (the scan stands).
struct CutCommit {
  std::size_t changed = 0;
  std::optional<std::string> redo;
};

CutCommit FinishCutCommit(const nvme::IndexStore& idx, const fs::path& data_path, int fd, const nvme::Superblock& sb,
                          const std::shared_ptr<Logger>& logger, std::vector<Found>* found) {
  CutCommit cut;
  auto commit = idx.ReadCommit();
  auto bytes = idx.ReadRedo();
  if (!commit.ok() || *commit != sb.indexed_commit + 1 || !bytes.ok() || !bytes->has_value()) return cut;
  auto redo = nvme::GroupCommitter::DecodeRedo(**bytes);
  if (!redo.ok()) return cut;
  cut.redo = **bytes;
  std::unordered_set<std::uint64_t> released;
  for (const nvme::Extent& e : redo->released) released.insert(e.offset);
  std::erase_if(*found, [&](const Found& f) {
    const bool drop = released.count(f.rec.offset) > 0;
    cut.changed += drop ? 1 : 0;
    return drop;
  });
  std::unordered_map<BlockKey, std::size_t> at;
  for (std::size_t i = 0; i < found->size(); ++i) at[(*found)[i].key] = i;
  std::vector<std::byte> data;
  for (const BlockKey& k : redo->keys) {
    auto rec = idx.ReadRecord(k);
    if (!rec.ok() || !rec->has_value()) continue;  // erased again in the same commit
    const nvme::Record& r = **rec;
    if (!BlockReadsBack(fd, data_path, sb, r, &data)) continue;
    auto it = at.find(k);
    if (it != at.end() && (*found)[it->second].rec == r) continue;
    if (it != at.end()) {
      (*found)[it->second].rec = r;
    } else {
      at[k] = found->size();
      found->push_back({k, r});
    }
    ++cut.changed;
  }
  if (cut.changed > 0)
    logger->Log(LogLevel::kWarning, "nvme",
                fmt::format("'{}': the last group commit was cut short before its descriptors; the rebuild follows "
                            "the old index's record of it ({} entries) and leaves it for the next read-write open to "
                            "finish",
                            data_path.string(), cut.changed));
  return cut;
}

// `redo` with `kept`'s keys and released extents added (a new redo record when there is none).
std::string MergedRedo(const std::optional<std::string>& redo, nvme::GroupCommitter::Redo kept) {
  if (redo) {
    auto pending = nvme::GroupCommitter::DecodeRedo(*redo);  // FinishCutCommit decoded it already
    if (pending.ok()) {
      kept.keys.insert(kept.keys.begin(), pending->keys.begin(), pending->keys.end());
      kept.released.insert(kept.released.begin(), pending->released.begin(), pending->released.end());
    }
  }
  return nvme::GroupCommitter::EncodeRedo(kept);
}

// The old index's records the scan did not find (a damaged or missing descriptor) or found only
// in an older generation, taken when the index is not behind the data file (its commit counter at
// least the superblock's: a stale index could name blocks erased since), the extent lies in the
// data area and overlaps no other kept extent, and the data passes its checksum. Returns them as
// a pending commit's redo record: the keys taken (their descriptors are still damaged or missing)
// and the extents of the older generations they replace (whose descriptors are still there), for
// the next read-write open to write and clear, so a later rebuild finds them without this index.
nvme::GroupCommitter::Redo KeepOldIndexRecords(const nvme::IndexStore& idx, const fs::path& data_path, int fd,
                                               const nvme::Superblock& sb, std::vector<Found>* found,
                                               RebuildReport* report) {
  nvme::GroupCommitter::Redo kept;
  // An index behind the data file (or whose commit counter does not read) may name blocks erased
  // since: none of its records is kept, and what it lists that the new index lacks is only
  // reported, as possibly lost.
  auto commit = idx.ReadCommit();
  report->old_index_stale = !commit.ok() || *commit < sb.indexed_commit;
  std::vector<Found> records;
  Status scanned = idx.Scan([&](std::string_view k, std::string_view v) {
    if (nvme::IsBookkeepingKey(k)) return;
    auto key = BlockKey::Decode(std::as_bytes(std::span(k.data(), k.size())));
    auto rec = nvme::Record::Decode(std::as_bytes(std::span(v.data(), v.size())));
    if (key.ok() && rec.ok()) {
      records.push_back({*key, *rec});
    } else {
      ++report->old_records_unreadable;
    }
  });
  if (!scanned.ok()) return kept;
  std::unordered_map<BlockKey, std::size_t> at;
  std::map<std::uint64_t, std::uint64_t> extents;  // offset -> end of every kept extent
  for (std::size_t i = 0; i < found->size(); ++i) {
    const nvme::Record& r = (*found)[i].rec;
    at[(*found)[i].key] = i;
    extents[r.offset] = r.offset + r.extent_bytes();
  }
  // True when [off, end) meets a kept extent other than the one at `except`.
  auto overlaps = [&](std::uint64_t off, std::uint64_t end, std::optional<std::uint64_t> except) {
    auto it = extents.lower_bound(off);
    if (it != extents.begin()) {
      auto prev = std::prev(it);
      if (prev->second > off && prev->first != except) return true;
    }
    for (; it != extents.end() && it->first < end; ++it) {
      if (it->first != except) return true;
    }
    return false;
  };
  std::vector<std::byte> data;
  for (const Found& f : records) {
    if (report->old_index_stale) break;
    const nvme::Record& r = f.rec;
    if (!r.FitsDataArea(sb.data_start, sb.capacity_bytes)) continue;  // before `overlaps` reads its extent
    auto it = at.find(f.key);
    std::optional<std::uint64_t> replaces;
    if (it != at.end()) {
      const nvme::Record& cur = (*found)[it->second].rec;
      if (cur == r || cur.generation >= r.generation) continue;
      replaces = cur.offset;
    }
    if (overlaps(r.offset, r.offset + r.extent_bytes(), replaces)) continue;
    if (!BlockReadsBack(fd, data_path, sb, r, &data)) continue;
    if (replaces) {
      nvme::Record& older = (*found)[it->second].rec;
      kept.released.push_back({older.offset, older.extent_bytes()});
      extents.erase(*replaces);
      older = r;
    } else {
      at[f.key] = found->size();
      found->push_back(f);
    }
    extents[r.offset] = r.offset + r.extent_bytes();
    kept.keys.push_back(f.key);
  }
  // What the old index listed that the new one will not: blocks whose listed version is intact
  // nowhere (gone, or only an older version of it found). A record that describes a found block of
  // another key (the same extent, generation and checksum) is a damaged record, not a lost block.
  std::set<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>> held;  // offset, generation, checksum
  for (const Found& f : *found) held.emplace(f.rec.offset, f.rec.generation, f.rec.checksum);
  std::unordered_set<BlockKey> lost;
  for (const Found& f : records) {
    if (held.contains({f.rec.offset, f.rec.generation, f.rec.checksum})) continue;
    auto now = at.find(f.key);
    const bool gone = now == at.end() || (*found)[now->second].rec.generation < f.rec.generation;
    if (gone && lost.insert(f.key).second) {
      ++report->lost_from_old_index;
      if (report->lost_keys.size() < RebuildReport::kMaxKeys) report->lost_keys.push_back(f.key.ToString());
    }
  }
  return kept;
}

// Why `building` is not what a rebuild of this store left, nullopt when it is: a real directory
// holding nothing but index files, with Terrace's creation marker naming the store (unfinished) or,
// without a marker, a manifest naming it (finished); or one that is empty or holds only the marker
// and/or its .tmp naming the store (unfinished: killed between creating the directory and the
// marker's rename). Sets *finished when it is. InvalidArgument (IoError when it cannot be listed).
std::optional<RebuildRefusal> BuildingRefusal(const fs::path& building, const nvme::Superblock& sb,
                                              const std::shared_ptr<Logger>& logger, bool* finished) {
  auto refuse = [&](std::string_view why) {
    return Refusal(Status::InvalidArgument, building, true,
                   fmt::format("'{}' is in the way of the rebuild and is not an unfinished rebuild of this store's "
                               "index ({})",
                               building.string(), why),
                   "move it away and run the rebuild again");
  };
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(building, ec))) return refuse("not a directory");
  for (fs::directory_iterator it(building, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!nvme::IsIndexStoreFileName(name) || !fs::is_regular_file(it->symlink_status(ec))) {
      return refuse(fmt::format("it holds '{}', which an index never writes", name));
    }
  }
  if (ec) {
    const std::string reason = fmt::format("cannot list '{}': {}", building.string(), ec.message());
    return RebuildRefusal{building, true, reason, Status::IoError(reason), {}};
  }
  if (nvme::OnlyOwnIndexCreatingMarkers(building, sb.UuidString()) ||
      nvme::IndexCreatingMarkerNames(building, sb.UuidString())) {
    *finished = false;
    return std::nullopt;
  }
  const OldIndex look = LookAtOldIndex(building, sb, logger);
  if (look.kind == OldIndex::Kind::kOurs && !fs::exists(building / nvme::kIndexCreatingMarker, ec)) {
    *finished = true;
    return std::nullopt;
  }
  return refuse("neither Terrace's marker of an unfinished index of this store nor a manifest of this store is in it");
}

// What a rebuild killed before it finished left (docs/nvme-format.md, "Scan and rebuild"): a
// finished new index whose rename into place was cut off (the old index already moved aside) is
// put in place; anything else of it is removed (the old index is still in place, or there was
// none). Only a directory BuildingRefusal accepts is touched.
Status TakeUpInterruptedRebuild(const fs::path& index, const nvme::Superblock& sb,
                                const std::shared_ptr<Logger>& logger, const RebuildStepFn& at_step) {
  const fs::path building = nvme::RebuildingIndexPath(index);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(building, ec))) return Status::Ok();
  bool finished = false;
  if (auto refusal = BuildingRefusal(building, sb, logger, &finished)) return refusal->status;
  if (finished && !fs::exists(fs::symlink_status(index, ec))) {
    fs::rename(building, index, ec);
    if (ec) {
      return Status::IoError(fmt::format("cannot rename the rebuilt index '{}' to '{}': {}", building.string(),
                                         index.string(), ec.message()));
    }
    logger->Log(LogLevel::kWarning, "nvme",
                fmt::format("put the index '{}' an interrupted rebuild finished into place as '{}'", building.string(),
                            index.string()));
    TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(index.parent_path()));
    if (at_step) at_step("leftover-put-in-place");
    return Status::Ok();
  }
  logger->Log(LogLevel::kWarning, "nvme",
              fmt::format("removing '{}', left by an interrupted rebuild of the index", building.string()));
  // BuildingRefusal saw nothing but index files in it.
  for (const auto& e : ListDir(building, &ec)) {
    if (!ec) fs::remove(e.path(), ec);
  }
  if (!ec) fs::remove(building, ec);
  if (ec) return Status::IoError(fmt::format("cannot remove '{}': {}", building.string(), ec.message()));
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(index.parent_path()));
  if (at_step) at_step("leftover-removed");
  return Status::Ok();
}

// Renames the old index `index` to "<index>.damaged-<UTC stamp>[-n]" and syncs the directory.
Result<fs::path> MoveOldIndexAside(const fs::path& index, const std::shared_ptr<Logger>& logger) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%S", &tm);
  std::error_code ec;
  fs::path target = index;
  target += fmt::format(".damaged-{}", stamp);
  for (int i = 1; fs::exists(fs::symlink_status(target, ec)); ++i) {
    target = index;
    target += fmt::format(".damaged-{}-{}", stamp, i);
  }
  fs::rename(index, target, ec);
  if (ec) {
    return Status::IoError(fmt::format("cannot move the old index '{}' aside to '{}': {}; the new index is complete in "
                                       "'{}' and the next rebuild puts it in place",
                                       index.string(), target.string(), ec.message(),
                                       nvme::RebuildingIndexPath(index).string()));
  }
  logger->Log(LogLevel::kWarning, "nvme",
              fmt::format("moved the old index '{}' aside to '{}'", index.string(), target.string()));
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(index.parent_path()));
  return target;
}

// Writes the new index into `dir` (created here, marked unfinished until its last record is
// synced and it is closed): `found`'s records, the manifest, the commit counter and `redo`.
Status WriteNewIndex(const fs::path& dir, const nvme::Superblock& sb, const std::vector<Found>& found,
                     const std::optional<std::string>& redo, const std::shared_ptr<Logger>& logger,
                     const RebuildStepFn& at_step) {
  std::error_code ec;
  fs::create_directory(dir, ec);
  if (ec) {
    return Status::IoError(fmt::format("cannot create the directory '{}' for the new index: {}", dir.string(),
                                       ec.message()));
  }
  if (at_step) at_step("directory");
  TERRACE_RETURN_IF_ERROR(nvme::WriteIndexCreatingMarker(dir, sb.UuidString(), [&] {
    if (at_step) at_step("marker-tmp");
  }));
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(dir.parent_path()));
  if (at_step) at_step("building");
  nvme::IndexOpenOptions io;
  io.create = true;
  io.logger = logger;
  TERRACE_ASSIGN_OR_RETURN(auto index, nvme::IndexStore::Open(dir, io));
  TERRACE_RETURN_IF_ERROR(index->WriteManifest(sb));
  if (at_step) at_step("manifest");
  constexpr std::size_t kBatch = 4096;
  rocksdb::WriteBatch batch;
  for (std::size_t i = 0; i < found.size(); ++i) {
    batch.Put(nvme::IndexStore::EncodeKey(found[i].key), nvme::IndexStore::EncodeRecord(found[i].rec));
    if (batch.Count() >= kBatch) {
      TERRACE_RETURN_IF_ERROR(index->Write(&batch, /*sync=*/false));
      batch.Clear();
      if (at_step) at_step("records");
    }
  }
  // The commit counter the data file recorded: the rebuilt index holds at least that history. A
  // cut-short last commit, and the records kept from the old index, stay pending, one commit ahead
  // with a redo record, so the next read-write open writes their descriptors (a later rebuild,
  // before that, follows it again).
  batch.Put(rocksdb::Slice(nvme::kCommitKey.data(), nvme::kCommitKey.size()),
            nvme::IndexStore::EncodeCommit(sb.indexed_commit + (redo ? 1 : 0)));
  if (redo) batch.Put(rocksdb::Slice(nvme::kRedoKey.data(), nvme::kRedoKey.size()), *redo);
  TERRACE_RETURN_IF_ERROR(index->Write(&batch, /*sync=*/true));
  if (at_step) at_step("last-record");
  TERRACE_RETURN_IF_ERROR(index->Close());
  if (at_step) at_step("closed");
  TERRACE_RETURN_IF_ERROR(nvme::RemoveIndexCreatingMarkers(dir));
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(dir));
  if (at_step) at_step("finished");
  return Status::Ok();
}

}  // namespace

Result<std::vector<NvmeTier::RebuildRefusal>> NvmeTier::RebuildTargetRefusals(const NvmeTierOptions& options) {
  TERRACE_ASSIGN_OR_RETURN(nvme::StorePaths paths, nvme::ResolveStorePaths(options, /*may_create=*/false));
  Fd fd;
  nvme::Superblock sb;
  std::uint64_t size = 0;
  TERRACE_RETURN_IF_ERROR(OpenData(paths, /*exclusive=*/false, options.lock_wait, &fd, &sb, &size));
  return RebuildRefusals(paths.index, sb, LoggerOrDefault(options.logger));
}

std::vector<NvmeTier::RebuildRefusal> NvmeTier::RebuildRefusals(const fs::path& index, const nvme::Superblock& sb,
                                                                const std::shared_ptr<Logger>& logger) {
  std::vector<RebuildRefusal> out;
  std::error_code ec;
  const fs::path building = nvme::RebuildingIndexPath(index);
  bool finished = false;
  if (fs::exists(fs::symlink_status(building, ec))) {
    if (auto r = BuildingRefusal(building, sb, logger, &finished)) out.push_back(std::move(*r));
  }
  for (RebuildRefusal& r : OldIndexRefusals(index, LookAtOldIndex(index, sb, logger), sb)) out.push_back(std::move(r));
  return out;
}

Status NvmeTier::CheckIndexDirForRebuild(const fs::path& index, const nvme::Superblock& sb,
                                         const std::shared_ptr<Logger>& logger) {
  const std::vector<RebuildRefusal> refusals = RebuildRefusals(index, sb, logger);
  if (refusals.size() <= 1) return refusals.empty() ? Status::Ok() : refusals.front().status;
  std::string all = fmt::format("a rebuild is refused for {} reasons:", refusals.size());
  for (std::size_t i = 0; i < refusals.size(); ++i) {
    std::string_view one = refusals[i].status.message();
    if (one.ends_with(kNothingChanged)) one.remove_suffix(kNothingChanged.size());
    all += fmt::format(" ({}) {};", i + 1, one);
  }
  all.pop_back();
  all += kNothingChanged;
  return refusals.front().status.IsInvalidArgument() ? Status::InvalidArgument(all)
         : refusals.front().status.code() == Code::kUnavailable ? Status::Unavailable(all)
                                                     : Status::IoError(all);
}

Result<RebuildReport> NvmeTier::RebuildIndex(const NvmeTierOptions& options, const ScanProgressFn& progress,
                                             const RebuildStepFn& at_step) {
  const auto start = std::chrono::steady_clock::now();
  if (options.read_only) {
    return Status::InvalidArgument(fmt::format("rebuilding the index of '{}' writes a new index; it cannot be done "
                                               "read-only",
                                               options.path.string()));
  }
  TERRACE_ASSIGN_OR_RETURN(nvme::StorePaths paths, nvme::ResolveStorePaths(options, /*may_create=*/false));
  Fd fd;
  nvme::Superblock sb;
  std::uint64_t size = 0;
  TERRACE_RETURN_IF_ERROR(OpenData(paths, /*exclusive=*/true, options.lock_wait, &fd, &sb, &size));
  if (options.capacity_bytes != 0 && options.capacity_bytes != sb.capacity_bytes) {
    return Status::InvalidArgument(fmt::format("Terrace store '{}' has capacity {} but the options give {}; give the "
                                               "original capacity (or 0: as recorded)",
                                               paths.data.string(), sb.capacity_bytes, options.capacity_bytes));
  }
  auto logger = LoggerOrDefault(options.logger);
  RebuildReport report;
  // Only this store's index directory is moved aside: never a user's folder, a file given as the
  // index, or another store's index. Checked before the scan (hours on a large device) and before
  // anything is written.
  TERRACE_RETURN_IF_ERROR(CheckIndexDirForRebuild(paths.index, sb, logger));
  TERRACE_RETURN_IF_ERROR(TakeUpInterruptedRebuild(paths.index, sb, logger, at_step));
  OldIndex old = LookAtOldIndex(paths.index, sb, logger);  // what TakeUpInterruptedRebuild may have put in place
  if (auto refusals = OldIndexRefusals(paths.index, old, sb); !refusals.empty()) return refusals.front().status;
  std::vector<Found> found;
  TERRACE_RETURN_IF_ERROR(Scan(fd.fd, paths.data, sb, progress, &found, &report.scan));
  CutCommit cut;
  if (old.idx) {
    cut = FinishCutCommit(*old.idx, paths.data, fd.fd, sb, logger, &found);
    report.cut_commit_entries = cut.changed;
    nvme::GroupCommitter::Redo kept = KeepOldIndexRecords(*old.idx, paths.data, fd.fd, sb, &found, &report);
    report.kept_from_old_index = kept.keys.size();
    (void)old.idx->Close();
    if (!kept.keys.empty()) cut.redo = MergedRedo(cut.redo, std::move(kept));
    if (report.kept_from_old_index > 0) {
      logger->Log(LogLevel::kWarning, "nvme",
                  fmt::format("'{}': {} blocks whose descriptor is damaged or missing were kept from the old index "
                              "(their data passes its checksum); the next read-write open writes their descriptors",
                              paths.data.string(), report.kept_from_old_index));
    }
  }

  // Crash-safe order (docs/nvme-format.md, "Scan and rebuild"): the new index is complete and
  // synced beside the old one before the old one is moved aside; a kill at any point leaves either
  // the old index in place or a finished new one that the next rebuild puts in place.
  const fs::path building = nvme::RebuildingIndexPath(paths.index);
  TERRACE_RETURN_IF_ERROR(WriteNewIndex(building, sb, found, cut.redo, logger, at_step));
  if (old.kind != OldIndex::Kind::kNone) {
    TERRACE_ASSIGN_OR_RETURN(report.moved_aside, MoveOldIndexAside(paths.index, logger));
    if (at_step) at_step("moved-aside");
  }
  std::error_code ec;
  fs::rename(building, paths.index, ec);  // replaces an empty index directory
  if (ec) {
    return Status::IoError(fmt::format("cannot rename the new index '{}' to '{}': {}; the next rebuild puts it in place",
                                       building.string(), paths.index.string(), ec.message()));
  }
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(paths.index.parent_path()));
  if (at_step) at_step("in-place");
  report.blocks_indexed = found.size();
  for (const Found& f : found) report.bytes_indexed += f.rec.length;
  report.corrupt_skipped = report.scan.corrupt;
  report.bytes_scanned = report.scan.bytes_scanned;
  report.seconds = SecondsSince(start);
  report.scan.seconds = report.seconds;
  logger->Log(LogLevel::kInfo, "nvme", fmt::format("'{}': {}", paths.data.string(), report.ToString()));
  return report;
}

}  // namespace terrace
