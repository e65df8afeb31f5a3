// Options for the store and each tier. Every field documents its default and unit.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "terrace/log.h"
#include "terrace/tier.h"

namespace terrace {

inline constexpr std::uint64_t kKiB = 1024, kMiB = 1024 * kKiB, kGiB = 1024 * kMiB;

// How the NVMe tier acknowledges a write into it (a put there, a write-through copy, a demotion).
// A block held only in a memory tier is not on NVMe at all (StoreOptions::write_policy).
enum class Durability : std::uint8_t {
  // A write is acknowledged when its data is written, before it is durable: it becomes durable at
  // the next group commit (at most group_commit_interval later) or Store::Flush. Until then a crash,
  // power cut or an exit that skips the store's close (_exit, a kill) can lose it. Default.
  kAsync = 0,
  // A write is acknowledged only once its data and index entry are durable. Concurrent writes share
  // one flush (group commit).
  kSync = 1,
};

// When a host tier faults in its memory (HostTierOptions::populate).
enum class HostPopulate : std::uint8_t {
  kOnDemand = 0,    // chunk by chunk as the arena grows (HostTierOptions::prefault says by whom)
  // populate_bytes mapped at open and faulted by a background thread that starts at open, in the
  // order the allocator hands pages out; Create and puts never wait for it (a put that gets ahead
  // faults its own pages). Put bandwidth into the fresh tier reaches memory speed only for the
  // part populated before the puts reach it (the fault rate is the background thread's). With a
  // CUDA device the chunks come from cudaHostAlloc, which faults them as it allocates: then
  // Create populates them as kAtOpen does.
  kBackground = 1,
  // populate_bytes faulted before Create returns: deterministic put latency from the first put;
  // Create takes about populate_bytes / the kernel's fault rate (docs/benchmarks.md).
  kAtOpen = 2,
};

struct HostTierOptions {
  std::uint64_t capacity_bytes = 4 * kGiB;
  // Pin memory: cudaHostAlloc when a CUDA device exists, else mlock where permitted. Pinning is
  // done lazily, one chunk at a time, as the arena grows; failure to pin is reported in stats and
  // logs, never fatal. false: the memory stays pageable; a store's CUDA HBM tier does not page-lock
  // it either (copies to and from it are staged), though an NVMe tier's io_uring fixed buffers hold
  // its pages while registered (TierCaps::pageable).
  bool pin = true;
  // Arena growth and pinning unit, and the largest block the tier takes: a block lies in one chunk,
  // so a Put of a larger block fails with OutOfCapacity whatever capacity_bytes is (raise
  // chunk_bytes for it). Rounded down to whole 4 KiB pages; at most capacity_bytes is used.
  std::uint64_t chunk_bytes = 256 * kMiB;
  // Fault in (and, with pin, lock) each new chunk's pages on a background thread, ahead of the puts
  // that fill it; puts never wait for it. false: a pinned chunk is faulted and locked on the putting
  // thread when it is added, an unpinned one page by page on first touch.
  bool prefault = true;
  // Back mmap'ed chunks with transparent huge pages (2 MiB-aligned, madvise(MADV_HUGEPAGE)) where
  // /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"; the prefaulter then
  // touches one page per huge page. Advisory: the kernel may still use 4 KiB pages;
  // Stats().detail says what it granted. cudaHostAlloc chunks are unaffected. Off by default: on
  // the benchmark VM (a Firecracker guest with free page reporting, so a fresh tier's memory is
  // memory the host has taken back) huge pages made puts into a fresh tier 2-3x slower and steady
  // gets no faster (docs/benchmarks.md, "Host tier huge pages"); they win only on memory the
  // guest freed moments before. Measure on your host before turning them on.
  bool huge_pages = false;
  // Populate at open: map, fault in and (with pin) lock the first populate_bytes of the capacity
  // when the tier is created, the way a serving engine sets up its pinned pool at start-up, so that
  // puts into the fresh tier copy at memory speed instead of at the kernel's page-fault rate. The
  // populated bytes then stay resident (locked, with pin) for the tier's lifetime whether or not
  // blocks use them, which is why the default is kOnDemand: a huge tier never takes its whole
  // capacity of RAM unasked.
  HostPopulate populate = HostPopulate::kOnDemand;
  // With populate kBackground / kAtOpen: bytes to populate from the start of the capacity (rounded
  // up to whole chunks); 0 or >= capacity_bytes: the whole capacity.
  std::uint64_t populate_bytes = 0;
  // Gets whose destination is at least this many bytes - one Get's buffer, or the buffers of one
  // GetBatch together - copy out with streaming (non-temporal) stores, which write the caller's
  // lines without reading them first: such a destination does not stay in cache anyway. Below it,
  // cached stores (the destination may be in cache, and the caller reads it next). 0: a quarter of
  // the last-level cache the kernel reports (8 MiB for a 32 MiB L3; where none is reported,
  // never); UINT64_MAX: never. Only blocks of at least 256 KiB are streamed. The checksum is
  // verified either way (docs/benchmarks.md, "Host tier gets: streaming stores").
  std::uint64_t stream_get_min_bytes = 0;
  std::shared_ptr<Logger> logger;           // null: the store's logger, or stderr (terrace/log.h)
};

enum class HbmMode : std::uint8_t {
  kAuto = 0,      // CUDA device memory if a device is present, else emulated
  kCuda = 1,      // require a CUDA device (Unavailable otherwise)
  kEmulated = 2,  // host memory standing in for HBM, with the link model below
  kOff = 3,       // no HBM tier
};

// Models the host<->device link for the emulated HBM tier: a copy of n bytes takes
// latency + n / bandwidth. Default: PCIe Gen5 x16, about 55 GB/s per direction.
struct LinkModel {
  bool enabled = true;
  double bandwidth_bytes_per_s = 55e9;
  double latency_us = 2.0;
};

struct HbmTierOptions {
  HbmMode mode = HbmMode::kAuto;
  std::uint64_t capacity_bytes = 1 * kGiB;
  int device = 0;                 // CUDA device ordinal
  unsigned copy_streams = 2;      // CUDA streams for H2D / D2H copies
  LinkModel link;                 // emulated mode only
  std::shared_ptr<Logger> logger; // null: the store's logger, or stderr (terrace/log.h)
};

struct NvmeTierOptions {
  // A directory (the tier creates terrace.data and an index/ RocksDB inside it) or a block
  // device path. Empty: no NVMe tier.
  std::filesystem::path path;
  // Preallocated data file size, bytes. 0: take it from the existing store's superblock (an error
  // when the store has to be created).
  std::uint64_t capacity_bytes = 16 * kGiB;
  unsigned queue_depth = 32;                  // io_uring submission depth per I/O thread
  // io_uring rings. A call holds one ring until its I/O completes, so concurrent callers (engine
  // threads doing single Gets, prefetch workers) run in parallel only up to io_threads; set it to
  // the number of threads that read or write concurrently. Each ring adds 8-64 staging buffers of
  // 1 MiB (min(queue_depth, 64), at least 8).
  unsigned io_threads = 1;
  Durability durability = Durability::kAsync;
  std::chrono::microseconds group_commit_interval{5000};  // async mode: max delay to durability
  bool direct_io = true;                      // O_DIRECT; falls back (and says so) where unsupported
  bool create_if_missing = true;
  // Read and checksum every block at open, dropping bad ones (slow on large stores). Get always
  // verifies, so this only moves the discovery of bad blocks to open time.
  bool verify_on_open = false;
  // Where the RocksDB index lives. Empty: <path>/index for a directory; required for a block device.
  std::filesystem::path index_dir;
  // Open an existing store without changing it: a shared lock on the data area (other readers may
  // open it too, writers may not), the index opened read-only, nothing written to the data file or
  // the index; Put / Erase / Flush fail with InvalidArgument and corrupt blocks are reported, not
  // dropped. Works on a full file system.
  bool read_only = false;
  // Format the data area even though it holds a Terrace store (every block in it is lost; an
  // existing index is moved aside, never deleted). Without it, a data area that holds a store is
  // only ever opened with its own index.
  bool reformat = false;
  // How long Open (and ScanDataFile / RebuildIndex) waits for another process to release the data
  // area's lock before failing with Unavailable ("in use by another process"; "already open in
  // this process" when a Store or tier of this process holds it: close that one first).
  std::chrono::milliseconds lock_wait{2000};
  std::shared_ptr<Logger> logger;  // null: the store's logger, or stderr (terrace/log.h)
};

enum class Placement : std::uint8_t {
  kExclusive = 0,  // a block lives in one tier; promotion moves it (a pinned block's copy stays too)
  kInclusive = 1,  // a block promoted to a faster tier keeps its copy below
};

enum class WritePolicy : std::uint8_t {
  kWriteBack = 0,     // a put lands in put_tier; it reaches lower tiers when evicted (demotion), so
                      // a block still only in a memory tier is gone when the process exits
  kWriteThrough = 1,  // a put is also written to the lowest tier (NVMe) before it is acknowledged;
                      // durable when acknowledged only with NvmeTierOptions::durability kSync (with
                      // kAsync, at the next group commit or Store::Flush)
};

enum class EvictionPolicy : std::uint8_t { kLru = 0, kS3Fifo = 1 };

// One slot of an explicit tier list (StoreOptions::tier_list). `kind` names the factory that
// builds it - "hbm" (from `hbm`), "host" (from `host`) or "nvme" (from `nvme`); the other two
// option structs are ignored.
struct TierSlotOptions {
  std::string kind;
  // The slot's name in stats, metrics and messages. Empty: the kind, with "-2", "-3", ... appended
  // to later slots of the same kind ("nvme", "nvme-2").
  std::string name;
  HbmTierOptions hbm;
  HostTierOptions host;
  NvmeTierOptions nvme;
};

struct StoreOptions {
  // The standard configuration, used when tier_list is empty: HBM (unless hbm.mode is kOff), host
  // (unless host.capacity_bytes is 0) and NVMe (when nvme.path is set), in that order.
  HbmTierOptions hbm;
  HostTierOptions host;
  NvmeTierOptions nvme;
  // An explicit, ordered tier list, fastest first (at most kMaxTierSlots); when non-empty it
  // replaces hbm/host/nvme above. Blocks are demoted from a slot into the next one. A TierId in
  // the API (put_tier, Acquire, Prefetch) means the first slot of that kind; a TierId with no
  // slot of its kind means the first slot of a slower kind where the rules below say "nearest
  // present tier below it".
  std::vector<TierSlotOptions> tier_list;
  // Where Put places new blocks (the nearest present tier below it when it has no slot). Open
  // refuses a put_tier with no tier at or below it (e.g. kNvme without an NVMe tier).
  TierId put_tier = TierId::kHost;
  Placement placement = Placement::kExclusive;
  WritePolicy write_policy = WritePolicy::kWriteBack;
  EvictionPolicy eviction = EvictionPolicy::kS3Fifo;
  bool promote_on_get = true;                   // a Get from a lower tier copies the block up to put_tier
  // A cache, whose every block can be rebuilt elsewhere (the prefix cache's pools): when the lowest
  // tier is full, making room there evicts its blocks in the eviction policy's order, their last
  // copy included - such a block is gone (Get: NotFound; StoreStats::dropped_blocks counts them) -
  // instead of failing the Put with OutOfCapacity. Pinned blocks and blocks under another
  // operation are never dropped. Off (the default): the store never drops the last copy of a block.
  bool lowest_tier_evicts = false;
  // Per-tier occupancy watermarks, as fractions of capacity: background demotion starts above
  // high_watermark and evicts down to low_watermark.
  double high_watermark = 0.90;
  double low_watermark = 0.75;
  // Threads of the store's Asio pool for GetAsync and PutAsync. Prefetch drains on a lane of its own,
  // max(1, background_threads - 1) threads, and background demotion on another (one thread), so
  // neither ever delays them.
  unsigned background_threads = 2;
  // Staging buffers for blocks moved between two tiers with no direct route (NVMe -> NVMe, or NVMe
  // -> a tier that cannot reserve space for a direct read): bounce_buffers buffers of
  // bounce_buffer_bytes each (rounded up to 4 KiB; 4 KiB-aligned; allocated on first use and
  // mlock'ed where permitted), plus one buffer at a time sized to a block larger than that.
  // A move waits for a free buffer. The store keeps two such pools, one for single-block moves and
  // one for batched reads (prefetch groups, GetBatch), which pack many small blocks into one
  // buffer; so up to 2 * (bounce_buffers * bounce_buffer_bytes + one large block) is held.
  // Must be >= 1 and >= 4096.
  unsigned bounce_buffers = 4;
  std::uint64_t bounce_buffer_bytes = 4 * kMiB;
  // Where the store and its tiers log (a tier's own logger, when set, wins). Null: stderr, kInfo.
  std::shared_ptr<Logger> logger;
};

}  // namespace terrace
