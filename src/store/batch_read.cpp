// Batched reads from slow tiers: Store::GetBatch and prefetch groups read every block that lives
// only in a non-addressable tier (NVMe) with one tier GetBatch per source tier, so the reads share
// the tier's I/O queue instead of going one at a time, then finish each key like a FetchDedup
// leader: verified, counted and moved under its stripe, with the single-key locked read as the
// fallback for anything unusual (a changed entry, an I/O error, a bad checksum).
#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
namespace {

// Reserved room per tier call; bounds the arena space one batch holds before it commits.
constexpr std::uint64_t kWindowBytes = 64 * kMiB;
// Blocks packed into a bounce buffer start at multiples of this (the NVMe tier's direct unit).
constexpr std::uint64_t kPackAlign = 4096;

}  // namespace

// One key a BulkFetch reads, as the leader of its in-flight fetch.
struct BulkLead {
  std::size_t item = 0;
  BlockDesc desc;
  std::uint64_t version = 0;
  int src = -1;
  std::shared_ptr<Fetch> fetch;
  std::span<std::byte> staged;       // the destination in a batch bounce buffer (no caller buffer, no reservation)
  std::optional<Reservation> room;   // the destination reserved in the move's target tier
  int room_slot = -1;                // the tier `room` is in
  Status status;                     // the tier's answer
  BlockDesc got;

  // Where the read lands: the reservation (with its rounded-up room, so an aligned tier needs no
  // staging), the caller's buffer (all of it: its room past the block lets an aligned tier read
  // the rounded-up tail, or the gap to the next block, in place), or space in a bounce buffer.
  std::span<std::byte> Destination(const BulkItem& it) {
    if (room) return room->bytes;
    if (!it.out.empty()) return it.out;
    return staged;
  }
  std::span<std::byte> Bytes(const BulkItem& it) { return Destination(it).first(desc.size); }
};

std::vector<BulkLead> StoreImpl::LeadBulkItems(std::span<BulkItem> items, std::optional<int> move_to,
                                               bool by_prefetch) {
  std::vector<BulkLead> leads;
  {
    MutexLock lock(&mu_);
    for (std::size_t i = 0; i < items.size(); ++i) {
      auto it = entries_.find(items[i].key);
      if (it == entries_.end() || it->second.mask == 0) continue;
      const Entry& e = it->second;
      const int src = Fastest(e.mask);
      if (move_to && items[i].out.empty() && src <= *move_to) {  // a move that is already done
        items[i].handled = true;
        items[i].desc = e.desc;
        continue;
      }
      if (tier(src).caps().memory != MemoryKind::kNone) continue;  // memory tiers: nothing to batch
      if (!items[i].out.empty() && items[i].out.size() < e.desc.size) continue;
      BulkLead l;
      l.item = i;
      l.desc = e.desc;
      l.version = e.version;
      l.src = src;
      leads.push_back(std::move(l));
    }
  }
  // Lead each fetch (outside mu_, like FetchDedup); a key someone else is fetching, or that
  // appears twice in this batch, goes to the caller's fallback and joins that fetch there.
  std::erase_if(leads, [&](BulkLead& l) {
    auto ticket = inflight_.JoinOrLead(items[l.item].key, by_prefetch, /*wants_bytes=*/!items[l.item].out.empty());
    if (!ticket.leader) return true;
    l.fetch = std::move(ticket.fetch);
    return false;
  });
  // One tier call per source slot.
  std::stable_sort(leads.begin(), leads.end(), [](const BulkLead& a, const BulkLead& b) { return a.src < b.src; });
  return leads;
}

bool StoreImpl::PrepareDestination(BulkLead& l, const BulkItem& item, std::optional<int> target,
                                   std::vector<BouncePool::Lease>& window, std::size_t* used) {
  if (target && *target < l.src) {
    if (std::optional<Reservation> r = ReserveRoom(*target, item.key, l.desc)) {
      l.room = std::move(*r);
      l.room_slot = *target;
      return true;
    }
  }
  if (!item.out.empty()) return true;
  // Pack into the window's current bounce buffer; take another when it is full.
  const std::uint64_t need = (l.desc.size + kPackAlign - 1) / kPackAlign * kPackAlign;
  if (window.empty() || window.back().bytes().size() - *used < need) {
    // Waiting is safe only while this window holds no buffer (see batch_bounce_).
    const bool first = window.empty();
    BouncePool::Lease lease = first ? batch_bounce_.Acquire(need) : batch_bounce_.TryAcquire(need);
    if (!lease.valid()) return first;  // first: out of memory; the read fails and the key takes the single-key path
    window.push_back(std::move(lease));
    *used = 0;
  }
  l.staged = window.back().bytes().subspan(*used, l.desc.size);
  *used += need;
  return true;
}

void StoreImpl::ReadLeads(std::span<BulkLead> leads, std::span<BulkItem> items) {
  if (leads.empty()) return;
  const int src = leads.front().src;
  std::vector<GetOp> ops;
  ops.reserve(leads.size());
  for (BulkLead& l : leads) ops.push_back(GetOp{items[l.item].key, l.Destination(items[l.item]), {}});
  std::vector<Status> st = TimedTierGetBatch(src, ops);
  for (std::size_t k = 0; k < leads.size(); ++k) {
    leads[k].status = std::move(st[k]);
    leads[k].got = ops[k].desc;
  }
}

void StoreImpl::FinishLead(BulkLead& l, BulkItem& item, std::optional<int> move_to, bool by_prefetch,
                           const std::function<Status(std::size_t)>& still_wanted) {
  const int target = move_to.value_or(0);
  // An item no longer wanted (cancelled, past its deadline) is read but not moved.
  Status wanted = still_wanted ? still_wanted(l.item) : Status::Ok();
  const MoveMode mode = move_to && wanted.ok() ? MoveMode::kUp : MoveMode::kNone;
  std::span<std::byte> bytes = l.Bytes(item);
  const bool good = l.status.ok() && Verify(tier(l.src).caps(), l.desc, l.got, bytes);
  ReadOutcome o;
  {
    auto guard = key_locks_.Lock(item.key);
    SlotMask mask = 0;
    bool same = false;  // the entry still holds the version we read, and its fastest copy is the one we read
    {
      MutexLock lock(&mu_);
      auto it = entries_.find(item.key);
      if (it != entries_.end()) {
        mask = it->second.mask;
        same = it->second.version == l.version && Fastest(mask) == l.src;
      }
    }
    bool from_bulk = false;
    if (good && same) {
      o.desc = l.desc;
      // The caller's copy first: a reservation's bytes are not ours once committed or aborted.
      if (l.room && !item.out.empty()) std::memcpy(item.out.data(), bytes.data(), l.desc.size);
      std::function<Status()> place;
      if (l.room && l.room_slot == target) {
        place = [&] { return CommitRoom(target, item.key, l.desc, *std::exchange(l.room, std::nullopt)); };
      } else {
        // Staged: from the bounce buffer or the caller's buffer into the target.
        place = [&] {
          Status s = PlaceInTier(target, item.key, l.desc, bytes);
          if (s.ok()) CountTransfer(/*direct=*/false, l.desc.size);
          return s;
        };
      }
      CompleteLockedRead(item.key, l.src, mask, mode, target, by_prefetch, &o, place);
      // A block delivered to the caller and not moved: read from a slower tier into the caller's
      // buffer (direct) or into a reservation not kept and copied from there (staged).
      if (!o.moved && !item.out.empty() && l.src > promote_slot_) CountTransfer(/*direct=*/!l.room, l.desc.size);
      from_bulk = true;
    } else {
      std::string dropped;
      if (same && (l.status.IsCorruption() || (l.status.ok() && !good))) {
        if (shared_mask_ & Bit(l.src)) {
          ForgetCopy(item.key, l.src);  // another process's block, maybe replaced: the locked read asks again
        } else {
          DropCopy(item.key, l.src);
          dropped = SlotName(l.src);
        }
      }
      if (l.room) tier(l.room_slot).Abort(*std::exchange(l.room, std::nullopt));
      o = LockedRead(item.key, item.out, mode, target, by_prefetch, std::move(dropped));
    }
    const bool delivered = o.desc.ok() && item.out.size() >= o.desc->size;
    CloseFetch(item.key, l.fetch, o, from_bulk ? bytes : delivered ? item.out.first(o.desc->size) : std::span<std::byte>{},
               by_prefetch);
    if (l.room) tier(l.room_slot).Abort(*std::exchange(l.room, std::nullopt));  // read, but not moved
  }
  item.handled = true;
  if (!wanted.ok()) {
    item.status = std::move(wanted);
  } else if (o.desc.ok() && !item.out.empty() && item.out.size() < o.desc->size) {
    item.status = ShortBuffer(item.key, item.out.size(), o.desc->size);  // the block changed since LeadBulkItems
  } else {
    item.status = o.desc.ok() && move_to && item.out.empty() ? o.move_status : o.desc.status();
  }
  if (o.desc.ok()) item.desc = *o.desc;
  InflightTable::Wake(*l.fetch);
}

void StoreImpl::BulkFetch(std::span<BulkItem> items, std::optional<int> move_to, bool by_prefetch,
                          const std::function<Status(std::size_t)>& still_wanted,
                          const std::function<void(std::size_t)>& finished) {
  std::vector<BulkLead> leads = LeadBulkItems(items, move_to, by_prefetch);
  // Read one window at a time: one tier call per source slot and window of destinations (reserved
  // room up to kWindowBytes, bounce buffers as many as are free), finished before the next is read,
  // so followers wake sooner and at most one window of destinations is held.
  for (std::size_t begin = 0; begin < leads.size();) {
    const int src = leads[begin].src;
    std::size_t end = begin;
    std::uint64_t reserved = 0;
    std::vector<BouncePool::Lease> window;
    std::size_t used = 0;
    for (; end < leads.size() && leads[end].src == src; ++end) {
      BulkLead& l = leads[end];
      if (end > begin && reserved + l.desc.size > kWindowBytes) break;
      if (!PrepareDestination(l, items[l.item], move_to, window, &used)) break;
      if (l.room) reserved += l.desc.size;
    }
    std::span<BulkLead> group(leads.data() + begin, end - begin);
    ReadLeads(group, items);
    for (BulkLead& l : group) {
      FinishLead(l, items[l.item], move_to, by_prefetch, still_wanted);
      if (finished) finished(l.item);
    }
    begin = end;
  }
}

std::vector<Status> StoreImpl::GetBatch(std::span<Store::GetItem> items, const GetOptions& opts) {
  std::vector<Status> st(items.size());
  std::vector<BulkItem> slow;
  std::vector<std::size_t> slow_index;
  auto to_slow = [&](std::size_t i) {
    slow.push_back(BulkItem{items[i].key, items[i].out, false, {}, {}});
    slow_index.push_back(i);
  };
  auto answer = [&](std::size_t i, const Result<BlockDesc>& r) {
    if (r.ok()) items[i].desc = *r;
    st[i] = r.status();
  };
  // Fast reads, grouped by the slot they read from: one tier GetBatch per slot, so a tier sees
  // the whole batch's destination (the host tier streams into a large one).
  std::vector<FastRead> plans(items.size());
  std::vector<std::vector<std::size_t>> by_slot(static_cast<std::size_t>(slot_count()));
  for (std::size_t i = 0; i < items.size(); ++i) {
    Result<BlockDesc> r = Status::NotFound("unset");
    plans[i] = PlanFastGet(items[i].key, items[i].out, &r);
    if (plans[i].answered) {
      answer(i, r);
    } else if (plans[i].src < 0) {
      to_slow(i);
    } else {
      by_slot[static_cast<std::size_t>(plans[i].src)].push_back(i);
    }
  }
  for (int src = 0; src < slot_count(); ++src) {
    const std::vector<std::size_t>& group = by_slot[static_cast<std::size_t>(src)];
    if (group.empty()) continue;
    std::vector<GetOp> ops;
    ops.reserve(group.size());
    for (std::size_t i : group) ops.push_back(GetOp{items[i].key, items[i].out, {}});
    const std::vector<Status> reads = TimedTierGetBatch(src, ops);
    for (std::size_t k = 0; k < group.size(); ++k) {
      const std::size_t i = group[k];
      Result<BlockDesc> r = Status::NotFound("unset");
      if (FinishFastGet(items[i].key, plans[i], reads[k], ops[k].desc, items[i].out, &r)) {
        answer(i, r);
      } else {
        to_slow(i);
      }
    }
  }
  if (slow.empty()) return st;
  DemandScope demand(*demand_);
  BulkFetch(slow, PromoteOnGetTarget(opts), /*by_prefetch=*/false);
  for (std::size_t k = 0; k < slow.size(); ++k) {
    Store::GetItem& item = items[slow_index[k]];
    if (slow[k].handled) {
      CountMissIfNone(slow[k].status);
      st[slow_index[k]] = slow[k].status;
      if (slow[k].status.ok()) item.desc = slow[k].desc;
      continue;
    }
    Result<BlockDesc> r = Get(item.key, item.out, opts);  // the single-key path, with the batch's promotion choice
    if (r.ok()) item.desc = *r;
    st[slow_index[k]] = r.status();
  }
  return st;
}

}  // namespace terrace::store_internal
