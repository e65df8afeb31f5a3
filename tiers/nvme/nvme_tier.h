// NvmeTier: the persistent tier. Blocks live in 4 KiB-aligned extents of one preallocated data
// file (or a block device) written with io_uring + O_DIRECT. Each extent is the block's data
// followed by a 4 KiB descriptor (key, length, checksum, codec, generation, store uuid), so the
// data file describes itself; a RocksDB index maps each key to its extent and is a cache of those
// descriptors that RebuildIndex can recreate. docs/nvme-format.md describes the layout.
//
// Contract (beyond terrace::Tier's):
// - Durability: kSync acknowledges a put once its data is fdatasync'ed and its index entry is
//   written with a synced WAL (group commit: concurrent puts share both). kAsync (default)
//   acknowledges once the data write completed; the next group commit (at most
//   group_commit_interval later, or Flush()) makes it durable. Data is always synced before the
//   index entries that point at it are written, and every Get verifies the checksum.
// - Overwrite writes a fresh extent, switches the index, and frees the old extent only once the
//   switch is durable and no reader is still using it; its descriptor is cleared first, so a
//   rebuild never resurrects it. Erase frees likewise.
// - Open never serves a shorter history than was acknowledged: an index that lost records (its
//   commit counter is behind the superblock's), an index that is missing, empty or belongs to
//   another store, or a damaged RocksDB log is refused with Corruption naming
//   `terrace store recover`; nothing in the index is changed before that check.
// - One process per data area: the data file (or device) is flock'ed, exclusively for read-write,
//   shared for read_only; a second opener gets Unavailable ("in use by another process").
// - Creation is atomic: a directory store is built as terrace.data.creating and renamed last; a
//   block device gets its superblock last. An interrupted creation is completed or discarded by
//   the next open.
// - Open recovers the in-memory map and the free-space map from one scan of the index (no data
//   reads unless verify_on_open), dropping records that are malformed, out of range or overlap a
//   newer record; see recovery_report(). read_only reports them without dropping.
// - After a failed group commit (fdatasync, descriptor clear or index write error, a full file
//   system included) the tier refuses writes with a non-retryable IoError until reopened; reads
//   keep working; RocksDB is not called again except to close it.
// - Stats: read_latency / write_latency are per device I/O (submission to completion, as fio's
//   clat), not per Put / Get; a block larger than 1 MiB is several I/Os.
// Thread-safety: every method may be called concurrently; the static functions take the lock on
// the data area themselves. Locks (checked by scripts/thread_safety.sh where annotated), in the
// order they may nest - a later one may be taken while an earlier one is held, never the reverse:
//   1. mu_ (map_, alloc_, detached_, used bytes, generations): short bookkeeping, no I/O under it;
//      only GroupCommitter::Stage* (its mutex, a leaf) and the logger are called with it held.
//   2. sb_mu_ (sb_, sb_unit_): held across the superblock's own write (PersistSuperblockLocked);
//      never held while taking mu_. Taken by the committer's before-sync callback with the
//      committer's mutex released.
//   3. reg_mu_ (external_): held while re-registering fixed buffers, which takes every ring's
//      mutex in the I/O engine (uring_engine.cpp, std::mutex: a try-lock over a ring array the
//      analysis cannot follow, so not annotated).
//   Leaves (nothing is taken while holding them): GroupCommitter::mu_ (released around the index
//   write, the data sync and both callbacks - the release callback takes mu_), StagingPool::mu_,
//   IndexStore::failure_mu_, FaultEngine::mu_, PowerCut::State::mu. No tier lock is held across
//   a wait for I/O except reg_mu_ / sb_mu_ around the synchronous requests above.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/key_map.h"
#include "src/common/mutex.h"
#include "terrace/log.h"
#include "terrace/options.h"
#include "terrace/tier.h"
#include "tiers/nvme/extent_allocator.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/io_engine.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace terrace {

namespace nvme {
class IndexStore;
class GroupCommitter;
class StagingPool;
}  // namespace nvme

// What Open found and dropped. Dropped records are erased from the index at open (read_only: kept).
// The group commit an index holds one ahead of its data file's superblock, with its redo record
// (cut short between its index write and its descriptors, or left pending by a rebuild; the next
// read-write open finishes it: docs/nvme-format.md).
struct PendingGroupCommit {
  std::vector<BlockKey> keys;                 // put by it (their descriptors may be missing)
  std::vector<std::uint64_t> released_offsets;  // extents it released (their descriptors may remain)
};

struct RecoveryReport {
  static constexpr std::size_t kMaxKeys = 8;
  bool created = false;                 // a new, empty store was created
  std::uint64_t records_scanned = 0;    // block records in the index
  std::uint64_t blocks_recovered = 0;   // records kept
  std::uint64_t bytes_in_use = 0;       // sum of kept block sizes
  std::uint64_t dropped_malformed = 0;  // undecodable key or record
  std::uint64_t dropped_out_of_range = 0;
  std::uint64_t dropped_overlap = 0;    // overlapped a record with a higher generation
  std::uint64_t dropped_checksum = 0;   // verify_on_open only
  // The last group commit was cut short after its index write (or a rebuild left records kept from
  // the old index pending): the descriptors it still had to write and the released extents it
  // still had to clear were written at open.
  std::uint64_t redo_descriptors = 0, redo_clears = 0;
  std::vector<std::string> dropped_keys;  // the first kMaxKeys, as BlockKey::ToString (or hex)
  double seconds = 0;                   // time spent in Open
  // Conditions under which "durable" is weaker than it says (tmpfs, O_DIRECT refused), one line
  // each; also logged as warnings and shown in Stats().detail.
  std::vector<std::string> warnings;

  std::uint64_t dropped() const {
    return dropped_malformed + dropped_out_of_range + dropped_overlap + dropped_checksum;
  }
  // The index's damaged records (malformed, out of range, overlapping): a read-write open refuses
  // them, a read-only one sets them aside. DamagedRecordsText: their counts by reason and first keys.
  std::uint64_t damaged_records() const { return dropped_malformed + dropped_out_of_range + dropped_overlap; }
  std::string DamagedRecordsText() const;
  std::string ToString() const;
};

// What ScanDataFile found. Only descriptors with this store's uuid count.
struct DataScanReport {
  static constexpr std::size_t kMaxKeys = 8;
  std::uint64_t blocks = 0;            // blocks reported: the newest valid extent of each key
  std::uint64_t bytes_in_blocks = 0;   // sum of their sizes
  std::uint64_t descriptors = 0;       // valid descriptors of this store
  std::uint64_t corrupt = 0;           // valid descriptor, but the data fails its checksum (skipped)
  std::uint64_t superseded = 0;        // an older generation of a key, or overlapped by a newer extent
  std::uint64_t foreign = 0;           // intact descriptors of another store (an earlier format of the
                                       // area), of any desc_version; block data shaped like one counts too
  std::uint64_t damaged = 0;           // units with the descriptor magic that do not decode (a damaged
                                       // descriptor: its block cannot be found by a scan)
  std::uint64_t bytes_scanned = 0;     // bytes of the data area read
  std::uint64_t max_generation = 0;
  double seconds = 0;
  std::vector<std::string> corrupt_keys;  // the first kMaxKeys, as BlockKey::ToString
  std::string ToString() const;
};

// What RebuildIndex did.
struct RebuildReport {
  DataScanReport scan;
  std::uint64_t blocks_indexed = 0;   // records written to the fresh index
  std::uint64_t corrupt_skipped = 0;  // = scan.corrupt
  std::uint64_t bytes_scanned = 0;    // = scan.bytes_scanned
  double seconds = 0;                 // whole rebuild
  std::filesystem::path moved_aside;  // where the old index directory went; empty: there was none
  // Entries taken from the old index's record of a last group commit cut short before its
  // descriptors (docs/nvme-format.md, "Scan and rebuild"); 0: none was pending.
  std::uint64_t cut_commit_entries = 0;
  // Blocks the scan did not find (a damaged or missing descriptor) or found only in an older
  // version, taken from the old index because their data still passes its checksum.
  std::uint64_t kept_from_old_index = 0;
  // Blocks the old index listed in a version the new one does not hold (that version's data intact
  // nowhere: a zeroed or overwritten extent, a truncated data file; the new index may hold an older
  // version or none), the first kMaxKeys as BlockKey::ToString, and the
  // old index's records too damaged to name a block. 0 without an old index of this store. With
  // old_index_stale (the old index is behind the data file: it may name blocks erased since, so none
  // of its records was kept), the blocks are possibly lost, not surely.
  static constexpr std::size_t kMaxKeys = 8;
  std::uint64_t lost_from_old_index = 0, old_records_unreadable = 0;
  bool old_index_stale = false;
  std::vector<std::string> lost_keys;
  std::uint64_t bytes_indexed = 0;  // sum of the sizes of the records written
  std::string ToString() const;
};

using ScanProgressFn = std::function<void(std::uint64_t done_bytes, std::uint64_t total_bytes)>;
// Called by RebuildIndex after each of its steps that changes files ("building", "manifest", "records",
// "last-record", "closed", "finished", "moved-aside", "in-place", and for a killed rebuild's
// leftovers "leftover-removed" / "leftover-put-in-place"): a test ends the process there to
// simulate a kill.
using RebuildStepFn = std::function<void(std::string_view step)>;

// Seams for tests and drills: what the tier uses for I/O. Every read, write and sync of the data
// file after it is opened (superblock updates included) goes through the engine, so a wrapping
// engine (fault injection, simulated power loss) sees all of them.
struct NvmeOpenHooks {
  nvme::IoEngineFactory engine;       // data-file I/O; empty: the io_uring engine
  rocksdb::Env* index_env = nullptr;  // Env for the RocksDB index (null: rocksdb::Env::Default()); not owned,
                                      // must outlive the tier
  // Tests: runs at the named steps of a directory store's creation ("index": before its index is
  // created; "index-created": after, before terrace.data.creating is renamed to terrace.data).
  std::function<void(std::string_view step)> at_creation_step;
};

class NvmeTier final : public Tier {
 public:
  // Unavailable (besides the errors of opening and recovering the files) when the group-commit
  // thread of async durability cannot be started.
  static Result<std::unique_ptr<NvmeTier>> Open(const NvmeTierOptions& options);
  static Result<std::unique_ptr<NvmeTier>> OpenWithHooks(const NvmeTierOptions& options, const NvmeOpenHooks& hooks);
  // As Open, with the raw I/O engine made by `factory` (tests wrap the io_uring engine in a
  // FaultInjectingIoEngine; see tiers/nvme/fault_engine.h). Same as OpenWithHooks({factory}).
  static Result<std::unique_ptr<NvmeTier>> OpenWithEngine(const NvmeTierOptions& options,
                                                         const nvme::IoEngineFactory& factory);
  // Reads the whole data area of the store `options` names (path, index_dir; capacity_bytes may be
  // 0) and reports every block it holds: a valid descriptor of this store whose data matches its
  // checksum; the newest generation of each key wins, overlapping extents are resolved by
  // generation. Needs no index and changes nothing. Takes a shared lock on the data area (fails
  // with Unavailable while a read-write tier has it open). Fails with InvalidArgument at the first
  // intact descriptor of another desc_version (another Terrace version wrote that extent: it is
  // not free space, so a report without it would not be true), before `on_block` runs.
  // `on_block` runs once per block (with its extent's byte offset in the data file), in no
  // particular order, after the scan; `progress` (optional) after each chunk read.
  static Result<DataScanReport> ScanDataFile(
      const NvmeTierOptions& options,
      const std::function<void(const BlockKey&, const BlockDesc&, std::uint64_t generation, std::uint64_t offset)>&
          on_block,
      const ScanProgressFn& progress = {});
  // Writes a fresh index from ScanDataFile, under an exclusive lock on the data area. An existing
  // index directory is renamed to "<index>.damaged-<UTC yyyymmddThhmmss>" (never deleted) once the
  // new one is complete, and only when it is this store's index: one whose manifest names another
  // store, one another process holds open, or a folder that is not a RocksDB index is refused
  // (InvalidArgument, nothing changed), and so is this store's index holding an intact block record
  // of another record_version (before the scan) and a data file holding an intact descriptor of
  // another desc_version (found by the scan): another Terrace version wrote them, and a rebuild by
  // this one would leave their extents out of the index, as free space later puts overwrite. When
  // the old index opens, it fills what the scan cannot see: the last group commit if it was cut
  // short before its descriptors (kept pending in the new index, so the next read-write open writes
  // them), and records whose descriptor is damaged or missing but whose data passes its checksum
  // (pending the same way: the next read-write open writes their descriptors). The data file is not
  // written.
  // Crash-safe: the new index is built in "<index>.rebuilding" (marked unfinished until its last
  // record is synced), the old index moved aside only then, and the new one renamed into place; a
  // rebuild finds what a killed one left there and removes it, or, when it is finished and the old
  // index already moved aside, puts it in place first (docs/nvme-format.md, "Scan and rebuild").
  // A "<index>.rebuilding" that is not such a leftover of this store is refused (InvalidArgument).
  // `at_step` (tests): called after each step that changes files, with the step's name.
  static Result<RebuildReport> RebuildIndex(const NvmeTierOptions& options, const ScanProgressFn& progress = {},
                                            const RebuildStepFn& at_step = {});
  // One reason RebuildIndex would refuse to start (it changes nothing then).
  struct RebuildRefusal {
    std::filesystem::path path;  // what it is about: the index directory, or "<index>.rebuilding"
    bool in_the_way = false;     // about "<index>.rebuilding", in the way of the rebuild (not the index directory)
    std::string reason;          // why, without advice; `status`'s message starts with it
    Status status;               // what RebuildIndex fails with when this is the only reason
    // Entries of the index directory an index never writes, when moving them out of it is all it
    // takes to lift this refusal; empty otherwise.
    std::vector<std::filesystem::path> strays;
    // The index holds block records another Terrace version wrote: neither a fix in place nor
    // another index directory lifts it; only the Terrace version that wrote them may rebuild.
    bool another_version = false;
  };
  // Every reason a rebuild of the store `sb` would refuse to start: first what lies at
  // "<index>.rebuilding" (anything but nothing or a killed rebuild's leftover of this store), then the
  // index directory `index` (anything but absent, empty or this store's index; then this store's
  // index holding block records of another record_version). Empty when it would
  // start. The one test RebuildIndex, CheckIndexDirForRebuild and the recover advice apply; opens an
  // index only read-only and changes nothing.
  static std::vector<RebuildRefusal> RebuildRefusals(const std::filesystem::path& index, const nvme::Superblock& sb,
                                                     const std::shared_ptr<Logger>& logger);
  // RebuildRefusals for the store `options` names, its superblock read under a shared lock on the
  // data area; an error when that cannot be read (no store; Unavailable while a read-write tier has
  // it open). Changes nothing.
  static Result<std::vector<RebuildRefusal>> RebuildTargetRefusals(const NvmeTierOptions& options);
  // OK when RebuildRefusals is empty; else the status RebuildIndex refuses with: the one refusal's,
  // or for several, one naming every reason (the first one's code).
  static Status CheckIndexDirForRebuild(const std::filesystem::path& index, const nvme::Superblock& sb,
                                        const std::shared_ptr<Logger>& logger);

  // Makes acknowledged puts durable, records the final commit in the superblock, flushes the
  // index, then closes the files. Every failure is logged; the first is returned (the store is
  // closed either way, and a reopen recovers what was acknowledged). Call it last: no other
  // method may be called after it. A second call does nothing and returns OK.
  Status Close();
  ~NvmeTier() override;  // Close(), its error logged only
  NvmeTier(const NvmeTier&) = delete;
  NvmeTier& operator=(const NvmeTier&) = delete;

  const TierCaps& caps() const override { return caps_; }
  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override;
  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override;
  Result<BlockDesc> Lookup(const BlockKey& key) const override;
  Status Erase(const BlockKey& key) override;
  // Submit every op's I/O together (one io_uring submission per queue-depth window).
  std::vector<Status> PutBatch(std::span<const PutOp> ops) override;
  std::vector<Status> GetBatch(std::span<GetOp> ops) override;
  // Reads only the units covering each range: [offset, offset + length) rounded out to 4 KiB
  // within the block's extent. A range whose offset is a multiple of 4 KiB, into 4 KiB-aligned
  // memory with room for its length rounded up, is read straight into op.out; any other goes
  // through a staging buffer and only the range's bytes are copied out. Every op's I/O is
  // submitted together, as GetBatch's is, and each op's extent is held (as a reader) until its
  // read is done, so a concurrent Erase or overwrite never hands the extent to another block under
  // it. Not verified (terrace/tier.h); counted in Stats().hits and bytes_read (the range's length).
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override;
  Status Pin(const BlockKey& key) override;
  Status Unpin(const BlockKey& key) override;
  Status Flush() override;
  std::uint64_t used_bytes() const override;
  // The data area's bytes the allocator does not hold free (a block's extent is its bytes rounded
  // up to 4 KiB plus one 4 KiB unit, so this exceeds used_bytes()): the figure
  // Stats().allocated_bytes reports. O(1) (the allocator counts its free bytes) for the store's
  // per-Put room and watermark checks.
  std::uint64_t allocated_bytes() const override;
  std::uint64_t block_count() const override;
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override;
  TierStatsSnapshot Stats() const override;

  // Registers memory the caller owns (e.g. the host tier's arena) with io_uring, so Put / Get
  // spans inside it that are 4 KiB-aligned use fixed-buffer I/O without staging. Replaces any
  // previous external registration; `bufs` must stay valid until replaced or the tier closes.
  // Waits for in-flight I/O. Unavailable (and nothing changes) if the kernel refuses.
  Status RegisterExternalBuffers(std::span<const iovec> bufs);
  Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) override;

  const RecoveryReport& recovery_report() const { return report_; }
  // What the index's pending group commit changes in the data file: set only by a read-only open
  // that found one (a read-write open finishes it); nullopt when none is pending or its redo record
  // does not read.
  std::optional<PendingGroupCommit> PendingCommit() const;
  bool read_only() const { return options_.read_only; }
  std::uint64_t free_bytes() const;                // allocator free space (includes pending frees: no)
  // I/Os that went through a staging buffer (unaligned memory, or a tail without room): each one
  // is a copy; a Get into aligned memory with room for the rounded-up tail needs none.
  std::uint64_t staged_ios() const { return staged_ios_.load(std::memory_order_relaxed); }
  // Chunks read along in the request of the chunk before them (GetBatch over blocks adjacent on
  // disk whose buffers are laid out as caps().read_gap_bytes describes): requests saved.
  std::uint64_t merged_reads() const { return merged_reads_.load(std::memory_order_relaxed); }
  // Bytes block reads (Get, GetBatch, GetRangeBatch) asked the device for: whole 4 KiB units, the
  // gaps merged reads carry included. A ranged read adds only the units around its range.
  std::uint64_t device_read_bytes() const { return device_read_bytes_.load(std::memory_order_relaxed); }
  // The per-I/O latency histograms behind Stats()' p50 / p99, cumulative since open: a caller
  // copies one (MergeFrom) before and after an interval to take that interval's latency alone.
  const LatencyHistogram& read_latency() const { return counters_.read_latency; }
  const LatencyHistogram& write_latency() const { return counters_.write_latency; }

 private:
  struct Entry {
    nvme::Record rec;
    std::uint32_t pins = 0;
    std::uint32_t readers = 0;  // Gets reading this extent now
  };
  // An extent no longer in map_ (overwritten, erased, dropped) that Gets are still reading.
  struct Detached {
    std::uint32_t readers = 0;
    std::uint64_t release_bytes = 0;  // > 0: the commit released it; free when readers reach 0
  };
  // One I/O unit of a block: at most one staging buffer long.
  struct Chunk {
    std::size_t op = 0;
    std::uint64_t file_offset = 0;
    std::byte* dst = nullptr;        // reads: the caller's memory for this chunk
    const std::byte* src = nullptr;  // writes: the caller's bytes for this chunk
    std::uint32_t len = 0;     // bytes of the block in this chunk
    // reads: bytes the I/O reads before the first one the caller wants (a range that starts
    // inside a unit); a chunk with skip > 0 is staged, and its bytes are copied from stage + skip
    std::uint32_t skip = 0;
    std::uint32_t io_len = 0;  // skip + len rounded up to the unit
    // reads: bytes of the caller's buffer past dst + io_len that may be overwritten (a request
    // that reads the next chunk along reads the gap before it into them)
    std::uint64_t room_after = 0;
    bool staged = false;
  };
  // One op of a PutBatch on its way through the steps (PutBatch in nvme_tier.cpp).
  struct PutPlan {
    bool allocated = false;         // holds the extent below (allocated, not yet given back)
    std::uint64_t offset = 0;       // the extent's first byte in the data area
    std::uint64_t generation = 0;   // written into its descriptor and index record
    std::uint32_t pending = 0;      // its data chunks still being written
  };
  // One op of a GetBatch or GetRangeBatch.
  struct GetPlan {
    nvme::Record rec;             // what the index held when the read began
    bool reading = false;         // found: counted in its entry's (or detached extent's) readers
    bool bad = false;             // the last read of it failed its checksum
    std::uint32_t pending = 0;    // its chunks still being read
  };

  NvmeTier(const NvmeTierOptions& options, const NvmeOpenHooks& hooks);
  // nvme_open.cpp
  void SetCapacity(std::uint64_t capacity);
  void Warn(std::string message);  // logs a warning and keeps it in report_.warnings
  Status OpenFiles();
  // One look at a directory store's files; sets *again (and returns OK) when another process
  // changed them meanwhile (renamed or created terrace.data.creating) or this one discarded a
  // leftover, so the caller looks again.
  Status OpenDirectoryStore(bool* again);
  // open, flock, engine; *open_errno (may be null) receives the errno of a failed open(2), else 0.
  // creating_path_ is opened with O_NOFOLLOW (a symbolic link fails with ELOOP).
  Status OpenFd(const std::filesystem::path& path, bool create, int* open_errno = nullptr);
  void CloseFd();  // undoes OpenFd: the engine, the lock, the descriptor
  // Removes terrace.data.creating, the file open and locked here, then CloseFd. The name goes while
  // the lock is held, so a process that opened the file meanwhile finds it gone once it has the lock
  // (FdIsAt) and never writes into a file about to be removed.
  std::error_code DiscardCreating();
  Status CreateInDirectory(bool* again);
  Status FinishCreation(bool fresh_sb);  // index + manifest, then rename (directory) / superblock (device)
  // Open phase. These run only inside OpenWithHooks, on its thread, before the tier is returned
  // and before committer_ (the only thread the tier starts) exists, so nothing else can reach
  // *this: they read and write sb_, sb_unit_, map_, alloc_, used_bytes_ and next_generation_
  // without taking sb_mu_ / mu_, and some call helpers (ReserveGenerations, WriteFreshSuperblock)
  // that take sb_mu_ themselves, so holding it across them is not possible. The analysis cannot
  // see "not yet shared", hence TERRACE_NO_THREAD_SAFETY_ANALYSIS on exactly these.
  // terrace.data.creating left by an interrupted creation: completed, or discarded (*again) when
  // provably Terrace's and not far enough along; see docs/nvme-format.md, "Creation".
  Status ResumeCreation(bool* again) TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  // The refusal of a terrace.data.creating that `what` shows is not a creation's own file (a link,
  // a used store's data file): names it, says it was left as it is and how to open it as a store.
  Status NotAnInterruptedCreation(std::string_view what) const;
  Status OpenExisting(bool block_device) TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  // InvalidArgument naming the first non-zero byte when the first or last MiB of the `size`-byte
  // data area (a device, or a data file reformat would take) is not all zero: it may hold
  // something else's data, which formatting would destroy.
  Status CheckDeviceBlank(std::uint64_t size);
  // After the superblock decoded from one slot: a warning (RecoveryReport::warnings) for each slot
  // that carries the magic but fails its check, so a lost second copy of the header is said.
  void WarnDamagedSuperblockSlots();
  Status FormatBlockDevice() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  Status Reformat();
  Status FormatNewStore() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  Status OpenIndexOfExisting() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  // Creates index_path_ and its parents (IoError naming it when it cannot).
  Status MakeIndexDirectory();
  Status CreateIndex() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  Status WriteFreshSuperblock();
  Status MoveIndexAside(std::string_view why);
  Status CheckDurableMedium();
  Status Recover() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  // Open: the index of an existing store is opened read-only for every check that may refuse the
  // open (which then changes no file); Recover reopens it read-write after them (not read_only).
  Status ReopenIndexWritable() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  // After Recover: finishes a group commit cut short between its index write and its descriptors
  // (group_commit.h), when the index is one commit ahead of the superblock.
  Status RedoLastCommit() TERRACE_NO_THREAD_SAFETY_ANALYSIS;
  Status VerifyAllBlocks();
  // One synchronous request through engine_; `what` describes it for the error ("writing the superblock of").
  Status EngineIo(nvme::IoOp op, std::uint64_t offset, std::byte* buf, std::uint32_t len, std::string_view what);
  Status EngineSync(std::string_view what);
  // Writes sb_ (sequence + 1) into its slot of the superblock through the engine.
  Status PersistSuperblockLocked() TERRACE_REQUIRES(sb_mu_);
  // Makes sure every generation below `upto` may be written: raises generation_limit durably.
  Status ReserveGenerations(std::uint64_t upto);
  std::string RecoverAdvice() const;  // "run `terrace store recover --dir D [--index-dir I]`"
  Status WithRecoverAdvice(Status s) const;  // a Corruption gains RecoverAdvice()
  // nvme_io.cpp
  // Split a block into chunks of at most one staging buffer; `file_offset` is a multiple of the
  // unit. A read of `len` bytes into `dst` starting `skip` (< kUnit) bytes past file_offset (a
  // range that begins inside a unit; the first chunk is then staged): `room` (>= len) is how many
  // bytes `dst` holds, so a tail that rounds up past len into that room needs no staging. A write
  // of `src`: a tail short of a unit is always staged (padded with zeros).
  void PlanReadChunks(std::size_t op, std::uint64_t file_offset, std::uint32_t skip, std::byte* dst, std::uint64_t len,
                      std::uint64_t room, std::vector<Chunk>* out) const;
  void PlanWriteChunks(std::size_t op, std::uint64_t file_offset, std::span<const std::byte> src,
                       std::vector<Chunk>* out) const;
  // Exactly one of dst (a read) and src (a write) is set; skip is 0 for a write.
  void PlanChunks(std::size_t op, std::uint64_t file_offset, std::uint32_t skip, std::byte* dst, const std::byte* src,
                  std::uint64_t len, std::uint64_t room, std::vector<Chunk>* out) const;
  void RunChunks(nvme::IoOp op, std::span<Chunk> chunks, const std::function<void(std::size_t, int)>& done);
  // (*index)[k]: the fixed-buffer index of chunk k's memory when its whole I/O length lies in one
  // registered external region, else -1 (staged chunks: -1); left empty (no allocation) when no
  // external region is registered. Takes reg_mu_ once.
  void ResolveExternalBuffers(nvme::IoOp op, std::span<const Chunk> chunks, std::vector<int>* index) const;
  Status IoStatus(nvme::IoOp op, int err, const BlockKey& key, std::uint64_t offset) const;
  // nvme_tier.cpp
  Status ReadOnlyError(std::string_view op) const;
  // PutBatch's steps, in order; st[i] holds op i's first failure and a failed op is skipped.
  void CheckPuts(std::span<const PutOp> ops, std::vector<Status>& st) const;  // sizes against desc and capacity
  void AllocateExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, std::vector<Status>& st);
  // Reserves the generations of every allocated op (its descriptor, written by the group commit,
  // carries it).
  Status ReserveGenerationsFor(const std::vector<PutPlan>& plans);
  // Gives every allocated extent back (nothing was written) and fails its op with `why`.
  void AbandonExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, const Status& why,
                      std::vector<Status>& st);
  // Writes the data of every allocated op (not its descriptor: the group commit writes that after
  // the index); verifies each caller checksum.
  void WriteExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, std::vector<Status>& st);
  // Indexes every written op (in memory, staged for the group commit with its descriptor); a
  // failed write's extent is staged for release (and its descriptor unit zeroed). Returns the last
  // staged sequence (0: none); adds the indexed bytes to *bytes.
  std::uint64_t SwitchIndex(std::span<const PutOp> ops, const std::vector<PutPlan>& plans,
                            const std::vector<Status>& st, std::uint64_t* bytes);
  void ReleaseExtents(std::vector<nvme::Extent>&& extents);
  std::uint64_t AllocatedBytesLocked() const TERRACE_REQUIRES(mu_);  // allocated_bytes()' figure
  void Detach(const Entry& e) TERRACE_REQUIRES(mu_);  // before e leaves map_
  void EndRead(const BlockKey& key, const nvme::Record& rec) TERRACE_REQUIRES(mu_);
  void DropCorrupt(const BlockKey& key, const nvme::Record& rec);
  // The read reference GetBatch and GetRangeBatch hold (Op: GetOp or RangeOp, each with a key).
  // BeginReads looks every op up and counts it as a reader of its extent (plans[i].reading, the
  // record in plans[i].rec), so an Erase, overwrite or drop racing the read detaches the extent
  // instead of freeing it; st[i]: NotFound, or check(op, record)'s error (a short buffer, a range
  // past the end), and such an op is not counted. EndReads, after the I/O, ends every read
  // BeginReads started (the last reader of a released extent frees it). Defined in nvme_tier.cpp.
  template <typename Op, typename Check>
  void BeginReads(std::span<Op> ops, const Check& check, std::vector<GetPlan>& plans, std::vector<Status>& st);
  template <typename Op>
  void EndReads(std::span<Op> ops, const std::vector<GetPlan>& plans);

  NvmeTierOptions options_;
  NvmeOpenHooks hooks_;
  std::shared_ptr<Logger> logger_;  // never null
  std::filesystem::path data_path_, index_path_;
  std::filesystem::path creating_path_;  // directory stores: terrace.data.creating
  bool block_device_ = false;
  int fd_ = -1;
  bool direct_ = true;
  TierCaps caps_;
  RecoveryReport report_;
  std::uint64_t index_commit_ = 0;  // the index's commit counter at open

  mutable Mutex sb_mu_;
  nvme::Superblock sb_ TERRACE_GUARDED_BY(sb_mu_);  // (identity fields never change)
  AlignedBuffer sb_unit_ TERRACE_GUARDED_BY(sb_mu_);  // the 4 KiB superblock as on disk
  std::unique_ptr<nvme::IoEngine> engine_;
  std::unique_ptr<nvme::IndexStore> index_;
  bool index_read_only_ = false;  // Open only: index_ is still the read-only handle of the checks
  std::unique_ptr<nvme::StagingPool> staging_;
  std::unique_ptr<nvme::GroupCommitter> committer_;

  mutable Mutex reg_mu_;
  std::vector<iovec> external_ TERRACE_GUARDED_BY(reg_mu_);  // fixed-buffer indices staging.count() + i

  mutable Mutex mu_;
  KeyMap<Entry> map_ TERRACE_GUARDED_BY(mu_);
  std::unique_ptr<nvme::ExtentAllocator> alloc_ TERRACE_GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, Detached> detached_ TERRACE_GUARDED_BY(mu_);  // by extent offset
  std::uint64_t used_bytes_ TERRACE_GUARDED_BY(mu_) = 0;
  std::uint64_t next_generation_ TERRACE_GUARDED_BY(mu_) = 1;
  mutable TierCounters counters_;
  std::atomic<std::uint64_t> staged_ios_{0};  // I/Os that went through a staging buffer (a copy)
  std::atomic<std::uint64_t> merged_reads_{0};  // chunks read in the request of the chunk before them
  std::atomic<std::uint64_t> device_read_bytes_{0};  // device_read_bytes()
};

}  // namespace terrace
