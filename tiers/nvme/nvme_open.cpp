// NvmeTier: opening, creating and recovering a store.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>

#include <fmt/format.h>

#include "tiers/nvme/group_commit.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/staging_pool.h"
#include "tiers/nvme/uring_engine.h"

namespace terrace {

namespace fs = std::filesystem;
using nvme::kDataStart;
using nvme::kUnit;

namespace {

constexpr std::size_t kStagingBufferBytes = 1 << 20;

std::string Hex(std::string_view bytes) {
  std::string s;
  for (char c : bytes) s += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return s;
}

struct AlignedBuf {
  explicit AlignedBuf(std::size_t n) : p(static_cast<std::byte*>(std::aligned_alloc(kUnit, n))), size(n) {
    if (p) std::memset(p, 0, n);
  }
  ~AlignedBuf() { std::free(p); }
  std::byte* p;
  std::size_t size;
};

Status Errno(std::string_view what, const fs::path& path, int err, std::string_view advice) {
  return Status::IoError(fmt::format("{} '{}': {}; {}", what, path.string(), std::strerror(err), advice));
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

NvmeTier::NvmeTier(const NvmeTierOptions& options, const NvmeOpenHooks& hooks) : options_(options), hooks_(hooks) {
  caps_.id = TierId::kNvme;
  caps_.name = "nvme";
  caps_.persistent = true;
  caps_.memory = MemoryKind::kNone;
  caps_.verifies_gets = true;  // GetBatch hashes each block in the caller's buffer
  SetCapacity(options.capacity_bytes);
}

void NvmeTier::SetCapacity(std::uint64_t capacity) {
  options_.capacity_bytes = capacity;
  caps_.capacity_bytes = capacity;
  caps_.max_block_bytes = capacity > kDataStart ? capacity - kDataStart : 0;
}

NvmeTier::~NvmeTier() {
  if (committer_) {
    Status s = committer_->Flush();
    if (!s.ok()) fmt::print(stderr, "[terrace nvme] closing '{}': final commit failed: {}\n", data_path_.string(), s.ToString());
  }
  committer_.reset();
  engine_.reset();
  index_.reset();
  if (fd_ >= 0) ::close(fd_);
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
  if (options.capacity_bytes != 0 && (options.capacity_bytes < kDataStart + kUnit || options.capacity_bytes % kUnit != 0)) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier '{}': capacity_bytes {} must be a multiple of {} and at least {}", options.path.string(),
        options.capacity_bytes, kUnit, kDataStart + kUnit));
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096 || options.io_threads == 0 || options.io_threads > 64) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier '{}': queue_depth {} / io_threads {} out of range; use queue_depth 1..4096, io_threads 1..64",
        options.path.string(), options.queue_depth, options.io_threads));
  }
  std::unique_ptr<NvmeTier> t(new NvmeTier(options, hooks));
  if (!t->hooks_.engine) t->hooks_.engine = nvme::OpenUringEngine;
  TERRACE_RETURN_IF_ERROR(t->OpenFiles());
  try {
    std::size_t n = std::max<std::size_t>(8, std::min<std::size_t>(options.queue_depth, 64)) * options.io_threads;
    t->staging_ = std::make_unique<nvme::StagingPool>(n, kStagingBufferBytes);
  } catch (const std::bad_alloc&) {
    return Status::OutOfCapacity(fmt::format("NVMe tier '{}': cannot allocate staging buffers", options.path.string()));
  }
  if (Status s = t->engine_->RegisterBuffers(t->staging_->iovecs()); !s.ok()) {
    fmt::print(stderr, "[terrace nvme] '{}': {}\n", t->data_path_.string(), s.ToString());
  }
  TERRACE_RETURN_IF_ERROR(t->Recover());
  auto interval = options.durability == Durability::kAsync
                      ? std::max(options.group_commit_interval, std::chrono::microseconds(1))
                      : std::chrono::microseconds(0);
  NvmeTier* raw = t.get();
  t->committer_ = std::make_unique<nvme::GroupCommitter>(
      t->engine_.get(), t->index_.get(), [raw](std::vector<nvme::Extent>&& e) { raw->ReleaseExtents(std::move(e)); },
      interval);
  if (options.verify_on_open) TERRACE_RETURN_IF_ERROR(t->VerifyAllBlocks());
  t->report_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print(stderr, "[terrace nvme] {} '{}' ({} I/O, {} mode, {}): {}; {:.3f} s\n",
             t->report_.created ? "created" : "opened", t->data_path_.string(),
             t->direct_ ? "O_DIRECT" : "buffered", options.durability == Durability::kSync ? "sync" : "async",
             t->engine_->fixed_buffers() ? "fixed buffers" : "no fixed buffers", t->report_.ToString(),
             t->report_.seconds);
  return t;
}

Status NvmeTier::OpenFiles() {
  const fs::path& path = options_.path;
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Status::IoError(fmt::format("NVMe tier path '{}' cannot be used: {}; choose a directory you can write",
                                       path.string(), ec.message()));
  }
  bool block_device = false;
  if (!fs::exists(st)) {
    if (!options_.create_if_missing) {
      return Status::NotFound(fmt::format("NVMe tier directory '{}' does not exist; create it or set "
                                          "create_if_missing=true",
                                          path.string()));
    }
    fs::create_directories(path, ec);
    if (ec) {
      return Status::IoError(fmt::format("cannot create NVMe tier directory '{}': {}; choose a writable location",
                                         path.string(), ec.message()));
    }
  } else if (fs::is_block_file(st)) {
    block_device = true;
  } else if (!fs::is_directory(st)) {
    return Status::InvalidArgument(fmt::format(
        "NVMe tier path '{}' is neither a directory nor a block device; point it at a directory (the tier creates "
        "terrace.data and index/ inside) or at a block device",
        path.string()));
  }
  if (block_device) {
    if (options_.index_dir.empty()) {
      return Status::InvalidArgument(fmt::format(
          "NVMe tier on block device '{}': set options.index_dir to a directory on a persistent file system for the "
          "index",
          path.string()));
    }
    data_path_ = path;
    index_path_ = options_.index_dir;
    return OpenDataFile(/*create=*/false, /*block_device=*/true);
  }
  data_path_ = path / "terrace.data";
  index_path_ = options_.index_dir.empty() ? path / "index" : options_.index_dir;
  bool data_exists = fs::exists(data_path_, ec);
  bool index_exists = fs::exists(index_path_, ec);
  if (data_exists) return OpenDataFile(false, false);
  if (index_exists) {
    return Status::Corruption(fmt::format(
        "NVMe tier '{}' has an index ('{}') but no data file 'terrace.data': the store is incomplete; restore "
        "terrace.data or delete the directory to start empty",
        path.string(), index_path_.string()));
  }
  if (!options_.create_if_missing) {
    return Status::NotFound(fmt::format("'{}' holds no Terrace store (no terrace.data) and create_if_missing is "
                                        "false",
                                        path.string()));
  }
  if (!fs::is_empty(path, ec)) {
    return Status::InvalidArgument(fmt::format(
        "'{}' is not empty and holds no Terrace store (no terrace.data); point the NVMe tier at an empty directory "
        "or an existing store",
        path.string()));
  }
  return OpenDataFile(/*create=*/true, false);
}

Status NvmeTier::OpenDataFile(bool create, bool block_device) {
  int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  direct_ = options_.direct_io;
  fd_ = ::open(data_path_.c_str(), flags | (direct_ ? O_DIRECT : 0), 0644);
  if (fd_ < 0 && direct_ && errno == EINVAL) {
    direct_ = false;
    fmt::print(stderr, "[terrace nvme] the file system under '{}' refused O_DIRECT; using buffered I/O (page cache)\n",
               data_path_.string());
    fd_ = ::open(data_path_.c_str(), flags, 0644);
  }
  if (fd_ < 0) {
    return Errno("cannot open NVMe data file", data_path_, errno, "check the path and its permissions");
  }
  const std::uint64_t cap = options_.capacity_bytes;
  AlignedBuf sbuf(nvme::kSuperblockBytes);
  if (!sbuf.p) return Status::OutOfCapacity("NVMe tier: cannot allocate 4 KiB for the superblock");
  nvme::IoEngineConfig cfg{fd_, options_.queue_depth, options_.io_threads};
  TERRACE_ASSIGN_OR_RETURN(engine_, hooks_.engine(cfg));
  // Formats a new store: a fresh uuid and the capacity, written and synced at offset 0.
  auto write_fresh_superblock = [&]() -> Status {
    std::random_device rd;
    for (auto& b : sb_.uuid) b = static_cast<std::uint8_t>(rd());
    sb_.capacity_bytes = cap;
    sb_.EncodeTo(sbuf.p);
    TERRACE_RETURN_IF_ERROR(EngineIo(nvme::IoOp::kWrite, 0, sbuf.p, static_cast<std::uint32_t>(sbuf.size),
                                     "writing the superblock of"));
    return EngineSync("syncing the superblock of");
  };

  if (create && cap == 0) {
    return Status::InvalidArgument(fmt::format("creating the NVMe store '{}': capacity_bytes is 0; give the capacity of "
                                               "the new store (0 means 'as recorded' and only opens an existing store)",
                                               data_path_.string()));
  }
  if (create) {
    int err = ::fallocate(fd_, 0, 0, static_cast<off_t>(cap)) == 0 ? 0 : errno;
    if (err == EOPNOTSUPP) err = ::ftruncate(fd_, static_cast<off_t>(cap)) == 0 ? 0 : errno;
    if (err != 0) {
      engine_.reset();
      ::close(fd_);
      fd_ = -1;
      std::error_code ec;
      fs::remove(data_path_, ec);
      std::string msg = fmt::format("cannot preallocate {} bytes for NVMe data file '{}': {}; free disk space or lower "
                                    "capacity_bytes",
                                    cap, data_path_.string(), std::strerror(err));
      if (err == ENOSPC || err == EFBIG || err == EDQUOT) return Status::OutOfCapacity(msg);
      return Status::IoError(msg);
    }
    TERRACE_RETURN_IF_ERROR(write_fresh_superblock());
    int dfd = ::open(data_path_.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
    report_.created = true;
    return OpenIndex(/*fresh_data=*/true);
  }

  std::uint64_t size = 0;
  if (block_device) {
    if (::ioctl(fd_, BLKGETSIZE64, &size) != 0) return Errno("cannot read the size of block device", data_path_, errno, "check the device");
  } else {
    struct stat sst {};
    if (::fstat(fd_, &sst) != 0) return Errno("cannot stat", data_path_, errno, "check the file");
    size = static_cast<std::uint64_t>(sst.st_size);
  }
  if (size < sbuf.size) {
    return Status::InvalidArgument(fmt::format("'{}' is {} bytes: too short to be a Terrace store", data_path_.string(), size));
  }
  TERRACE_RETURN_IF_ERROR(EngineIo(nvme::IoOp::kRead, 0, sbuf.p, static_cast<std::uint32_t>(sbuf.size),
                                   "reading the superblock of"));
  const ssize_t got = static_cast<ssize_t>(sbuf.size);
  bool blank = std::all_of(sbuf.p, sbuf.p + sbuf.size, [](std::byte b) { return b == std::byte{0}; });
  if (block_device && blank && got == static_cast<ssize_t>(sbuf.size) && options_.create_if_missing) {
    if (cap == 0) {
      return Status::InvalidArgument(fmt::format("formatting block device '{}' as a new NVMe store: capacity_bytes is 0; "
                                                 "give the capacity to use",
                                                 data_path_.string()));
    }
    if (size < cap) {
      return Status::OutOfCapacity(fmt::format("block device '{}' has {} bytes, less than capacity_bytes {}",
                                               data_path_.string(), size, cap));
    }
    TERRACE_RETURN_IF_ERROR(write_fresh_superblock());
    report_.created = true;
    return OpenIndex(true);
  }
  TERRACE_ASSIGN_OR_RETURN(sb_, nvme::Superblock::Decode(std::span<const std::byte>(sbuf.p, static_cast<std::size_t>(std::max<ssize_t>(got, 0))),
                                                         data_path_.string()));
  if (cap == 0) {
    SetCapacity(sb_.capacity_bytes);
  } else if (sb_.capacity_bytes != cap) {
    return Status::InvalidArgument(fmt::format(
        "Terrace store '{}' was created with capacity_bytes={} but the options ask for {}; open it with the "
        "original capacity or use a new directory",
        data_path_.string(), sb_.capacity_bytes, cap));
  }
  if (size < sb_.capacity_bytes) {
    return Status::Corruption(fmt::format("NVMe data file '{}' is {} bytes, shorter than its capacity {}: it was "
                                          "truncated; restore it or delete the store",
                                          data_path_.string(), size, sb_.capacity_bytes));
  }
  return OpenIndex(false);
}

Status NvmeTier::EngineIo(nvme::IoOp op, std::uint64_t offset, std::byte* buf, std::uint32_t len,
                          std::string_view what) {
  nvme::IoRequest r;
  r.op = op;
  r.offset = offset;
  r.buf = buf;
  r.len = len;
  int err = 0;
  nvme::RunToCompletion(*engine_, std::span<nvme::IoRequest>(&r, 1), [&](std::size_t, int e) { err = e; });
  if (err == 0) return Status::Ok();
  return Errno(what, data_path_, -err, "check the device and the file system");
}

Status NvmeTier::EngineSync(std::string_view what) {
  int err = engine_->SyncData();
  if (err == 0) return Status::Ok();
  return Errno(what, data_path_, -err, "check the device and the file system");
}

Status NvmeTier::OpenIndex(bool fresh_data) {
  std::error_code ec;
  // An empty directory counts as no index (users pre-create index_dir for a new store).
  const bool exists = fs::exists(index_path_, ec) && !fs::is_empty(index_path_, ec);
  if (fresh_data && exists) {
    return Status::InvalidArgument(fmt::format("index directory '{}' is not empty but the data file is new; remove it",
                                               index_path_.string()));
  }
  if (!exists && !fresh_data) {
    // No index ever became durable (a crash while creating the store): nothing was acknowledged.
    fmt::print(stderr, "[terrace nvme] '{}': index '{}' is missing; starting with an empty index\n",
               data_path_.string(), index_path_.string());
  }
  TERRACE_ASSIGN_OR_RETURN(index_, nvme::IndexStore::Open(index_path_, /*create=*/!exists, hooks_.index_env));
  if (!exists) return index_->WriteManifest(sb_);
  TERRACE_ASSIGN_OR_RETURN(auto manifest, index_->ReadManifest());
  if (!manifest) {
    return Status::Corruption(fmt::format("'{}' has no Terrace manifest: it is not a Terrace index (or it is damaged); "
                                          "restore it or delete the store directory",
                                          index_path_.string()));
  }
  TERRACE_ASSIGN_OR_RETURN(nvme::Superblock m,
                           nvme::Superblock::Decode(std::as_bytes(std::span(manifest->data(), manifest->size())),
                                                    fmt::format("manifest in '{}'", index_path_.string())));
  if (!(m == sb_)) {
    return Status::Corruption(fmt::format(
        "index '{}' belongs to store {} (capacity {}) but '{}' is store {} (capacity {}); pair each index with its "
        "own data file",
        index_path_.string(), m.UuidString(), m.capacity_bytes, data_path_.string(), sb_.UuidString(),
        sb_.capacity_bytes));
  }
  return Status::Ok();
}

Status NvmeTier::Recover() {
  struct Loaded {
    BlockKey key;
    nvme::Record rec;
  };
  std::vector<Loaded> recs;
  std::vector<std::string> drop;  // encoded keys to delete
  auto note_drop = [&](std::string_view k, std::uint64_t* counter) {
    ++*counter;
    drop.emplace_back(k);
    if (report_.dropped_keys.size() < RecoveryReport::kMaxKeys) {
      auto key = BlockKey::Decode(std::as_bytes(std::span(k.data(), k.size())));
      report_.dropped_keys.push_back(key.ok() ? key->ToString() : Hex(k));
    }
  };
  const std::uint64_t cap = sb_.capacity_bytes;
  TERRACE_RETURN_IF_ERROR(index_->Scan([&](std::string_view k, std::string_view v) {
    if (k == nvme::kManifestKey) return;
    ++report_.records_scanned;
    auto key = BlockKey::Decode(std::as_bytes(std::span(k.data(), k.size())));
    auto rec = nvme::Record::Decode(std::as_bytes(std::span(v.data(), v.size())));
    if (!key.ok() || !rec.ok()) return note_drop(k, &report_.dropped_malformed);
    const nvme::Record& r = *rec;
    if (r.offset % kUnit != 0 || r.offset < kDataStart || r.offset >= cap || r.length > cap ||
        r.extent_bytes() > cap - r.offset) {
      return note_drop(k, &report_.dropped_out_of_range);
    }
    recs.push_back({*key, r});
  }));

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
  next_generation_ = max_gen + 1;
  alloc_ = std::make_unique<nvme::ExtentAllocator>(kDataStart, cap, kUnit);
  alloc_->ResetWithUsed(used);
  report_.blocks_recovered = map_.size();
  report_.bytes_in_use = used_bytes_;

  if (!drop.empty()) {
    TERRACE_RETURN_IF_ERROR(index_->DeleteKeys(drop));
    fmt::print(stderr, "[terrace nvme] recovery of '{}' dropped {} index records: {}\n", data_path_.string(),
               drop.size(), report_.ToString());
  }
  return Status::Ok();
}

Status NvmeTier::VerifyAllBlocks() {
  std::vector<BlockKey> keys;
  {
    std::lock_guard<std::mutex> l(mu_);
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
        --report_.blocks_recovered;
        report_.bytes_in_use -= bufs[j].size();
        if (report_.dropped_keys.size() < RecoveryReport::kMaxKeys) report_.dropped_keys.push_back(ops[j].key.ToString());
      } else if (!st[j].ok()) {
        return st[j].WithContext("verify_on_open");
      }
    }
  }
  return committer_->Flush();
}

}  // namespace terrace
