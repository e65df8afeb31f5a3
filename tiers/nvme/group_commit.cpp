#include "tiers/nvme/group_commit.h"

#include <rocksdb/write_batch.h>

#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "src/common/start_thread.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/io_engine.h"

namespace terrace::nvme {

GroupCommitter::GroupCommitter(IoEngine* engine, IndexStore* index, ReleaseFn release, BeforeSyncFn before_sync,
                               std::uint64_t commit)
    : engine_(engine), index_(index), release_(std::move(release)), before_sync_(std::move(before_sync)),
      pending_(std::make_unique<rocksdb::WriteBatch>()), durable_commit_(commit) {}

Result<std::unique_ptr<GroupCommitter>> GroupCommitter::Create(IoEngine* engine, IndexStore* index, ReleaseFn release,
                                                               BeforeSyncFn before_sync, std::uint64_t commit,
                                                               std::chrono::microseconds interval) {
  std::unique_ptr<GroupCommitter> c(
      new GroupCommitter(engine, index, std::move(release), std::move(before_sync), commit));
  if (interval.count() > 0) {
    GroupCommitter* raw = c.get();
    TERRACE_ASSIGN_OR_RETURN(c->bg_, StartThread("the NVMe tier's group-commit thread (async durability)",
                                                 [raw, interval] { raw->BackgroundLoop(interval); }));
  }
  return c;
}

GroupCommitter::~GroupCommitter() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  bg_cv_.SignalAll();
  if (bg_.joinable()) bg_.join();
}

std::uint64_t GroupCommitter::StagePut(const Descriptor& desc, Extent release) {
  const std::string key = IndexStore::EncodeKey(desc.key), record = IndexStore::EncodeRecord(desc.rec);
  MutexLock l(&mu_);
  pending_->Put(key, record);
  pending_puts_.push_back(desc);
  pending_data_ = true;
  if (release.length > 0) pending_release_.push_back(release);
  if (staged_seq_++ == durable_seq_) bg_cv_.Signal();
  return staged_seq_;
}

std::uint64_t GroupCommitter::StageDelete(std::string key, Extent release) {
  MutexLock l(&mu_);
  pending_->Delete(key);
  if (release.length > 0) pending_release_.push_back(release);
  if (staged_seq_++ == durable_seq_) bg_cv_.Signal();
  return staged_seq_;
}

std::uint64_t GroupCommitter::StageClear(Extent release) {
  MutexLock l(&mu_);
  if (release.length > 0) pending_release_.push_back(release);
  if (staged_seq_++ == durable_seq_) bg_cv_.Signal();
  return staged_seq_;
}

namespace {
constexpr std::uint32_t kRedoMagic = 0x4f444552;  // "REDO"
constexpr std::size_t kRedoHeader = 24, kRedoExtent = 16;
}  // namespace

// u32 magic, u32 0, u64 number of keys, u64 number of extents, then each key (BlockKey::kEncodedSize
// bytes) and each extent (u64 offset, u64 length); little-endian.
std::string GroupCommitter::EncodeRedo(const Redo& redo) {
  std::string out(kRedoHeader + redo.keys.size() * BlockKey::kEncodedSize + redo.released.size() * kRedoExtent, '\0');
  std::byte* p = reinterpret_cast<std::byte*>(out.data());
  PutLe(p, kRedoMagic, 8);
  PutLe(p + 8, redo.keys.size(), 8);
  PutLe(p + 16, redo.released.size(), 8);
  p += kRedoHeader;
  for (const BlockKey& k : redo.keys) {
    k.EncodeTo(p);
    p += BlockKey::kEncodedSize;
  }
  for (const Extent& e : redo.released) {
    PutLe(p, e.offset, 8);
    PutLe(p + 8, e.length, 8);
    p += kRedoExtent;
  }
  return out;
}

Result<GroupCommitter::Redo> GroupCommitter::DecodeRedo(std::string_view in) {
  auto bad = [&](std::string_view why) {
    return Status::Corruption(fmt::format("the index's redo record ({} bytes) is damaged: {}", in.size(), why));
  };
  const std::byte* p = reinterpret_cast<const std::byte*>(in.data());
  if (in.size() < kRedoHeader || GetLe(p, 8) != kRedoMagic) return bad("no redo header");
  const std::uint64_t nk = GetLe(p + 8, 8), ne = GetLe(p + 16, 8);
  if (nk > in.size() / BlockKey::kEncodedSize || ne > in.size() / kRedoExtent ||
      in.size() != kRedoHeader + nk * BlockKey::kEncodedSize + ne * kRedoExtent)
    return bad(fmt::format("{} keys and {} extents do not fill it", nk, ne));
  Redo r;
  p += kRedoHeader;
  for (std::uint64_t i = 0; i < nk; ++i, p += BlockKey::kEncodedSize) {
    auto k = BlockKey::Decode(std::span(p, BlockKey::kEncodedSize));
    if (!k.ok()) return bad(k.status().message());
    r.keys.push_back(*k);
  }
  for (std::uint64_t i = 0; i < ne; ++i, p += kRedoExtent) {
    const Extent e{GetLe(p, 8), GetLe(p + 8, 8)};
    if (e.length < kUnit || e.offset % kUnit != 0 || e.length % kUnit != 0) return bad("an extent is not whole units");
    r.released.push_back(e);
  }
  return r;
}

Status GroupCommitter::WriteDescriptorUnits(IoEngine& engine, std::span<const Descriptor> puts,
                                            std::span<const Extent> released) {
  std::unordered_set<std::uint64_t> gone;  // a put released by the same commit gets no descriptor
  for (const Extent& e : released) gone.insert(e.offset);
  std::size_t n = 0;
  for (const Descriptor& d : puts) n += gone.count(d.rec.offset) ? 0 : 1;
  if (n == 0 && released.empty()) return Status::Ok();
  // One unit per descriptor, then one zero unit that every clear writes from (the engine only reads it).
  AlignedBuffer units((n + 1) * kUnit, kUnit);
  if (!units.data()) return Status::OutOfCapacity("NVMe tier: cannot allocate the commit's descriptor units");
  std::memset(units.data(), 0, (n + 1) * kUnit);
  std::byte* zero = units.data() + n * kUnit;
  std::vector<IoRequest> reqs;
  reqs.reserve(n + released.size());
  std::size_t u = 0;
  for (const Descriptor& d : puts) {
    if (gone.count(d.rec.offset)) continue;
    std::byte* unit = units.data() + (u++) * kUnit;
    d.EncodeTo(unit);
    reqs.push_back({.op = IoOp::kWrite, .offset = d.rec.descriptor_offset(), .src = unit, .len = static_cast<std::uint32_t>(kUnit)});
  }
  for (const Extent& e : released)  // the descriptor is the extent's last unit
    reqs.push_back({.op = IoOp::kWrite, .offset = e.offset + e.length - kUnit, .src = zero, .len = static_cast<std::uint32_t>(kUnit)});
  int first_err = 0;
  std::uint64_t where = 0;
  RunToCompletion(engine, reqs, [&](std::size_t i, int err) {
    if (err != 0 && first_err == 0) {
      first_err = err;
      where = reqs[i].offset;
    }
  });
  if (first_err == 0) return Status::Ok();
  return Status::IoError(fmt::format(
      "NVMe tier: writing the descriptor unit at offset {} of the data file failed: {}; the tier refuses further "
      "writes: reopen it (the open finishes the commit's descriptors from the index)",
      where, std::strerror(-first_err)));
}

Status GroupCommitter::SyncData(std::string_view what) {
  const int err = engine_->SyncData();
  if (err >= 0) return Status::Ok();
  return Status::IoError(fmt::format(
      "NVMe tier: fdatasync of the data file ({}) failed: {}; the tier refuses further writes: reopen it (recovery "
      "keeps every block that was durable)",
      what, std::strerror(-err)));
}

Status GroupCommitter::WaitDurable(std::uint64_t seq) {
  MutexLock l(&mu_);
  while (true) {
    if (!failed_.ok()) return failed_;
    if (durable_seq_ >= seq) return Status::Ok();
    if (leader_) {
      cv_.Wait(&mu_);
      continue;
    }
    leader_ = true;
    auto batch = std::move(pending_);
    pending_ = std::make_unique<rocksdb::WriteBatch>();
    auto release = std::move(pending_release_);
    pending_release_.clear();
    auto puts = std::move(pending_puts_);
    pending_puts_.clear();
    const bool data_written = pending_data_;
    pending_data_ = false;
    const bool superblock_unsynced = superblock_unsynced_;
    std::uint64_t upto = staged_seq_;
    const std::uint64_t commit = durable_commit_;
    l.Unlock();

    // 1. The new blocks' bytes are durable before any record points at them, and so is the
    //    superblock the previous commit left written but not synced (the index must never get two
    //    commits ahead of the durable superblock: an open redoes only the last one).
    Status s = data_written || superblock_unsynced ? SyncData("the new blocks' data") : Status::Ok();
    // 2. The index: the commit point, with what step 3 must write if it is cut short.
    const bool index_write = batch->Count() > 0;
    if (s.ok() && index_write) {
      Redo redo;
      redo.keys.reserve(puts.size());
      for (const Descriptor& d : puts) redo.keys.push_back(d.key);
      redo.released = release;
      batch->Put(rocksdb::Slice(kRedoKey.data(), kRedoKey.size()), EncodeRedo(redo));
      batch->Put(rocksdb::Slice(kCommitKey.data(), kCommitKey.size()), IndexStore::EncodeCommit(commit + 1));
      s = index_->Write(batch.get(), /*sync=*/true);
    }
    // 3-4. The data file follows: descriptors of the new blocks, zeros over the released ones; one
    // fdatasync.
    if (s.ok() && (!puts.empty() || !release.empty())) {
      s = WriteDescriptorUnits(*engine_, puts, release);
      if (s.ok()) s = SyncData("the commit's descriptors");
    }
    // 5. Only now may the superblock say the index holds commit c + 1 (written, not synced: the
    //    next commit's step 1 or the close syncs it). Until it does, an open redoes step 3.
    bool wrote_superblock = false;
    if (s.ok() && index_write && before_sync_) {
      s = before_sync_(commit + 1);
      wrote_superblock = true;
    }
    // The extents go back to the allocator before any waiter wakes, so a Flush that returns sees
    // them free. Safe to reuse now: the records that dropped them and their cleared descriptors are durable.
    if (s.ok() && !release.empty()) release_(std::move(release));

    l.Lock();
    leader_ = false;
    if (s.ok()) superblock_unsynced_ = wrote_superblock;  // step 1 or 4 synced any earlier one
    if (s.ok() && index_write) durable_commit_ = commit + 1;
    if (!s.ok()) {
      failed_ = s.WithContext("group commit");
      cv_.SignalAll();
      return failed_;
    }
    durable_seq_ = upto;
    ++commits_;
    cv_.SignalAll();
  }
}

Status GroupCommitter::Flush() {
  std::uint64_t seq;
  {
    MutexLock l(&mu_);
    seq = staged_seq_;
  }
  return WaitDurable(seq);
}

Status GroupCommitter::health() const {
  MutexLock l(&mu_);
  return failed_;
}

std::uint64_t GroupCommitter::durable_commit() const {
  MutexLock l(&mu_);
  return durable_commit_;
}

std::uint64_t GroupCommitter::commits() const {
  MutexLock l(&mu_);
  return commits_;
}

void GroupCommitter::BackgroundLoop(std::chrono::microseconds interval) {
  MutexLock l(&mu_);
  while (!stop_) {
    while (!stop_ && staged_seq_ <= durable_seq_) bg_cv_.Wait(&mu_);
    if (stop_) break;
    // Let more mutations join the group, but never hold one longer than `interval`.
    const auto until = std::chrono::steady_clock::now() + interval;
    while (!stop_ && bg_cv_.WaitUntil(&mu_, until)) {
    }
    if (stop_ || !failed_.ok()) break;
    std::uint64_t seq = staged_seq_;
    l.Unlock();
    (void)WaitDurable(seq);  // a failure is recorded in failed_ and reported by Flush / Put
    l.Lock();
  }
}

}  // namespace terrace::nvme
