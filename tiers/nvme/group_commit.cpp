#include "tiers/nvme/group_commit.h"

#include <rocksdb/write_batch.h>

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/io_engine.h"

namespace terrace::nvme {

GroupCommitter::GroupCommitter(IoEngine* engine, IndexStore* index, ReleaseFn release, BeforeSyncFn before_sync,
                               std::uint64_t commit, std::chrono::microseconds interval)
    : engine_(engine), index_(index), release_(std::move(release)), before_sync_(std::move(before_sync)),
      pending_(std::make_unique<rocksdb::WriteBatch>()), durable_commit_(commit) {
  if (interval.count() > 0) bg_ = std::thread([this, interval] { BackgroundLoop(interval); });
}

GroupCommitter::~GroupCommitter() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  bg_cv_.SignalAll();
  if (bg_.joinable()) bg_.join();
}

std::uint64_t GroupCommitter::StagePut(std::string key, std::string record, Extent release) {
  MutexLock l(&mu_);
  pending_->Put(key, record);
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

Status GroupCommitter::ClearDescriptors(const std::vector<Extent>& extents) {
  AlignedBuffer zero(kUnit, kUnit);
  if (!zero.data()) return Status::OutOfCapacity("NVMe tier: cannot allocate 4 KiB to clear descriptors");
  std::memset(zero.data(), 0, kUnit);
  std::vector<IoRequest> reqs(extents.size());
  for (std::size_t i = 0; i < extents.size(); ++i) {
    reqs[i].op = IoOp::kWrite;
    reqs[i].offset = extents[i].offset + extents[i].length - kUnit;  // the descriptor is the extent's last unit
    reqs[i].src = zero.data();  // only read by the engine: one buffer serves every request
    reqs[i].len = static_cast<std::uint32_t>(kUnit);
  }
  int first_err = 0;
  std::uint64_t where = 0;
  RunToCompletion(*engine_, reqs, [&](std::size_t i, int err) {
    if (err != 0 && first_err == 0) {
      first_err = err;
      where = extents[i].offset;
    }
  });
  if (first_err == 0) return Status::Ok();
  return Status::IoError(fmt::format(
      "NVMe tier: clearing the descriptor of the released extent at offset {} of the data file failed: {}; the tier "
      "refuses further writes: reopen it",
      where, std::strerror(-first_err)));
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
    bool sync_data = pending_data_ || !release.empty();
    pending_data_ = false;
    std::uint64_t upto = staged_seq_;
    const std::uint64_t commit = durable_commit_;
    l.Unlock();

    Status s;
    if (!release.empty()) s = ClearDescriptors(release);
    if (s.ok() && sync_data && before_sync_) s = before_sync_(commit);
    if (s.ok() && sync_data) {
      int err = engine_->SyncData();
      if (err < 0) {
        s = Status::IoError(fmt::format(
            "NVMe tier: fdatasync of the data file failed: {}; blocks written since the last commit are "
            "not durable and the tier refuses further writes: reopen it (recovery keeps every block that "
            "was durable)",
            std::strerror(-err)));
      }
    }
    const bool index_write = batch->Count() > 0;
    if (s.ok() && index_write) {
      batch->Put(rocksdb::Slice(kCommitKey.data(), kCommitKey.size()), IndexStore::EncodeCommit(commit + 1));
      s = index_->Write(batch.get(), /*sync=*/true);
      // Record the new commit in the superblock at once (no sync: it is made durable by the next
      // commit's fdatasync at the latest), so damage to the log's last records is detectable too.
      if (s.ok() && before_sync_) s = before_sync_(commit + 1);
    }
    // The extents go back to the allocator before any waiter wakes, so a Flush that returns sees
    // them free. Safe to reuse now: the records that dropped them are durable.
    if (s.ok() && !release.empty()) release_(std::move(release));

    l.Lock();
    leader_ = false;
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
