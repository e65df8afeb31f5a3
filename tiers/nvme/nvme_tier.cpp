// NvmeTier's block operations: put, get, erase, pin, stats. Open and recovery: nvme_open.cpp;
// chunked I/O: nvme_io.cpp.
#include "tiers/nvme/nvme_tier.h"

#include <array>
#include <cstring>

#include <fmt/format.h>

#include "tiers/nvme/group_commit.h"
#include "tiers/nvme/index_store.h"
#include "tiers/nvme/staging_pool.h"

namespace terrace {

using nvme::IoOp;

Status NvmeTier::Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) {
  PutOp op{key, desc, data};
  return std::move(PutBatch(std::span<const PutOp>(&op, 1))[0]);
}

Status NvmeTier::Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  GetOp op{key, out, {}};
  Status s = std::move(GetBatch(std::span<GetOp>(&op, 1))[0]);
  if (s.ok() && desc) *desc = op.desc;
  return s;
}

Status NvmeTier::ReadOnlyError(std::string_view op) const {
  return Status::InvalidArgument(fmt::format("{} on the NVMe store '{}': the store was opened read-only; open it "
                                             "without read_only to change it",
                                             op, data_path_.string()));
}

namespace {
// Bytes an extent of a `length`-byte block occupies: its data units and its descriptor unit.
std::uint64_t ExtentBytes(std::uint64_t length) {
  nvme::Record r;
  r.length = length;
  return r.extent_bytes();
}
}  // namespace

// A put runs in steps, each over the whole batch so the I/O of every op goes out together:
// check the ops, allocate extents, reserve generations, write the data, switch the index (staging
// each descriptor for the group commit, which writes it after the index); with kSync, wait for the
// group commit. st[i] records the first
// failure of op i; a failed op takes no further step (an allocated extent is given back).
std::vector<Status> NvmeTier::PutBatch(std::span<const PutOp> ops) {
  std::vector<Status> st(ops.size());
  if (options_.read_only) {
    for (auto& s : st) s = ReadOnlyError("put");
    return st;
  }
  if (Status h = committer_->health(); !h.ok()) {
    for (auto& s : st) s = h;
    return st;
  }
  CheckPuts(ops, st);
  std::vector<PutPlan> plans(ops.size());
  AllocateExtents(ops, plans, st);
  if (Status s = ReserveGenerationsFor(plans); !s.ok()) {
    AbandonExtents(ops, plans, s, st);
    return st;
  }
  WriteExtents(ops, plans, st);
  std::uint64_t bytes = 0;
  const std::uint64_t last_seq = SwitchIndex(ops, plans, st, &bytes);
  if (options_.durability == Durability::kSync && last_seq > 0) {
    Status s = committer_->WaitDurable(last_seq);
    if (!s.ok()) {
      for (std::size_t i = 0; i < ops.size(); ++i) {
        if (plans[i].allocated && st[i].ok()) st[i] = s;
      }
    }
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (st[i].ok()) counters_.Add(counters_.puts);
  }
  counters_.Add(counters_.bytes_written, bytes);
  return st;
}

void NvmeTier::CheckPuts(std::span<const PutOp> ops, std::vector<Status>& st) const {
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const PutOp& op = ops[i];
    if (op.desc.size != op.data.size()) {
      st[i] = Status::InvalidArgument(fmt::format("put of block {}: desc.size {} != data size {}; build the desc with "
                                                  "DescribeBlock(data)",
                                                  op.key.ToString(), op.desc.size, op.data.size()));
    } else if (op.data.size() > caps_.max_block_bytes) {
      st[i] = Status::OutOfCapacity(fmt::format(
          "block {} is {} bytes, larger than the NVMe tier at '{}' can hold ({} bytes of {} capacity); split the "
          "block, or use a new store with a larger capacity_bytes (a store's capacity is fixed when it is created)",
          op.key.ToString(), op.data.size(), data_path_.string(), caps_.max_block_bytes, caps_.capacity_bytes));
    }
  }
}

void NvmeTier::AllocateExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, std::vector<Status>& st) {
  // If space is short and frees are waiting on a commit, commit and retry once.
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool short_of_space = false;
    {
      MutexLock l(&mu_);
      for (std::size_t i = 0; i < ops.size(); ++i) {
        if (!st[i].ok() || plans[i].allocated) continue;
        auto off = alloc_->Allocate(ExtentBytes(ops[i].data.size()));
        if (off) {
          plans[i].offset = *off;
          plans[i].generation = next_generation_++;
          plans[i].allocated = true;
        } else {
          short_of_space = true;
        }
      }
    }
    if (!short_of_space) return;
    if (attempt == 0) {
      if (Status f = committer_->Flush(); !f.ok()) {
        for (std::size_t i = 0; i < ops.size(); ++i) {
          if (st[i].ok() && !plans[i].allocated) st[i] = f;
        }
        return;
      }
      continue;
    }
    MutexLock l(&mu_);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (!st[i].ok() || plans[i].allocated) continue;
      const std::uint64_t need = ExtentBytes(ops[i].data.size());
      st[i] = Status::OutOfCapacity(fmt::format(
          "NVMe tier at '{}' has no free extent for block {} ({} bytes, an extent of {} bytes with its data rounded "
          "up to 4 KiB and its 4 KiB descriptor): {}: {} bytes free in {} extents, largest {}; erase blocks, or "
          "move to a new store with a larger capacity_bytes (a store's capacity is fixed when it is created)",
          data_path_.string(), ops[i].key.ToString(), ops[i].data.size(), need,
          alloc_->free_bytes() >= need ? "its free space is fragmented" : "it is full", alloc_->free_bytes(),
          alloc_->free_extents(), alloc_->largest_free()));
    }
  }
}

Status NvmeTier::ReserveGenerationsFor(const std::vector<PutPlan>& plans) {
  // Each extent's descriptor (its last 4 KiB) carries the generation: make sure the superblock
  // covers every generation about to be written before any of them reaches the disk.
  std::uint64_t max_generation = 0;
  bool any = false;
  for (const PutPlan& p : plans) {
    if (!p.allocated) continue;
    max_generation = std::max(max_generation, p.generation);
    any = true;
  }
  return any ? ReserveGenerations(max_generation) : Status::Ok();
}

void NvmeTier::AbandonExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, const Status& why,
                              std::vector<Status>& st) {
  MutexLock l(&mu_);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!plans[i].allocated) continue;
    alloc_->Free(plans[i].offset, ExtentBytes(ops[i].data.size()));  // nothing was written there
    plans[i].allocated = false;
    st[i] = why;
  }
}

void NvmeTier::WriteExtents(std::span<const PutOp> ops, std::vector<PutPlan>& plans, std::vector<Status>& st) {
  // Every allocated block in one batch, each caller checksum verified while the rest are in flight.
  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!plans[i].allocated) continue;
    const std::size_t before = chunks.size();
    PlanWriteChunks(i, plans[i].offset, ops[i].data, &chunks);
    plans[i].pending = static_cast<std::uint32_t>(chunks.size() - before);
  }
  auto check_sum = [&](std::size_t i) {
    if (st[i].ok() && Checksum(ops[i].data) != ops[i].desc.checksum) {
      st[i] = Status::InvalidArgument(fmt::format(
          "put of block {}: desc.checksum {:016x} does not match the data ({:016x}); build the desc with "
          "DescribeBlock(data)",
          ops[i].key.ToString(), ops[i].desc.checksum, Checksum(ops[i].data)));
    }
  };
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (plans[i].allocated && plans[i].pending == 0) check_sum(i);  // an empty block: no data to write
  RunChunks(IoOp::kWrite, chunks, [&](std::size_t ci, int err) {
    const Chunk& c = chunks[ci];
    const std::size_t i = c.op;
    if (err != 0 && st[i].ok()) {
      counters_.Add(counters_.io_errors);
      st[i] = IoStatus(IoOp::kWrite, err, ops[i].key, c.file_offset);
    }
    if (--plans[i].pending == 0) check_sum(i);
  });
}

std::uint64_t NvmeTier::SwitchIndex(std::span<const PutOp> ops, const std::vector<PutPlan>& plans,
                                    const std::vector<Status>& st, std::uint64_t* bytes) {
  // In memory now, durably at the group commit.
  nvme::Descriptor d;
  {
    MutexLock l(&sb_mu_);
    d.uuid = sb_.uuid;
  }
  std::uint64_t last_seq = 0;
  MutexLock l(&mu_);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!plans[i].allocated) continue;
    nvme::Record rec;
    rec.offset = plans[i].offset;
    rec.length = ops[i].data.size();
    rec.checksum = ops[i].desc.checksum;
    rec.codec = ops[i].desc.codec;
    if (!st[i].ok()) {
      // Never indexed (and no descriptor written): released by the next commit.
      committer_->StageClear({rec.offset, rec.extent_bytes()});
      continue;
    }
    rec.generation = plans[i].generation;
    nvme::Extent old{};
    auto [it, inserted] = map_.try_emplace(ops[i].key);
    if (!inserted) {
      Detach(it->second);
      it->second.readers = 0;
      old = {it->second.rec.offset, it->second.rec.extent_bytes()};
      used_bytes_ -= it->second.rec.length;
    }
    it->second.rec = rec;
    used_bytes_ += rec.length;
    *bytes += rec.length;
    d.key = ops[i].key;
    d.rec = rec;
    last_seq = committer_->StagePut(d, old);
  }
  return last_seq;
}

template <typename Op, typename Check>
void NvmeTier::BeginReads(std::span<Op> ops, const Check& check, std::vector<GetPlan>& plans, std::vector<Status>& st) {
  constexpr std::size_t kAhead = 8;  // lookups prefetched ahead: the map's cache misses overlap
  std::uint64_t misses = 0;
  {
    MutexLock l(&mu_);
    for (std::size_t i = 0; i < std::min(kAhead, ops.size()); ++i) map_.prefetch(ops[i].key);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (i + kAhead < ops.size()) map_.prefetch(ops[i + kAhead].key);
      auto it = map_.find(ops[i].key);
      if (it == map_.end()) {
        ++misses;
        st[i] = Status::NotFound(fmt::format("block {} is not in the NVMe tier at '{}'", ops[i].key.ToString(),
                                             data_path_.string()));
        continue;
      }
      st[i] = check(ops[i], it->second.rec);
      if (!st[i].ok()) continue;
      plans[i].rec = it->second.rec;
      plans[i].reading = true;
      ++it->second.readers;
    }
  }
  if (misses > 0) counters_.Add(counters_.misses, misses);
}

template <typename Op>
void NvmeTier::EndReads(std::span<Op> ops, const std::vector<GetPlan>& plans) {
  constexpr std::size_t kAhead = 8;
  MutexLock l(&mu_);
  for (std::size_t i = 0; i < std::min(kAhead, ops.size()); ++i) map_.prefetch(ops[i].key);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (i + kAhead < ops.size()) map_.prefetch(ops[i + kAhead].key);
    if (plans[i].reading) EndRead(ops[i].key, plans[i].rec);
  }
}

namespace {

// A Get's buffer must hold the whole block.
Status CheckGetBuffer(const GetOp& op, const nvme::Record& rec) {
  if (op.out.size() >= rec.length) return Status::Ok();
  return Status::InvalidArgument(fmt::format("get of block {}: output buffer has {} bytes, the block has {}; "
                                             "size the buffer from Lookup()",
                                             op.key.ToString(), op.out.size(), rec.length));
}

BlockDesc DescOf(const nvme::Record& rec) { return BlockDesc{rec.length, rec.codec, rec.checksum}; }

}  // namespace

std::vector<Status> NvmeTier::GetBatch(std::span<GetOp> ops) {
  std::vector<Status> st(ops.size());
  std::vector<GetPlan> plans(ops.size());
  BeginReads(ops, CheckGetBuffer, plans, st);

  // Read, then verify each block as soon as its last chunk lands; a mismatch is re-read once
  // (a transient transfer error) before the block is declared corrupt.
  std::vector<Chunk> chunks;
  chunks.reserve(ops.size());
  for (int pass = 0; pass < 2; ++pass) {
    chunks.clear();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      GetPlan& p = plans[i];
      if (!p.reading || !st[i].ok() || (pass == 1 && !p.bad)) continue;
      p.bad = false;
      const std::size_t before = chunks.size();
      PlanReadChunks(i, p.rec.offset, 0, ops[i].out.data(), p.rec.length, ops[i].out.size(), &chunks);
      p.pending = static_cast<std::uint32_t>(chunks.size() - before);
      if (p.pending == 0) p.bad = Checksum(ops[i].out.first(0)) != p.rec.checksum;
    }
    if (chunks.empty() && pass == 1) break;
    RunChunks(IoOp::kRead, chunks, [&](std::size_t ci, int err) {
      const std::size_t i = chunks[ci].op;
      GetPlan& p = plans[i];
      if (err != 0 && st[i].ok()) {
        counters_.Add(counters_.io_errors);
        st[i] = IoStatus(IoOp::kRead, err, ops[i].key, chunks[ci].file_offset);
      }
      if (--p.pending == 0 && st[i].ok()) p.bad = Checksum(ops[i].out.first(p.rec.length)) != p.rec.checksum;
    });
  }

  std::uint64_t bytes = 0, hits = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const GetPlan& p = plans[i];
    if (!p.reading) continue;
    if (st[i].ok() && p.bad) {
      counters_.Add(counters_.corruptions);
      if (options_.read_only) {
        st[i] = Status::Corruption(fmt::format(
            "block {} at offset {} of '{}' failed its checksum (twice); its bytes were not returned; the store is open "
            "read-only, so the block was kept (open it read-write to drop it)",
            ops[i].key.ToString(), p.rec.offset, data_path_.string()));
        continue;
      }
      DropCorrupt(ops[i].key, p.rec);
      st[i] = Status::Corruption(fmt::format(
          "block {} at offset {} of '{}' failed its checksum (twice); it was dropped from the NVMe tier and its "
          "bytes were not returned: recompute or refetch it",
          ops[i].key.ToString(), p.rec.offset, data_path_.string()));
    } else if (st[i].ok()) {
      ops[i].desc = DescOf(p.rec);
      ++hits;
      bytes += p.rec.length;
    }
  }
  EndReads(ops, plans);
  if (hits > 0) counters_.Add(counters_.hits, hits);
  counters_.Add(counters_.bytes_read, bytes);
  return st;
}

std::vector<Status> NvmeTier::GetRangeBatch(std::span<RangeOp> ops) {
  std::vector<Status> st(ops.size());
  std::vector<GetPlan> plans(ops.size());
  BeginReads(ops, [](const RangeOp& op, const nvme::Record& rec) { return CheckRange(op, rec.length); }, plans, st);

  // The extent starts on a unit, so the range's first unit is offset rounded down; the chunks
  // read from there to offset + length rounded up (never past the block's data units).
  std::vector<Chunk> chunks;
  chunks.reserve(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!plans[i].reading) continue;
    const RangeOp& op = ops[i];
    const std::uint64_t skip = op.offset % nvme::kUnit;
    PlanReadChunks(i, plans[i].rec.offset + (op.offset - skip), static_cast<std::uint32_t>(skip), op.out.data(),
                   op.length, op.out.size(), &chunks);
  }
  RunChunks(IoOp::kRead, chunks, [&](std::size_t ci, int err) {
    const std::size_t i = chunks[ci].op;
    if (err != 0 && st[i].ok()) {
      counters_.Add(counters_.io_errors);
      st[i] = IoStatus(IoOp::kRead, err, ops[i].key, chunks[ci].file_offset);
    }
  });

  std::uint64_t bytes = 0, hits = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!plans[i].reading || !st[i].ok()) continue;
    ops[i].desc = DescOf(plans[i].rec);
    ++hits;
    bytes += ops[i].length;
  }
  EndReads(ops, plans);
  if (hits > 0) counters_.Add(counters_.hits, hits);
  counters_.Add(counters_.bytes_read, bytes);
  return st;
}

void NvmeTier::DropCorrupt(const BlockKey& key, const nvme::Record& rec) {
  MutexLock l(&mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.rec.generation != rec.generation) return;  // already replaced
  used_bytes_ -= rec.length;
  Detach(it->second);
  map_.erase(it);
  committer_->StageDelete(nvme::IndexStore::EncodeKey(key), {rec.offset, rec.extent_bytes()});
  logger_->Log(LogLevel::kWarning, "nvme",
               fmt::format("dropped corrupt block {} (offset {}, {} bytes) from '{}'", key.ToString(), rec.offset,
                           rec.length, data_path_.string()));
}

void NvmeTier::Detach(const Entry& e) {
  if (e.readers > 0) detached_[e.rec.offset].readers = e.readers;
}

void NvmeTier::EndRead(const BlockKey& key, const nvme::Record& rec) {
  auto it = map_.find(key);
  if (it != map_.end() && it->second.rec.generation == rec.generation) {
    --it->second.readers;
    return;
  }
  auto d = detached_.find(rec.offset);
  if (--d->second.readers > 0) return;
  if (d->second.release_bytes > 0) alloc_->Free(rec.offset, d->second.release_bytes);
  detached_.erase(d);
}

void NvmeTier::ReleaseExtents(std::vector<nvme::Extent>&& extents) {
  MutexLock l(&mu_);
  for (const nvme::Extent& e : extents) {
    auto d = detached_.find(e.offset);
    if (d != detached_.end()) {
      d->second.release_bytes = e.length;
    } else {
      alloc_->Free(e.offset, e.length);
    }
  }
}

Result<BlockDesc> NvmeTier::Lookup(const BlockKey& key) const {
  MutexLock l(&mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    return Status::NotFound(fmt::format("block {} is not in the NVMe tier at '{}'", key.ToString(), data_path_.string()));
  }
  return DescOf(it->second.rec);
}

Status NvmeTier::Erase(const BlockKey& key) {
  if (options_.read_only) return ReadOnlyError(fmt::format("erase of block {}", key.ToString()));
  std::uint64_t seq;
  {
    MutexLock l(&mu_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      return Status::NotFound(fmt::format("erase of block {}: not in the NVMe tier at '{}'", key.ToString(),
                                          data_path_.string()));
    }
    if (it->second.pins > 0) {
      return Status::InvalidArgument(fmt::format("erase of block {}: it is pinned {} time(s); Unpin it first",
                                                 key.ToString(), it->second.pins));
    }
    if (Status h = committer_->health(); !h.ok()) return h;
    const nvme::Record r = it->second.rec;  // its descriptor is cleared by the commit
    used_bytes_ -= r.length;
    Detach(it->second);
    map_.erase(it);
    seq = committer_->StageDelete(nvme::IndexStore::EncodeKey(key), {r.offset, r.extent_bytes()});
  }
  if (options_.durability == Durability::kSync) return committer_->WaitDurable(seq);
  return Status::Ok();
}

Status NvmeTier::Pin(const BlockKey& key) {
  MutexLock l(&mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Status::NotFound(fmt::format("pin of block {}: not in the NVMe tier", key.ToString()));
  ++it->second.pins;
  return Status::Ok();
}

Status NvmeTier::Unpin(const BlockKey& key) {
  MutexLock l(&mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Status::NotFound(fmt::format("unpin of block {}: not in the NVMe tier", key.ToString()));
  if (it->second.pins == 0) {
    return Status::InvalidArgument(fmt::format("unpin of block {}: it is not pinned", key.ToString()));
  }
  --it->second.pins;
  return Status::Ok();
}

Status NvmeTier::Flush() {
  if (options_.read_only) return ReadOnlyError("flush");
  return committer_->Flush();
}

std::uint64_t NvmeTier::used_bytes() const {
  MutexLock l(&mu_);
  return used_bytes_;
}

std::uint64_t NvmeTier::allocated_bytes() const {
  MutexLock l(&mu_);
  return AllocatedBytesLocked();
}

std::uint64_t NvmeTier::AllocatedBytesLocked() const {
  return caps_.capacity_bytes - nvme::kDataStart - alloc_->free_bytes();
}

std::uint64_t NvmeTier::block_count() const {
  MutexLock l(&mu_);
  return map_.size();
}

std::uint64_t NvmeTier::free_bytes() const {
  MutexLock l(&mu_);
  return alloc_->free_bytes();
}

void NvmeTier::ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const {
  MutexLock l(&mu_);
  for (const auto& [k, e] : map_) fn(k, DescOf(e.rec));
}

TierStatsSnapshot NvmeTier::Stats() const {
  TierStatsSnapshot s = SnapshotCounters(counters_);
  s.name = caps_.name;
  s.capacity_bytes = caps_.capacity_bytes;
  s.read_requests = counters_.read_latency.count();  // one sample per request (RunChunks)
  MutexLock l(&mu_);
  s.used_bytes = used_bytes_;
  s.allocated_bytes = AllocatedBytesLocked();
  s.free_bytes = alloc_->free_bytes();
  s.blocks = map_.size();
  MutexLock r(&reg_mu_);
  s.detail = fmt::format(
      "fixed buffers: {} ({} staging + {} registered external regions); staged I/Os: {}; merged reads: {}; "
      "device bytes read: {}",
      engine_->fixed_buffers() ? "on" : "off", staging_->count(), external_.size(),
      staged_ios_.load(std::memory_order_relaxed), merged_reads_.load(std::memory_order_relaxed),
      device_read_bytes_.load(std::memory_order_relaxed));
  if (options_.read_only) s.detail += "; read-only";
  for (const std::string& w : report_.warnings) s.detail += "; warning: " + w;
  return s;
}

Status NvmeTier::RegisterIoRegions(std::span<const std::span<std::byte>> regions) {
  std::vector<iovec> bufs;
  bufs.reserve(regions.size());
  for (const auto& r : regions) bufs.push_back(iovec{r.data(), r.size()});
  return RegisterExternalBuffers(bufs);
}

Status NvmeTier::RegisterExternalBuffers(std::span<const iovec> bufs) {
  std::vector<iovec> all = staging_->iovecs();
  all.insert(all.end(), bufs.begin(), bufs.end());
  MutexLock l(&reg_mu_);
  Status s = engine_->RegisterBuffers(all);
  if (!s.ok()) {
    // Restore the staging-only table so fixed I/O keeps working for staged chunks, and forget the
    // external regions: their indices are no longer in the table (I/O into them goes out plain).
    (void)engine_->RegisterBuffers(staging_->iovecs());
    external_.clear();
    return s.WithContext(fmt::format("registering {} external buffers with the NVMe tier", bufs.size()));
  }
  external_.assign(bufs.begin(), bufs.end());
  return Status::Ok();
}

}  // namespace terrace
