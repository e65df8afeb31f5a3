// Group commit of index changes: clear released descriptors, superblock watermark, data
// fdatasync, then one synced RocksDB WriteBatch.
//
// Stage() queues an index mutation (in the order the caller applied it to the in-memory map) and
// returns its sequence number. WaitDurable(seq) returns once that mutation is durable: the first
// waiter becomes the leader and commits everything staged so far; later waiters ride along
// (leader/follower). One commit, in this order:
//   1. zero the descriptor unit (the last 4 KiB) of every extent released by the staged changes, so
//      a rebuild from the data file can never resurrect it;
//   2. `before_sync(c)`: the tier writes its superblock recording commit c (the last one known
//      durable in the index) through the engine;
//   3. one fdatasync of the data file (when anything was written: data, clears or superblock);
//   4. one WriteBatch with WAL sync holding the staged changes and the commit counter c + 1;
//   5. `before_sync(c + 1)` again: the superblock records the new commit right away (made durable
//      by the next commit's fdatasync at the latest), so it never claims more than the index holds
//      and is behind it by at most the commit in flight.
// Extents handed to Stage are released (the `release` callback) only after step 4, so a crash
// never finds a durable record over reused space, and reused space never holds a stale descriptor.
// A failed commit is permanent (as after a failed fsync nothing can be trusted): every later
// WaitDurable returns the same error until the tier is reopened.
// Async mode: a background thread commits at most `interval` after the first staged mutation.
// Thread-safety: all methods are thread-safe. Lock order: the tier's mutex may be held while
// calling Stage; never while calling WaitDurable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/common/mutex.h"
#include "terrace/status.h"
#include "tiers/nvme/extent_allocator.h"

namespace rocksdb {
class WriteBatch;
}

namespace terrace::nvme {

class IoEngine;
class IndexStore;

class GroupCommitter {
 public:
  // Returns extents to the allocator. Called by the commit leader without the committer's lock,
  // after the records that dropped them are durable and before any WaitDurable covering them returns.
  using ReleaseFn = std::function<void(std::vector<Extent>&&)>;
  // Writes (does not sync) the superblock recording `durable_commit`; called by the leader before
  // each data fdatasync and after each index write.
  using BeforeSyncFn = std::function<Status(std::uint64_t durable_commit)>;
  // `commit`: the index's commit counter at open. `interval` > 0 starts the background committer
  // (async mode).
  GroupCommitter(IoEngine* engine, IndexStore* index, ReleaseFn release, BeforeSyncFn before_sync,
                 std::uint64_t commit, std::chrono::microseconds interval);
  ~GroupCommitter();  // stops the background thread; does not commit (call Flush first)

  // Queues a put of `record` under `key` (both encoded); `data_written` says the data file must be
  // synced first. `release` (may be empty-length) is freed after the mutation is durable.
  std::uint64_t StagePut(std::string key, std::string record, Extent release);
  std::uint64_t StageDelete(std::string key, Extent release);
  // Queues only the clearing and release of `release` (an extent written but never indexed).
  std::uint64_t StageClear(Extent release);

  Status WaitDurable(std::uint64_t seq);
  // Makes every mutation staged so far durable.
  Status Flush();
  // OK, or the permanent commit failure.
  Status health() const;

  std::uint64_t commits() const;  // number of group commits performed
  std::uint64_t durable_commit() const;  // the index commit counter, as last made durable

 private:
  void BackgroundLoop(std::chrono::microseconds interval);

  Status ClearDescriptors(const std::vector<Extent>& extents);

  IoEngine* engine_;
  IndexStore* index_;
  ReleaseFn release_;
  BeforeSyncFn before_sync_;

  mutable Mutex mu_;
  CondVar cv_; // durable_seq_ / leader_ / failed_ changes
  CondVar bg_cv_;  // wakes the background committer
  std::unique_ptr<rocksdb::WriteBatch> pending_ TERRACE_GUARDED_BY(mu_);
  std::vector<Extent> pending_release_ TERRACE_GUARDED_BY(mu_);
  bool pending_data_ TERRACE_GUARDED_BY(mu_) = false;  // a staged put needs a data sync
  std::uint64_t staged_seq_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t durable_seq_ TERRACE_GUARDED_BY(mu_) = 0;
  bool leader_ TERRACE_GUARDED_BY(mu_) = false;
  bool stop_ TERRACE_GUARDED_BY(mu_) = false;
  std::uint64_t commits_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t durable_commit_ TERRACE_GUARDED_BY(mu_) = 0;  // written by the leader only
  Status failed_ TERRACE_GUARDED_BY(mu_);
  std::thread bg_;
};

}  // namespace terrace::nvme
