// Batched reads from slow tiers: Store::GetBatch and prefetch groups read every block that lives
// only in a non-addressable tier (NVMe) with one tier GetBatch per source tier, so the reads share
// the tier's I/O queue instead of going one at a time, then finish each key like a FetchDedup
// leader: verified, counted and moved under its stripe, with the single-key locked read as the
// fallback for anything unusual (a changed entry, an I/O error, a bad checksum).
#include <algorithm>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
namespace {

// Temporary buffers (for moves without a caller buffer) per tier call; bounds a batch's memory.
constexpr std::uint64_t kWindowBytes = 64 * kMiB;

struct Lead {
  std::size_t item = 0;
  BlockDesc desc;
  std::uint64_t version = 0;
  int src = -1;
  std::shared_ptr<Fetch> fetch;
  std::vector<std::byte> temp;  // the block when the item has no caller buffer
  Status status;                // the tier's answer
  BlockDesc got;
};

}  // namespace

void StoreImpl::BulkFetch(std::span<BulkItem> items, std::optional<int> move_to, bool by_prefetch,
                          const std::function<Status(std::size_t)>& still_wanted) {
  std::vector<Lead> leads;
  {
    std::lock_guard lock(mu_);
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
      leads.push_back(Lead{i, e.desc, e.version, src, nullptr, {}, {}, {}});
    }
  }
  // Lead each fetch (outside mu_, like FetchDedup); a key someone else is fetching, or that
  // appears twice in this batch, goes to the caller's fallback and joins that fetch there.
  std::erase_if(leads, [&](Lead& l) {
    auto ticket = inflight_.JoinOrLead(items[l.item].key, by_prefetch);
    if (!ticket.leader) return true;
    l.fetch = std::move(ticket.fetch);
    return false;
  });
  auto bytes_of = [&](Lead& l) -> std::span<std::byte> {
    std::span<std::byte> out = items[l.item].out;
    return out.empty() ? std::span<std::byte>(l.temp) : out.first(l.desc.size);
  };

  // Finishes one read key under its stripe, as its fetch's leader.
  const int target = move_to.value_or(0);
  auto finish = [&](Lead& l) {
    BulkItem& item = items[l.item];
    // An item no longer wanted (cancelled, past its deadline) is read but not moved.
    Status wanted = still_wanted ? still_wanted(l.item) : Status::Ok();
    const MoveMode mode = move_to && wanted.ok() ? MoveMode::kUp : MoveMode::kNone;
    Fetch& f = *l.fetch;
    std::span<std::byte> bytes = bytes_of(l);
    const bool good = l.status.ok() && Verify(tier(l.src).caps(), l.desc, l.got, bytes);
    ReadOutcome o;
    bool from_bulk = false;
    {
      auto guard = key_locks_.Lock(item.key);
      SlotMask mask = 0;
      bool same = false;  // the entry still holds the version we read, and its fastest copy is the one we read
      {
        std::lock_guard lock(mu_);
        auto it = entries_.find(item.key);
        if (it != entries_.end()) {
          mask = it->second.mask;
          same = it->second.version == l.version && Fastest(mask) == l.src;
        }
      }
      if (good && same) {
        o.desc = l.desc;
        CompleteLockedRead(item.key, l.desc, bytes, l.src, mask, mode, target, by_prefetch, &o);
        from_bulk = true;
      } else {
        std::string dropped;
        if (same && (l.status.IsCorruption() || (l.status.ok() && !good))) {
          DropCopy(item.key, l.src);
          dropped = SlotName(l.src);
        }
        o = LockedRead(item.key, &f.bytes, mode, target, by_prefetch, std::move(dropped));
        if (o.desc.ok() && !item.out.empty()) std::memcpy(item.out.data(), f.bytes.data(), o.desc->size);
      }
    }
    f.status = o.desc.status();
    if (o.desc.ok()) f.desc = *o.desc;
    item.handled = true;
    if (!wanted.ok()) {
      item.status = std::move(wanted);
    } else {
      item.status = o.desc.ok() && move_to && item.out.empty() ? o.move_status : o.desc.status();
    }
    if (o.desc.ok()) item.desc = *o.desc;
    const std::size_t followers = inflight_.Close(item.key, l.fetch);
    if (from_bulk && followers > 0) f.bytes.assign(bytes.begin(), bytes.end());
    InflightTable::Wake(f);
  };

  // Read: one tier call per source tier and window of temporary bytes.
  std::stable_sort(leads.begin(), leads.end(), [](const Lead& a, const Lead& b) { return a.src < b.src; });
  for (std::size_t begin = 0; begin < leads.size();) {
    const int src = leads[begin].src;
    std::size_t end = begin;
    std::uint64_t temp_bytes = 0;
    for (; end < leads.size() && leads[end].src == src; ++end) {
      if (!items[leads[end].item].out.empty()) continue;
      if (end > begin && temp_bytes + leads[end].desc.size > kWindowBytes) break;
      temp_bytes += leads[end].desc.size;
      leads[end].temp.resize(leads[end].desc.size);
    }
    std::vector<GetOp> ops;
    ops.reserve(end - begin);
    for (std::size_t k = begin; k < end; ++k) ops.push_back(GetOp{items[leads[k].item].key, bytes_of(leads[k]), {}});
    auto t0 = Clock::now();
    std::vector<Status> st = tier(src).GetBatch(ops);
    const std::uint64_t ns = NanosSince(t0);  // each op is charged the whole call: an upper bound
    for (std::size_t k = begin; k < end; ++k) {
      Lead& l = leads[k];
      l.status = std::move(st[k - begin]);
      l.got = ops[k - begin].desc;
      slot(src).measured.read_latency.Record(ns);
      if (l.status.IsIoError()) slot(src).measured.Add(slot(src).measured.io_errors);
    }
    // Finish this window before reading the next: followers wake sooner and at most one window
    // of temporary buffers is alive.
    for (std::size_t k = begin; k < end; ++k) {
      finish(leads[k]);
      std::vector<std::byte>().swap(leads[k].temp);
    }
    begin = end;
  }
}

std::vector<Status> StoreImpl::GetBatch(std::span<Store::GetItem> items) {
  std::vector<Status> st(items.size());
  std::vector<BulkItem> slow;
  std::vector<std::size_t> slow_index;
  for (std::size_t i = 0; i < items.size(); ++i) {
    Result<BlockDesc> r = Status::NotFound("unset");
    if (FastGet(items[i].key, items[i].out, &r)) {
      if (r.ok()) items[i].desc = *r;
      st[i] = r.status();
      continue;
    }
    slow.push_back(BulkItem{items[i].key, items[i].out, false, {}, {}});
    slow_index.push_back(i);
  }
  if (slow.empty()) return st;
  DemandScope demand(*demand_);
  BulkFetch(slow, PromoteOnGetTarget(), /*by_prefetch=*/false);
  for (std::size_t k = 0; k < slow.size(); ++k) {
    Store::GetItem& item = items[slow_index[k]];
    if (slow[k].handled) {
      st[slow_index[k]] = slow[k].status;
      if (slow[k].status.ok()) item.desc = slow[k].desc;
      continue;
    }
    Result<BlockDesc> r = Get(item.key, item.out);  // the single-key path
    if (r.ok()) item.desc = *r;
    st[slow_index[k]] = r.status();
  }
  return st;
}

}  // namespace terrace::store_internal
