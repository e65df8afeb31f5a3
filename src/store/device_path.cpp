// Device-memory buffers (BufferKind::kDevice): Put and Get that go to and from a tier that takes
// device buffers (TierCaps::device_buffers, the HBM tier) with no host bounce; the tier computes
// and checks the checksum where the data is. Store::Put / Get with a BufferRef land here.
#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace {

Status Store::Put(const BlockKey& key, ConstBufferRef data, const PutOptions& opts) {
  if (data.kind == BufferKind::kDevice) return impl_->PutDevice(key, data.bytes, opts);
  return impl_->Put(key, data.bytes, opts);
}

Result<BlockDesc> Store::Get(const BlockKey& key, BufferRef out) {
  if (out.kind == BufferKind::kDevice) return impl_->GetDevice(key, out.bytes);
  return impl_->Get(key, out.bytes);
}

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
  Status s = PlaceWith(target, key, data.size(), [&] {
    TierCounters& m = slot(target).measured;
    auto t0 = Clock::now();
    Result<BlockDesc> r = tier(target).PutDevice(key, opts.codec, data);
    m.write_latency.Record(NanosSince(t0));
    if (!r.ok()) {
      if (r.status().IsIoError()) m.Add(m.io_errors);
      return r.status();
    }
    desc = *r;
    return Status::Ok();
  });
  if (!s.ok()) return s.WithContext(fmt::format("put {} from device memory into tier {}", key.ToString(), SlotName(target)));
  SlotMask new_mask = Bit(target);
  if (write_through) {
    // The lowest tier cannot read device memory: copy the stored block down from `target`.
    TransferOutcome t = Transfer(target, through, key, desc);
    Status ws = t.read.ok() ? t.write : t.read;
    if (!ws.ok()) {
      RemoveEveryCopy(key, old_mask | new_mask);
      return ws.WithContext(fmt::format("put {} from device memory reached tier {} but could not be written through "
                                        "to tier {}; the block and any previous version under this key were removed",
                                        key.ToString(), SlotName(target), SlotName(through)));
    }
    new_mask |= Bit(through);
  }
  PublishPut(key, desc, old_mask, new_mask);
  return Status::Ok();
}

Result<BlockDesc> StoreImpl::GetDevice(const BlockKey& key, std::span<std::byte> out) {
  int d = -1;
  for (int i = 0; i < slot_count() && d < 0; ++i) {
    if (tier(i).caps().device_buffers) d = i;
  }
  if (d < 0) {
    return Status::InvalidArgument(fmt::format(
        "get {} into device memory: no tier of this store writes device memory; configure the hbm tier or "
        "get into a host buffer", key.ToString()));
  }
  DemandScope demand(*demand_);
  auto guard = key_locks_.Lock(key);
  for (int attempt = 0; attempt < slot_count() + 1; ++attempt) {
    // Bring the block into the device tier (a Transfer when it is elsewhere), then copy it out
    // device to device.
    ReadOutcome o = LockedRead(key, nullptr, MoveMode::kExact, d, /*by_prefetch=*/false);
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
      m.Add(m.bytes_read, desc.size);
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

}  // namespace store_internal
}  // namespace terrace
