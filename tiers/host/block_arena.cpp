#include "tiers/host/block_arena.h"

#include <algorithm>

#include <fmt/format.h>

namespace terrace::tiers {
namespace {

std::uint64_t RoundDown(std::uint64_t v, std::uint64_t unit) { return v / unit * unit; }

}  // namespace

BlockArena::BlockArena(const BlockArenaOptions& o, GrowFn grow)
    : tier_name_(o.tier_name),
      page_bytes_(o.page_bytes),
      chunk_bytes_(RoundDown(std::min(o.chunk_bytes, o.capacity_bytes), o.page_bytes)),
      capacity_bytes_(RoundDown(o.capacity_bytes, o.page_bytes)),
      grow_(std::move(grow)),
      alloc_(static_cast<std::uint32_t>(std::max<std::uint64_t>(chunk_bytes_ / page_bytes_, 1)),
             static_cast<std::uint32_t>(chunk_bytes_ == 0 ? 0 : (capacity_bytes_ + chunk_bytes_ - 1) / chunk_bytes_)),
      index_(&pool_) {}

std::uint32_t BlockArena::NewSlot(const PageExtent& e) {
  std::uint32_t id;
  if (!free_slots_.empty()) {
    id = free_slots_.back();
    free_slots_.pop_back();
    slots_[id] = Slot{e, 0, false};
  } else {
    id = static_cast<std::uint32_t>(slots_.size());
    slots_.push_back(Slot{e, 0, false});
  }
  return id;
}

void BlockArena::ReleaseSlot(std::uint32_t slot) {
  alloc_.Free(slots_[slot].extent);
  slots_[slot] = Slot{};
  free_slots_.push_back(slot);
}

void BlockArena::RetireEntry(const Entry& e) {
  const std::uint32_t slot = e.slot;
  used_pages_ -= slots_[slot].extent.pages;
  used_bytes_ -= e.desc.size;
  if (slots_[slot].refs == 0) {
    ReleaseSlot(slot);
  } else {
    slots_[slot].retired = true;
  }
}

Result<BlockArena::Ticket> BlockArena::BeginWrite(const BlockKey& key, const BlockDesc& desc) {
  if (desc.size > max_block_bytes()) {
    return Status::OutOfCapacity(fmt::format("{} tier: block {} is {} bytes, larger than the tier's largest block "
                                             "({} bytes); store it in a larger tier or split it",
                                             tier_name_, key.ToString(), desc.size, max_block_bytes()));
  }
  const std::uint32_t pages = PagesFor(desc.size);
  MutexLock lock(&mu_);
  for (;;) {
    if (auto it = index_.find(key); it != index_.end() && it->second.pins > 0) {
      return Status::InvalidArgument(fmt::format("{} tier: block {} is pinned; Unpin it before replacing it",
                                                 tier_name_, key.ToString()));
    }
    if (auto e = alloc_.Allocate(pages)) {
      return Ticket{NewSlot(*e), *e, desc};
    }
    if (growing_) {
      while (growing_) grow_done_.Wait(&mu_);
      continue;
    }
    const std::uint32_t chunk = alloc_.num_chunks();
    if (chunk >= alloc_.max_chunks()) {
      return Status::OutOfCapacity(fmt::format(
          "{} tier: no room for block {} ({} bytes): {} of {} bytes free, largest free run {} bytes; "
          "evict blocks or raise capacity_bytes",
          tier_name_, key.ToString(), desc.size, alloc_.free_pages() * page_bytes_, capacity_bytes_,
          std::uint64_t{alloc_.largest_free_run()} * page_bytes_));
    }
    TERRACE_RETURN_IF_ERROR(GrowOne(fmt::format("block {}", key.ToString())));
  }
}

Status BlockArena::GrowOne(std::string_view why) {
  const std::uint32_t chunk = alloc_.num_chunks();
  if (chunk >= alloc_.max_chunks()) {
    return Status::OutOfCapacity(fmt::format("{} tier: the arena is at its capacity ({} bytes)", tier_name_, capacity_bytes_));
  }
  const std::uint64_t bytes = std::min(chunk_bytes_, capacity_bytes_ - std::uint64_t{chunk} * chunk_bytes_);
  growing_ = true;
  mu_.Unlock();
  Status st = grow_(chunk, bytes);
  mu_.Lock();
  growing_ = false;
  grow_done_.SignalAll();
  if (!st.ok()) return st.WithContext(fmt::format("{} tier: growing the arena for {}", tier_name_, why));
  alloc_.AddChunk(static_cast<std::uint32_t>(bytes / page_bytes_));
  return Status::Ok();
}

Status BlockArena::GrowTo(std::uint64_t bytes) {
  const std::uint64_t target = std::min(bytes, capacity_bytes_);
  MutexLock lock(&mu_);
  for (;;) {
    while (growing_) grow_done_.Wait(&mu_);
    if (alloc_.total_pages() * page_bytes_ >= target || alloc_.num_chunks() >= alloc_.max_chunks()) return Status::Ok();
    TERRACE_RETURN_IF_ERROR(GrowOne("populating it at open"));
  }
}

Status BlockArena::CommitWrite(const BlockKey& key, const Ticket& t) {
  MutexLock lock(&mu_);
  auto [it, inserted] = index_.try_emplace(key, Entry{t.desc, t.slot, 0});
  if (!inserted) {
    if (it->second.pins > 0) {
      ReleaseSlot(t.slot);
      return Status::InvalidArgument(fmt::format("{} tier: block {} was pinned while being replaced; Unpin it "
                                                 "before replacing it", tier_name_, key.ToString()));
    }
    RetireEntry(it->second);
    it->second = Entry{t.desc, t.slot, 0};
  }
  used_pages_ += t.extent.pages;
  used_bytes_ += t.desc.size;
  return Status::Ok();
}

void BlockArena::AbortWrite(const Ticket& t) {
  MutexLock lock(&mu_);
  ReleaseSlot(t.slot);
}

Result<BlockArena::Ticket> BlockArena::BeginRead(const BlockKey& key) {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: block {} not found", tier_name_, key.ToString()));
  Slot& s = slots_[it->second.slot];
  ++s.refs;
  return Ticket{it->second.slot, s.extent, it->second.desc};
}

void BlockArena::EndRead(const BlockKey& key, const Ticket& t, bool drop_corrupt) {
  MutexLock lock(&mu_);
  Slot& s = slots_[t.slot];
  --s.refs;
  if (drop_corrupt && !s.retired) {
    auto it = index_.find(key);
    if (it != index_.end() && it->second.slot == t.slot && it->second.pins == 0) {
      RetireEntry(it->second);
      index_.erase(it);
      return;
    }
  }
  if (s.retired && s.refs == 0) ReleaseSlot(t.slot);
}

Result<BlockDesc> BlockArena::Lookup(const BlockKey& key) const {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: block {} not found", tier_name_, key.ToString()));
  return it->second.desc;
}

Status BlockArena::Erase(const BlockKey& key) {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: block {} not found", tier_name_, key.ToString()));
  if (it->second.pins > 0) {
    return Status::InvalidArgument(fmt::format("{} tier: block {} is pinned ({} pins); Unpin it before erasing it",
                                               tier_name_, key.ToString(), it->second.pins));
  }
  RetireEntry(it->second);
  index_.erase(it);
  return Status::Ok();
}

Status BlockArena::Pin(const BlockKey& key) {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: cannot pin block {}: not found", tier_name_, key.ToString()));
  ++it->second.pins;
  return Status::Ok();
}

Status BlockArena::Unpin(const BlockKey& key) {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: cannot unpin block {}: not found", tier_name_, key.ToString()));
  if (it->second.pins == 0) {
    return Status::InvalidArgument(fmt::format("{} tier: block {} is not pinned; every Unpin must match a Pin",
                                               tier_name_, key.ToString()));
  }
  --it->second.pins;
  return Status::Ok();
}

Result<PageExtent> BlockArena::Locate(const BlockKey& key) const {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound(fmt::format("{} tier: block {} not found", tier_name_, key.ToString()));
  return slots_[it->second.slot].extent;
}

std::uint64_t BlockArena::used_bytes() const {
  MutexLock lock(&mu_);
  return used_bytes_;
}

std::uint64_t BlockArena::allocated_bytes() const {
  MutexLock lock(&mu_);
  return used_pages_ * page_bytes_;
}

std::uint64_t BlockArena::block_count() const {
  MutexLock lock(&mu_);
  return index_.size();
}

std::uint64_t BlockArena::arena_bytes() const {
  MutexLock lock(&mu_);
  return alloc_.total_pages() * page_bytes_;
}

void BlockArena::ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const {
  std::vector<std::pair<BlockKey, BlockDesc>> snapshot;
  {
    MutexLock lock(&mu_);
    snapshot.reserve(index_.size());
    for (const auto& [k, e] : index_) snapshot.emplace_back(k, e.desc);
  }
  for (const auto& [k, d] : snapshot) fn(k, d);
}

bool BlockArena::CheckInvariants() const {
  MutexLock lock(&mu_);
  return alloc_.CheckInvariants();
}

}  // namespace terrace::tiers
