#include "tiers/host/host_tier.h"

#include "src/common/clock.h"
#include "tiers/host/fast_checksum.h"
#include "tiers/host/stream_copy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

namespace terrace {
namespace {

constexpr std::uint64_t kPageBytes = 4096;
constexpr std::uint64_t kMaxChunks = 1'000'000;
// PageAllocator numbers pages with 32-bit ids, the largest kept as "none" (page_allocator.h).
constexpr std::uint64_t kMaxPageIds = 0xffffffffull - 1;
constexpr std::size_t kPrefaultPieceBytes = 4 * 1024 * 1024;  // one madvise call of the prefaulter

}  // namespace

std::uint64_t HostTier::MaxCapacityBytes(std::uint64_t chunk_bytes) {
  const std::uint64_t pages = std::max<std::uint64_t>(chunk_bytes / kPageBytes, 1);
  return std::min(kMaxChunks, kMaxPageIds / pages) * pages * kPageBytes;
}

Result<std::unique_ptr<HostTier>> HostTier::Create(const HostTierOptions& options, std::string_view name) {
  if (options.capacity_bytes < kPageBytes) {
    return Status::InvalidArgument(fmt::format("host tier: capacity_bytes {} is below one page ({} bytes); "
                                               "set HostTierOptions::capacity_bytes to at least {}",
                                               options.capacity_bytes, kPageBytes, kPageBytes));
  }
  if (options.chunk_bytes < kPageBytes) {
    return Status::InvalidArgument(fmt::format("host tier: chunk_bytes {} is below one page ({} bytes); "
                                               "set HostTierOptions::chunk_bytes to e.g. 256 MiB",
                                               options.chunk_bytes, kPageBytes));
  }
  // As the arena lays it out (block_arena.cpp): chunks of min(chunk, capacity) in whole pages.
  const std::uint64_t chunk = std::min(options.chunk_bytes, options.capacity_bytes) / kPageBytes * kPageBytes;
  // Ceiling division that cannot wrap (capacity_bytes near 2^64 wrapped to 0 chunks and passed).
  const std::uint64_t whole_pages = options.capacity_bytes / kPageBytes * kPageBytes;
  const std::uint64_t chunks = whole_pages / chunk + (whole_pages % chunk != 0 ? 1 : 0);
  if (chunk / kPageBytes > kMaxPageIds) {
    // One chunk alone has more pages than a tier numbers: no capacity works with it.
    return Status::InvalidArgument(fmt::format(
        "host tier: chunk_bytes {} is more than one tier holds ({} pages of {} bytes); lower chunk_bytes (e.g. "
        "256 MiB: it is the arena's growth unit and the largest block the tier takes){}",
        options.chunk_bytes, kMaxPageIds, kPageBytes,
        whole_pages / kPageBytes > kMaxPageIds
            ? fmt::format(" and capacity_bytes to at most {}", MaxCapacityBytes(256 * kMiB))
            : std::string()));
  }
  if (chunks > kMaxChunks || chunks * (chunk / kPageBytes) > kMaxPageIds) {
    // Too many pages: only a lower capacity helps. Too many chunks: larger chunks help too, up to
    // the page bound.
    const std::uint64_t max_pages_bytes = kMaxPageIds / (chunk / kPageBytes) * chunk;
    std::string fix = fmt::format("lower capacity_bytes to at most {}", MaxCapacityBytes(chunk));
    if (chunks > kMaxChunks && whole_pages <= max_pages_bytes)
      fix += fmt::format(" or raise chunk_bytes to at least {}",
                         (whole_pages / kMaxChunks + kPageBytes) / kPageBytes * kPageBytes);
    return Status::InvalidArgument(fmt::format(
        "host tier: capacity_bytes {} in chunks of {} bytes is more than one tier holds (at most {} chunks and {} "
        "pages of {} bytes); {}",
        options.capacity_bytes, chunk, kMaxChunks, kMaxPageIds, kPageBytes, fix));
  }
  std::unique_ptr<HostTier> tier(new HostTier(options, name));
  if (options.prefault || (options.populate == HostPopulate::kBackground && tier->populate_chunks_ > 0)) {
    TERRACE_ASSIGN_OR_RETURN(tier->prefaulter_, tiers::Prefaulter::Create(kPrefaultPieceBytes));
  }
  if (options.populate != HostPopulate::kOnDemand && tier->populate_chunks_ > 0) {
    const std::uint64_t t0 = SteadyNanos();
    TERRACE_RETURN_IF_ERROR(tier->arena_.GrowTo(std::uint64_t{tier->populate_chunks_} * tier->arena_.chunk_bytes()));
    tier->open_populate_ns_ = SteadyNanos() - t0;
  }
  return tier;
}

HostTier::HostTier(const HostTierOptions& options, std::string_view name)
    : options_(options),
      name_(name),
      logger_(LoggerOrDefault(options.logger)),
      arena_(tiers::BlockArenaOptions{std::string(name), options.capacity_bytes, options.chunk_bytes, kPageBytes},
             [this](std::uint32_t chunk, std::uint64_t bytes) { return Grow(chunk, bytes); }) {
  caps_.id = TierId::kHost;
  caps_.name = "host";
  caps_.memory = MemoryKind::kHost;
  caps_.verifies_gets = true;  // Get: fused copy + checksum of the caller's bytes
  caps_.reserves = true;
  caps_.pageable = !options_.pin;
  caps_.capacity_bytes = arena_.capacity_bytes();
  caps_.max_block_bytes = arena_.max_block_bytes();
  if (options.stream_get_min_bytes != 0) {
    stream_get_bytes_ = options.stream_get_min_bytes;
  } else if (const std::uint64_t llc = tiers::LastLevelCacheBytes(); llc > 0) {
    stream_get_bytes_ = llc / 4;
  }
  const std::uint64_t chunk = arena_.chunk_bytes();
  bases_.assign(chunk == 0 ? 0 : (arena_.capacity_bytes() + chunk - 1) / chunk, nullptr);
  faulted_ = std::make_unique<std::atomic<std::uint64_t>[]>(bases_.size());
  if (options.populate != HostPopulate::kOnDemand && chunk > 0) {
    const std::uint64_t cap = arena_.capacity_bytes();
    const std::uint64_t want = options.populate_bytes == 0 ? cap : std::min(options.populate_bytes, cap);
    populate_chunks_ = static_cast<std::uint32_t>((want + chunk - 1) / chunk);
  }
  if (!options.huge_pages) {
    huge_note_ = "HostTierOptions::huge_pages off";
  } else if (const tiers::ThpSupport& thp = tiers::TransparentHugePages(); !thp.usable) {
    huge_note_ = thp.why;
  } else {
    huge_pages_ = true;
    huge_note_ = thp.why;
  }
  // The prefaulter (a thread) is started by Create, which can report a refused thread.
}

HostTier::~HostTier() {
  prefaulter_.reset();  // joins its thread before the chunks it may be faulting are unmapped
  MutexLock lock(&chunks_mu_);
  for (const auto& c : chunks_) tiers::FreeHostChunk(c);
}

Status HostTier::Grow(std::uint32_t chunk, std::uint64_t bytes) {
  // Who faults the chunk's pages in: mlock on this thread (pinned, no prefaulter; unpinned
  // chunks then fault on first touch), the prefaulter, or this thread now (populate at open).
  enum class Fault { kByPin, kAhead, kNow };
  const bool populated = chunk < populate_chunks_;
  const Fault how = populated ? (options_.populate == HostPopulate::kAtOpen ? Fault::kNow : Fault::kAhead)
                              : (options_.prefault ? Fault::kAhead : Fault::kByPin);
  tiers::HostChunkOptions co;
  co.pin = options_.pin;
  co.populate = how == Fault::kByPin;
  co.huge_pages = huge_pages_;
  TERRACE_ASSIGN_OR_RETURN(tiers::HostChunk c, tiers::AllocateHostChunk(bytes, co));
  if (!c.pin_note.empty()) {
    pin_refusal_log_.Log(*logger_, LogLevel::kWarning, "host", fmt::format("pinned: no ({})", c.pin_note));
  }
  const bool faulted_now = how == Fault::kNow || c.kind == tiers::PinKind::kCudaHost ||
                           (how == Fault::kByPin && c.kind == tiers::PinKind::kMlock);
  // Before the prefaulter sees the chunk: it reads faulted_[chunk] as the puts' frontier.
  faulted_[chunk].store(faulted_now ? c.bytes : 0, std::memory_order_relaxed);
  if (c.kind != tiers::PinKind::kCudaHost) {  // cudaHostAlloc chunks are faulted already
    if (how == Fault::kAhead) prefaulter_->Enqueue(c.data, c.bytes, c.huge_pages, &faulted_[chunk]);
    if (how == Fault::kNow) {
      if (Status st = tiers::PopulateNow(c.data, c.bytes); !st.ok()) {
        tiers::FreeHostChunk(c);
        return st;
      }
    }
  }
  bases_[chunk] = c.data;
  MutexLock lock(&chunks_mu_);
  chunks_.push_back(std::move(c));
  return Status::Ok();
}

std::byte* HostTier::Address(const tiers::PageExtent& e) const { return bases_[e.chunk] + arena_.ByteOffset(e); }

bool HostTier::FaultedIn(const tiers::PageExtent& e) const {
  return arena_.ByteOffset(e) + std::uint64_t{e.pages} * arena_.page_bytes() <=
         faulted_[e.chunk].load(std::memory_order_relaxed);
}

void HostTier::NoteWritten(const tiers::PageExtent& e) {
  const std::uint64_t end = arena_.ByteOffset(e) + std::uint64_t{e.pages} * arena_.page_bytes();
  std::atomic<std::uint64_t>& f = faulted_[e.chunk];
  std::uint64_t cur = f.load(std::memory_order_relaxed);
  while (cur < end && !f.compare_exchange_weak(cur, end, std::memory_order_relaxed)) {
  }
}

void HostTier::CopyIn(const tiers::PageExtent& e, const std::byte* src, std::size_t n) {
  if (FaultedIn(e) && n >= tiers::kStreamCopyMinBytes) {
    tiers::CopyForPut(Address(e), src, n);
    streamed_puts_.fetch_add(1, std::memory_order_relaxed);
  } else {
    std::memcpy(Address(e), src, n);
    NoteWritten(e);
  }
}

std::uint64_t HostTier::CopyInAndChecksum(const tiers::PageExtent& e, const std::byte* src, std::size_t n) {
  if (FaultedIn(e) && n >= tiers::kStreamCopyMinBytes) {
    streamed_puts_.fetch_add(1, std::memory_order_relaxed);
    return tiers::CopyForPutAndChecksum(Address(e), src, n);
  }
  const std::uint64_t sum = tiers::CopyAndChecksum(Address(e), src, n);
  NoteWritten(e);
  return sum;
}

Status HostTier::Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) {
  if (desc.size != data.size()) {
    return Status::InvalidArgument(fmt::format("{} tier: put of block {}: desc.size {} != data size {}; "
                                               "build the desc with DescribeBlock(data)",
                                               name_, key.ToString(), desc.size, data.size()));
  }
  const std::uint64_t t0 = SteadyNanos();
  TERRACE_ASSIGN_OR_RETURN(tiers::BlockArena::Ticket t, arena_.BeginWrite(key, desc));
  if (desc.size > 0) CopyIn(t.extent, data.data(), desc.size);
  TERRACE_RETURN_IF_ERROR(arena_.CommitWrite(key, t));
  counters_.Add(counters_.puts);
  counters_.Add(counters_.bytes_written, desc.size);
  counters_.write_latency.Record(SteadyNanos() - t0);
  return Status::Ok();
}

Status HostTier::PutDescribing(const BlockKey& key, BlockDesc* desc, std::span<const std::byte> data) {
  if (desc->size != data.size()) {
    return Status::InvalidArgument(fmt::format("{} tier: put of block {}: desc.size {} != data size {}; "
                                               "set the desc's size to the data's",
                                               name_, key.ToString(), desc->size, data.size()));
  }
  const std::uint64_t t0 = SteadyNanos();
  TERRACE_ASSIGN_OR_RETURN(tiers::BlockArena::Ticket t, arena_.BeginWrite(key, *desc));  // sized by desc->size
  t.desc.checksum = desc->size > 0 ? CopyInAndChecksum(t.extent, data.data(), desc->size)
                                   : tiers::FastChecksum(nullptr, 0);
  TERRACE_RETURN_IF_ERROR(arena_.CommitWrite(key, t));
  desc->checksum = t.desc.checksum;
  counters_.Add(counters_.puts);
  counters_.Add(counters_.bytes_written, desc->size);
  counters_.write_latency.Record(SteadyNanos() - t0);
  return Status::Ok();
}

Status HostTier::Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) {
  return GetInto(key, out, desc, out.size() >= stream_get_bytes_);
}

std::vector<Status> HostTier::GetBatch(std::span<GetOp> ops) {
  std::uint64_t dest = 0;
  for (const GetOp& op : ops) dest += op.out.size();
  const bool stream = dest >= stream_get_bytes_;
  std::vector<Status> st;
  st.reserve(ops.size());
  for (GetOp& op : ops) st.push_back(GetInto(op.key, op.out, &op.desc, stream));
  return st;
}

std::vector<Status> HostTier::GetRangeBatch(std::span<RangeOp> ops) {
  std::vector<Status> st;
  st.reserve(ops.size());
  std::uint64_t hits = 0, misses = 0, bytes = 0;
  for (RangeOp& op : ops) {
    const std::uint64_t t0 = SteadyNanos();
    Status s = arena_.ReadRange(op, [&](const tiers::BlockArena::Ticket& t) {
      std::memcpy(op.out.data(), Address(t.extent) + op.offset, op.length);
      return Status::Ok();
    });
    if (s.ok()) {
      ++hits;
      bytes += op.length;
      counters_.read_latency.Record(SteadyNanos() - t0);
    } else if (s.IsNotFound()) {
      ++misses;
    }
    st.push_back(std::move(s));
  }
  if (hits > 0) counters_.Add(counters_.hits, hits);
  if (misses > 0) counters_.Add(counters_.misses, misses);
  counters_.Add(counters_.bytes_read, bytes);
  return st;
}

Status HostTier::GetInto(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc, bool stream) {
  const std::uint64_t t0 = SteadyNanos();
  auto r = arena_.BeginRead(key);
  if (!r.ok()) {
    counters_.Add(counters_.misses);
    return r.status();
  }
  const tiers::BlockArena::Ticket& t = *r;
  if (out.size() < t.desc.size) {
    arena_.EndRead(key, t, false);
    return Status::InvalidArgument(fmt::format("{} tier: get of block {}: buffer of {} bytes is smaller than "
                                               "the block ({} bytes); Lookup the size first",
                                               name_, key.ToString(), out.size(), t.desc.size));
  }
  stream = stream && t.desc.size >= tiers::kStreamCopyMinBytes;
  if (stream) streamed_gets_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t sum = t.desc.size == 0 ? tiers::FastChecksum(nullptr, 0)
                            : stream        ? tiers::ChecksumAndStream(out.data(), Address(t.extent), t.desc.size)
                                            : tiers::ChecksumAndCopy(out.data(), Address(t.extent), t.desc.size);
  const bool corrupt = sum != t.desc.checksum;
  arena_.EndRead(key, t, corrupt);
  if (corrupt) {
    counters_.Add(counters_.corruptions);
    return Status::Corruption(fmt::format("{} tier: block {} failed its checksum (recorded {:016x}, read {:016x}); "
                                          "it was dropped: fetch it from a lower tier or recompute it",
                                          name_, key.ToString(), t.desc.checksum, sum));
  }
  if (desc) *desc = t.desc;
  counters_.Add(counters_.hits);
  counters_.Add(counters_.bytes_read, t.desc.size);
  counters_.read_latency.Record(SteadyNanos() - t0);
  return Status::Ok();
}

Status HostTier::Erase(const BlockKey& key) { return arena_.Erase(key); }

void HostTier::WaitForPrefault() const {
  if (prefaulter_ != nullptr) prefaulter_->Drain();
}

namespace {
// A reservation's token: the arena ticket's slot and extent.
tiers::BlockArena::Ticket TicketOf(const Reservation& r, const BlockDesc& desc) {
  tiers::BlockArena::Ticket t;
  t.slot = static_cast<std::uint32_t>(r.token[0]);
  t.extent.chunk = static_cast<std::uint32_t>(r.token[1] >> 32);
  t.extent.page = static_cast<std::uint32_t>(r.token[1]);
  t.extent.pages = static_cast<std::uint32_t>(r.token[2]);
  t.desc = desc;
  return t;
}
}  // namespace

Result<Reservation> HostTier::Reserve(const BlockKey& key, const BlockDesc& desc) {
  TERRACE_ASSIGN_OR_RETURN(tiers::BlockArena::Ticket t, arena_.BeginWrite(key, desc));
  Reservation r;
  r.token = {t.slot, (std::uint64_t{t.extent.chunk} << 32) | t.extent.page, t.extent.pages};
  if (t.extent.pages > 0) r.bytes = {Address(t.extent), std::uint64_t{t.extent.pages} * kPageBytes};
  return r;
}

Status HostTier::Commit(const BlockKey& key, const BlockDesc& desc, const Reservation& r) {
  const tiers::BlockArena::Ticket t = TicketOf(r, desc);
  TERRACE_RETURN_IF_ERROR(arena_.CommitWrite(key, t));
  NoteWritten(t.extent);  // the caller filled the reservation: its pages are faulted in
  counters_.Add(counters_.puts);
  counters_.Add(counters_.bytes_written, desc.size);
  return Status::Ok();
}

void HostTier::Abort(const Reservation& r) { arena_.AbortWrite(TicketOf(r, {})); }

const std::byte* HostTier::ResidentPtr(const BlockKey& key) const {
  auto e = arena_.Locate(key);
  if (!e.ok()) return nullptr;
  // An empty block has no bytes, but it is resident: never null (null means absent), whether or
  // not the arena has grown a chunk yet.
  static const std::byte kEmptyBlock{};
  if (e->pages == 0) return &kEmptyBlock;
  return Address(*e);
}

std::vector<iovec> HostTier::Regions() const {
  MutexLock lock(&chunks_mu_);
  std::vector<iovec> out;
  out.reserve(chunks_.size());
  for (const auto& c : chunks_) out.push_back(iovec{c.data, c.bytes});
  return out;
}

std::vector<std::span<std::byte>> HostTier::IoRegions() const {
  std::vector<std::span<std::byte>> out;
  for (const iovec& r : Regions()) out.emplace_back(static_cast<std::byte*>(r.iov_base), r.iov_len);
  return out;
}

std::string HostTier::PinSummary() const {
  MutexLock lock(&chunks_mu_);
  if (chunks_.empty()) return options_.pin ? "pinned: pending (no chunk yet)" : "pinned: no (not requested)";
  if (!options_.pin) return "pinned: no (not requested)";
  std::size_t cuda = 0, mlocked = 0;
  for (const auto& c : chunks_) {
    cuda += c.kind == tiers::PinKind::kCudaHost;
    mlocked += c.kind == tiers::PinKind::kMlock;
  }
  const std::size_t n = chunks_.size();
  if (cuda == n) return "pinned: yes (cudaHostAlloc)";
  if (mlocked == n) return "pinned: yes (mlock)";
  if (cuda + mlocked == 0) return "pinned: no (mlock refused)";
  return fmt::format("pinned: partial ({} of {} chunks; mlock refused for the rest)", cuda + mlocked, n);
}

std::uint64_t HostTier::huge_page_bytes() const {
  std::vector<tiers::ByteRange> ranges;
  {
    MutexLock lock(&chunks_mu_);
    for (const auto& c : chunks_) {
      if (c.huge_pages) ranges.push_back(tiers::ByteRange{c.data, c.bytes});
    }
  }
  if (ranges.empty()) return 0;
  auto bytes = tiers::AnonHugeBytes(ranges);
  return bytes.ok() ? *bytes : 0;
}

std::string HostTier::HugePageSummary() const {
  if (!huge_pages_) return fmt::format("huge pages: no ({})", huge_note_);
  std::uint64_t advised = 0, total = 0;
  {
    MutexLock lock(&chunks_mu_);
    if (chunks_.empty()) return fmt::format("huge pages: pending ({}; no chunk yet)", huge_note_);
    for (const auto& c : chunks_) {
      total += c.bytes;
      if (c.huge_pages) advised += c.bytes;
    }
  }
  if (advised == 0) return "huge pages: no (cudaHostAlloc chunks, or madvise(MADV_HUGEPAGE) refused)";
  const std::uint64_t huge = huge_page_bytes();
  if (huge == 0) return fmt::format("huge pages: advised, none granted so far ({}; {} MiB of chunks)", huge_note_, total >> 20);
  return fmt::format("huge pages: yes ({}; {} of {} MiB faulted in as huge pages)", huge_note_, huge >> 20, total >> 20);
}

TierStatsSnapshot HostTier::Stats() const {
  TierStatsSnapshot s = SnapshotCounters(counters_);
  s.name = caps_.name;
  s.capacity_bytes = caps_.capacity_bytes;
  s.used_bytes = used_bytes();
  s.allocated_bytes = allocated_bytes();
  s.blocks = block_count();
  s.detail = fmt::format("{}; {}; arena {} MiB of {} MiB", PinSummary(), HugePageSummary(), arena_.arena_bytes() >> 20,
                         caps_.capacity_bytes >> 20);
  if (stream_get_bytes_ == UINT64_MAX) {
    s.detail += "; gets: cached stores";
  } else if (stream_get_bytes_ <= tiers::kStreamCopyMinBytes) {
    s.detail += fmt::format("; gets stream every block of at least {} KiB ({} streamed)",
                            tiers::kStreamCopyMinBytes >> 10, streamed_gets());
  } else {
    s.detail += fmt::format("; gets stream from {} KiB of destination ({} streamed)", stream_get_bytes_ >> 10,
                            streamed_gets());
  }
  if (populate_chunks_ > 0) {
    const std::uint64_t mib = std::min(std::uint64_t{populate_chunks_} * arena_.chunk_bytes(), caps_.capacity_bytes) >> 20;
    if (options_.populate == HostPopulate::kAtOpen) {
      s.detail += fmt::format("; populated {} MiB at open in {:.2f} s", mib, static_cast<double>(open_populate_ns_) / 1e9);
    } else {
      s.detail += fmt::format("; populating {} MiB in the background from open", mib);
    }
  }
  if (prefaulter_ != nullptr) {
    s.detail += fmt::format("; faulted ahead {} MiB", prefaulter_->faulted_bytes() >> 20);
    if (const std::uint64_t skipped = prefaulter_->skipped_bytes(); skipped > 0) {
      s.detail += fmt::format(" ({} MiB first reached by puts)", skipped >> 20);
    }
    if (std::string note = prefaulter_->note(); !note.empty()) s.detail += "; " + note;
  }
  return s;
}

}  // namespace terrace
