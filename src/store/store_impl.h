// StoreImpl: the state behind terrace::Store. Internal; see include/terrace/store.h for the rules.
//
// Locking (acquire in this order; never block on a key lock while holding mu_):
//   1. key_locks_ stripe of the key an operation is about (blocking), then victims' stripes with
//      TryLock only. A Put may wait (timed, BusyVictims::kWait) for a busy victim's stripe to be
//      released while holding its own stripe: the timeout breaks the one cycle this allows.
//   2. regions_mu_ (RefreshIoRegions, during a demotion under the victim's stripe); the tier's own
//      locks are taken inside it by RegisterIoRegions (the NVMe tier's reg_mu_, then its I/O
//      rings' mutexes; their order is in tiers/nvme/nvme_tier.h).
//   3. mu_ guards the directory (entries_, handles_) and the eviction policies; held only for
//      short bookkeeping, never across tier I/O.
//   Leaves, never held while taking another store lock: key_locks_'s wait mutex, bounce_'s and batch_bounce_'s mutexes
//   (a Transfer, or a single-key read into a caller's buffer the tier cannot write in place
//   (ReadOut), waits on bounce_ holding only its key stripe - inside a BulkFetch window, which
//   holds batch_bounce_ buffers, it never waits: a thread holding a lease takes a one-off buffer;
//   a BulkFetch window waits on batch_bounce_ holding no stripe and no buffer; see BouncePool), inflight_'s table mutex and each
//   Fetch::mu, prefetch_mu_ (the queues), DemandGate::mu (a speculative group sleeps on it with
//   no other lock held), the Future states' mutexes (a cancel callback takes DemandGate::mu).
// Tier I/O runs under at most the stripes (and regions_mu_ for registration), never under mu_,
// so no tier lock is ever taken with mu_ held. The members each lock guards are marked
// TERRACE_GUARDED_BY (src/common/mutex.h) and checked by scripts/thread_safety.sh; the stripes
// are std::mutex (chosen by key hash at run time, which the analysis cannot name).
// Every change to an entry's mask (which slots hold a copy) happens with the key's stripe held.
// Gets of a copy at or above put_tier take no key lock: tiers replace blocks atomically and the
// store re-verifies checksums; any anomaly retries on the locked slow path.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/common/clock.h"
#include "src/common/key_map.h"
#include "src/common/mutex.h"
#include "src/store/bounce_pool.h"
#include "src/store/eviction_policy.h"
#include "src/store/inflight.h"
#include "src/store/key_locks.h"
#include "src/store/placement_rules.h"
#include "src/store/thread_pool.h"
#include "terrace/store.h"

namespace terrace::store_internal {

// Tier slots are positions in the store's ordered tier list, 0 = fastest; SlotMask, Bit, Fastest,
// Below and the placement decisions over them are in src/store/placement_rules.h.

// True when a tier's answer (`got`, `bytes`) is the block the directory describes (`want`). A tier
// whose Get verifies its own output (TierCaps::verifies_gets) has already hashed `bytes` against
// got.checksum, so comparing descriptors suffices; any other tier's bytes are hashed here.
inline bool Verify(const TierCaps& caps, const BlockDesc& want, const BlockDesc& got, std::span<const std::byte> bytes) {
  if (got.size != want.size || got.checksum != want.checksum || bytes.size() < want.size) return false;
  return caps.verifies_gets || Checksum(bytes.first(want.size)) == want.checksum;
}

// True when a tier's Get can write `size` bytes straight into `out`: it holds the block, and for a
// tier with an io_alignment (NVMe O_DIRECT) it starts on that alignment and has room for the size
// rounded up to it (the tier may overwrite that tail). Otherwise the tier would stage the read
// itself, so the store reads through an aligned bounce buffer instead.
inline bool ReadsInPlace(const TierCaps& caps, std::span<const std::byte> out, std::uint64_t size) {
  if (out.size() < size) return false;
  const std::uint64_t align = caps.io_alignment;
  return align == 0 ||
         (reinterpret_cast<std::uintptr_t>(out.data()) % align == 0 && out.size() >= (size + align - 1) / align * align);
}

// InvalidArgument for a Get whose buffer (`have` bytes) is smaller than the block (`need` bytes).
Status ShortBuffer(const BlockKey& key, std::size_t have, std::uint64_t need);

struct Entry {
  BlockDesc desc;
  SlotMask mask = 0;          // bit i: slot i holds a current copy
  SlotMask handle_mask = 0;   // bit i: live BlockHandles pin slot i's copy (counts: StoreImpl::handles_)
  std::uint32_t pins = 0;     // Store::Pin count (all tiers)
  std::uint64_t version = 0;  // store-unique, new on every Put that writes
  bool prefetched = false;    // brought up by Prefetch, not read since
  bool PinnedIn(int slot) const { return pins > 0 || (handle_mask & Bit(slot)) != 0; }
  bool AnyPin() const { return pins > 0 || handle_mask != 0; }
};

// One tier of the store's ordered list.
struct TierSlot {
  std::unique_ptr<Tier> tier;  // never null; immutable after construction
  std::string name;            // "hbm", "host", "nvme", "nvme-2", ...; immutable
  TierId kind = TierId::kHost; // tier->caps().id; immutable
  std::unique_ptr<EvictionPolicy> policy;  // set by the constructor; then only through StoreImpl::Policy (checked)
  // Store-measured: hits, misses, evictions, corruptions, io_errors, latencies. Bytes and puts come
  // from the tier's own Stats() (StoreImpl::Stats); their counters here stay 0.
  TierCounters measured;
  std::atomic<bool> demotion_scheduled{false};
  std::size_t registered_regions = 0;      // as a source tier; only through StoreImpl::RegisteredRegions (checked)
};

// A tier and its slot name, as StoreImpl is built from (name empty: from caps().name).
struct NamedTier {
  std::unique_ptr<Tier> tier;
  std::string name;
};

// How a locked read moves the block it reads.
enum class MoveMode : std::uint8_t {
  kNone,   // read only
  kUp,     // copy into target if the fastest copy is below it
  kExact,  // make sure target holds a copy (from wherever it is)
};

// PlanFastGet's answer for one key: the directory's descriptor and the tier slot to read it from.
struct FastRead {
  bool answered = false;  // the result is final without a read (a miss, a buffer too small)
  int src = -1;           // the slot to read from; -1: the locked path
  BlockDesc desc;
};

struct ReadOutcome {
  Result<BlockDesc> desc = Status::NotFound("unset");
  Status move_status;  // OK when no move was needed or it succeeded
  bool moved = false;
  bool leader = true;  // false: the result came from another caller's in-flight read
  int src = -1;        // the slot the block was read from (-1: none, or no read was needed)
};

// What Transfer did: the source read, and (when that succeeded) the destination write.
struct TransferOutcome {
  Status read;          // Corruption: the source copy failed its checksum; NotFound: it is gone
  Status write;         // meaningful only when read is OK
  bool direct = false;  // the route taken (when write is OK)
};

struct PrefetchJob;
struct BulkLead;  // batch_read.cpp

// One key of a BulkFetch.
struct BulkItem {
  BlockKey key;
  std::span<std::byte> out;  // destination (at least the block's size); empty: read for a move only
  bool handled = false;      // false: finish it on the single-key path
  Status status;             // when handled: the read's outcome (with a move: the move's)
  BlockDesc desc;            // when handled and OK
};

// Where speculative prefetch waits for demand to end (demand Gets, and kDemand prefetch jobs from
// their Prefetch call until their last item is done). Shared with prefetch Futures' cancel
// callbacks (which may outlive the store), so it is reference-counted. Thread-safe.
struct DemandGate {
  Mutex mu;
  CondVar cv;            // notified when active drops, on a cancel, and when the store stops
  int active TERRACE_GUARDED_BY(mu) = 0;           // demand fetches in progress
  std::uint64_t wakes TERRACE_GUARDED_BY(mu) = 0;  // bumped by Wake() (a prefetch was cancelled)
  void Wake() {
    {
      MutexLock lock(&mu);
      ++wakes;
    }
    cv.SignalAll();
  }
};

// Counts a demand fetch for as long as it lives (speculative prefetch yields to it).
class DemandScope final {
 public:
  explicit DemandScope(DemandGate& gate) : gate_(gate) {
    MutexLock lock(&gate_.mu);
    ++gate_.active;
  }
  ~DemandScope() {
    {
      MutexLock lock(&gate_.mu);
      --gate_.active;
    }
    gate_.cv.SignalAll();
  }
  DemandScope(const DemandScope&) = delete;
  DemandScope& operator=(const DemandScope&) = delete;

 private:
  DemandGate& gate_;
};

// Returns once every store handed to StoreImpl::CloseElsewhere (before or during the call) has
// closed. Run at program exit by a static destructor; tests call it to observe the closes.
void WaitForClosingStores();

class StoreImpl {
 public:
  StoreImpl(const StoreOptions& options, std::vector<NamedTier> tiers);
  // Joins the store's threads: never on one of them (Store::~Store hands that case to CloseElsewhere).
  ~StoreImpl();
  // For a store dropped on one of its own threads (the last owner of the Store released in a
  // completion callback), which cannot join itself: destroys `impl` on a new closing thread, which
  // joins this one once the callback returns. Closing threads are joined at program exit (and by
  // WaitForClosingStores), so the store's tiers close (final commits) before the process ends.
  // When no thread can be started the store is leaked (its threads keep running), with an error
  // logged: joining from here would std::terminate.
  static void CloseElsewhere(std::unique_ptr<StoreImpl> impl);
  // True on one of the store's threads (running a task: an async call, a prefetch, a demotion).
  bool OnOwnThread() const {
    return pool_.OnPoolThread() || prefetch_lane_.OnPoolThread() || demotion_lane_.OnPoolThread();
  }
  Status Init();  // validates tiers, recovers the directory from what they hold
  // Starts the three executors' threads (OpenImpl, after Init). Unavailable when the OS refuses a
  // thread: the store must not be used then (its destructor joins what was started).
  Status StartThreads();

  Status Put(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts);
  Result<BlockDesc> Get(const BlockKey& key, std::span<std::byte> out, const GetOptions& opts = {});
  Result<BlockHandle> Acquire(const BlockKey& key, TierId where);
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) const;
  bool Contains(const BlockKey& key) const;
  Status Erase(const BlockKey& key);
  Status EvictCopy(const BlockKey& key, TierId tier);  // evict_copy.cpp
  Status Pin(const BlockKey& key);
  Status Unpin(const BlockKey& key);
  void ReleaseHandle(const BlockKey& key, int slot);
  Status Flush();

  std::vector<Status> GetBatch(std::span<Store::GetItem> items, const GetOptions& opts = {});
  std::vector<Status> GetBatch(std::span<Store::GetRefItem> items);  // device_path.cpp
  std::vector<Status> GetRanges(std::span<Store::GetRangeItem> items);  // range_read.cpp
  // One lookup-and-read pass of GetRanges over items[pending]: sets st[i] for each, and returns the
  // items to look up again (the tier named answered NotFound: the copy moved; or the key was just
  // adopted from a shared tier, which only happens with adopt_shared, and then takes the keys'
  // stripes: the caller must hold none). The reads take no store lock.
  std::vector<std::size_t> RangeRound(std::span<Store::GetRangeItem> items, std::span<const std::size_t> pending,
                                      bool adopt_shared, std::vector<Status>& st);
  Future<std::vector<Status>> Prefetch(std::span<const BlockKey> keys, TierId target, const PrefetchOptions& options);
  Future<Result<BlockDesc>> GetAsync(const BlockKey& key, std::span<std::byte> out);
  Future<Status> PutAsync(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts);

  StoreStats Stats() const;
  std::string PrometheusText() const;

  const StoreOptions& options() const { return options_; }
  bool HasTier(TierId t) const { return SlotOf(t) >= 0; }
  std::uint32_t read_gap_bytes() const {
    std::uint32_t gap = 0;
    for (int t = 0; t < slot_count(); ++t) gap = std::max(gap, tier(t).caps().read_gap_bytes);
    return gap;
  }

 private:
  int slot_count() const { return static_cast<int>(slots_.size()); }
  Tier& tier(int slot) const { return *slots_[static_cast<std::size_t>(slot)].tier; }
  TierSlot& slot(int i) const { return slots_[static_cast<std::size_t>(i)]; }
  // A slot's members guarded by a StoreImpl lock (an annotation on TierSlot cannot name it).
  EvictionPolicy& Policy(int i) const TERRACE_REQUIRES(mu_) { return *slot(i).policy; }
  std::size_t& RegisteredRegions(int i) TERRACE_REQUIRES(regions_mu_) { return slot(i).registered_regions; }
  const std::string& SlotName(int i) const { return slots_[static_cast<std::size_t>(i)].name; }
  int LowestSlot() const { return slot_count() - 1; }
  // The first slot of kind `kind`, or -1.
  int SlotOf(TierId kind) const;
  // The first slot of kind `kind` or of a slower kind (the "nearest present tier below"), or -1.
  int SlotAtOrBelow(TierId kind) const;
  // Where a Get from a lower tier moves the block: promote_slot_, or nowhere when the call's
  // GetOptions::promote (or, unset, promote_on_get) is off.
  std::optional<int> PromoteOnGetTarget(const GetOptions& opts) const {
    return opts.promote.value_or(options_.promote_on_get) ? std::optional(promote_slot_) : std::nullopt;
  }

  // Caller holds key's stripe; the directory has no entry for key. Asks each shared tier
  // (TierCaps::shared), fastest first, and enters the first copy found. True if one was.
  bool AdoptFromShared(const BlockKey& key);
  bool InDirectory(const BlockKey& key) const;  // has a directory entry with a copy

  // read_path.cpp
  // Unlocked read from the fastest copy at or above the promotion slot: true with *result set, or
  // false when the locked path must answer (no such copy, or it moved or failed its check).
  bool FastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result);
  // FastGet in two steps, so that GetBatch can read many keys from one tier with one GetBatch:
  // PlanFastGet looks the key up (answered: *result is final, a miss or a short buffer; src < 0:
  // the locked path), FinishFastGet takes the tier's answer for f.src.
  FastRead PlanFastGet(const BlockKey& key, std::span<std::byte> out, Result<BlockDesc>* result);
  bool FinishFastGet(const BlockKey& key, const FastRead& f, const Status& read, const BlockDesc& got,
                     std::span<const std::byte> out, Result<BlockDesc>* result);
  // Deduplicated, locked fetch; with move_to, also moves the block (kUp semantics).
  // Delivers the block into `out` when it is non-empty (InvalidArgument when too small).
  ReadOutcome FetchDedup(const BlockKey& key, std::optional<int> move_to, bool by_prefetch,
                         std::span<std::byte> out);
  // Caller holds key's stripe. Reads the fastest good copy (dropping bad copies) and moves it per
  // `mode` to slot `target` (Transfer). The verified block lands in `out` when out holds it
  // (else, e.g. empty when only the move matters, it is read and checked but not delivered): a
  // move copies it there from where Transfer put it (the reservation in the target, once); a read
  // that moves nothing is ReadOut's. `dropped` names tiers whose copy the caller already dropped
  // as corrupt.
  ReadOutcome LockedRead(const BlockKey& key, std::span<std::byte> out, MoveMode mode, int target,
                         bool by_prefetch, std::string dropped = {});
  // Caller holds key's stripe. A read of slot `src`'s copy of the block (`desc`) that moves
  // nothing, verified. Into `out` directly when the tier can write it in place (ReadsInPlace),
  // else through a bounce_ buffer and one copy into `out` (empty `out`: read and checked only).
  // From a tier below the promotion slot, a delivered block counts as a transfer: direct, or
  // staged through the bounce buffer. Corruption: the copy failed its checksum.
  Status ReadOut(int src, const BlockKey& key, const BlockDesc& desc, std::span<std::byte> out);
  // Caller holds key's stripe and leads `fetch`, whose read ended in `o`; `have` holds the verified
  // block when the leader has it (its caller's buffer, a bounce buffer, a reservation; empty: it
  // read for a move only). Closes the fetch (no caller joins it after this), sets its status and
  // desc, and when a follower that wants the bytes joined, copies them into Fetch::bytes: from
  // `have`, else read again from the block's fastest copy (now the move's target). Under the
  // stripe because `have` may be a committed reservation, which an eviction could free once the
  // stripe is released. The caller wakes the fetch (InflightTable::Wake) afterwards.
  void CloseFetch(const BlockKey& key, const std::shared_ptr<Fetch>& fetch, const ReadOutcome& o,
                  std::span<const std::byte> have, bool by_prefetch);
  // Caller holds key's stripe; the block was just read (verified) from slot `src` while the
  // entry's mask was `mask`. Counts the read (not a prefetch's), and when `mode` asks for a move to `target`, calls
  // `place` (which puts the block there and counts the transfer) and updates the directory;
  // updates the policies.
  void CompleteLockedRead(const BlockKey& key, int src, SlotMask mask, MoveMode mode, int target, bool by_prefetch,
                          ReadOutcome* out, const std::function<Status()>& place);
  // transfer.cpp: the one place a block is copied from one tier into another. Caller holds key's
  // stripe; `desc` is the directory's description. Routes, first that applies:
  //   1. `to` reserves space (TierCaps::reserves): `from` reads straight into the reservation,
  //      aligned for its io_alignment (NVMe -> host arena, HBM -> host arena): direct;
  //   2. a move down (to > from) from a tier that keeps the block in host memory (ResidentPtr;
  //      pinned meanwhile, hashed first since no Get verified it): `to` writes it from there
  //      (host arena -> NVMe through registered buffers, emulated HBM -> host): direct;
  //   3. through a buffer of bounce_ (waits for one): staged.
  // Makes room in `to` like PlaceInTier. `seen`, when given, gets the verified bytes before the
  // copy is published (a Get's buffer). Counts the transfer in StoreStats.
  TransferOutcome Transfer(int from, int to, const BlockKey& key, const BlockDesc& desc,
                           const std::function<void(std::span<const std::byte>)>& seen = {});
  // Room for the block in slot `t` when that tier reserves (evicting a few blocks if needed).
  std::optional<Reservation> ReserveRoom(int t, const BlockKey& key, const BlockDesc& desc);
  // Publishes a filled reservation as the block; counts the write and a direct transfer.
  Status CommitRoom(int t, const BlockKey& key, const BlockDesc& desc, const Reservation& r);
  // Counts one block moved between tiers: direct (tier memory to tier memory, no store buffer) or
  // staged (through a store-side copy).
  void CountTransfer(bool direct, std::uint64_t bytes);
  Status MoveUp(const BlockKey& key, int target, bool by_prefetch);
  // Caller holds key's stripe; removes the copy in `slot` (already found bad) and records why;
  // when it was the last copy, the key is remembered as lost (lost_).
  void DropCopy(const BlockKey& key, int slot);
  // Forgets this store's record of the copy in `slot` without touching the tier: for a shared tier,
  // whose copy another process may have replaced or erased (it is that process's, not ours to drop).
  void ForgetCopy(const BlockKey& key, int slot);
  // The answer for a key with no directory entry: Corruption naming the tiers when it is in lost_,
  // else NotFound.
  Status MissLocked(const BlockKey& key) const TERRACE_REQUIRES(mu_);
  Status Miss(const BlockKey& key) const;
  std::string LostTierNames(SlotMask mask) const;
  // One caller's read served from slot `served_from`: a miss in each faster slot, a hit there;
  // served_from == slot_count(): a miss in every slot.
  void CountGet(int served_from);

  // batch_read.cpp
  // Reads the items held only in non-addressable tiers (NVMe) with one tier GetBatch per source
  // tier (so the reads share the I/O queue), then, one key at a time under its stripe, verifies,
  // counts and moves each like a deduplicating FetchDedup leader would (move_to: kUp to that slot).
  // Items it leaves unhandled (in memory tiers, already being fetched by another caller, missing,
  // buffer too small) are the caller's to finish on the single-key path. `still_wanted(i)`, if
  // given, is asked after the read: a non-OK answer becomes item i's status and nothing moves.
  // `finished(i)`, if given, is called (no lock held) as soon as item i is handled.
  void BulkFetch(std::span<BulkItem> items, std::optional<int> move_to, bool by_prefetch,
                 const std::function<Status(std::size_t)>& still_wanted = {},
                 const std::function<void(std::size_t)>& finished = {});
  // BulkFetch's steps. Leads: the items this call reads, each leading its key's in-flight fetch.
  std::vector<BulkLead> LeadBulkItems(std::span<BulkItem> items, std::optional<int> move_to, bool by_prefetch);
  // Gives a lead its destination: reserved room in `target` when that tier reserves (the read then
  // lands there directly), else the caller's buffer, else space packed into a batch_bounce_
  // buffer (`window`: this window's buffers, *used: bytes taken of the last). Waits for a buffer
  // only while `window` holds none. False: no buffer was free; the window ends before this lead.
  bool PrepareDestination(BulkLead& lead, const BulkItem& item, std::optional<int> target,
                          std::vector<BouncePool::Lease>& window, std::size_t* used);
  // Issues one tier GetBatch for `leads` (all from one source slot) and records each answer.
  void ReadLeads(std::span<BulkLead> leads, std::span<BulkItem> items);
  // Verifies, counts and moves one read key under its stripe, as its fetch's leader; anything
  // unusual falls back to LockedRead.
  void FinishLead(BulkLead& lead, BulkItem& item, std::optional<int> move_to, bool by_prefetch,
                  const std::function<Status(std::size_t)>& still_wanted);

  // write_path.cpp
  // The slot a put goes to: PutOptions::tier (or the store's put_tier), else the next tier below
  // it; InvalidArgument naming the key when no such tier is configured.
  Result<int> PutTarget(const BlockKey& key, const PutOptions& opts) const;
  // Caller holds key's stripe; the key's copies are old_mask, none pinned. Put's write-through
  // part: refuses a block `target` can never hold before anything is written, writes `through` (the
  // lowest slot) then `target`. When `target` has no room (OutOfCapacity), publishes the block in
  // `through` alone and counts it in puts_placed_lower; any other failure of the target's write
  // removes every copy (RemoveEveryCopy) and says so.
  Status PutWritingThrough(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data, int target,
                           int through, SlotMask old_mask);
  Status EraseLocked(const BlockKey& key);
  // Erases `key` from every slot in `mask`; returns the slots whose copy is still served (NotFound
  // counts as removed). A failed erase whose tier no longer serves the copy (it applied the erase
  // but could not make it durable) is added to *unsure, when given. *first_error: the first
  // failure. Every failed erase counts as an I/O error of its tier.
  SlotMask EraseCopies(const BlockKey& key, SlotMask mask, Status* first_error, SlotMask* unsure);
  // Caller holds key's stripe; the block (`desc`) now lives in new_mask's slots: removes the
  // previous version's other copies (old_mask) and updates the directory. When a previous copy
  // cannot be removed, the put is undone instead (its new copies erased, the directory left on the
  // previous version where it is still served) and the error says so, also when a tier applied the
  // erase but not durably: an acknowledged put never leaves an older version in a tier, where a
  // reopen or another process would find it.
  Status PublishPut(const BlockKey& key, const BlockDesc& desc, SlotMask old_mask, SlotMask new_mask);
  // Caller holds key's stripe. A put that reached some tiers (new_mask: `desc`) but failed to
  // reach others: erases every copy, old (old_mask) and new. Copies a tier could not erase stay in
  // the directory (the version in the slowest of them: what a reopen would find), so the directory
  // never hides what a tier holds. Returns the sentence for the put's error: what is left.
  std::string RemoveEveryCopy(const BlockKey& key, const BlockDesc& desc, SlotMask old_mask, SlotMask new_mask);
  // Caller holds key's stripe and mu_. Points the directory at the version left in `stuck_old`
  // (the entry's current desc) and `stuck_new` (`desc`), whichever has the slowest slot; an empty
  // result drops the entry. Returns the slots kept.
  SlotMask KeepLeftoverLocked(const BlockKey& key, const BlockDesc& desc, SlotMask stuck_old, SlotMask stuck_new)
      TERRACE_REQUIRES(mu_);
  // Caller holds key's stripe. InvalidArgument if the key is pinned; else the slots holding its
  // current version (0: none).
  Result<SlotMask> ReplaceableMask(const BlockKey& key) const;

 public:
  // device_path.cpp: Store::Put / Get with BufferKind::kDevice buffers (store.h).
  Status PutDevice(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts);
  Result<BlockDesc> GetDevice(const BlockKey& key, std::span<std::byte> out);

 private:
  // The first slot whose tier takes device buffers (TierCaps::device_buffers), or -1.
  int DeviceSlot() const;
  // Result of a kDevice Get when DeviceSlot() < 0.
  static Status NoDeviceTier(const BlockKey& key);

  // A caller's read that found no readable copy of its key (NotFound, or Corruption: every copy
  // lost) counts a miss in every tier, whichever read call it was.
  void CountMissIfNone(const Status& s) {
    if (s.IsNotFound() || s.IsCorruption()) CountGet(slot_count());
  }

  // placement.cpp
  // What room-making does when every victim is busy (its key locked by another thread, e.g. being
  // demoted): kSkip gives up after a few quick looks (promotions, which have another route);
  // kWait waits for a busy victim's release (up to kBusyVictimWait each time) and looks again
  // (a Put, whose caller holds only the put key's lock and has no other route).
  enum class BusyVictims { kSkip, kWait };
  static constexpr std::chrono::milliseconds kBusyVictimWait{2000};
  Status PlaceInTier(int slot, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data,
                     BusyVictims busy = BusyVictims::kSkip);
  // OutOfCapacity when a `size`-byte block can never be placed in `slot` (larger than its
  // capacity or max block size), however much is evicted; Ok otherwise. Reads only caps().
  Status CheckBlockFits(int slot, const BlockKey& key, std::uint64_t size) const;
  // PlaceInTier's room-making loop around any write of a `size`-byte block into `slot` (`write`
  // returns the tier's answer; OutOfCapacity makes the loop evict and retry).
  Status PlaceWith(int slot, const BlockKey& key, std::uint64_t size, const std::function<Status()>& write,
                   BusyVictims busy = BusyVictims::kSkip);
  // Frees one copy from `slot` (demoting it if needed). OutOfCapacity when nothing is evictable,
  // or the error a victim's demotion hit. With BusyVictims::kWait, also Ok without evicting when
  // every victim was busy and one of them was released meanwhile: room may have appeared, so the
  // caller looks again; OutOfCapacity when none was released within kBusyVictimWait.
  Status EvictOne(int slot, BusyVictims busy = BusyVictims::kSkip);
  // While one lives (on the stack of a thread that holds `key`'s lock for a write-back Put), this
  // thread's room-making may evict copies of `key` - the previous version the put replaces - from
  // slots outside `keep` (those the put writes; shared tiers and the slots just above them are
  // kept too), demoting them like any other victim, since the put
  // may still fail and the previous version must survive that. Without one, room-making never
  // evicts a key this thread locked (an operation of this thread is on it). The put reads the
  // key's copies again (CopiesOf) before it publishes. Not copyable; nests.
  class OwnCopiesEvictable {
   public:
    OwnCopiesEvictable(const StoreImpl* store, const BlockKey& key, SlotMask keep);
    ~OwnCopiesEvictable();
    OwnCopiesEvictable(const OwnCopiesEvictable&) = delete;
    OwnCopiesEvictable& operator=(const OwnCopiesEvictable&) = delete;
    // True if one living on this thread lets `store` evict `key`'s copy in `slot`.
    static bool Allows(const StoreImpl* store, const BlockKey& key, int slot);

   private:
    const StoreImpl* store_;
    BlockKey key_;
    SlotMask keep_;
    const OwnCopiesEvictable* outer_;
    static thread_local const OwnCopiesEvictable* innermost_;  // on this thread
  };
  // The slots holding `key`'s copies now (0 when the directory has no entry).
  SlotMask CopiesOf(const BlockKey& key) const;
  // PlaceWith's OutOfCapacity once no eviction helps: "fragmented" when the block fits the tier's
  // free space by count (allocated bytes, the block rounded up to io_alignment) and the tier still
  // refused it (`refused`), else "full".
  Status NoRoom(int slot, const BlockKey& key, std::uint64_t size, const Status& refused) const;
  // Caller holds key's stripe: removes slot's copy, demoting it into the next slot first when no
  // slot below holds one. OutOfCapacity when it cannot (the copy is pinned there, the last one, or
  // finds no room below), NotFound when the copy moved; other errors are the demotion's.
  Status EvictLocked(int slot, const BlockKey& key);
  void MaybeScheduleDemotion(int slot);
  // Caller holds key's stripe: writes the copy in `from` (described by `desc`) into `to`.
  // Corruption: the copy in `from` failed its checksum (nothing was written).
  Status DemoteCopy(int from, int to, const BlockKey& key, const BlockDesc& desc);
  // Registers `from`'s memory regions with `to` for direct I/O, again whenever `from` has grown.
  void RefreshIoRegions(int from, int to);
  // Every store read from a tier goes through one of these two: the read's latency and an IoError
  // go into the slot's store-measured counters (NoteTierRead). A batch charges each op the whole
  // call (an upper bound).
  Status TimedTierGet(int slot, const BlockKey& key, std::span<std::byte> out, BlockDesc* desc);
  std::vector<Status> TimedTierGetBatch(int slot, std::span<GetOp> ops);
  void NoteTierRead(int slot, std::uint64_t ns, const Status& s);
  Status TimedTierPut(int slot, const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data);
  // Runs `write` (one write into slot t's tier, returning its Status), recording its latency and
  // an IoError in the slot's store-measured counters. Every store write into a tier goes through it.
  template <typename Write>
  Status TimedTierWrite(int t, Write&& write) {
    TierCounters& m = slot(t).measured;
    const auto t0 = Clock::now();
    Status s = std::forward<Write>(write)();
    m.write_latency.Record(NanosSince(t0));
    if (s.IsIoError()) m.Add(m.io_errors);
    return s;
  }
  // Sets e's mask to new_mask, telling the policies; `evicted_from` is the slot a policy eviction
  // removed the copy from, if any.
  void SetMaskLocked(const BlockKey& key, Entry& e, SlotMask new_mask, int evicted_from = -1)
      TERRACE_REQUIRES(mu_);

  // prefetch.cpp
  using PrefetchItem = std::pair<std::shared_ptr<PrefetchJob>, std::size_t>;  // job, key index
  static constexpr std::size_t kPrefetchGroup = 64;  // kDemand items per drainer pass (one batched read)
  // Speculative items per pass: Store::kSpeculativeGroup, so a demand waits for at most that many.
  // Queues the job's items and posts drainers, or, once the store is stopping, completes them
  // Cancelled; each item completes exactly once either way.
  void EnqueuePrefetch(const std::shared_ptr<PrefetchJob>& job);
  void DrainPrefetch();
  // Destructor, after prefetch_lane_ is joined: completes the items still queued (their drainer was
  // posted after the lane stopped running work) as Cancelled. Nothing is queued after it (stopping_).
  void CancelQueuedPrefetch();
  Status PrefetchCheck(const PrefetchJob& job, std::size_t i) const;  // OK: item i may still start
  // Runs the group's items. A speculative group that finds a demand job queued while it has to wait
  // for demand puts its items back at the front of their queue instead, so this lane thread can run
  // the demand job.
  void RunPrefetchGroup(std::span<PrefetchItem> group);

  friend class ::terrace::BlockHandle;

  StoreOptions options_;
  const std::shared_ptr<Logger> logger_;  // options_.logger or stderr; never null
  mutable std::vector<TierSlot> slots_;   // the tier list, fastest first; its size never changes
  int promote_slot_ = 0;                  // put_tier's slot, or the nearest slot below it (Init)
  SlotMask shared_mask_ = 0;              // slots whose tier is TierCaps::shared (Init)

  mutable Mutex mu_;
  KeyMap<Entry> entries_ TERRACE_GUARDED_BY(mu_);  // no reference into it survives an insert
  // Live BlockHandles per slot, for keys with any (Entry::handle_mask mirrors it).
  KeyMap<std::array<std::uint32_t, kMaxTierSlots>> handles_ TERRACE_GUARDED_BY(mu_);
  std::uint64_t last_version_ TERRACE_GUARDED_BY(mu_) = 0;  // Entry::version source (unique across erase + re-put)
  // Keys whose last copy was dropped as bad (DropCopy), with the slots it was dropped from, so a
  // later read answers Corruption ("stored but lost"), not NotFound ("never stored"). Cleared by a
  // Put or an Erase of the key; at most kMaxLost keys, the oldest forgotten first.
  static constexpr std::size_t kMaxLost = 65536;
  KeyMap<SlotMask> lost_ TERRACE_GUARDED_BY(mu_);
  std::deque<BlockKey> lost_order_ TERRACE_GUARDED_BY(mu_);  // insertion order of lost_ (may hold stale keys)

  KeyLocks key_locks_;
  InflightTable inflight_;

  std::atomic<std::uint64_t> promotions_{0}, demotions_{0}, evictions_{0}, dropped_blocks_{0}, dedup_hits_{0},
      lower_tier_reads_{0}, put_dedup_hits_{0}, prefetch_issued_{0}, prefetch_useful_{0},
      prefetch_late_{0}, corruptions_dropped_{0}, direct_transfers_{0}, direct_transfer_bytes_{0},
      staged_transfers_{0}, staged_transfer_bytes_{0}, device_copies_{0}, device_copy_bytes_{0},
      range_reads_{0}, range_read_bytes_{0}, puts_placed_lower_{0};

  // Demand fetches in progress; speculative prefetch waits while there are any.
  const std::shared_ptr<DemandGate> demand_ = std::make_shared<DemandGate>();

  std::atomic<bool> stopping_{false};

  Mutex prefetch_mu_;
  std::array<std::deque<PrefetchItem>, 3> prefetch_queues_ TERRACE_GUARDED_BY(prefetch_mu_);  // by Priority
  unsigned prefetch_drainers_ TERRACE_GUARDED_BY(prefetch_mu_) = 0;  // drain tasks on prefetch_lane_
  unsigned prefetch_spec_running_ TERRACE_GUARDED_BY(prefetch_mu_) = 0;  // drainers running a speculative group

  // Staging buffers (StoreOptions::bounce_buffers): bounce_ for Transfer, batch_bounce_ for
  // BulkFetch windows. Separate because a window holds its buffers while it blocks on key stripes,
  // and a Transfer waits for a buffer while holding one: sharing a pool could deadlock.
  BouncePool bounce_;
  BouncePool batch_bounce_;

  Mutex regions_mu_;
  LogOnce regions_log_;  // "memory not registered" is logged for the first failure only

  // Three executors, so background work never delays demand: pool_ (background_threads threads)
  // runs GetAsync and PutAsync; prefetch_lane_ (max(1, background_threads - 1) threads, its own)
  // drains the prefetch queues; demotion_lane_ (one thread) runs the demotion passes, each of
  // which writes blocks into a lower tier until its tier is down to low_watermark (seconds on a slow
  // drive). Last members; the destructor joins them in the order prefetch, pool, demotion (the
  // first two may schedule demotions).
  const unsigned lane_threads_;
  ThreadPool pool_;
  ThreadPool prefetch_lane_;
  ThreadPool demotion_lane_;
};

// InvalidArgument when one of `options`' enums (eviction, placement, write_policy, put_tier) holds
// a value the library does not name. Store::Open calls it before any tier is built (nothing is
// created for a refused open); Init calls it again for stores opened over given tiers.
Status ValidateStoreEnums(const StoreOptions& options);

// Builds and initialises the store state over `tiers` (fastest first).
Result<std::unique_ptr<StoreImpl>> OpenImpl(const StoreOptions& options, std::vector<NamedTier> tiers);

}  // namespace terrace::store_internal
