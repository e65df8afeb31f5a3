// NvmeTier: opening, creating and recovering a store.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>
#include <sstream>
#include <optional>
#include <random>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/common/clock.h"
#include "src/common/list_dir.h"
#include "tiers/nvme/group_commit.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/lock_holders.h"
#include "tiers/nvme/nvme_paths.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/staging_pool.h"
#include "tiers/nvme/uring_engine.h"

namespace terrace {

namespace fs = std::filesystem;
using nvme::kDataStart;
using nvme::kUnit;

namespace {

// A new random store id.
std::array<std::uint8_t, 16> NewStoreId() {
  std::random_device rd;
  std::array<std::uint8_t, 16> id{};
  for (auto& b : id) b = static_cast<std::uint8_t>(rd());
  return id;
}

constexpr std::size_t kStagingBufferBytes = 1 << 20;
// Generations reserved per superblock write: one durable superblock update per this many puts.
constexpr std::uint64_t kGenerationReserve = 1 << 20;

Status Errno(std::string_view what, const fs::path& path, int err, std::string_view advice) {
  return Status::IoError(fmt::format("{} '{}': {}; {}", what, path.string(), std::strerror(err), advice));
}

bool EmptyOrAbsent(const fs::path& p) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return true;
  return fs::is_directory(p, ec) && fs::is_empty(p, ec);
}

// True when the open `fd` is the file at `path` now (not one renamed or removed since it was opened).
bool FdIsAt(int fd, const fs::path& path) {
  struct stat open_st {}, path_st {};
  return ::fstat(fd, &open_st) == 0 && ::stat(path.c_str(), &path_st) == 0 && open_st.st_dev == path_st.st_dev &&
         open_st.st_ino == path_st.st_ino;
}

// What an interrupted creation left in `dir` besides `creating`: the first entry that is neither
// it nor an empty `index`; nullopt when there is none.
std::optional<std::string> OtherThanCreation(const fs::path& dir, const fs::path& creating, const fs::path& index) {
  std::error_code ec;
  for (const auto& e : ListDir(dir, &ec)) {
    if (e.path().filename() == creating.filename()) continue;
    std::error_code same_ec;
    if (fs::equivalent(e.path(), index, same_ec) && EmptyOrAbsent(index)) continue;
    return e.path().filename().string();
  }
  if (ec) return fmt::format("(cannot list it: {})", ec.message());
  return std::nullopt;
}

}  // namespace

std::string RecoveryReport::ToString() const {
  std::string s = fmt::format("{} blocks recovered ({} bytes) of {} index records; dropped {} (malformed {}, out of "
                              "range {}, overlapping {}, bad checksum {})",
                              blocks_recovered, bytes_in_use, records_scanned, dropped(), dropped_malformed,
                              dropped_out_of_range, dropped_overlap, dropped_checksum);
  if (!dropped_keys.empty()) s += fmt::format("; first dropped: {}", fmt::join(dropped_keys, ", "));
  return s;
}

std::string RecoveryReport::DamagedRecordsText() const {
  return fmt::format("malformed {}, out of range {}, overlapping {}; first: {}", dropped_malformed,
                     dropped_out_of_range, dropped_overlap, fmt::join(dropped_keys, ", "));
}

NvmeTier::NvmeTier(const NvmeTierOptions& options, const NvmeOpenHooks& hooks)
    : options_(options), hooks_(hooks), logger_(LoggerOrDefault(options.logger)) {
  caps_.id = TierId::kNvme;
  caps_.name = "nvme";
  caps_.persistent = true;
  caps_.memory = MemoryKind::kNone;
  caps_.verifies_gets = true;  // GetBatch hashes each block in the caller's buffer
  caps_.io_alignment = static_cast<std::uint32_t>(kUnit);  // aligned reads with room for the rounded tail: no staging
  caps_.read_gap_bytes = static_cast<std::uint32_t>(kUnit);  // an extent is its data, then one descriptor unit
  SetCapacity(options.capacity_bytes);
  sb_unit_ = AlignedBuffer(nvme::kSuperblockBytes, kUnit);
  if (sb_unit_.data()) std::memset(sb_unit_.data(), 0, nvme::kSuperblockBytes);
}

void NvmeTier::SetCapacity(std::uint64_t capacity) {
  options_.capacity_bytes = capacity;
  caps_.capacity_bytes = capacity;
  caps_.max_block_bytes = capacity > kDataStart + kUnit ? capacity - kDataStart - kUnit : 0;
}

void NvmeTier::Warn(std::string message) {
  logger_->Log(LogLevel::kWarning, "nvme", message);
  report_.warnings.push_back(std::move(message));
}

Status NvmeTier::WithRecoverAdvice(Status s) const {
  if (!s.IsCorruption() || s.message().find("terrace store recover --dir") != std::string::npos) return s;
  return Status::Corruption(fmt::format("{}; {}", s.message(), RecoverAdvice()));
}

std::string NvmeTier::RecoverAdvice() const {
  const std::string dir = options_.path.string();
  nvme::Superblock sb;
  {
    MutexLock l(&sb_mu_);
    sb = sb_;
  }
  // The advice is to run what would work: recover refuses an index directory that is not this
  // store's (another store's index, a folder of other files, one open elsewhere), and an
  // "<index>.rebuilding" that is not a killed rebuild of this store; the advice names which. A
  // refused index directory comes first: its remedies (another index directory) leave this one's
  // "<index>.rebuilding" out of the way.
  std::string cmd = fmt::format("terrace store recover --dir {}", dir);
  if (!options_.index_dir.empty()) cmd += fmt::format(" --index-dir {}", options_.index_dir.string());
  const std::vector<RebuildRefusal> refusals = RebuildRefusals(index_path_, sb, logger_);
  // Records of another version: an index rebuilt elsewhere would leave their blocks unprotected,
  // so no other index directory is advised.
  for (const RebuildRefusal& r : refusals) {
    if (!r.another_version) continue;
    return fmt::format("use the Terrace version that wrote this store to recover it, with its `{}` (this build's "
                       "recover refuses '{}': {})",
                       cmd, index_path_.string(), r.reason);
  }
  for (const RebuildRefusal& r : refusals) {
    if (r.in_the_way) continue;
    return fmt::format(
        "give the index directory this store was created with, or run `terrace store recover --dir {} --index-dir "
        "NEW_DIR` with a new or empty NEW_DIR to rebuild the index there from the data file (recover refuses '{}' "
        "itself: {})",
        dir, index_path_.string(), r.reason);
  }
  if (!refusals.empty()) {  // only what lies in the way of the rebuild, not the index directory
    const RebuildRefusal& r = refusals.front();
    return fmt::format("move '{}' away, then run `{}` to rebuild the index from the data file (recover refuses it: "
                       "{})",
                       r.path.string(), cmd, r.reason);
  }
  return fmt::format("run `{}` to rebuild the index from the data file (the damaged index is kept aside)", cmd);
}

NvmeTier::~NvmeTier() {
  if (Status s = Close(); !s.ok()) logger_->Log(LogLevel::kError, "nvme", s.ToString());
}

Status NvmeTier::Close() {
  Status first;
  // The first failure is returned; any later one is logged here.
  auto failed = [&](const Status& s) {
    Status named = s.WithContext(fmt::format("closing '{}'", data_path_.string()));
    if (first.ok()) {
      first = std::move(named);
    } else {
      logger_->Log(LogLevel::kError, "nvme", named.ToString());
    }
  };
  if (committer_) {
    Status s = committer_->Flush();
    if (!s.ok()) {
      failed(s.WithContext("final commit failed"));
    } else if (!index_->failed()) {
      // Record the final commit, durably, so a reopen can tell a complete index from one that lost
      // records, and the next session's index can never get two commits ahead of the superblock.
      MutexLock l(&sb_mu_);
      const std::uint64_t c = committer_->durable_commit();
      Status w;
      if (sb_.indexed_commit != c) {
        sb_.indexed_commit = c;
        w = PersistSuperblockLocked();
      }
      if (w.ok()) w = EngineSync("syncing the superblock of");  // also the last commit's unsynced write
      if (!w.ok()) failed(w);
    }
  }
  committer_.reset();
  if (index_) {
    if (Status s = index_->Close(); !s.ok()) failed(s);
  }
  index_.reset();
  engine_.reset();
  if (fd_ >= 0) {
    // Unlock explicitly: io_uring may still hold a reference to the file for a moment after its
    // rings are torn down, and the lock lives as long as any reference.
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
    fd_ = -1;
  }
  return first;
}

Result<std::unique_ptr<NvmeTier>> NvmeTier::Open(const NvmeTierOptions& options) {
  return OpenWithHooks(options, NvmeOpenHooks{});
}

Result<std::unique_ptr<NvmeTier>> NvmeTier::OpenWithEngine(const NvmeTierOptions& options,
                                                          const nvme::IoEngineFactory& factory) {
  NvmeOpenHooks hooks;
  hooks.engine = factory;
  return OpenWithHooks(options, hooks);
}

Result<std::unique_ptr<NvmeTier>> NvmeTier::OpenWithHooks(const NvmeTierOptions& options, const NvmeOpenHooks& hooks) {
  const auto start = std::chrono::steady_clock::now();
  if (options.path.empty()) {
    return Status::InvalidArgument("NVMe tier: options.path is empty; set it to a directory or a block device");
  }
  if (options.capacity_bytes != 0 &&
      (options.capacity_bytes < kDataStart + 2 * kUnit || options.capacity_bytes % kUnit != 0)) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier '{}': capacity_bytes {} must be a multiple of {} and at least {}", options.path.string(),
        options.capacity_bytes, kUnit, kDataStart + 2 * kUnit));
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096 || options.io_threads == 0 || options.io_threads > 64) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier '{}': queue_depth {} / io_threads {} out of range; use queue_depth 1..4096, io_threads 1..64",
        options.path.string(), options.queue_depth, options.io_threads));
  }
  if (options.durability != Durability::kAsync && options.durability != Durability::kSync) {
    return Status::InvalidArgument(fmt::format("NVMe tier '{}': durability {} is not Durability::kAsync or kSync",
                                               options.path.string(), static_cast<unsigned>(options.durability)));
  }
  if (options.read_only && options.reformat) {
    return Status::InvalidArgument(fmt::format("NVMe tier '{}': read_only and reformat exclude each other",
                                               options.path.string()));
  }
  std::unique_ptr<NvmeTier> t(new NvmeTier(options, hooks));
  {
    MutexLock l(&t->sb_mu_);
    if (!t->sb_unit_.data()) return Status::OutOfCapacity("NVMe tier: cannot allocate 4 KiB for the superblock");
  }
  if (!t->hooks_.engine) t->hooks_.engine = nvme::OpenUringEngine;
  TERRACE_RETURN_IF_ERROR(t->OpenFiles());
  try {
    std::size_t n = std::max<std::size_t>(8, std::min<std::size_t>(options.queue_depth, 64)) * options.io_threads;
    t->staging_ = std::make_unique<nvme::StagingPool>(n, kStagingBufferBytes);
  } catch (const std::bad_alloc&) {
    return Status::OutOfCapacity(fmt::format("NVMe tier '{}': cannot allocate staging buffers", options.path.string()));
  }
  if (Status s = t->engine_->RegisterBuffers(t->staging_->iovecs()); !s.ok()) {
    t->logger_->Log(LogLevel::kWarning, "nvme", fmt::format("'{}': {}", t->data_path_.string(), s.ToString()));
  }
  TERRACE_RETURN_IF_ERROR(t->Recover());
  if (!options.read_only) {
    auto interval = options.durability == Durability::kAsync
                        ? std::max(options.group_commit_interval, std::chrono::microseconds(1))
                        : std::chrono::microseconds(0);
    NvmeTier* raw = t.get();
    TERRACE_ASSIGN_OR_RETURN(t->committer_, nvme::GroupCommitter::Create(
        t->engine_.get(), t->index_.get(),
        [raw](std::vector<nvme::Extent>&& e) { raw->ReleaseExtents(std::move(e)); },
        [raw](std::uint64_t durable_commit) -> Status {
          MutexLock l(&raw->sb_mu_);
          if (raw->sb_.indexed_commit == durable_commit) return Status::Ok();
          raw->sb_.indexed_commit = durable_commit;
          return raw->PersistSuperblockLocked();
        },
        t->index_commit_, interval));
  }
  if (options.verify_on_open) TERRACE_RETURN_IF_ERROR(t->VerifyAllBlocks());
  t->report_.seconds = SecondsSince(start);
  t->logger_->Log(LogLevel::kInfo, "nvme",
                  fmt::format("{} '{}' ({}{} I/O, {} mode, {}): {}; {:.3f} s", t->report_.created ? "created" : "opened",
                              t->data_path_.string(), options.read_only ? "read-only, " : "",
                              t->direct_ ? "O_DIRECT" : "buffered",
                              options.durability == Durability::kSync ? "sync" : "async",
                              t->engine_->fixed_buffers() ? "fixed buffers" : "no fixed buffers", t->report_.ToString(),
                              t->report_.seconds));
  return t;
}

Status NvmeTier::OpenFiles() {
  TERRACE_ASSIGN_OR_RETURN(nvme::StorePaths paths, nvme::ResolveStorePaths(options_, /*may_create=*/
                                                                             options_.create_if_missing &&
                                                                                 !options_.read_only));
  data_path_ = paths.data;
  index_path_ = paths.index;
  creating_path_ = paths.creating;
  block_device_ = paths.block_device;
  if (block_device_) return OpenExisting(/*block_device=*/true);
  // Each look that finds the files changed under it (another process's creation finished or
  // started) or discards a leftover is followed by a fresh one, which sees what is there now.
  constexpr int kMaxLooks = 8;
  for (int look = 0; look < kMaxLooks; ++look) {
    bool again = false;
    Status s = OpenDirectoryStore(&again);
    if (!again) return s;
  }
  return Status::Unavailable(fmt::format(
      "the files in '{}' kept changing while they were opened (other processes creating a store there); close them "
      "and try again",
      options_.path.string()));
}

Status NvmeTier::OpenDirectoryStore(bool* again) {
  std::error_code ec;
  if (fs::exists(data_path_, ec)) return OpenExisting(false);
  if (fs::exists(creating_path_, ec)) {
    if (options_.read_only) {
      return Status::NotFound(fmt::format(
          "'{}' holds no complete Terrace store: a creation was interrupted (terrace.data.creating is left); open it "
          "read-write once to complete or discard it",
          options_.path.string()));
    }
    return ResumeCreation(again);
  }
  if (!EmptyOrAbsent(index_path_)) {
    return Status::Corruption(fmt::format(
        "NVMe tier '{}' has an index ('{}') but no data file 'terrace.data': the store is incomplete; restore "
        "terrace.data, or point --index-dir at an empty directory to start a new store",
        options_.path.string(), index_path_.string()));
  }
  if (!options_.create_if_missing || options_.read_only) {
    return Status::NotFound(fmt::format("'{}' holds no Terrace store (no terrace.data){}", options_.path.string(),
                                        options_.read_only ? " and it is opened read-only" : " and create_if_missing is false"));
  }
  for (const auto& entry : ListDir(options_.path, &ec)) {
    if (fs::equivalent(entry.path(), index_path_, ec)) continue;  // a pre-created empty index directory
    const fs::path name = entry.path().filename();
    const bool ours = name == data_path_.filename() || name == creating_path_.filename();
    if (ours && fs::is_regular_file(entry.symlink_status(ec))) {
      *again = true;  // another process started creating a store here since the checks above
      return Status::Ok();
    }
    return Status::InvalidArgument(fmt::format(
        "'{}' is not empty and holds no Terrace store (no terrace.data; found '{}'{}); point the NVMe tier at an empty "
        "directory or an existing store",
        options_.path.string(), entry.path().filename().string(),
        fs::is_symlink(entry.symlink_status(ec)) ? ", a symbolic link, which Terrace never makes" : ""));
  }
  return CreateInDirectory(again);
}

Status NvmeTier::OpenFd(const fs::path& path, bool create, int* open_errno) {
  if (open_errno) *open_errno = 0;
  const bool ro = options_.read_only;
  int flags = (ro ? O_RDONLY : O_RDWR) | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  // terrace.data.creating is only ever a file Terrace made there: a symbolic link of that name is
  // never followed (it may lead to another store's data file).
  if (path == creating_path_) flags |= O_NOFOLLOW;
  direct_ = options_.direct_io;
  // O_NOATIME: no access-time check and update on every read (a per-I/O kernel cost on the read
  // path). Only the file's owner (or CAP_FOWNER) may set it: without it, open without.
  fd_ = ::open(path.c_str(), flags | O_NOATIME | (direct_ ? O_DIRECT : 0), 0644);
  if (fd_ < 0 && errno == EPERM) fd_ = ::open(path.c_str(), flags | (direct_ ? O_DIRECT : 0), 0644);
  if (fd_ < 0 && direct_ && errno == EINVAL) {
    direct_ = false;
    fd_ = ::open(path.c_str(), flags, 0644);
    if (fd_ >= 0) {
      Warn(fmt::format("the file system under '{}' refused O_DIRECT; using buffered I/O (page cache): durability rests "
                       "on fdatasync alone",
                       path.string()));
    }
  }
  if (fd_ < 0) {
    if (open_errno) *open_errno = errno;
    return Errno("cannot open NVMe data file", path, errno, "check the path and its permissions");
  }
  if (int err = nvme::LockDataArea(fd_, ro ? LOCK_SH : LOCK_EX, options_.lock_wait); err != 0) {
    // The holders are looked up while fd_ is still open: FlockHolderPids finds the file by it.
    Status refused = err == EWOULDBLOCK
                         ? nvme::DataAreaInUse(path, fd_, ro ? " for writing" : "",
                                               "close that process first (one writer per data area; read-only opens "
                                               "may share it)")
                         : Errno("cannot lock NVMe data file", path, err, "check the file system supports flock");
    ::close(fd_);
    fd_ = -1;
    return refused;
  }
  nvme::IoEngineConfig cfg{fd_, options_.queue_depth, options_.io_threads};
  TERRACE_ASSIGN_OR_RETURN(engine_, hooks_.engine(cfg));
  return CheckDurableMedium();
}

Status NvmeTier::CheckDurableMedium() {
  auto check = [&](const fs::path& p, std::string_view what) {
    struct statfs st {};
    fs::path probe = p;
    std::error_code ec;
    while (!probe.empty() && !fs::exists(probe, ec)) probe = probe.parent_path();
    if (probe.empty() || ::statfs(probe.c_str(), &st) != 0) return;
    const auto type = static_cast<unsigned long>(st.f_type);
    if (type == TMPFS_MAGIC || type == RAMFS_MAGIC) {
      Warn(fmt::format("the {} '{}' is on {}, which keeps nothing across a reboot or power loss: 'durable' only "
                       "means it survives a crash of this process; use a persistent file system",
                       what, p.string(), type == TMPFS_MAGIC ? "tmpfs" : "ramfs"));
    }
  };
  if (!block_device_) check(data_path_, "data file");
  check(index_path_, "index");
  return Status::Ok();
}

Status NvmeTier::EngineIo(nvme::IoOp op, std::uint64_t offset, std::byte* buf, std::uint32_t len,
                          std::string_view what) {
  nvme::IoRequest r;
  r.op = op;
  r.offset = offset;
  if (op == nvme::IoOp::kRead) {
    r.buf = buf;
  } else {
    r.src = buf;
  }
  r.len = len;
  int err = 0;
  nvme::RunToCompletion(*engine_, std::span<nvme::IoRequest>(&r, 1), [&](std::size_t, int e) { err = e; });
  if (err == 0) return Status::Ok();
  if (err == -ENOSPC || err == -EDQUOT) {
    return Errno(what, data_path_, -err, "the file system holding it is full: free space on it");
  }
  return Errno(what, data_path_, -err, "check the device and the file system");
}

Status NvmeTier::EngineSync(std::string_view what) {
  int err = engine_->SyncData();
  if (err == 0) return Status::Ok();
  return Errno(what, data_path_, -err, "check the device and the file system");
}

Status NvmeTier::PersistSuperblockLocked() {
  ++sb_.sequence;
  sb_.EncodeIntoUnit(sb_unit_.data());
  return EngineIo(nvme::IoOp::kWrite, 0, sb_unit_.data(), static_cast<std::uint32_t>(nvme::kSuperblockBytes),
                  "writing the superblock of");
}

Status NvmeTier::ReserveGenerations(std::uint64_t upto) {
  MutexLock l(&sb_mu_);
  if (upto < sb_.generation_limit) return Status::Ok();
  const std::uint64_t before = sb_.generation_limit;
  sb_.generation_limit = upto + kGenerationReserve;
  Status s = PersistSuperblockLocked();
  if (s.ok()) s = EngineSync("syncing the superblock of");
  // Not durable: the next put reserves again, so no descriptor ever carries a generation at or
  // above the limit on disk.
  if (!s.ok()) sb_.generation_limit = before;
  return s;
}

// A fresh identity in sb_ and sb_unit_, written through the engine and synced.
Status NvmeTier::WriteFreshSuperblock() {
  MutexLock l(&sb_mu_);
  nvme::Superblock sb;
  sb.uuid = sb_.uuid;
  if (std::all_of(sb.uuid.begin(), sb.uuid.end(), [](std::uint8_t b) { return b == 0; })) sb.uuid = NewStoreId();
  sb.capacity_bytes = options_.capacity_bytes;
  sb.generation_limit = 1;
  sb_ = sb;
  std::memset(sb_unit_.data(), 0, nvme::kSuperblockBytes);  // both slots: nothing of an earlier store survives
  TERRACE_RETURN_IF_ERROR(PersistSuperblockLocked());
  return EngineSync("syncing the superblock of");
}

Status NvmeTier::MakeIndexDirectory() {
  std::error_code ec;
  fs::create_directories(index_path_, ec);
  if (ec) {
    return Status::IoError(fmt::format("cannot create the NVMe index directory '{}': {}; choose a writable location",
                                       index_path_.string(), ec.message()));
  }
  return Status::Ok();
}

Status NvmeTier::CreateIndex() {
  TERRACE_RETURN_IF_ERROR(MakeIndexDirectory());
  // Every caller saw it empty (or cleared it); anything else in it now was put there since, by
  // another process (one creating a store with the same index directory): never shared with it.
  if (!nvme::OnlyOwnIndexCreatingMarkers(index_path_, sb_.UuidString())) {
    return Status::InvalidArgument(fmt::format(
        "creating the NVMe store '{}': its index directory '{}' is no longer empty (another process may be creating "
        "a store with it); nothing was written there; point --index-dir at an empty directory that only this store "
        "uses",
        options_.path.string(), index_path_.string()));
  }
  TERRACE_RETURN_IF_ERROR(nvme::WriteIndexCreatingMarker(index_path_, sb_.UuidString()));
  nvme::IndexOpenOptions io;
  io.create = true;
  io.env = hooks_.index_env;
  io.logger = logger_;
  TERRACE_ASSIGN_OR_RETURN(index_, nvme::IndexStore::Open(index_path_, io));
  TERRACE_RETURN_IF_ERROR(index_->WriteManifest(sb_));
  index_commit_ = 0;
  // The manifest now proves the index is this store's; a marker left by a failed removal is harmless.
  if (Status s = nvme::RemoveIndexCreatingMarkers(index_path_); !s.ok())
    logger_->Log(LogLevel::kWarning, "nvme", s.message() + " (the index is complete; the marker can be deleted)");
  return Status::Ok();
}

std::error_code NvmeTier::DiscardCreating() {
  std::error_code ec;
  fs::remove(creating_path_, ec);
  CloseFd();
  return ec;
}

void NvmeTier::CloseFd() {
  engine_.reset();
  if (fd_ < 0) return;
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
  fd_ = -1;
}

// Directory store (docs/nvme-format.md, "Creation"): terrace.data.creating is created empty and
// its superblock written and synced first, so from its first byte on it is recognisably
// Terrace's; then it is preallocated to the capacity (synced), then the index with its manifest,
// then the rename to terrace.data and a directory fsync. A kill at any point leaves
// terrace.data.creating, which the next open completes or discards (ResumeCreation). *again:
// another process created terrace.data.creating first.
Status NvmeTier::CreateInDirectory(bool* again) {
  const std::uint64_t cap = options_.capacity_bytes;
  if (cap == 0) {
    return Status::InvalidArgument(fmt::format("creating the NVMe store '{}': capacity_bytes is 0; give the capacity of "
                                               "the new store (0 means 'as recorded' and only opens an existing store)",
                                               options_.path.string()));
  }
  int open_errno = 0;
  if (Status s = OpenFd(creating_path_, /*create=*/true, &open_errno); !s.ok()) {
    *again = open_errno == EEXIST;
    return *again ? Status::Ok() : s;
  }
  // Between the open and the lock another process may have taken the new, empty file for a
  // leftover and discarded it.
  if (!FdIsAt(fd_, creating_path_)) {
    CloseFd();
    *again = true;
    return Status::Ok();
  }
  TERRACE_RETURN_IF_ERROR(WriteFreshSuperblock());
  int err = ::fallocate(fd_, 0, 0, static_cast<off_t>(cap)) == 0 ? 0 : errno;
  if (err == EOPNOTSUPP) {
    err = ::ftruncate(fd_, static_cast<off_t>(cap)) == 0 ? 0 : errno;
    if (err == 0) {
      Warn(fmt::format("the file system under '{}' cannot preallocate (fallocate unsupported): the data file is sparse "
                       "and writes can fail when that file system fills up",
                       options_.path.string()));
    }
  }
  if (err != 0) {
    (void)DiscardCreating();  // best effort: the preallocation error is the one reported
    // EFBIG: the file system's (or the process's, RLIMIT_FSIZE) largest file is smaller; free space
    // would not help.
    const std::string need = err == EFBIG ? "files there cannot be that large (the file system's or this process's "
                                            "file size limit): use another file system"
                                          : "the file system holding it needs that much free space: free space on it";
    std::string msg = fmt::format("cannot preallocate {} bytes for NVMe data file '{}': {}; {} or lower the capacity",
                                  cap, data_path_.string(), std::strerror(err), need);
    if (err == ENOSPC || err == EFBIG || err == EDQUOT) return Status::OutOfCapacity(msg);
    return Status::IoError(msg);
  }
  TERRACE_RETURN_IF_ERROR(EngineSync("syncing the preallocated size of"));
  // An index directory that cannot be made (a bad index_dir) ends this creation: the file it
  // preallocated holds no block yet, so it is removed rather than left to leak its capacity.
  if (!index_) {
    if (Status s = MakeIndexDirectory(); !s.ok()) {
      (void)DiscardCreating();
      return s;
    }
  }
  return FinishCreation(true);
}

Status NvmeTier::FinishCreation(bool /*fresh_sb*/) {
  if (hooks_.at_creation_step) hooks_.at_creation_step("index");
  if (!index_) TERRACE_RETURN_IF_ERROR(CreateIndex());
  if (hooks_.at_creation_step) hooks_.at_creation_step("index-created");
  // Only the file this process holds locked is renamed into place. Terrace removes or renames
  // terrace.data.creating only under its lock, so this holds unless something outside Terrace
  // moved it; whatever the name leads to then is not this creation's and is left as it is.
  if (!FdIsAt(fd_, creating_path_)) {
    return Status::Unavailable(fmt::format(
        "creating the NVMe store '{}': '{}' was moved or replaced by something other than this creation while it "
        "ran; nothing was renamed to '{}'; make sure only Terrace uses that directory, then open the store again",
        options_.path.string(), creating_path_.string(), data_path_.string()));
  }
  std::error_code ec;
  fs::rename(creating_path_, data_path_, ec);
  if (ec) {
    return Status::IoError(fmt::format("cannot rename '{}' to '{}': {}; check the directory's permissions",
                                       creating_path_.string(), data_path_.string(), ec.message()));
  }
  TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(data_path_.parent_path()));
  report_.created = true;
  return Status::Ok();
}

Status NvmeTier::NotAnInterruptedCreation(std::string_view what) const {
  return Status::InvalidArgument(fmt::format(
      "options.path '{}' holds 'terrace.data.creating', which {}: it is not an interrupted creation (it may be a "
      "store's data file holding acknowledged blocks), so Terrace left it as it is; if it is this directory's store, "
      "rename it (the file itself, not a link) to 'terrace.data' and open it, or run `terrace store recover --dir {}` "
      "if its index is missing; otherwise move it away or use another directory",
      options_.path.string(), what, options_.path.string()));
}

Status NvmeTier::ResumeCreation(bool* again) {
  const std::string creating = creating_path_.string();
  int open_errno = 0;
  if (Status s = OpenFd(creating_path_, /*create=*/false, &open_errno); !s.ok()) {
    return open_errno == ELOOP ? NotAnInterruptedCreation("is a symbolic link") : s;
  }
  // The lock may have been waited for while its holder finished (renamed the file to terrace.data)
  // or discarded it: what is open is then no longer terrace.data.creating.
  if (!FdIsAt(fd_, creating_path_)) {
    CloseFd();
    *again = true;
    return Status::Ok();
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Errno("cannot stat", creating_path_, errno, "check the file");
  // A creation's file has one name; another name may be a store's data file.
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1) {
    CloseFd();
    return NotAnInterruptedCreation(S_ISREG(st.st_mode)
                                        ? fmt::format("has {} hard links (other names for the same file)", st.st_nlink)
                                        : std::string("is not a regular file"));
  }
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  // Its first unit: a creation writes the superblock there before anything else.
  std::memset(sb_unit_.data(), 0, nvme::kSuperblockBytes);
  if (size >= nvme::kSuperblockBytes) {
    TERRACE_RETURN_IF_ERROR(EngineIo(nvme::IoOp::kRead, 0, sb_unit_.data(),
                                     static_cast<std::uint32_t>(nvme::kSuperblockBytes), "reading the superblock of"));
  } else if (size > 0 && ::pread(fd_, sb_unit_.data(), nvme::kSuperblockBytes, 0) != static_cast<ssize_t>(size)) {
    return Errno("cannot read", creating_path_, errno, "check the file");
  }
  auto sb = nvme::Superblock::DecodeUnit(std::span<const std::byte>(sb_unit_.data(), nvme::kSuperblockBytes), creating);
  const bool blank = std::all_of(sb_unit_.data(), sb_unit_.data() + nvme::kSuperblockBytes,
                                 [](std::byte b) { return b == std::byte{0}; });
  if (!sb.ok() && !blank) {
    return Status::InvalidArgument(fmt::format(
        "options.path '{}' holds 'terrace.data.creating', which was not made by Terrace (it does not start with a "
        "Terrace superblock); Terrace deletes only what it created: move that file away or use another directory",
        options_.path.string()));
  }
  if (blank) {
    // Empty or zeros: a creation killed (or cut by a power loss) before its superblock was durable
    // leaves this, but so could anyone. It is taken as Terrace's only where nothing else is.
    if (auto other = OtherThanCreation(options_.path, creating_path_, index_path_)) {
      return Status::InvalidArgument(fmt::format(
          "options.path '{}' holds an empty or all-zero 'terrace.data.creating' beside '{}': it may not be Terrace's, "
          "so it is left as it is; move it away (or delete it if it is a leftover of Terrace) or use another "
          "directory",
          options_.path.string(), *other));
    }
  } else if (sb->indexed_commit != 0 || sb->generation_limit != 1) {
    // A creation's superblock is the fresh one (WriteFreshSuperblock): nothing committed, no
    // generation reserved. Anything past that is a store that was used.
    CloseFd();
    return NotAnInterruptedCreation(fmt::format(
        "has a superblock of a store that was written to (indexed_commit {}, generation_limit {}; a creation leaves "
        "0 and 1)",
        sb->indexed_commit, sb->generation_limit));
  } else {
    sb_ = *sb;
  }
  if (blank || size < sb_.capacity_bytes) {
    // Killed before the preallocation was durable: nothing else of this store was made yet (the
    // index comes after it). Discard it, then look again (the directory must be empty to create).
    if (!EmptyOrAbsent(index_path_)) {
      return Status::Corruption(fmt::format(
          "NVMe tier '{}' has an interrupted creation that never got to its index, but the index directory '{}' is "
          "not empty; point --index-dir at an empty directory",
          options_.path.string(), index_path_.string()));
    }
    logger_->Log(LogLevel::kInfo, "nvme", fmt::format("discarding '{}' left by an interrupted creation", creating));
    if (std::error_code ec = DiscardCreating())
      return Status::IoError(fmt::format("cannot remove '{}': {}", creating, ec.message()));
    TERRACE_RETURN_IF_ERROR(nvme::SyncDirectory(options_.path));
    *again = true;
    return Status::Ok();
  }
  if (options_.capacity_bytes != 0 && options_.capacity_bytes != sb_.capacity_bytes) {
    return Status::InvalidArgument(fmt::format(
        "'{}' (an interrupted creation) has capacity_bytes={} but the options ask for {}; open it with the original "
        "capacity or delete it",
        creating, sb_.capacity_bytes, options_.capacity_bytes));
  }
  SetCapacity(sb_.capacity_bytes);
  // The index directory was empty when this creation began. What is in it now is removed only when
  // this creation's marker says it made it: the directory may be another one than the creation used
  // (a different --index-dir), and Terrace never deletes what it did not create.
  if (!EmptyOrAbsent(index_path_) && nvme::OnlyIndexCreatingMarkers(index_path_))
    TERRACE_RETURN_IF_ERROR(nvme::RemoveIndexCreatingMarkers(index_path_));  // killed before RocksDB made anything
  if (!EmptyOrAbsent(index_path_)) {
    nvme::IndexOpenOptions io;
    io.env = hooks_.index_env;
    io.logger = logger_;
    io.read_only = true;  // a look for the manifest writes nothing into a directory that may not be ours
    bool same_store = false;
    if (auto idx = nvme::IndexStore::Open(index_path_, io); idx.ok()) {
      auto m = (*idx)->ReadManifest();
      if (m.ok() && m->has_value()) {
        auto ms = nvme::Superblock::Decode(std::as_bytes(std::span((*m)->data(), (*m)->size())), "manifest");
        if (!ms.ok() || !ms->SameStore(sb_)) {
          return Status::Corruption(fmt::format(
              "index '{}' belongs to another store than the interrupted creation '{}'; point --index-dir at an empty "
              "directory",
              index_path_.string(), creating));
        }
        same_store = true;
      }
      TERRACE_RETURN_IF_ERROR((*idx)->Close());
    }
    if (same_store) {
      io.read_only = false;
      TERRACE_ASSIGN_OR_RETURN(index_, nvme::IndexStore::Open(index_path_, io));
      TERRACE_RETURN_IF_ERROR(nvme::RemoveIndexCreatingMarkers(index_path_));
    } else if (!nvme::IndexCreatingMarkerNames(index_path_, sb_.UuidString())) {
      return Status::InvalidArgument(fmt::format(
          "index directory '{}' is not empty and was not made by the interrupted creation '{}' (no Terrace manifest, "
          "no creation marker of store {}); Terrace deletes only what it created: point --index-dir at the directory "
          "that creation used, or at an empty one",
          index_path_.string(), creating, sb_.UuidString()));
    } else {
      logger_->Log(LogLevel::kInfo, "nvme",
                   fmt::format("removing the half-created index '{}' of the interrupted creation '{}'",
                               index_path_.string(), creating));
      TERRACE_RETURN_IF_ERROR(nvme::DestroyIndexFiles(index_path_));
      TERRACE_RETURN_IF_ERROR(nvme::RemoveIndexCreatingMarkers(index_path_));
    }
  }
  logger_->Log(LogLevel::kInfo, "nvme", fmt::format("completing the interrupted creation '{}'", creating));
  return FinishCreation(false);
}

Status NvmeTier::OpenExisting(bool block_device) {
  TERRACE_RETURN_IF_ERROR(OpenFd(data_path_, /*create=*/false));
  std::uint64_t size = 0;
  if (int err = nvme::DataAreaBytes(fd_, block_device, &size); err != 0) {
    return block_device ? Errno("cannot read the size of block device", data_path_, err, "check the device")
                        : Errno("cannot stat", data_path_, err, "check the file");
  }
  if (size < nvme::kSuperblockBytes) {
    return Status::InvalidArgument(
        fmt::format("'{}' is {} bytes: too short to be a Terrace store", data_path_.string(), size));
  }
  TERRACE_RETURN_IF_ERROR(EngineIo(nvme::IoOp::kRead, 0, sb_unit_.data(),
                                   static_cast<std::uint32_t>(nvme::kSuperblockBytes), "reading the superblock of"));
  const bool blank = std::all_of(sb_unit_.data(), sb_unit_.data() + nvme::kSuperblockBytes,
                                 [](std::byte b) { return b == std::byte{0}; });
  if (block_device && blank && !options_.read_only && (options_.create_if_missing || options_.reformat)) {
    // A zero first 4 KiB is not enough to call a device unused: btrfs keeps its superblock at
    // 64 KiB, ZFS and RAID members theirs further in or at the end.
    TERRACE_RETURN_IF_ERROR(CheckDeviceBlank(size));
    if (options_.capacity_bytes == 0) {
      return Status::InvalidArgument(fmt::format("formatting block device '{}' as a new NVMe store: capacity_bytes is "
                                                 "0; give the capacity to use",
                                                 data_path_.string()));
    }
    if (size < options_.capacity_bytes) {
      return Status::OutOfCapacity(fmt::format("block device '{}' has {} bytes, less than capacity_bytes {}",
                                               data_path_.string(), size, options_.capacity_bytes));
    }
    return FormatBlockDevice();
  }
  auto decoded = nvme::Superblock::DecodeUnit(std::span<const std::byte>(sb_unit_.data(), nvme::kSuperblockBytes),
                                              data_path_.string());
  if (!decoded.ok()) {
    // Reformatting overwrites only a Terrace store (one whose superblock slots carry the magic,
    // damaged or not) or an all-zero data file: never what something else wrote there.
    const bool terrace_header = nvme::Superblock::SlotsHaveMagic(
        std::span<const std::byte>(sb_unit_.data(), nvme::kSuperblockBytes));
    if (options_.reformat && !options_.read_only) {
      // A zero first 4 KiB is not enough (a file system image may start with zeros): the first and
      // last MiB must be.
      if (!terrace_header && !(blank && !block_device && CheckDeviceBlank(size).ok())) {
        return decoded.status().WithContext(fmt::format(
            "reformat refused: '{}' does not hold a Terrace store (no TRRCNVME superblock) and is not all zeros, "
            "and Terrace never overwrites what it did not write",
            data_path_.string()));
      }
      if (size >= options_.capacity_bytes && options_.capacity_bytes > 0) return Reformat();
    }
    return decoded.status();
  }
  {
    MutexLock l(&sb_mu_);
    sb_ = *decoded;
  }
  WarnDamagedSuperblockSlots();
  if (options_.reformat) {
    if (options_.capacity_bytes == 0) SetCapacity(sb_.capacity_bytes);
    if (size < options_.capacity_bytes) {
      return Status::OutOfCapacity(fmt::format("'{}' has {} bytes, less than capacity_bytes {}", data_path_.string(),
                                               size, options_.capacity_bytes));
    }
    return Reformat();
  }
  if (options_.capacity_bytes == 0) {
    SetCapacity(sb_.capacity_bytes);
  } else if (sb_.capacity_bytes != options_.capacity_bytes) {
    return Status::InvalidArgument(fmt::format(
        "Terrace store '{}' was created with capacity_bytes={} but the options ask for {}; open it with the "
        "original capacity (or 0: as recorded) or use a new directory",
        data_path_.string(), sb_.capacity_bytes, options_.capacity_bytes));
  }
  if (size < sb_.capacity_bytes) {
    nvme::StorePaths paths;
    paths.data = data_path_;
    paths.block_device = block_device;
    return nvme::ShorterThanCapacity(paths, size, sb_.capacity_bytes);
  }
  return OpenIndexOfExisting();
}

void NvmeTier::WarnDamagedSuperblockSlots() {
  std::array<std::byte, nvme::kSuperblockBytes> unit;
  {
    MutexLock l(&sb_mu_);
    std::memcpy(unit.data(), sb_unit_.data(), unit.size());
  }
  for (std::size_t i = 0; i < 2; ++i) {
    const auto slot = std::span<const std::byte>(unit).subspan(i * nvme::kSuperblockSlotStride, nvme::kSuperblockHeaderBytes);
    if (!nvme::Superblock::SlotsHaveMagic(slot) ||  // an absent slot (never written) is no damage
        nvme::Superblock::Decode(slot, data_path_.string()).ok())
      continue;
    Warn(fmt::format("superblock slot {} of '{}' is damaged (it fails its check: a torn or damaged write of the "
                     "store's header); the other slot, intact, is used, but the header has no second copy until the "
                     "next superblock write of a read-write open replaces the damaged one",
                     i, data_path_.string()));
  }
}

Status NvmeTier::CheckDeviceBlank(std::uint64_t size) {
  constexpr std::uint64_t kEdge = 1 << 20;
  AlignedBuffer buf(kEdge);
  for (const std::uint64_t start : {std::uint64_t{0}, size > kEdge ? size - kEdge : 0}) {
    const std::uint64_t len = std::min(kEdge, size - start) / nvme::kSuperblockBytes * nvme::kSuperblockBytes;
    if (len == 0) continue;
    TERRACE_RETURN_IF_ERROR(EngineIo(nvme::IoOp::kRead, start, buf.data(), static_cast<std::uint32_t>(len),
                                     "checking that it is blank: reading"));
    const std::byte* begin = buf.data();
    const std::byte* end = begin + len;
    const std::byte* hit = std::find_if(begin, end, [](std::byte b) { return b != std::byte{0}; });
    if (hit != end) {
      return Status::InvalidArgument(fmt::format(
          "block device '{}' is not blank: its first 4 KiB are zero but the byte at offset {} is not (a file "
          "system, partition table or RAID member may live there; btrfs, for one, starts at 64 KiB). Terrace "
          "formats only a device whose first and last MiB read as zeros and never overwrites what it did not "
          "write: check the device name; if its contents are yours to lose, clear it yourself (blkdiscard -z {}) "
          "and run again",
          data_path_.string(), start + static_cast<std::uint64_t>(hit - begin), data_path_.string()));
    }
  }
  return Status::Ok();
}

// A blank device: the index and its manifest first, the superblock last, so a kill in between
// leaves a blank device and an index naming the store to be (completed by the next open).
Status NvmeTier::FormatBlockDevice() {
  if (!EmptyOrAbsent(index_path_)) {
    nvme::IndexOpenOptions io;
    io.env = hooks_.index_env;
    io.logger = logger_;
    TERRACE_ASSIGN_OR_RETURN(auto idx, nvme::IndexStore::Open(index_path_, io));
    TERRACE_ASSIGN_OR_RETURN(auto m, idx->ReadManifest());
    TERRACE_ASSIGN_OR_RETURN(std::uint64_t commit, idx->ReadCommit());
    std::optional<nvme::Superblock> ms;
    if (m) {
      auto d = nvme::Superblock::Decode(std::as_bytes(std::span(m->data(), m->size())), "manifest");
      if (d.ok()) ms = *d;
    }
    if (!ms || commit != 0 || ms->capacity_bytes != options_.capacity_bytes) {
      return Status::InvalidArgument(fmt::format(
          "block device '{}' is blank but the index directory '{}' is not empty (it holds another store's index); "
          "point --index-dir at an empty directory",
          data_path_.string(), index_path_.string()));
    }
    // Left by an interrupted format of this device: adopt its identity.
    sb_.uuid = ms->uuid;
    index_ = std::move(idx);
    TERRACE_RETURN_IF_ERROR(WriteFreshSuperblock());
    report_.created = true;
    return Status::Ok();
  }
  return FormatNewStore();
}

Status NvmeTier::MoveIndexAside(std::string_view why) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%S", &tm);
  fs::path target = index_path_;
  target += fmt::format(".{}-{}", why, stamp);
  std::error_code ec;
  for (int i = 1; fs::exists(target, ec); ++i) {
    target = index_path_;
    target += fmt::format(".{}-{}-{}", why, stamp, i);
  }
  fs::rename(index_path_, target, ec);
  if (ec) {
    return Status::IoError(fmt::format("cannot move the index '{}' aside to '{}': {}", index_path_.string(),
                                       target.string(), ec.message()));
  }
  logger_->Log(LogLevel::kWarning, "nvme",
               fmt::format("moved the index '{}' aside to '{}'", index_path_.string(), target.string()));
  return nvme::SyncDirectory(index_path_.parent_path());
}

// reformat: the index (if any) is moved aside, a fresh index is created, the superblock last.
Status NvmeTier::Reformat() {
  logger_->Log(LogLevel::kWarning, "nvme",
               fmt::format("reformatting '{}' as a new, empty store (reformat was requested)", data_path_.string()));
  if (!EmptyOrAbsent(index_path_)) TERRACE_RETURN_IF_ERROR(MoveIndexAside("reformatted"));
  return FormatNewStore();
}

// A new identity and capacity, a fresh index, then the superblock (last, so a kill in between
// leaves no superblock naming an index that does not exist).
Status NvmeTier::FormatNewStore() {
  {
    MutexLock l(&sb_mu_);
    sb_.uuid = NewStoreId();
    sb_.capacity_bytes = options_.capacity_bytes;
  }
  TERRACE_RETURN_IF_ERROR(CreateIndex());
  TERRACE_RETURN_IF_ERROR(WriteFreshSuperblock());
  report_.created = true;
  return Status::Ok();
}

Status NvmeTier::OpenIndexOfExisting() {
  if (EmptyOrAbsent(index_path_)) {
    std::error_code ec;
    return Status::Corruption(fmt::format(
        "the data file '{}' holds Terrace store {} but its index '{}' is {}: opening it with an empty index would "
        "lose every block; if the store keeps its index in another directory, give that one (--index-dir); "
        "otherwise {} (or reformat the data area to start an empty store: every block in it is lost)",
        data_path_.string(), sb_.UuidString(), index_path_.string(),
        fs::exists(index_path_, ec) ? "an empty directory" : "missing", RecoverAdvice()));
  }
  // Check the index read-only first, so an index that is refused is never changed (RocksDB's
  // recovery of a read-write open may rewrite its log).
  nvme::IndexOpenOptions io;
  io.read_only = true;
  io.env = hooks_.index_env;
  io.logger = logger_;
  auto opened = nvme::IndexStore::Open(index_path_, io);
  if (!opened.ok()) {
    if (opened.status().IsCorruption()) {
      return Status::Corruption(fmt::format("the index '{}' of '{}' is damaged ({}); {}", index_path_.string(),
                                            data_path_.string(), opened.status().message(), RecoverAdvice()));
    }
    return opened.status();
  }
  std::unique_ptr<nvme::IndexStore> idx = std::move(*opened);
  auto read_manifest = idx->ReadManifest();
  if (!read_manifest.ok()) return WithRecoverAdvice(read_manifest.status());
  auto manifest = std::move(*read_manifest);
  if (!manifest) {
    return Status::Corruption(fmt::format("'{}' has no Terrace manifest: it is not a Terrace index (or it is damaged); "
                                          "{}",
                                          index_path_.string(), RecoverAdvice()));
  }
  auto m = nvme::Superblock::Decode(std::as_bytes(std::span(manifest->data(), manifest->size())),
                                    fmt::format("manifest in '{}'", index_path_.string()));
  if (!m.ok()) {
    return Status::Corruption(fmt::format("{}; {}", m.status().message(), RecoverAdvice()));
  }
  if (!m->SameStore(sb_)) {
    return Status::Corruption(fmt::format(
        "index '{}' belongs to store {} (capacity {}) but '{}' is store {} (capacity {}): refusing to pair them (its "
        "blocks would be overwritten); {}",
        index_path_.string(), m->UuidString(), m->capacity_bytes, data_path_.string(), sb_.UuidString(),
        sb_.capacity_bytes, RecoverAdvice()));
  }
  auto commit = idx->ReadCommit();
  if (!commit.ok()) return WithRecoverAdvice(commit.status());
  index_commit_ = *commit;
  if (index_commit_ < sb_.indexed_commit) {
    return Status::Corruption(fmt::format(
        "the index '{}' of '{}' lost records: it holds {} group commits but the data file recorded {} as durable, "
        "so blocks were lost from the index (a damaged or truncated write-ahead log); {}",
        index_path_.string(), data_path_.string(), index_commit_, sb_.indexed_commit, RecoverAdvice()));
  }
  if (index_commit_ > sb_.indexed_commit + 1) {
    // A store's commits never leave its index two ahead (the superblock is synced before each
    // index write); a copy of the store (same uuid) that went on alone does. Serving it would
    // hand out extents that hold the other copy's blocks here and overwrite them.
    return Status::Corruption(fmt::format(
        "the index '{}' holds {} group commits but the data file '{}' recorded {}: this store never lets its index "
        "get more than one commit ahead, so the index was written with another data file - most likely a copy of "
        "this store (copies keep the store's uuid) that was used on its own; nothing was changed. Pair the data file "
        "with its own index directory (--index-dir), or give an empty --index-dir to 'terrace store recover --dir {}' "
        "to rebuild one from the data file",
        index_path_.string(), index_commit_, data_path_.string(), sb_.indexed_commit, options_.path.string()));
  }
  // Still read-only: Recover() checks the records before ReopenIndexWritable().
  index_ = std::move(idx);
  index_read_only_ = true;
  return Status::Ok();
}

Status NvmeTier::ReopenIndexWritable() {
  if (options_.read_only || !index_read_only_) return Status::Ok();
  TERRACE_RETURN_IF_ERROR(index_->Close());
  index_.reset();
  nvme::IndexOpenOptions io;
  io.env = hooks_.index_env;
  io.logger = logger_;
  auto rw = nvme::IndexStore::Open(index_path_, io);
  if (!rw.ok()) return WithRecoverAdvice(rw.status());
  index_ = std::move(rw).value();
  index_read_only_ = false;
  return Status::Ok();
}

Status NvmeTier::Recover() {
  struct Loaded {
    BlockKey key;
    nvme::Record rec;
  };
  std::vector<Loaded> recs;
  auto note_drop = [&](std::string_view k, std::uint64_t* counter) {
    ++*counter;
    if (report_.dropped_keys.size() < RecoveryReport::kMaxKeys) report_.dropped_keys.push_back(nvme::EncodedKeyText(k));
  };
  const std::uint64_t cap = sb_.capacity_bytes;
  nvme::OtherVersionRecords other_version;  // refuse, never drop
  Status scanned = index_->Scan([&](std::string_view k, std::string_view v) {
    if (nvme::IsBookkeepingKey(k)) return;
    ++report_.records_scanned;
    auto key = BlockKey::Decode(std::as_bytes(std::span(k.data(), k.size())));
    auto rec = nvme::Record::Decode(std::as_bytes(std::span(v.data(), v.size())));
    if (other_version.Note(rec.status(), k)) return;
    if (!key.ok() || !rec.ok()) return note_drop(k, &report_.dropped_malformed);
    const nvme::Record& r = *rec;
    if (!r.FitsDataArea(kDataStart, cap)) {
      return note_drop(k, &report_.dropped_out_of_range);
    }
    recs.push_back({*key, r});
  });
  if (!scanned.ok()) return WithRecoverAdvice(scanned);
  if (other_version.count() > 0) {
    return Status::InvalidArgument(fmt::format(
        "the index '{}' of NVMe store '{}' {}; this build does not read them and changed nothing: open the store "
        "with the Terrace version that wrote it",
        index_path_.string(), data_path_.string(), other_version.Describe()));
  }

  std::sort(recs.begin(), recs.end(), [](const Loaded& a, const Loaded& b) { return a.rec.offset < b.rec.offset; });
  std::vector<Loaded> kept;
  kept.reserve(recs.size());
  for (Loaded& l : recs) {
    bool keep = true;
    while (!kept.empty() && l.rec.offset < kept.back().rec.offset + kept.back().rec.extent_bytes()) {
      if (kept.back().rec.generation < l.rec.generation) {
        note_drop(nvme::IndexStore::EncodeKey(kept.back().key), &report_.dropped_overlap);
        kept.pop_back();
      } else {
        note_drop(nvme::IndexStore::EncodeKey(l.key), &report_.dropped_overlap);
        keep = false;
        break;
      }
    }
    if (keep) kept.push_back(l);
  }
  recs.clear();
  recs.shrink_to_fit();
  if (const std::uint64_t damaged = report_.damaged_records(); damaged > 0 && !options_.read_only) {
    // A damaged record says nothing reliable about its extent, whose data and descriptor may be
    // intact, and an index whose records overlap is damaged too (a commit never leaves two keys on
    // one extent): one of them may be another key's record copied over, and dropping either could
    // free an intact block's extent for the next put. The data file is the authority; a rebuild
    // from it keeps every intact block.
    return Status::Corruption(fmt::format(
        "the index '{}' of NVMe store '{}' holds {} damaged block record{} ({}); their blocks may be intact in the "
        "data file, and dropping the records would free their space for new blocks, so nothing was changed; {}",
        index_path_.string(), data_path_.string(), damaged, damaged == 1 ? "" : "s", report_.DamagedRecordsText(),
        RecoverAdvice()));
  }
  // Every refusal is behind: only now may RocksDB's read-write open rewrite the index's files.
  TERRACE_RETURN_IF_ERROR(ReopenIndexWritable());

  std::vector<nvme::Extent> used;
  used.reserve(kept.size());
  map_.reserve(kept.size());
  std::uint64_t max_gen = 0;
  for (const Loaded& l : kept) {
    used.push_back({l.rec.offset, l.rec.extent_bytes()});
    map_[l.key].rec = l.rec;
    used_bytes_ += l.rec.length;
    max_gen = std::max(max_gen, l.rec.generation);
  }
  // Above every generation the index knows and every one that may sit in an unindexed descriptor.
  next_generation_ = std::max(max_gen + 1, sb_.generation_limit);
  alloc_ = std::make_unique<nvme::ExtentAllocator>(kDataStart, cap, kUnit);
  alloc_->ResetWithUsed(used);
  report_.blocks_recovered = map_.size();
  report_.bytes_in_use = used_bytes_;

  if (report_.damaged_records() > 0) {  // read-only only: a read-write open with them was refused above
    logger_->Log(LogLevel::kWarning, "nvme",
                 fmt::format("recovery of '{}' found (and, read-only, kept) {} damaged index records: {}",
                             data_path_.string(), report_.damaged_records(), report_.ToString()));
  }
  if (!options_.read_only && index_commit_ == sb_.indexed_commit + 1) TERRACE_RETURN_IF_ERROR(RedoLastCommit());
  return Status::Ok();
}

std::optional<PendingGroupCommit> NvmeTier::PendingCommit() const {
  {
    MutexLock l(&sb_mu_);
    if (!options_.read_only || index_commit_ != sb_.indexed_commit + 1) return std::nullopt;
  }
  auto bytes = index_->ReadRedo();
  if (!bytes.ok() || !bytes->has_value()) return std::nullopt;
  auto redo = nvme::GroupCommitter::DecodeRedo(**bytes);
  if (!redo.ok()) return std::nullopt;
  PendingGroupCommit pending;
  pending.keys = std::move(redo->keys);
  for (const nvme::Extent& e : redo->released) pending.released_offsets.push_back(e.offset);
  return pending;
}

Status NvmeTier::RedoLastCommit() {
  auto bytes = index_->ReadRedo();
  if (!bytes.ok()) return WithRecoverAdvice(bytes.status());
  if (!bytes->has_value()) return Status::Ok();  // commits of an earlier version wrote descriptors with the data
  auto redo = nvme::GroupCommitter::DecodeRedo(**bytes);
  if (!redo.ok()) return WithRecoverAdvice(redo.status());
  // The index is that commit's result: each key it put is written with the record the index holds
  // now (a key it put and then erased has none); a released extent is zeroed unless a record holds
  // it (which only a damaged index could say).
  std::vector<nvme::Descriptor> puts;
  std::unordered_set<std::uint64_t> live;
  for (const auto& [key, e] : map_) live.insert(e.rec.offset);
  std::unordered_set<BlockKey> seen;
  for (const BlockKey& k : redo->keys) {
    auto it = map_.find(k);
    if (it == map_.end() || !seen.insert(k).second) continue;
    nvme::Descriptor d;
    d.uuid = sb_.uuid;
    d.key = k;
    d.rec = it->second.rec;
    puts.push_back(d);
  }
  std::vector<nvme::Extent> clears;
  for (const nvme::Extent& e : redo->released)
    if (!live.count(e.offset) && e.offset >= kDataStart && e.length <= sb_.capacity_bytes - e.offset) clears.push_back(e);
  TERRACE_RETURN_IF_ERROR(nvme::GroupCommitter::WriteDescriptorUnits(*engine_, puts, clears));
  // The descriptors durable first: a superblock that says the commit is whole must never reach the
  // disk without them (the next open would not redo it).
  TERRACE_RETURN_IF_ERROR(EngineSync("syncing the descriptors of the last group commit in"));
  {
    MutexLock l(&sb_mu_);
    sb_.indexed_commit = index_commit_;
    TERRACE_RETURN_IF_ERROR(PersistSuperblockLocked());
  }
  TERRACE_RETURN_IF_ERROR(EngineSync("syncing the superblock of"));
  report_.redo_descriptors = puts.size();
  report_.redo_clears = clears.size();
  logger_->Log(LogLevel::kInfo, "nvme",
               fmt::format("'{}': finished the pending group commit (cut short after its index write, or left "
                           "by a rebuild): wrote {} descriptors and cleared {} released extents",
                           data_path_.string(), puts.size(), clears.size()));
  return Status::Ok();
}

Status NvmeTier::VerifyAllBlocks() {
  std::vector<BlockKey> keys;
  {
    MutexLock l(&mu_);
    keys.reserve(map_.size());
    for (const auto& [k, e] : map_) keys.push_back(k);
  }
  constexpr std::size_t kBatch = 32;
  std::vector<std::vector<std::byte>> bufs(kBatch);
  std::vector<GetOp> ops;
  for (std::size_t i = 0; i < keys.size(); i += kBatch) {
    ops.clear();
    for (std::size_t j = i; j < std::min(keys.size(), i + kBatch); ++j) {
      auto d = Lookup(keys[j]);
      if (!d.ok()) continue;
      auto& b = bufs[ops.size()];
      b.resize(d->size);
      ops.push_back(GetOp{keys[j], b, {}});
    }
    std::vector<Status> st = GetBatch(ops);
    for (std::size_t j = 0; j < ops.size(); ++j) {
      if (st[j].IsCorruption()) {
        ++report_.dropped_checksum;
        if (!options_.read_only) {
          --report_.blocks_recovered;
          report_.bytes_in_use -= bufs[j].size();
        }
        if (report_.dropped_keys.size() < RecoveryReport::kMaxKeys) report_.dropped_keys.push_back(ops[j].key.ToString());
      } else if (!st[j].ok()) {
        return st[j].WithContext("verify_on_open");
      }
    }
  }
  return options_.read_only ? Status::Ok() : committer_->Flush();
}

namespace nvme {

std::vector<long> FlockHolderPids(int fd) {
  std::vector<long> pids;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return pids;
  // /proc/locks lines: "<n>: FLOCK ADVISORY WRITE <pid> <major hex>:<minor hex>:<inode> 0 EOF";
  // a waiter's line has "->" after "<n>:" and holds nothing.
  const std::string file = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev), st.st_ino);
  std::ifstream locks("/proc/locks");
  std::string line;
  while (std::getline(locks, line)) {
    std::istringstream words(line);
    std::string n, kind, mode, access, dev_ino;
    long pid = 0;
    if (!(words >> n >> kind >> mode >> access >> pid >> dev_ino)) continue;
    if (kind == "FLOCK" && dev_ino == file && pid > 0) pids.push_back(pid);
  }
  std::sort(pids.begin(), pids.end());
  pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
  return pids;
}

namespace {
std::string HolderText(std::vector<long> pids) {
  const long self = ::getpid();
  const bool mine = std::erase(pids, self) > 0;
  const std::string others = pids.empty()       ? std::string()
                             : pids.size() == 1 ? fmt::format("another process (pid {})", pids[0])
                                                : fmt::format("other processes (pids {})", fmt::join(pids, ", "));
  if (!mine) return others.empty() ? std::string("another process") : others;
  const std::string me = fmt::format("this process (pid {}: another Store or tier_list entry)", self);
  return others.empty() ? me : others + " and " + me;
}
}  // namespace

std::string FlockHolderText(int fd) { return HolderText(FlockHolderPids(fd)); }

Status DataAreaInUse(const fs::path& data, int fd, std::string_view detail, std::string_view advice) {
  const std::vector<long> pids = FlockHolderPids(fd);  // one read of /proc/locks
  // The holder may be this very process: a second Store (or tier_list entry) on the same path.
  if (pids == std::vector<long>{static_cast<long>(::getpid())}) {
    return Status::Unavailable(fmt::format(
        "NVMe store '{}' is already open in this process (pid {}; its data file is locked{}): another Store or "
        "tier_list entry holds it; close that one first, or share one Store",
        data.string(), ::getpid(), detail));
  }
  return Status::Unavailable(fmt::format("NVMe store '{}' is in use by {} (its data file is locked{}); {}",
                                         data.string(), HolderText(pids), detail, advice));
}

}  // namespace nvme

}  // namespace terrace
