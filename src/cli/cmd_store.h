// Shared pieces of the `terrace store` subcommands (cmd_store*.cpp): the store-path arguments every
// subcommand takes, and the block check that `store
// check` and `store drill` both run. Internal to the CLI.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <CLI/CLI.hpp>

#include "src/cli/command.h"
#include "terrace/block.h"
#include "terrace/options.h"
#include "terrace/status.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli::store_cmd {

// The words of the command the user ran, for a message about one store: the flags naming its
// directory and capacity, and the remedies that command offers.
struct StoreWords {
  std::string dir_flag = "--dir";        // the flag naming the store's directory
  std::string path_words = "--dir";      // stands for the library's options.path
  std::string capacity_flag = "--capacity";
  // Stands for the library's "lower the capacity" (a new store could not be preallocated); empty:
  // "give a smaller <capacity_flag>". For a store whose size no flag sets.
  std::string lower_capacity;
  // Stand for the library's advice to use another (empty) directory for the store, or an existing
  // store, or another directory for its index.
  std::string new_dir = "give --dir an empty directory";
  std::string new_dir_or_existing = "give --dir an empty directory or an existing Terrace store";
  std::string new_index_dir = "point --index-dir at an empty directory";
  // Stands for the library's "(or reformat the data area to start an empty store: ...)".
  std::string start_over =
      "(or, to start over with an empty store and lose every block in it, delete the data file, or clear a block "
      "device with 'blkdiscard -z DEVICE' (its first and last MiB must read as zeros), and run 'terrace store fill')";
};

// The words of a store that another command keeps in a directory of its own (the prefix cache's
// pools, the expert store): that command has no --index-dir and no in-place remedy, so every
// "other directory" advice becomes "give a new <dir_flag> directory"; path_words stand for the
// store's path, start_over for the reformat advice.
StoreWords CommandDirWords(std::string dir_flag, std::string path_words, std::string start_over);

// The words of the `store` commands for the store in `dir`: a prefix-cache pool (DIR/kv or
// DIR/state, as `model run --store DIR` or `demo --dir DIR` made them; demo marks its pools with
// terrace-demo.marker) is started over by the command that made it, not by 'store fill'.
StoreWords StoreCommandWords(const std::string& dir);

// The CLI's words for the tier's refusal of a store (`what`: "pool", "expert store") in `store_dir`
// whose data file another process holds locked (the message says "is in use by <holder> (its data
// file is locked"): that holder uses the `dir_flag` directory, which serves one process at a time;
// `waited` is how long the open waited for the lock. nullopt for any other error.
std::optional<Status> DirInUse(std::string_view dir_flag, std::string_view what, const std::filesystem::path& store_dir,
                               std::chrono::milliseconds waited, const Status& e);

// The tier's messages speak of API fields (capacity_bytes, options.index_dir) and of remedies the
// library offers (reformat, read-write opens); the CLI's name the flags and the commands. Rewrites
// the known phrases of `message` into `words`.
std::string InCliWords(std::string_view message, const StoreWords& words);
// InCliWords(message, StoreCommandWords(dir)) for the store ExistingStoreOptions last resolved (the
// one the running `store` command opens), else with the default StoreWords.
std::string InCliWords(std::string_view message);
// Fail(InCliWords(status.ToString())): exit 1.
int FailStatus(const Status& status);
// The exit of a failed ExistingStoreOptions: a usage error (2, the message alone) for an
// InvalidArgument about the command line (its message begins with the flag); else FailStatus (1),
// whose label keeps the code: a data file that is not a Terrace store is an InvalidArgument of
// exit 1.
int FailStoreOptions(const Status& status);

// Where a store lives, as the user gave it.
struct StorePaths {
  std::string dir;
  std::string index_dir;
  std::uint64_t capacity = 0;  // --capacity; 0 = not given
};

// Adds --dir, --index-dir (and --capacity when `with_capacity`) to `app`.
void AddStorePathOptions(CLI::App* app, StorePaths* p, bool dir_created_if_missing, bool with_capacity);

// "--dir D", with " --index-dir I" when --index-dir was given: the paths of `p` as a command names them.
std::string StorePathFlags(const StorePaths& p);

// The path of the data file of `dir`: dir itself for a block device, else dir/terrace.data.
std::string DataFilePath(const std::string& dir);

// What the data file's superblock says, read without opening the store (nothing is written).
struct SuperblockInfo {
  std::uint64_t capacity_bytes = 0;
  std::uint32_t format_version = 0;
  std::string uuid;
};
// nullopt when `dir` holds no data file (or a blank block device); an error when it holds one that
// is unreadable or not a Terrace superblock.
Result<std::optional<SuperblockInfo>> ReadSuperblock(const std::string& dir);

// What a command does with --index-dir: open the index 'store fill' wrote (check, stats, the
// drill's check), or write a new one (recover, which may be given a directory that does not exist
// yet).
enum class IndexDirUse { kExisting, kRebuild };

// NvmeTierOptions for an existing store: the capacity comes from the store; --capacity, when given,
// must match it. InvalidArgument beginning with the flag (a usage error, exit 2) when --capacity
// differs or --dir / --index-dir is a path of the wrong kind (a regular file, a FIFO, a dangling
// symlink: not a directory; --dir may also be a block device); InvalidArgument beginning with the
// data file's path (a runtime failure, exit 1: FailStoreOptions) when it is not a Terrace store. NotFound naming the flag when --dir does not
// exist or holds no store, or when --index-dir does not exist and `index_use` is kExisting.
Result<NvmeTierOptions> ExistingStoreOptions(const StorePaths& p, IndexDirUse index_use);

// What dir/terrace.data.creating is: absent (kNone), held locked by the process creating the store
// right now (kLive: it must be left alone), or left by a stopped creation that no process holds
// (kStopped: the next read-write open completes or discards it).
enum class Creation { kNone, kLive, kStopped };
Creation CreationIn(const std::filesystem::path& dir);

// The refusal of `flag` `bytes` for the prefix-cache pool in `dir`, whose unfinished creation was
// started with `own` bytes: InvalidArgument naming the flag; while the creation is live, advice to
// wait for it (never to delete its files), else to complete it or start the pool anew.
Status PoolCreationSizeMismatch(const std::filesystem::path& dir, std::string_view flag, std::uint64_t bytes,
                                std::uint64_t own);

// Reads the --expect file: `durable <key>` lines as `store fill` prints them (other lines are
// refused). A directory, device or FIFO is refused (InvalidArgument naming --expect), never read.
Result<std::vector<BlockKey>> ReadDurableLines(const std::string& path);

// The verdict on the blocks of one store.
struct BlockCheck {
  std::uint64_t indexed = 0;          // blocks the index holds
  std::uint64_t ok = 0;               // read back passing their checksum (and, with a seed, exactly its pattern)
  std::uint64_t corrupt = 0;          // the tier refused them (checksum) or failed to read them
  std::uint64_t wrong_content = 0;    // returned as good but differing from the seed's pattern (never allowed)
  std::uint64_t missing = 0;          // expected keys neither in the index nor (when scanned) in the data file
  std::uint64_t lost_from_index = 0;  // committed in the data file, absent from the index
  bool scanned = false;               // the data file was scanned for lost_from_index
  // Indexed, but with no valid descriptor in the data file (damaged or never written): served from
  // the index, yet a rebuild from the data file alone would not find them. Corrupt blocks are not
  // counted here (the scan skips an extent whose data fails its checksum; its descriptor is fine),
  // nor are the blocks of pending_commit.
  std::uint64_t index_only = 0;
  // Indexed blocks the data file does not describe yet because they are puts of the index's pending
  // group commit (ScannedBlocks::pending.keys): the next read-write open writes their
  // descriptors. Nothing is damaged.
  std::uint64_t pending_commit = 0;
  // Blocks the data file still describes at an extent the pending group commit released (a key it
  // erased or overwrote): the index rightly lacks them, and the next read-write open clears their
  // descriptors. Not lost from the index; nothing is damaged.
  std::uint64_t pending_release = 0;
  // Indexed blocks that read back passing the index's checksum while the data file's descriptor for
  // the key (when scanned) differs and another key's matches the index entry: the index points the
  // key at another block's bytes (a damaged index). Counted in wrong_content too.
  std::uint64_t index_mismatch = 0;
  std::vector<BlockKey> corrupt_keys;
  std::vector<BlockKey> missing_keys;
  std::vector<BlockKey> lost_keys;
  // Expected keys the index holds that did not read back ok (corrupt or wrong content).
  std::vector<BlockKey> expected_bad_keys;
};

// How many bad blocks of one kind (corrupt, wrong content, missing, lost from the index) a check
// names one per line; the rest are counted on one line.
inline constexpr std::uint64_t kMaxBlockLines = 10;

// What a scan of the data file found (NvmeTier::ScanDataFile): every committed block by key; and,
// read under the same lock (ReadPendingCommit), the keys the index's pending group commit put.
struct ScannedBlock {
  BlockDesc desc;
  std::uint64_t generation = 0;
  std::uint64_t offset = 0;  // of its extent in the data file
};
// What the index's pending group commit (ReadPendingCommit) changes in the data file.
struct PendingCommit {
  std::unordered_set<BlockKey> keys;           // put by it
  std::unordered_set<std::uint64_t> released;  // extent offsets it released (erased or overwritten keys)
};
struct ScannedBlocks {
  DataScanReport report;
  std::unordered_map<BlockKey, ScannedBlock> blocks;
  PendingCommit pending;
};
// Scans the data area of `options` (ScanDataFile takes a shared lock for the scan alone: to compare
// the result with the index, hold a SharedDataLock across both). Prints progress to stderr on large
// stores.
Result<ScannedBlocks> ScanDataArea(const NvmeTierOptions& options);

// A shared lock on the data area of the store `options` names, held until destroyed. Writers
// (read-write tiers, recover) lock it exclusively, so while it is held neither the data file nor
// the index changes; ScanDataFile and read-only tiers (shared locks) open beside it. Take() fails
// with Unavailable ("in use by another process") while a writer has the store open.
class SharedDataLock {
 public:
  static Result<SharedDataLock> Take(const NvmeTierOptions& options);
  SharedDataLock(SharedDataLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  SharedDataLock& operator=(SharedDataLock&&) = delete;
  SharedDataLock(const SharedDataLock&) = delete;
  ~SharedDataLock();

 private:
  explicit SharedDataLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// The keys put and the extents released by the pending group commit of `tier`, opened read-only
// (NvmeTier::PendingCommit); empty when none is pending.
PendingCommit ReadPendingCommit(const NvmeTier& tier);

// Reads every indexed block of `tier`: a block is ok when the tier returns it (its checksum
// passes) and, when `seed` is given, it equals FillPattern(*seed, key); without a seed (a store
// `store fill` did not write) no block is wrong-content. Then counts the keys of `expected` that
// neither the index nor `scan` (may be null: not scanned) holds as missing, and, with `scan`, the
// lost-from-index and index-only blocks. `report` (may be null) receives a line for each of the
// first kMaxBlockLines bad blocks of each kind, and then "... and N more <kind> blocks".
BlockCheck CheckBlocks(NvmeTier& tier, std::optional<std::uint64_t> seed, const std::vector<BlockKey>& expected,
                       const ScannedBlocks* scan, const std::function<void(const std::string&)>& report);

// Subcommands defined in their own files.
void RegisterStoreRecover(CLI::App* store, Runner* run);  // cmd_store_recover.cpp
void RegisterStoreDrill(CLI::App* store, Runner* run);    // cmd_store_drill.cpp
void RegisterStoreStats(CLI::App* store, Runner* run);    // cmd_store_stats.cpp

// `store fill`'s hidden drill flags: the fault its child process injects into itself.
struct FillFault {
  std::string kind;             // "", "eio", "enospc", "short", "powercut", "close-eio" (only the close's sync fails)
  std::uint64_t seed = 1;
  double rate = 0.02;           // eio/enospc/short: probability per write request
  std::uint64_t cut_after = 0;  // powercut: events before the power goes off
};

}  // namespace terrace::cli::store_cmd
