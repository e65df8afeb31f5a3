// Transfer: the one place a block is copied from one tier into another (promotions, prefetch,
// Acquire, demotions), by the direct route where one exists, else staged through the bounded
// bounce-buffer pool. BulkFetch (batch_read.cpp) reads many blocks at once into the same kinds of
// destination (a reservation: direct; a bounce buffer: staged) and counts them the same way.
#include <fmt/format.h>

#include "src/store/store_impl.h"

namespace terrace::store_internal {
namespace {

// Evictions tried to make room for one reservation before the move takes another route.
constexpr int kReserveAttempts = 8;

}  // namespace

std::optional<Reservation> StoreImpl::ReserveRoom(int t, const BlockKey& key, const BlockDesc& desc) {
  Tier& dst = tier(t);
  if (!dst.caps().reserves) return std::nullopt;
  for (int attempt = 0; attempt < kReserveAttempts; ++attempt) {
    Result<Reservation> r = dst.Reserve(key, desc);
    if (r.ok()) return std::move(*r);
    if (!r.status().IsOutOfCapacity() || !EvictOne(t).ok()) break;
  }
  return std::nullopt;
}

Status StoreImpl::CommitRoom(int t, const BlockKey& key, const BlockDesc& desc, const Reservation& r) {
  // The block's bytes landed in the reservation during the source's read (timed as that read);
  // the commit is this route's write into `t`.
  Status s = TimedTierWrite(t, [&] { return tier(t).Commit(key, desc, r); });
  if (!s.ok()) return s.WithContext(fmt::format("put {} into tier {}", key.ToString(), SlotName(t)));
  CountTransfer(/*direct=*/true, desc.size);
  MaybeScheduleDemotion(t);
  return s;
}

TransferOutcome StoreImpl::Transfer(int from, int to, const BlockKey& key, const BlockDesc& desc,
                                    const std::function<void(std::span<const std::byte>)>& seen) {
  TransferOutcome out;
  Tier& src = tier(from);
  const TierCaps& caps = src.caps();

  // 1. Straight into room reserved in the destination.
  if (std::optional<Reservation> room = ReserveRoom(to, key, desc)) {
    BlockDesc got;
    out.read = TimedTierGet(from, key, room->bytes, &got);
    if (out.read.ok() && !Verify(caps, desc, got, room->bytes)) {
      out.read = Status::Corruption(fmt::format("block {} failed its checksum in tier {} while being moved to tier {}",
                                                key.ToString(), SlotName(from), SlotName(to)));
    }
    if (!out.read.ok()) {
      tier(to).Abort(*room);
      return out;
    }
    if (seen) seen(room->bytes.first(desc.size));
    out.write = CommitRoom(to, key, desc, *room);
    out.direct = true;
    return out;
  }

  // 2. From where the source keeps it in host memory: for moves down (demotions), and for moves up
  // into a tier that copies host memory itself (device_buffers: the HBM tier's Put is the H2D copy,
  // by DMA from the pinned arena). Other moves up read the source through its Get (a tier may do
  // work there: a test double's accounting).
  const bool up_by_dma = to < from && tier(to).caps().device_buffers;
  if ((to > from || up_by_dma) && caps.memory == MemoryKind::kHost && src.Pin(key).ok()) {
    const std::byte* p = src.ResidentPtr(key);
    if (p != nullptr) {
      if (Checksum({p, desc.size}) != desc.checksum) {
        // Counted where the copy is dropped (DropCopy), as for the other routes: not here too.
        out.read = Status::Corruption(fmt::format("block {} failed its checksum in tier {} while being moved to tier {}",
                                                  key.ToString(), SlotName(from), SlotName(to)));
      } else {
        if (seen) seen({p, desc.size});
        RefreshIoRegions(from, to);
        out.write = PlaceInTier(to, key, desc, {p, desc.size});
        out.direct = true;
        if (out.write.ok()) CountTransfer(/*direct=*/true, desc.size);
      }
    }
    (void)src.Unpin(key);
    if (p != nullptr) return out;
    // not resident after all (a tier that pins without a pointer): stage it
  }

  // 3. Staged through a bounce buffer.
  BouncePool::Lease lease = bounce_.Acquire(desc.size);
  if (!lease.valid()) {
    out.read = Status::OutOfCapacity(fmt::format("no memory for a {}-byte staging buffer to move block {} from tier "
                                                 "{} to tier {}", desc.size, key.ToString(), SlotName(from),
                                                 SlotName(to)));
    return out;
  }
  std::span<std::byte> buf = lease.bytes();
  BlockDesc got;
  out.read = TimedTierGet(from, key, buf, &got);
  if (out.read.ok() && !Verify(caps, desc, got, buf)) {
    out.read = Status::Corruption(fmt::format("block {} failed its checksum in tier {} while being moved to tier {}",
                                              key.ToString(), SlotName(from), SlotName(to)));
  }
  if (!out.read.ok()) return out;
  if (seen) seen(buf.first(desc.size));
  out.write = PlaceInTier(to, key, desc, buf.first(desc.size));
  if (out.write.ok()) CountTransfer(/*direct=*/false, desc.size);
  return out;
}

Status StoreImpl::DemoteCopy(int from, int to, const BlockKey& key, const BlockDesc& desc) {
  TransferOutcome t = Transfer(from, to, key, desc);
  if (!t.read.ok()) return t.read;
  // Corruption from DemoteCopy means "the source copy is bad" (the caller drops it): a destination
  // reporting Corruption is only a failed write.
  if (t.write.IsCorruption()) return Status::IoError(t.write.message());
  return t.write;
}

}  // namespace terrace::store_internal
