// Device-memory buffers (BufferKind::kDevice): Put, Get and GetBatch that go to and from a tier
// that takes device buffers (TierCaps::device_buffers, the HBM tier) with no host bounce; the tier
// computes and checks the checksum where the data is. Store::Put / Get / GetBatch with a BufferRef
// land here.
#include <optional>

#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace {
namespace {

// InvalidArgument for a BufferKind value the library does not name (it would be taken as host
// memory, which a device pointer is not).
Status CheckBufferKind(BufferKind kind, std::string_view op, const BlockKey& key) {
  if (kind <= BufferKind::kDevice) return Status::Ok();
  return Status::InvalidArgument(fmt::format("{} {}: the buffer's kind holds {}, a value BufferKind does not name "
                                             "(kHost, kPinnedHost or kDevice)",
                                             op, key.ToString(), static_cast<int>(kind)));
}

}  // namespace

Status Store::Put(const BlockKey& key, ConstBufferRef data, const PutOptions& opts) {
  TERRACE_RETURN_IF_ERROR(CheckBufferKind(data.kind, "put", key));
  if (data.kind == BufferKind::kDevice) return impl_->PutDevice(key, data.bytes, opts);
  return impl_->Put(key, data.bytes, opts);
}

Result<BlockDesc> Store::Get(const BlockKey& key, BufferRef out) {
  TERRACE_RETURN_IF_ERROR(CheckBufferKind(out.kind, "get", key));
  if (out.kind == BufferKind::kDevice) return impl_->GetDevice(key, out.bytes);
  return impl_->Get(key, out.bytes);
}

std::vector<Status> Store::GetBatch(std::span<GetRefItem> items) { return impl_->GetBatch(items); }

namespace store_internal {

Status StoreImpl::PutDevice(const BlockKey& key, std::span<const std::byte> data, const PutOptions& opts) {
  TERRACE_ASSIGN_OR_RETURN(const int target, PutTarget(key, opts));
  if (!tier(target).caps().device_buffers) {
    return Status::InvalidArgument(fmt::format(
        "put {}: the data is in device memory, which tier {} cannot read; put it into the hbm tier "
        "(PutOptions::tier = TierId::kHbm) or pass a host buffer", key.ToString(), SlotName(target)));
  }
  const int through = WriteThroughSlot(target, LowestSlot(), options_.write_policy);  // -1: none
  const bool write_through = through >= 0;

  auto guard = key_locks_.Lock(key);
  TERRACE_ASSIGN_OR_RETURN(const SlotMask old_mask, ReplaceableMask(key));
  BlockDesc desc;
  Status s;
  {
    // Write-back: room below may be held only by this key's previous version, demoted as in Put.
    std::optional<OwnCopiesEvictable> own;
    if (!write_through) own.emplace(this, key, Bit(target));
    s = PlaceWith(target, key, data.size(), [&] {
      return TimedTierWrite(target, [&] {
        Result<BlockDesc> r = tier(target).PutDevice(key, opts.codec, data);
        if (r.ok()) desc = *r;
        return r.status();
      });
    }, BusyVictims::kWait);
  }
  if (!s.ok()) return s.WithContext(fmt::format("put {} from device memory into tier {}", key.ToString(), SlotName(target)));
  SlotMask new_mask = Bit(target);
  if (write_through) {
    // The lowest tier cannot read device memory: copy the stored block down from `target`.
    TransferOutcome t = Transfer(target, through, key, desc);
    Status ws = t.read.ok() ? t.write : t.read;
    if (!ws.ok()) {
      // The new version goes; the previous one stays wherever the target's write did not replace it
      // (the lowest tier's write failed, so its copy there is intact), as a failed host Put leaves it.
      Status undo_err;
      const SlotMask stuck_new = EraseCopies(key, Bit(target), &undo_err, nullptr);
      SlotMask kept;
      {
        MutexLock lock(&mu_);
        kept = KeepLeftoverLocked(key, desc, static_cast<SlotMask>(old_mask & ~Bit(target)), stuck_new);
      }
      std::string left;
      if (kept & stuck_new) {
        left = fmt::format("the new version could not be removed from tier {} either ({}), so the key reads it",
                           SlotName(target), undo_err.ToString());
      } else if (stuck_new != 0) {
        left = fmt::format("the new version's copy could not be removed from tier {} ({}) and stays there unread; {}",
                           SlotName(target), undo_err.ToString(),
                           kept != 0 ? "the previous version is kept" : "no version is readable");
      } else {
        left = kept != 0       ? "the new version was removed; the previous version is kept"
               : old_mask != 0 ? "the new version was removed (the previous version was only in that tier, which "
                                 "the put replaced)"
                               : "the new version was removed";
      }
      return ws.WithContext(fmt::format("put {} from device memory reached tier {} but could not be written through "
                                        "to tier {}; {}",
                                        key.ToString(), SlotName(target), SlotName(through), left));
    }
    new_mask |= Bit(through);
  }
  // Without write-through, room-making may have moved the previous version's copies.
  return PublishPut(key, desc, write_through ? old_mask : CopiesOf(key), new_mask);
}

int StoreImpl::DeviceSlot() const {
  for (int i = 0; i < slot_count(); ++i) {
    if (tier(i).caps().device_buffers) return i;
  }
  return -1;
}

Status StoreImpl::NoDeviceTier(const BlockKey& key) {
  return Status::InvalidArgument(fmt::format(
      "get {} into device memory: no tier of this store writes device memory; configure the hbm tier or "
      "get into a host buffer", key.ToString()));
}

Result<BlockDesc> StoreImpl::GetDevice(const BlockKey& key, std::span<std::byte> out) {
  const int d = DeviceSlot();
  if (d < 0) return NoDeviceTier(key);
  DemandScope demand(*demand_);
  auto guard = key_locks_.Lock(key);
  for (int attempt = 0; attempt < slot_count() + 1; ++attempt) {
    // Bring the block into the device tier (a Transfer when it is elsewhere), then copy it out
    // device to device.
    ReadOutcome o = LockedRead(key, {}, MoveMode::kExact, d, /*by_prefetch=*/false);
    CountMissIfNone(o.desc.status());
    if (!o.desc.ok()) return o.desc.status();
    TERRACE_RETURN_IF_ERROR(o.move_status);
    const BlockDesc desc = *o.desc;
    if (out.size() < desc.size) {
      return Status::InvalidArgument(fmt::format("buffer for block {} holds {} bytes; the block needs {} bytes",
                                                 key.ToString(), out.size(), desc.size));
    }
    TierCounters& m = slot(d).measured;
    BlockDesc got;
    auto t0 = Clock::now();
    Status s = tier(d).GetDevice(key, out, &got);
    m.read_latency.Record(NanosSince(t0));
    if (s.ok() && got == desc) {
      if (!o.moved) CountGet(d);
      device_copies_.fetch_add(1, std::memory_order_relaxed);
      device_copy_bytes_.fetch_add(desc.size, std::memory_order_relaxed);
      MutexLock lock(&mu_);
      auto it = entries_.find(key);
      if (it != entries_.end() && (it->second.mask & Bit(d))) Policy(d).OnAccess(key);
      return desc;
    }
    if (s.ok() || s.IsCorruption() || s.IsNotFound()) {
      DropCopy(key, d);  // bad or gone: another copy (or Corruption) next round
      continue;
    }
    if (s.IsIoError()) m.Add(m.io_errors);
    return s.WithContext(fmt::format("get {} from tier {} into device memory", key.ToString(), SlotName(d)));
  }
  return Status::Corruption(fmt::format("block {}: every copy failed verification while getting it into device memory "
                                        "from tier {}", key.ToString(), SlotName(d)));
}

std::vector<Status> StoreImpl::GetBatch(std::span<Store::GetRefItem> items) {
  std::vector<Status> st(items.size());
  std::vector<Store::GetItem> host;
  std::vector<std::size_t> host_index;
  std::vector<BulkItem> dev;
  std::vector<std::size_t> dev_index;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (Status s = CheckBufferKind(items[i].out.kind, "get", items[i].key); !s.ok()) {
      st[i] = std::move(s);
    } else if (items[i].out.kind == BufferKind::kDevice) {
      dev.push_back(BulkItem{items[i].key, {}, false, {}, {}});
      dev_index.push_back(i);
    } else {
      host.push_back(Store::GetItem{items[i].key, items[i].out.bytes, {}});
      host_index.push_back(i);
    }
  }
  if (!host.empty()) {
    std::vector<Status> hs = GetBatch(std::span<Store::GetItem>(host));
    for (std::size_t k = 0; k < host.size(); ++k) {
      if (hs[k].ok()) items[host_index[k]].desc = host[k].desc;
      st[host_index[k]] = std::move(hs[k]);
    }
  }
  if (dev.empty()) return st;
  const int d = DeviceSlot();
  if (d < 0) {
    for (std::size_t k = 0; k < dev.size(); ++k) st[dev_index[k]] = NoDeviceTier(dev[k].key);
    return st;
  }
  {
    // Moves every block found only in a non-addressable tier (NVMe) up into the device tier with
    // one tier read per source tier (staged through batch_bounce_: the device tier does not
    // reserve); the rest is moved key by key below.
    DemandScope demand(*demand_);
    BulkFetch(dev, d, /*by_prefetch=*/false);
  }
  for (std::size_t k = 0; k < dev.size(); ++k) {
    Store::GetRefItem& item = items[dev_index[k]];
    // A copy lost to corruption, or a key gone: that is the item's answer. Anything else (moved,
    // already there, not batched, a move that failed) is finished by the single-key device Get,
    // which moves the block if it still has to and copies it device to device.
    if (dev[k].handled && (dev[k].status.IsCorruption() || dev[k].status.IsNotFound())) {
      st[dev_index[k]] = dev[k].status;
      continue;
    }
    Result<BlockDesc> r = GetDevice(item.key, item.out.bytes);
    if (r.ok()) item.desc = *r;
    st[dev_index[k]] = r.status();
  }
  return st;
}

}  // namespace store_internal
}  // namespace terrace
