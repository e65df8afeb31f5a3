// Group commit of index changes. The index is the commit point; the data file's descriptors are
// written after it, so a descriptor never describes a block the index did not commit (a put whose
// commit never ran leaves data without a descriptor, which no rebuild can bring back).
//
// Stage() queues an index mutation (in the order the caller applied it to the in-memory map) and
// returns its sequence number. WaitDurable(seq) returns once that mutation is durable: the first
// waiter becomes the leader and commits everything staged so far; later waiters ride along
// (leader/follower). One commit, in this order:
//   1. one fdatasync of the data file when a staged put wrote data (the blocks' bytes are on the
//      media before any record points at them);
//   2. one WriteBatch with WAL sync holding the staged changes, the commit counter c + 1 and the
//      redo record (kRedoKey: the keys put and the extents released by this commit);
//   3. the descriptor unit (the last 4 KiB) of every extent put by this commit (unless released by
//      it too) is written, and the descriptor unit of every extent released is zeroed;
//   4. one fdatasync of the data file;
//   5. `before_sync(c + 1)` writes (does not sync) the tier's superblock recording commit c + 1.
// Step 1 also syncs the previous commit's step 5, so the durable superblock records c or c + 1
// whenever the index holds c + 1. The superblock at c with the index at c + 1 (a crash between 2
// and 5, or before 5 was synced) makes the next open redo step 3 from the redo record
// (NvmeTier::RedoLastCommit); the superblock at c + 1 says step 4 completed. So once a commit returns, every indexed
// block has its descriptor and no released extent has one: a rebuild from the data file finds
// exactly the committed blocks and never resurrects an erased or overwritten one.
// Extents handed to Stage are released (the `release` callback) only after step 4, so reused space
// never holds a stale descriptor and a crash never finds a durable record over reused space.
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
#include "tiers/nvme/format.h"

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
  // Writes (does not sync) the superblock recording `durable_commit`; called by the leader once a
  // commit's descriptors are durable (step 5).
  using BeforeSyncFn = std::function<Status(std::uint64_t durable_commit)>;
  // `commit`: the index's commit counter at open. `interval` > 0 starts the background committer
  // (async mode); Unavailable when its thread cannot be started.
  static Result<std::unique_ptr<GroupCommitter>> Create(IoEngine* engine, IndexStore* index, ReleaseFn release,
                                                        BeforeSyncFn before_sync, std::uint64_t commit,
                                                        std::chrono::microseconds interval);
  ~GroupCommitter();  // stops the background thread; does not commit (call Flush first)

  // Queues a put of `desc` (its key and record; its data already written to the data file).
  // `release` (may be empty-length) is freed after the mutation is durable. The descriptor is
  // written by the commit, after the index.
  std::uint64_t StagePut(const Descriptor& desc, Extent release);
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

  // The redo record of a commit: the keys it put and the extents it released.
  struct Redo {
    std::vector<BlockKey> keys;
    std::vector<Extent> released;
  };
  static std::string EncodeRedo(const Redo& redo);
  // Corruption when the bytes are not a redo record.
  static Result<Redo> DecodeRedo(std::string_view bytes);
  // Step 3 of a commit: writes the descriptors `puts` (skipping any whose extent is in `released`)
  // and zeroes the descriptor unit of every extent in `released`, in one batch. Does not sync.
  static Status WriteDescriptorUnits(IoEngine& engine, std::span<const Descriptor> puts,
                                     std::span<const Extent> released);

 private:
  void BackgroundLoop(std::chrono::microseconds interval);

  Status SyncData(std::string_view what);

  IoEngine* engine_;
  IndexStore* index_;
  ReleaseFn release_;
  BeforeSyncFn before_sync_;

  mutable Mutex mu_;
  CondVar cv_; // durable_seq_ / leader_ / failed_ changes
  CondVar bg_cv_;  // wakes the background committer
  std::unique_ptr<rocksdb::WriteBatch> pending_ TERRACE_GUARDED_BY(mu_);
  std::vector<Extent> pending_release_ TERRACE_GUARDED_BY(mu_);
  std::vector<Descriptor> pending_puts_ TERRACE_GUARDED_BY(mu_);  // descriptors to write after the index
  bool pending_data_ TERRACE_GUARDED_BY(mu_) = false;  // a staged put needs a data sync
  // The last commit's step 5 is not synced yet. True at first: the previous session's last step 5
  // (or a killed process's) may not be durable, and the first index write must not pass it.
  bool superblock_unsynced_ TERRACE_GUARDED_BY(mu_) = true;
  std::uint64_t staged_seq_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t durable_seq_ TERRACE_GUARDED_BY(mu_) = 0;
  bool leader_ TERRACE_GUARDED_BY(mu_) = false;
  bool stop_ TERRACE_GUARDED_BY(mu_) = false;
  std::uint64_t commits_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t durable_commit_ TERRACE_GUARDED_BY(mu_) = 0;  // written by the leader only
  Status failed_ TERRACE_GUARDED_BY(mu_);
  GroupCommitter(IoEngine* engine, IndexStore* index, ReleaseFn release, BeforeSyncFn before_sync,
                 std::uint64_t commit);  // no thread: Create starts it
  std::thread bg_;
};

}  // namespace terrace::nvme
