// The tier interface: the one seam every storage tier (HBM, pinned host, NVMe, test fakes and
// fault-injecting wrappers) implements, and that the conformance suite (tests/conformance/) runs
// against. Embedders normally use terrace::Store (store.h); implement Tier to add a backend.
//
// Contract for every implementation:
// - Thread-safety: every method may be called concurrently from any thread.
// - Put copies the caller's bytes; after it returns OK the block is readable by Get. Putting an
//   existing key replaces the block atomically (readers see the old or the new block, never a mix).
// - Get never returns bytes whose checksum does not match the recorded BlockDesc: it drops such a
//   block, counts it in corruptions, and returns Corruption.
// - A block larger than caps().max_block_bytes or than the free capacity yields OutOfCapacity, and the
//   tier is unchanged. A tier never evicts on its own: the Store decides what to evict.
// - Pinned blocks (Pin) cannot be erased: Erase returns InvalidArgument until every Pin is undone.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "terrace/block.h"
#include "terrace/stats.h"
#include "terrace/status.h"

namespace terrace {

// The kind of a tier: the role it plays in the standard configuration (HBM -> pinned host -> NVMe),
// in that order from fastest to slowest. The store's tier list is open (StoreOptions::tier_list,
// Store::OpenWithTiers): any number of tier slots up to kMaxTierSlots, several of one kind
// allowed; the store API addresses a kind by its first (fastest) slot.
enum class TierId : std::uint8_t { kHbm = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;       // number of TierId values (kinds), not of a store's tiers
inline constexpr int kMaxTierSlots = 8;   // most tiers one store composes
std::string_view TierName(TierId id);  // "hbm", "host", "nvme"

// Where a resident block's bytes live, for zero-copy access through ResidentPtr.
enum class MemoryKind : std::uint8_t { kNone = 0, kHost = 1, kDevice = 2 };

// Where a caller's buffer lives (Store::Put / Store::Get with a BufferRef). kHost: pageable host
// memory; kPinnedHost: page-locked host memory (a GPU tier copies it by DMA, no staging); kDevice:
// GPU device memory (a CUDA device pointer, or the emulated HBM tier's stand-in), which only a tier
// with TierCaps::device_buffers reads or writes, and the host never touches.
enum class BufferKind : std::uint8_t { kHost = 0, kPinnedHost = 1, kDevice = 2 };

struct TierCaps {
  TierId id = TierId::kHost;       // the tier's kind
  std::string name;                // "hbm", "host", "nvme" (wrappers keep the wrapped name)
  bool emulated = false;           // HBM tier running in host memory
  bool persistent = false;         // survives process exit (NVMe)
  MemoryKind memory = MemoryKind::kHost;  // kNone: bytes are not addressable (NVMe)
  std::uint64_t capacity_bytes = 0;
  std::uint64_t max_block_bytes = 0;
  // True when Get itself checks the bytes it wrote into the caller's buffer against the recorded
  // checksum (every built-in tier does). The Store then compares descriptors instead of hashing
  // the bytes a second time. Wrappers that can alter bytes after the inner tier's check (the
  // fault injector) report false.
  bool verifies_gets = false;
  // True for a tier that may hold keys the store's directory has not seen: one other processes
  // write too (a shared remote cache). A directory miss then asks this tier (Lookup) before the
  // store answers NotFound, and a block found there joins the directory. The store removes only
  // the copies it knows of: a Put does not erase an older copy another process left in it, and a
  // read neither moves a block out of it nor drops a copy there that failed or vanished (another
  // process may have replaced or erased it; the store asks again).
  bool shared = false;
  // Direct-transfer unit, bytes (0: none): a Get into memory aligned to it, with room for the
  // block rounded up to it, transfers without a staging copy (NVMe O_DIRECT: 4096).
  std::uint32_t io_alignment = 0;
  // Bytes between the data of two blocks written one after the other (0: none; NVMe: 4096, each
  // extent's descriptor unit). A GetBatch reads a run of blocks that lie one after the other on
  // the medium as one request when their buffers lie the same way: op k+1's out starting exactly
  // read_gap_bytes past op k's size rounded up to io_alignment, which op k's out must cover (the
  // gap's bytes are overwritten). A caller that lays out a batch's buffers so lets the device see
  // a few large reads instead of many small ones.
  std::uint32_t read_gap_bytes = 0;
  // Reserve / Commit / Abort are implemented: another tier can read a block straight into this
  // tier's memory.
  bool reserves = false;
  // PutDevice / GetDevice are implemented: blocks go to and from device-memory buffers without a
  // host bounce (the HBM tier).
  bool device_buffers = false;
  // Host memory its owner asked not to page-lock (HostTierOptions::pin false). The store does not
  // give its IoRegions to a device tier (caps().memory kDevice), whose registration would page-lock
  // them (the CUDA HBM tier's cudaHostRegister): copies between the two are then staged. An NVMe
  // tier still registers them as io_uring fixed buffers (their pages held while registered).
  bool pageable = false;
};

// Space a tier set aside for one block (Tier::Reserve): fill `bytes`, then Commit or Abort.
struct Reservation {
  std::span<std::byte> bytes;           // at least the block's size, rounded up to the tier's page
  std::array<std::uint64_t, 3> token{};  // the tier's own bookkeeping
};

struct PutOp {
  BlockKey key;
  BlockDesc desc;                       // desc.size == data.size(); checksum as DescribeBlock
  std::span<const std::byte> data;
};

struct GetOp {
  BlockKey key;
  std::span<std::byte> out;             // must hold at least desc.size bytes
  BlockDesc desc;                       // filled on success
};

// One ranged read (Tier::GetRangeBatch): bytes [offset, offset + length) of a block.
struct RangeOp {
  BlockKey key;
  std::uint64_t offset = 0;             // bytes into the block
  std::uint64_t length = 0;             // offset + length <= the block's size
  std::span<std::byte> out;             // must hold at least length bytes
  BlockDesc desc;                       // filled on success: the whole block's descriptor
};

// OK when `op`'s range lies within a block of `block_size` bytes and op.out holds it; else
// InvalidArgument naming the key, the range and the size (what every GetRangeBatch answers).
Status CheckRange(const RangeOp& op, std::uint64_t block_size);

class Tier {
 public:
  virtual ~Tier() = default;

  virtual const TierCaps& caps() const = 0;

  virtual Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) = 0;
  // Put for a caller that has not hashed the bytes: stores `data` as Put does and sets
  // desc->checksum to their XXH3-64 (Checksum(data), what DescribeBlock gives); desc->size must
  // equal data.size() and desc->codec is kept. *desc is what Lookup reports afterwards. A tier
  // that copies through the CPU can hash while it copies (the host tier), reading the bytes once
  // instead of twice. Default: Checksum, then Put.
  virtual Status PutDescribing(const BlockKey& key, BlockDesc* desc, std::span<const std::byte> data) {
    desc->checksum = Checksum(data);
    return Put(key, *desc, data);
  }
  // Copies the block into `out` (out.size() >= block size) and fills *desc. A tier with
  // caps().io_alignment may also overwrite out's bytes past the block's size (up to out.size(),
  // within the size rounded up to io_alignment) when that saves a staging copy.
  virtual Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) = 0;
  // NotFound if absent. Cheap: no I/O.
  virtual Result<BlockDesc> Lookup(const BlockKey& key) const = 0;
  virtual Status Erase(const BlockKey& key) = 0;

  // Batched forms; one Status per op, in order. The defaults loop; tiers with queues override
  // them to submit together (one io_uring submission for a batch of NVMe reads, say).
  virtual std::vector<Status> PutBatch(std::span<const PutOp> ops);
  virtual std::vector<Status> GetBatch(std::span<GetOp> ops);

  // Ranged reads: copies bytes [offset, offset + length) of each op's block into op.out and fills
  // op.desc with the whole block's descriptor; one Status per op, in order. NOT verified: the
  // recorded checksum covers the whole block, so a range comes back as the medium holds it. A
  // caller checks it against a checksum of its own (the prefix cache's per-layer XXH3-64) and, on
  // a mismatch, reads the whole block with Get, which verifies it and drops a damaged copy.
  // NotFound if absent; InvalidArgument when the range passes the block's end or out is short.
  // A tier with caps().io_alignment reads a range whose offset is a multiple of it into aligned
  // memory with no staging copy, and may then overwrite out's bytes past length (up to out.size(),
  // within length rounded up to io_alignment). Default: each op's whole block through Get (which
  // verifies it, in every built-in tier) into a temporary buffer, then the range copied out.
  virtual std::vector<Status> GetRangeBatch(std::span<RangeOp> ops);

  // Pin: the block may not be erased while pinned; pins nest. NotFound if absent.
  virtual Status Pin(const BlockKey& key) = 0;
  virtual Status Unpin(const BlockKey& key) = 0;

  // For addressable tiers (caps().memory != kNone): the block's bytes in place, valid while the
  // block is pinned. nullptr if absent or not addressable (an empty block that is present is not
  // null).
  virtual const std::byte* ResidentPtr(const BlockKey& key) const {
    (void)key;
    return nullptr;
  }

  // The memory an addressable tier keeps its blocks in, for another tier to register for direct
  // I/O (io_uring fixed buffers). A region, once listed, stays mapped at the same address for the
  // tier's lifetime; more may appear as the tier grows. Default: none.
  virtual std::vector<std::span<std::byte>> IoRegions() const { return {}; }
  // Registers another tier's IoRegions(), replacing any earlier registration, so I/O from and to
  // them needs no staging copy. Unavailable when the tier has no use for them (the default) or the
  // system refuses (e.g. RLIMIT_MEMLOCK); the tier keeps working either way.
  virtual Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) {
    (void)regions;
    return Status::Unavailable("this tier does not register other tiers' memory");
  }

  // Reserve -> fill -> commit, for tiers with caps().reserves: Reserve sets aside room for a block
  // described by `desc` (OutOfCapacity like Put when there is none; used_bytes counts it only
  // once committed). The caller writes exactly the bytes `desc` describes into
  // r.bytes.first(desc.size) (the rest may be overwritten), then Commit publishes them as the
  // block (replacing a previous one atomically, like Put; the tier trusts desc.checksum) or Abort
  // returns the space. Every Reserve ends in exactly one Commit or Abort; a Commit that fails has
  // returned the space itself. Defaults:
  // Unimplemented / no-op.
  virtual Result<Reservation> Reserve(const BlockKey& key, const BlockDesc& desc) {
    (void)key;
    (void)desc;
    return Status::Unavailable("this tier does not reserve space for direct reads");
  }
  virtual Status Commit(const BlockKey& key, const BlockDesc& desc, const Reservation& r) {
    (void)key;
    (void)desc;
    (void)r;
    return Status::Unavailable("this tier does not reserve space for direct reads");
  }
  virtual void Abort(const Reservation& r) { (void)r; }

  // Device-memory buffers, for tiers with caps().device_buffers. PutDevice stores `device_data` (a
  // device pointer) as the block and computes its checksum where the data is (a device kernel, or
  // a staged copy of the stored bytes); it returns the BlockDesc it recorded. Otherwise like Put.
  // GetDevice copies the block into `device_out` (device memory, >= the block's size) and verifies
  // the stored bytes' checksum first (Corruption: dropped, like Get). Defaults: Unavailable.
  // Streams: the caller's writes to `device_data` must be complete before PutDevice (synchronised
  // with the host: the CUDA tier copies on its own non-blocking streams, which wait for no other
  // stream, so a kernel still writing the buffer would have stale bytes stored and checksummed as
  // valid). Both calls return once their copies are complete; until then the caller must neither
  // read nor write the buffer.
  virtual Result<BlockDesc> PutDevice(const BlockKey& key, Codec codec, std::span<const std::byte> device_data) {
    (void)key;
    (void)codec;
    (void)device_data;
    return Status::Unavailable("this tier does not read device memory");
  }
  virtual Status GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) {
    (void)key;
    (void)device_out;
    (void)desc;
    return Status::Unavailable("this tier does not write device memory");
  }

  // Durability barrier: returns once every acknowledged Put is durable. No-op for volatile tiers.
  virtual Status Flush() { return Status::Ok(); }

  // The blocks' own bytes (their sizes summed): what TierStatsSnapshot::used_bytes reports.
  virtual std::uint64_t used_bytes() const = 0;
  // The tier's space its blocks take (>= used_bytes(); more where the tier rounds blocks up, e.g.
  // to whole 4 KiB pages): the store's room and watermark checks compare it with capacity_bytes.
  // Default: used_bytes().
  virtual std::uint64_t allocated_bytes() const { return used_bytes(); }
  virtual std::uint64_t block_count() const = 0;
  // Visits every block (snapshot order is unspecified). `fn` must not call back into the tier.
  virtual void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const = 0;

  virtual TierStatsSnapshot Stats() const = 0;
};

}  // namespace terrace
