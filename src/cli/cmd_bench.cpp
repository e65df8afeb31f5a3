// terrace bench tiers: throughput, IOPS and latency of one tier, driven through the Tier interface.
//
// Each of --threads workers issues batches of --batch operations (PutBatch / GetBatch); the NVMe
// tier keeps --queue-depth I/Os in flight through a batch. Buffers are 4 KiB-aligned, as an engine's
// pinned buffers are, so O_DIRECT I/O needs no staging copy. Latency percentiles are the NVMe
// tier's own per-I/O figures (submit to completion, as fio's clat); for memory tiers they come from
// a separate pass of single-operation calls (up to 4096 of them, after the timed passes), so they
// are per-operation, not per-batch. The NVMe figures cover the timed passes' I/Os only (the tier's
// histograms copied before and after each timed pass), as MB/s does; latency_samples counts them.
// A pass's time runs from the moment all its workers have started (they wait at a gate) to the
// last one's return: thread start and join are not in it. --warmup untimed passes run first (default 1; 0 to time a
// fresh tier's first touch), then --repeat timed passes; MB/s and IOPS are the median pass (an even
// --repeat: the mean of the two middle passes' MB/s), with the slowest and fastest pass as the
// spread. Read buffers are allocated and faulted in once, before the first pass, as the memcpy
// baseline's are: a read pass, the first one (--warmup 0) included, times the tier against memcpy
// with both destinations mapped. A write pass with --warmup 0 still counts the tier's first touch
// of its own memory (a fresh tier), against memcpy into pre-faulted memory: that is the target
// ("puts into a fresh tier"), so the first-write figure is not like for like by design.
#include <mutex>
#include <optional>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <fcntl.h>
#include <sys/stat.h>
#include <csignal>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/command.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/aligned_buffer.h"
#include "src/common/json_text.h"
#include "src/common/list_dir.h"
#include "src/common/median.h"
#include "terrace/options.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli {
namespace {

// Option bounds: one block buffer is allocated whole; the data moved must fit a tier.
constexpr std::uint64_t kMaxBlockBytes = 1 * kGiB;
constexpr std::uint64_t kMaxTotalBytes = 64ull << 40;

struct BenchArgs {
  std::string tier = "host";
  std::string op = "write";
  std::uint64_t block_size = 1 * kMiB;
  unsigned queue_depth = 32;
  std::uint64_t total_bytes = 1 * kGiB;
  std::string dir;
  std::string index_dir;
  bool json = false;
  std::string durability = "async";
  unsigned threads = 1;
  unsigned batch = 0;  // 0: BatchSize() picks
  unsigned warmup = 1;  // untimed passes before the timed ones
  unsigned repeat = 1;  // timed passes (median reported)
  bool keep = false;
  std::string host_prefault = "on";  // --host-prefault: HostOptionsFor()
  bool host_prefault_given = false;  // --host-prefault was on the command line (refused for other tiers)
  std::string host_huge_pages = "off";  // --host-huge-pages: HostTierOptions::huge_pages
  bool host_huge_pages_given = false;
  std::string host_stream_gets = "auto";  // --host-stream-gets: HostTierOptions::stream_get_min_bytes
  bool host_stream_gets_given = false;
  // The NVMe-only flags given on the command line, in command-line spelling (refused for other tiers).
  std::vector<std::string> nvme_flags_given;
  // NVMe default: 8 queues' worth or 64 MiB per call, whichever is more, and never more than
  // kMaxDefaultBatch blocks (as --help says), so the drain at the end of each call costs little;
  // memory tiers: one queue's worth. --batch overrides it.
  static constexpr std::uint64_t kMaxDefaultBatch = 4096;
  unsigned BatchSize() const {
    if (batch) return batch;
    if (tier != "nvme") return queue_depth;
    const std::uint64_t by_bytes = (64ull << 20) / std::max<std::uint64_t>(block_size, 1);
    return static_cast<unsigned>(std::min(kMaxDefaultBatch, std::max<std::uint64_t>(8ull * queue_depth, by_bytes)));
  }
  // The blocks one PutBatch / GetBatch call carries at most: the batch, or the whole data set
  // when that is smaller (a read buffer never holds more blocks than a call moves).
  std::uint64_t BlocksPerCall() const {
    return std::max<std::uint64_t>(1, std::min<std::uint64_t>(BatchSize(), total_bytes / std::max<std::uint64_t>(block_size, 1)));
  }
};

// Marks a directory the bench created (and removes on exit), so that a later run recognises what a
// killed run (SIGKILL, power loss) left behind.
constexpr const char* kBenchMarker = "terrace-bench.marker";
// Marks a store directory a run with --keep created: later runs reuse it (and never remove it); an
// existing store without it is not the bench's, and the bench, which writes and erases its own
// blocks in the store it opens, refuses it.
constexpr const char* kBenchKeptMarker = "terrace-bench-kept.marker";

struct BenchResult {
  double seconds = 0;
  std::uint64_t ops = 0;
  double p50_us = 0, p99_us = 0;
  double flush_seconds = 0;
  double user_seconds = 0, sys_seconds = 0;  // the process's CPU time over the pass (every thread)
};

using Clock = std::chrono::steady_clock;

// What the bench creates in --dir and --index-dir, removed when it ends: a directory that did not
// exist before the run goes whole; one that existed and was empty keeps the directory and loses
// only what the bench put there (its store's files, its index's files, its marker; anything else
// there is left, and said). Never a block device, a file, or a directory that held something. Each
// kBenchMarker goes last, so a run stopped while removing (a second Ctrl-C) leaves a marked
// leftover that the next run removes.
class RemoveCreatedDirs {
 public:
  RemoveCreatedDirs() = default;
  RemoveCreatedDirs(const RemoveCreatedDirs&) = delete;
  RemoveCreatedDirs& operator=(const RemoveCreatedDirs&) = delete;
  ~RemoveCreatedDirs() { Run(); }
  // True when `p` did not exist, or is an empty directory (it is recorded, with `flag` to name it
  // and whether it is an index directory).
  bool Add(const std::filesystem::path& p, std::string_view flag, bool index) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) {
      paths_.push_back({p, std::string(flag), index, /*existed=*/false});
      return true;
    }
    if (IsBlockDevice(p.string()) || !std::filesystem::is_directory(p, ec) || !std::filesystem::is_empty(p, ec) || ec)
      return false;
    paths_.push_back({p, std::string(flag), index, /*existed=*/true});
    return true;
  }
  // A block device this run formatted (its tier reported a creation): cleared again at the end
  // (ClearDevice), first, so it is blank for the next run, as it was for this one.
  void AddFormattedDevice(const std::filesystem::path& dev) { device_ = dev; }
  void Run() {
    if (!device_.empty()) {
      if (Status s = ClearDevice(device_); !s.ok()) fmt::print(stderr, "bench: {}\n", s.message());
      device_.clear();
    }
    for (const Entry& e : paths_) {
      std::error_code ec;
      if (!e.existed) {
        if (!std::filesystem::is_directory(std::filesystem::symlink_status(e.path, ec))) continue;
        RemoveMarkerLast(e.path, ec);
        if (!ec) std::filesystem::remove(e.path, ec);
        if (ec) fmt::print(stderr, "bench: cannot remove '{}': {}\n", e.path.string(), ec.message());
      } else if (Status s = EmptyExisting(e); !s.ok()) {
        fmt::print(stderr, "bench: {}\n", s.message());
      }
    }
    paths_.clear();
  }

 private:
  struct Entry {
    std::filesystem::path path;
    std::string flag;
    bool index = false, existed = false;
  };
  static void RemoveMarkerLast(const std::filesystem::path& dir, std::error_code& ec) {
    for (const auto& e : ListDir(dir, &ec)) {
      if (e.path().filename() != kBenchMarker && !ec) std::filesystem::remove_all(e.path(), ec);
    }
    if (!ec) std::filesystem::remove(dir / kBenchMarker, ec);
  }
  // A directory the user had, empty: only the bench's own files go, the directory stays.
  static Status EmptyExisting(const Entry& e) {
    if (!e.index) return RemoveOwnedStore(e.path, kBenchMarker, e.flag, "terrace bench tiers").status();
    if (std::optional<std::filesystem::path> foreign = ForeignIndexEntry(e.path, kBenchMarker)) {
      return Status::InvalidArgument(fmt::format("{} {}: left the index the bench made there, because '{}' appeared "
                                                 "beside it",
                                                 e.flag, e.path.string(), foreign->filename().string()));
    }
    std::error_code ec;
    RemoveMarkerLast(e.path, ec);
    if (ec) return Status::IoError(fmt::format("cannot empty {} {}: {}", e.flag, e.path.string(), ec.message()));
    return Status::Ok();
  }
  // Zeroes the first and the last MiB of `dev` (what the tier's blank check reads): the store the
  // bench wrote there is gone and the device reads as blank again.
  static Status ClearDevice(const std::filesystem::path& dev) {
    auto bytes = BlockDeviceBytes(dev.string());
    if (!bytes.ok()) return bytes.status();
    const int fd = ::open(dev.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return Status::IoError(fmt::format("cannot clear the store it wrote on {}: {}", dev.string(), std::strerror(errno)));
    constexpr std::uint64_t kEdge = 1 << 20;
    const std::vector<char> zeros(kEdge, 0);
    bool ok = true;
    for (const std::uint64_t at : {std::uint64_t{0}, *bytes > kEdge ? *bytes - kEdge : 0}) {
      const std::uint64_t len = std::min(kEdge, *bytes - at);
      ok = ok && ::pwrite(fd, zeros.data(), len, static_cast<off_t>(at)) == static_cast<ssize_t>(len);
    }
    ok = ok && ::fsync(fd) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok) {
      return Status::IoError(fmt::format("cannot clear the store it wrote on {} ({}); clear it with "
                                         "'blkdiscard -z {}' before the next run",
                                         dev.string(), std::strerror(err), dev.string()));
    }
    return Status::Ok();
  }
  std::vector<Entry> paths_;
  std::filesystem::path device_;
};

// The host tier's options: its capacity, and --host-prefault (ApplyHostPrefault).
HostTierOptions HostOptionsFor(const BenchArgs& a, std::uint64_t capacity) {
  HostTierOptions o;
  o.capacity_bytes = capacity;
  o.chunk_bytes = std::max<std::uint64_t>(RoundUp(a.block_size, 4 * kKiB), 256 * kMiB);
  ApplyHostPrefault(a.host_prefault, &o);
  o.huge_pages = a.host_huge_pages == "on";
  ApplyHostStreamGets(a.host_stream_gets, &o);
  return o;
}

// The largest block the hbm tier takes when it is emulated in host memory (no CUDA device): its
// arena grows in chunks of this size and a block never spans two (tiers/hbm/emulated_hbm_tier.h).
// The CUDA tier's arena is one chunk of its whole capacity.
constexpr std::uint64_t kEmulatedHbmMaxBlock = EmulatedHbmTier::kChunkBytes;

// Bytes of a memory tier's arena that hold `slots` blocks of `unit` bytes (4 KiB-rounded) when it
// grows in chunks of `chunk` (>= unit) bytes: a block never spans two chunks, so a chunk holds
// chunk / unit of them (the arena places each block at the start of a free run, so equal blocks
// never leave a hole smaller than a block between them).
std::uint64_t ArenaBytesFor(std::uint64_t slots, std::uint64_t unit, std::uint64_t chunk) {
  const std::uint64_t per_chunk = std::max<std::uint64_t>(chunk / unit, 1);
  return slots / per_chunk * chunk + slots % per_chunk * unit;
}

// The room the bench's tier needs: `need` for its blocks (the NVMe tier stores each block in an
// extent of its data units plus one descriptor unit; the memory tiers in 4 KiB units), and the
// `capacity` it is made with.
// - NVMe: need plus an eighth plus 64 MiB. A new NVMe tier's file takes `capacity` on the file
//   system of --dir (CheckBenchSizes checks the free space against it). Every write pass starts
//   from an empty tier (an overwrite needs a new extent before the old one is freed).
// - Memory tiers: the arena for every block plus one more per worker that can be writing
//   (`inflight`): a rewrite (the timed pass after the warm-up, the per-operation pass) puts a
//   block's new copy before it frees the old one, so a tier of `need` bytes could not rewrite a
//   block as large as itself. Plus 64 MiB. In chunks of max(block, 256 MiB), as the host tier
//   (HostOptionsFor) and the emulated hbm tier grow (a CUDA hbm tier is one chunk: no less room).
//   CheckBenchSizes counts `capacity` against the RAM budget: the tier may hold all of it.
struct BenchRoom {
  std::uint64_t blocks, need, capacity, per_block;
};

// The NVMe tier's data file for `blocks` blocks of `per_block` bytes on disk: RoomFor's capacity for --tier nvme.
std::uint64_t NvmeFileBytes(std::uint64_t blocks, std::uint64_t per_block) {
  const std::uint64_t need = blocks * per_block;
  return RoundUp(need + need / 8 + 64 * kMiB, 4 * kKiB);
}

BenchRoom RoomFor(const BenchArgs& a) {
  const std::uint64_t blocks = a.total_bytes / a.block_size;
  const std::uint64_t per_block =
      a.tier == "nvme" ? nvme::Record{.length = a.block_size}.extent_bytes() : RoundUp(a.block_size, 4 * kKiB);
  const std::uint64_t need = blocks * per_block;  // no overflow: --total-bytes and --block-size are bounded
  if (a.tier == "nvme") return {blocks, need, NvmeFileBytes(blocks, per_block), per_block};
  const std::uint64_t inflight = std::min<std::uint64_t>(std::max(1u, a.threads), blocks);
  const std::uint64_t chunk = std::max<std::uint64_t>(per_block, 256 * kMiB);
  return {blocks, need, RoundUp(ArenaBytesFor(blocks + inflight, per_block, chunk) + 64 * kMiB, 4 * kKiB), per_block};
}

Result<std::unique_ptr<Tier>> MakeTier(const BenchArgs& a, const std::filesystem::path& dir) {
  const auto [blocks, need, room_capacity, per_block] = RoomFor(a);
  std::uint64_t capacity = room_capacity;
  if (a.tier == "host") {
    TERRACE_ASSIGN_OR_RETURN(auto t, HostTier::Create(HostOptionsFor(a, capacity)));
    return std::unique_ptr<Tier>(std::move(t));
  }
  if (a.tier == "hbm") {
    HbmTierOptions o;
    o.capacity_bytes = capacity;
    return CreateHbmTier(o);
  }
  NvmeTierOptions o;
  o.path = dir;
  o.index_dir = a.index_dir;
  if (IsBlockDevice(dir.string())) {
    // The whole device (rounded down to 4 KiB): the same capacity on every run, whatever
    // --total-bytes, so a later run reopens the format the first one wrote.
    TERRACE_ASSIGN_OR_RETURN(std::uint64_t dev_bytes, BlockDeviceBytes(dir.string()));
    if (dev_bytes / (4 * kKiB) * (4 * kKiB) < need + 4 * kKiB) {
      return Status::OutOfCapacity(fmt::format("block device '{}' has {}, too small for {} blocks of {}; lower "
                                               "--total-bytes",
                                               dir.string(), FormatBytes(static_cast<double>(dev_bytes)), blocks,
                                               FormatBytes(static_cast<double>(a.block_size))));
    }
    capacity = dev_bytes / (4 * kKiB) * (4 * kKiB);
  } else if (auto existing = ExistingStoreCapacity(dir); existing.ok()) {
    // A store kept from an earlier run (--keep): reopen it with the capacity it was made with.
    if (*existing < need + 4 * kKiB) {
      return Status::InvalidArgument(fmt::format(
          "--dir {} holds a Terrace store of {}, too small for {} blocks of {}; lower --total-bytes or give a new "
          "--dir",
          dir.string(), FormatBytes(static_cast<double>(*existing)), blocks,
          FormatBytes(static_cast<double>(a.block_size))));
    }
    capacity = *existing;
  }
  o.capacity_bytes = capacity;
  o.queue_depth = a.queue_depth;
  o.io_threads = std::clamp(a.threads, 1u, 64u);  // one ring per worker: concurrent calls do not queue on one ring
  o.durability = a.durability == "sync" ? Durability::kSync : Durability::kAsync;
  TERRACE_ASSIGN_OR_RETURN(auto t, NvmeTier::Open(o));
  return std::unique_ptr<Tier>(std::move(t));
}

BlockKey BenchKey(std::uint64_t i) { return BlockKey{0xbe4c, BlockKind::kOther, 0, ContentId{0, i}}; }

// True when `tier` holds every block the bench would write (keys 0..blocks-1, each with `desc`'s size
// and checksum): a store kept by an earlier run (--keep) of the same --block-size and --total-bytes.
bool HoldsDataSet(const Tier& tier, std::uint64_t blocks, const BlockDesc& desc) {
  if (tier.block_count() < blocks) return false;
  for (std::uint64_t i = 0; i < blocks; ++i) {
    auto d = tier.Lookup(BenchKey(i));
    if (!d.ok() || d->size != desc.size || d->checksum != desc.checksum || d->codec != desc.codec) return false;
  }
  return true;
}

// Each read worker's buffer (BlocksPerCall() x --block-size: --batch blocks, or the whole data set
// when that is smaller; 4 KiB-aligned), allocated once for the whole
// run and touched once before the first pass (warm-up included), so that no pass pays for faulting
// in its destination: the memcpy baseline's destination is faulted once too (MemcpyBaseline).
// Empty for --op write.
using ReadBuffers = std::vector<std::unique_ptr<AlignedBuffer>>;

Result<ReadBuffers> AllocateReadBuffers(const BenchArgs& a) {
  ReadBuffers outs;
  if (a.op == "write") return outs;
  const std::uint64_t per_call = a.BlocksPerCall();
  for (unsigned t = 0; t < std::max(1u, a.threads); ++t) {
    outs.push_back(std::make_unique<AlignedBuffer>(RoundUp(a.block_size, 4 * kKiB) * per_call));
    if (!outs.back()->ok()) {
      return Status::OutOfCapacity(fmt::format(
          "cannot allocate the {} read buffer ({} blocks per call x --block-size {}); lower --batch or --block-size",
          FormatBytes(static_cast<double>(outs.back()->size())), per_call, FormatBytes(static_cast<double>(a.block_size))));
    }
    Prefault(*outs.back());  // every page now, not in a pass
  }
  return outs;
}

// Runs `ops` operations as batches of `batch` spread over `threads` workers. `index(i)` maps the
// i-th operation to a block index. Reads land in `outs` (one buffer per worker, each holding
// min(batch, ops) blocks: AllocateReadBuffers with the flags' values, so overrides may only be smaller).
template <typename IndexFn>
Result<BenchResult> RunOps(Tier& tier, const BenchArgs& a, bool write, std::uint64_t ops, IndexFn index,
                           std::span<const std::byte> payload, const BlockDesc& desc, const ReadBuffers& outs,
                           unsigned batch_override = 0, unsigned threads_override = 0) {
  const unsigned batch = batch_override ? batch_override : a.BatchSize();
  const unsigned nthreads = threads_override ? threads_override : std::max(1u, a.threads);
  const std::uint64_t stride = RoundUp(a.block_size, 4 * kKiB);
  if (!write && (outs.size() < nthreads || outs.front()->size() < stride * std::min<std::uint64_t>(batch, ops))) {
    return Status::Internal(fmt::format("bench: {} read buffers of {} for {} workers' batches of {}", outs.size(),
                                        outs.empty() ? 0 : outs.front()->size(), nthreads, batch));
  }
  BenchResult r;
  LatencyHistogram latency;
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> failed{false};
  Status first_error;
  std::mutex err_mu;
  // The workers' read buffers are registered with the tier for fixed-buffer I/O where it takes
  // them (the NVMe tier; as the store registers its host arena), and unregistered after the pass.
  std::vector<std::span<std::byte>> regions;
  for (unsigned t = 0; t < nthreads && !write; ++t) regions.push_back(outs[t]->span());
  struct Unregister {
    Tier* tier = nullptr;
    ~Unregister() {
      if (tier) (void)tier->RegisterIoRegions({});
    }
  } unregister;
  if (!regions.empty() && a.tier == "nvme" && tier.RegisterIoRegions(regions).ok()) unregister.tier = &tier;
  auto worker = [&](unsigned w) {
    std::vector<PutOp> puts;
    std::vector<GetOp> gets;
    AlignedBuffer none(0);
    AlignedBuffer& out = write ? none : *outs[w];
    while (!failed.load(std::memory_order_relaxed)) {
      if (StopSignalReceived() != 0) {
        if (!failed.exchange(true)) {
          std::lock_guard<std::mutex> l(err_mu);
          first_error = Status::Cancelled("interrupted");
        }
        break;
      }
      std::uint64_t begin = next.fetch_add(batch);
      if (begin >= ops) break;
      std::uint64_t end = std::min<std::uint64_t>(begin + batch, ops);
      auto t0 = Clock::now();
      std::vector<Status> st;
      if (write) {
        puts.clear();
        for (std::uint64_t i = begin; i < end; ++i) puts.push_back(PutOp{BenchKey(index(i)), desc, payload});
        st = tier.PutBatch(puts);
      } else {
        gets.clear();
        for (std::uint64_t i = begin; i < end; ++i) {
          gets.push_back(GetOp{BenchKey(index(i)), out.span().subspan((i - begin) * stride, a.block_size), {}});
        }
        st = tier.GetBatch(gets);
      }
      auto ns = NanosSince(t0);
      for (const Status& s : st) {
        if (!s.ok() && !failed.exchange(true)) {
          std::lock_guard<std::mutex> l(err_mu);
          first_error = s;
        }
        latency.Record(ns);
      }
    }
  };
  // Timed from the moment every worker has started to the last one's return: thread start and
  // join are outside the pass's time (on a tiny pass they would dominate it).
  std::pair<double, double> cpu0;
  const GatedRun gated = RunGated(nthreads, "benchmark worker (--threads)", worker, [&] { cpu0 = ProcessCpuSeconds(); });
  if (!gated.status.ok() && !failed.exchange(true)) first_error = gated.status;  // the pass is void
  r.seconds = gated.seconds();
  const auto cpu1 = ProcessCpuSeconds();
  r.user_seconds = cpu1.first - cpu0.first;
  r.sys_seconds = cpu1.second - cpu0.second;
  r.ops = ops;
  r.p50_us = static_cast<double>(latency.Percentile(0.5)) / 1e3;
  r.p99_us = static_cast<double>(latency.Percentile(0.99)) / 1e3;
  if (failed) return first_error;
  if (write) {
    auto f0 = Clock::now();
    TERRACE_RETURN_IF_ERROR(tier.Flush());
    r.flush_seconds = SecondsSince(f0);
  }
  return r;
}

// Adds to *window the samples `now` holds beyond `before`, an earlier copy of the same histogram
// (each as its bucket's upper bound, the value Percentile reports for it).
void AddSamplesSince(const LatencyHistogram& now, const LatencyHistogram& before, LatencyHistogram* window) {
  for (int b = 0; b < LatencyHistogram::kBuckets; ++b) {
    const std::uint64_t n = now.BucketCount(b) - before.BucketCount(b);
    for (std::uint64_t i = 0; i < n; ++i) window->Record(LatencyHistogram::BucketUpperBound(b));
  }
}

// The median of the timed passes (non-empty, each of the same ops), field by field (Median: an even
// count takes the mean of the two middle values): its time is that of the median throughput, its
// flush and CPU times the medians of the passes' own. Latency fields are left 0 (they come from
// the single-operation pass or the tier's histogram).
BenchResult MedianPass(const std::vector<BenchResult>& passes) {
  std::vector<double> rate, flush, user, sys;
  for (const BenchResult& p : passes) {
    rate.push_back(static_cast<double>(p.ops) / p.seconds);
    flush.push_back(p.flush_seconds);
    user.push_back(p.user_seconds);
    sys.push_back(p.sys_seconds);
  }
  BenchResult m;
  m.ops = passes.front().ops;
  m.seconds = static_cast<double>(m.ops) / Median(rate);
  m.flush_seconds = Median(flush);
  m.user_seconds = Median(user);
  m.sys_seconds = Median(sys);
  return m;
}

// The memory tiers' baseline, a memcpy of the same bytes in the same direction as the op (at most
// 1 GiB, in --block-size pieces) with memory faulted beforehand. Writes: from the cache-hot
// payload into `bytes` of pre-faulted memory (what a put does). Reads: from `bytes` of pre-faulted
// memory, which is not cache-resident, into a --batch x --block-size buffer cycled like the
// bench's read buffer (what a get does). Pass() is run after each timed pass, so tier and baseline
// alternate under the same load.
class MemcpyBaseline {
 public:
  MemcpyBaseline(std::span<const std::byte> payload, std::uint64_t bytes, bool reads, unsigned batch)
      : block_(payload.size()), n_(std::max<std::uint64_t>(std::min<std::uint64_t>(bytes, 1 * kGiB) / block_, 1)),
        reads_(reads), batch_(std::max(1u, batch)), mem_(n_ * block_), buf_(reads ? RoundUp(block_, 4 * kKiB) * batch_ : 0),
        payload_(payload) {
    if (!ok()) return;
    Prefault(mem_);
    if (reads_) {
      Prefault(buf_);
      for (std::uint64_t i = 0; i < n_; ++i) std::memcpy(mem_.data() + i * block_, payload_.data(), block_);
    }
  }
  bool ok() const { return mem_.ok() && buf_.ok(); }
  const char* what() const {
    return reads_ ? "pre-faulted memory into a --batch x --block-size buffer" : "the block into pre-faulted memory";
  }
  double Pass() const {  // MB/s
    const std::uint64_t stride = RoundUp(block_, 4 * kKiB);
    const auto t0 = Clock::now();
    for (std::uint64_t i = 0; i < n_; ++i) {
      if (reads_) std::memcpy(buf_.data() + (i % batch_) * stride, mem_.data() + i * block_, block_);
      else std::memcpy(mem_.data() + i * block_, payload_.data(), block_);
    }
    const double s = SecondsSince(t0);
    return static_cast<double>(mem_.size()) / 1e6 / s;
  }

 private:
  std::uint64_t block_, n_;
  bool reads_;
  unsigned batch_;
  AlignedBuffer mem_, buf_;
  std::span<const std::byte> payload_;
};

// Physical memory in bytes (0 when unknown).
std::uint64_t PhysicalMemory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

// Free bytes on the file system that holds `p` (or its nearest existing parent); 0 when unknown.
std::uint64_t FreeBytesAt(std::filesystem::path p) {
  std::error_code ec;
  p = std::filesystem::absolute(p, ec);
  while (!p.empty() && !std::filesystem::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  struct statvfs v {};
  if (::statvfs(p.c_str(), &v) != 0) return 0;
  return static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
}

// A --total-bytes value (as the flag takes it, rounded down to KiB or MiB) of at most `bytes`.
std::string SizeFlagValueAtMost(std::uint64_t bytes) {
  if (bytes >= kMiB) return fmt::format("{}MiB", bytes / kMiB);
  if (bytes >= kKiB) return fmt::format("{}KiB", bytes / kKiB);
  return fmt::format("{}", bytes);
}

// What to do when the NVMe tier's file (RoomFor(a).capacity) does not fit in `free` bytes: the
// file has a 64 MiB floor and each block takes its --block-size rounded up to 4 KiB plus a 4 KiB
// descriptor, so "lower --total-bytes" helps only down to a point; the advice says how far, or
// that only another --dir helps.
std::string NvmeRoomAdvice(const BenchArgs& a, std::uint64_t free) {
  const BenchRoom room = RoomFor(a);
  const std::string per_block = fmt::format(
      "each --block-size {} block takes {} KiB of the file (rounded up to 4 KiB, plus a 4 KiB descriptor), and "
      "the file is that plus an eighth plus 64 MiB",
      FormatBytes(static_cast<double>(a.block_size)), room.per_block / kKiB);
  if (NvmeFileBytes(1, room.per_block) > free) {
    return fmt::format("{}; even one block needs a {} file, so a lower --total-bytes cannot help: choose a --dir on "
                       "a file system with more room",
                       per_block, FormatBytes(static_cast<double>(NvmeFileBytes(1, room.per_block))));
  }
  // The most blocks whose file fits: the estimate from the formula, then down while it does not.
  std::uint64_t fit = free > 64 * kMiB + 4 * kKiB ? (free - 64 * kMiB - 4 * kKiB) / 9 * 8 / room.per_block : 1;
  fit = std::clamp<std::uint64_t>(fit, 1, room.blocks);
  while (fit > 1 && NvmeFileBytes(fit, room.per_block) > free) --fit;
  std::string advice = fmt::format("lower --total-bytes to at most {} ({} blocks), or choose another --dir: {}",
                                   SizeFlagValueAtMost(fit * a.block_size), fit, per_block);
  if (a.block_size % (4 * kKiB) != 0) {
    advice += fmt::format("; a --block-size in whole 4 KiB units wastes less of it (a {} block uses {} KiB)",
                          FormatBytes(static_cast<double>(a.block_size)), room.per_block / kKiB);
  }
  return advice;
}

// Sizes that cannot work on this machine are usage errors naming the flags, checked before any
// allocation: the memory tiers hold their capacity (RoomFor: every block and a rewritten copy per
// worker) in RAM, every read worker holds a buffer of BlocksPerCall() x --block-size, the NVMe
// tier's file (RoomFor) needs its size in free space. The hbm tier emulated in host memory takes
// blocks of at most 256 MiB.
Status CheckBenchSizes(const BenchArgs& a, const std::filesystem::path& dir) {
  if (a.tier == "hbm" && a.block_size > kEmulatedHbmMaxBlock && !HbmCudaDeviceAvailable()) {
    return Status::InvalidArgument(fmt::format(
        "--block-size {} is larger than the largest block --tier hbm takes here, {} (with no CUDA device the hbm "
        "tier is emulated in host memory, in arena chunks of that size); lower --block-size to at most 256MiB",
        FormatBytes(static_cast<double>(a.block_size)), FormatBytes(static_cast<double>(kEmulatedHbmMaxBlock))));
  }
  const std::uint64_t block = RoundUp(a.block_size, 4 * kKiB);
  const std::uint64_t per_call = a.BlocksPerCall();
  const std::uint64_t threads = std::max(1u, a.threads);
  const std::uint64_t ram = PhysicalMemory();
  const std::uint64_t budget = ram == 0 ? UINT64_MAX : ram / 4 * 3;
  const std::uint64_t read_buffers = a.op == "write" ? 0 : threads * per_call * block;  // no overflow: all bounded
  if (read_buffers > budget) {
    return Status::InvalidArgument(fmt::format(
        "--threads {} x {} x --block-size {} need {} of read buffers, more than this machine can give "
        "({} of RAM); lower --batch, --block-size or --threads",
        threads,
        per_call == a.BatchSize() ? fmt::format("--batch {}{}", per_call, a.batch ? "" : " (the default)")
                                  : fmt::format("{} blocks (all of --total-bytes, fewer than --batch {})", per_call,
                                                a.BatchSize()),
        FormatBytes(static_cast<double>(a.block_size)), FormatBytes(static_cast<double>(read_buffers)),
        FormatBytes(static_cast<double>(ram))));
  }
  const BenchRoom room = RoomFor(a);
  if (a.tier != "nvme" && room.capacity + read_buffers > budget) {
    return Status::InvalidArgument(fmt::format(
        "--total-bytes {} does not fit in the memory of this machine ({} of RAM) for the {} tier: it is made with "
        "{} (the {} blocks of --block-size {}, room to rewrite one per worker, and 64 MiB){}; lower --total-bytes "
        "or --block-size",
        FormatBytes(static_cast<double>(a.total_bytes)), FormatBytes(static_cast<double>(ram)), a.tier,
        FormatBytes(static_cast<double>(room.capacity)), room.blocks, FormatBytes(static_cast<double>(a.block_size)),
        read_buffers ? fmt::format(", besides {} of read buffers", FormatBytes(static_cast<double>(read_buffers)))
                     : std::string()));
  }
  if (a.tier == "nvme" && !IsBlockDevice(dir.string())) {
    const std::uint64_t free = FreeBytesAt(dir);
    const std::uint64_t file = room.capacity;
    if (free != 0 && file > free) {
      return Status::InvalidArgument(fmt::format(
          "--total-bytes {} needs about {} on the file system of --dir {}, which has {} free; {}",
          FormatBytes(static_cast<double>(a.total_bytes)), FormatBytes(static_cast<double>(file)), dir.string(),
          FormatBytes(static_cast<double>(free)), NvmeRoomAdvice(a, free)));
    }
  }
  return Status::Ok();
}

// --dir: absent, a directory or a block device; --index-dir: absent or a directory.
Status CheckBenchPaths(const BenchArgs& a, const std::filesystem::path& dir) {
  if (!IsBlockDevice(dir.string())) TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(dir, "--dir"));
  if (!a.index_dir.empty()) TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(a.index_dir, "--index-dir"));
  return CheckNvmePaths(dir.string(), a.index_dir);
}

// A leftover of an earlier run that was killed before it could clean up: a directory holding only
// a Terrace store and the bench's marker (an index directory: the marker). Removed, with a note.
// The marker beside anything else is refused naming that entry, and nothing is removed.
Status RemoveLeftovers(const BenchArgs& a, const std::filesystem::path& dir) {
  std::error_code ec;
  if (IsOwnedStoreOrLeftover(dir, kBenchMarker)) {
    TERRACE_ASSIGN_OR_RETURN(bool removed, RemoveOwnedStore(dir, kBenchMarker, "--dir", "terrace bench tiers"));
    if (removed) std::filesystem::remove(dir, ec);
    fmt::print(stderr, "bench: removed '{}', left behind by an earlier 'terrace bench tiers' run that did not finish "
               "(it holds the bench's {})\n", dir.string(), kBenchMarker);
  } else if (IsKind(dir, S_IFDIR) && IsKind(dir / kBenchMarker, S_IFREG)) {
    // The leftover of a killed run that also holds something else: that entry is the reason it is
    // not removed (CheckDirContents could only say the folder is not the bench's).
    std::string why = NonStoreEntry(dir, kBenchMarker, "--dir");
    if (why.empty()) why = fmt::format("--dir {} holds what is not a Terrace store", dir.string());
    return Status::InvalidArgument(fmt::format(
        "{}, beside the bench's {} of an earlier 'terrace bench tiers' run that did not finish; the bench removes "
        "only its own store, so nothing was removed (move that entry out, or give another --dir)",
        why, kBenchMarker));
  }
  if (!a.index_dir.empty()) {
    const std::filesystem::path idx(a.index_dir);
    struct stat st {};
    if (::lstat(idx.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && DescribePathKind(idx / kBenchMarker) == "a regular file") {
      // Only the marker and index files, and no run still using them (RocksDB holds a write lock on
      // LOCK while the index is open): anything else is not the bench's to remove.
      if (std::optional<long> pid = IndexLockHolder(idx)) {
        return Status::InvalidArgument(fmt::format(
            "--index-dir {} holds the bench's {} and an index that another process (pid {}) has open right now; "
            "nothing was removed (wait for that run to finish, or give another --index-dir)",
            idx.string(), kBenchMarker, *pid));
      }
      if (std::optional<std::filesystem::path> foreign = ForeignIndexEntry(idx, kBenchMarker)) {
        return Status::InvalidArgument(fmt::format(
            "--index-dir {} holds the bench's {} and also '{}', which an index never holds; nothing was removed "
            "(move that entry out, or give another --index-dir)",
            idx.string(), kBenchMarker, foreign->filename().string()));
      }
      fmt::print(stderr, "bench: removing '{}', an index directory left behind by an earlier 'terrace bench tiers' "
                 "run that did not finish (it holds the bench's {})\n", idx.string(), kBenchMarker);
      std::filesystem::remove_all(idx, ec);
      if (ec) return Status::IoError(fmt::format("--index-dir {}: cannot remove the leftover: {}", idx.string(), ec.message()));
    }
  }
  return Status::Ok();
}

// What --dir of an NVMe run holds before the bench opens it: nothing (absent or empty: a new store),
// or a store an earlier --keep run made (reopened; *reopened set). A store without the kept
// marker, or other files, is refused with InvalidArgument naming --dir: the bench would write its
// blocks into it. A block device (the flag names the whole device) is refused when it holds a
// Terrace store, for the same reason; the tier itself refuses to format one that is not blank.
Status CheckDirContents(const std::filesystem::path& dir, bool* reopened) {
  *reopened = false;
  std::error_code ec;
  if (IsBlockDevice(dir.string())) {
    auto unit = ReadSuperblockUnit(dir, /*follow_symlinks=*/true);
    if (unit.ok() && nvme::Superblock::SlotsHaveMagic(*unit)) {
      return Status::InvalidArgument(fmt::format(
          "--dir {} is a block device that holds a Terrace store; the bench writes and erases its own blocks in the "
          "store it opens, so it leaves this one alone: give a blank device, or a new or empty directory (a store "
          "an earlier run kept with --keep is not told apart from others: if it is yours to lose, clear the device "
          "with 'blkdiscard -z {}')",
          dir.string(), dir.string()));
    }
    return Status::Ok();
  }
  if (!std::filesystem::exists(dir, ec) || std::filesystem::is_empty(dir, ec)) return Status::Ok();
  if (IsOwnedStore(dir, kBenchKeptMarker)) {
    *reopened = true;
    return Status::Ok();
  }
  if (IsKind(dir / kBenchKeptMarker, S_IFREG)) {  // a kept store beside something else: name that
    if (std::string why = NonStoreEntry(dir, kBenchKeptMarker, "--dir"); !why.empty()) {
      return Status::InvalidArgument(fmt::format(
          "{}, beside the store that 'terrace bench tiers --keep' made ({}); the bench reuses only a folder holding "
          "nothing but that store, so it leaves this one alone: move that entry out, or give a new or empty --dir",
          why, kBenchKeptMarker));
    }
  }
  // A Terrace data file by its magic (IsStoreDataFile), not by its name: a terrace.data of anything
  // else is just an entry that makes the folder not empty.
  const std::filesystem::path data = dir / "terrace.data";
  if (IsStoreDataFile(data)) {
    return Status::InvalidArgument(fmt::format(
        "--dir {} holds a Terrace store that 'terrace bench tiers --keep' did not create (no {}); the bench writes "
        "and erases its own blocks in the store it opens, so it leaves this one alone: give a new or empty --dir",
        dir.string(), kBenchKeptMarker));
  }
  return Status::InvalidArgument(fmt::format("--dir {} is not empty and holds no store of the bench{}; give a new or "
                                             "empty directory (the bench removes what it creates there)",
                                             dir.string(),
                                             StoreDataExists(dir) ? " (its terrace.data is not a Terrace data file)" : ""));
}

int RunBenchTiers(const BenchArgs& a) {
  StopSignals stop_signals;  // workers stop, the tier closes and what the bench created is removed
  if (a.host_prefault_given && a.tier != "host") {
    return FailUsage(fmt::format("--host-prefault applies to --tier host only (got --tier {}); drop it", a.tier));
  }
  if (a.host_stream_gets_given && a.tier != "host") {
    return FailUsage(fmt::format("--host-stream-gets applies to --tier host only (got --tier {}); drop it", a.tier));
  }
  if (a.host_huge_pages_given && a.tier != "host") {
    return FailUsage(fmt::format("--host-huge-pages applies to --tier host only (got --tier {}); drop it", a.tier));
  }
  if (!a.nvme_flags_given.empty() && a.tier != "nvme") {
    return FailUsage(fmt::format("{} {} to --tier nvme only (got --tier {}); drop {}",
                                 fmt::join(a.nvme_flags_given, ", "), a.nvme_flags_given.size() == 1 ? "applies" : "apply",
                                 a.tier, a.nvme_flags_given.size() == 1 ? "it" : "them"));
  }
  if (a.total_bytes < a.block_size) {
    return FailUsage(fmt::format("--total-bytes {} is less than one --block-size {}; raise --total-bytes",
                                 FormatBytes(static_cast<double>(a.total_bytes)),
                                 FormatBytes(static_cast<double>(a.block_size))));
  }
  if (a.total_bytes % a.block_size != 0) {
    const std::uint64_t moved = a.total_bytes / a.block_size * a.block_size;
    fmt::print(stderr, "bench: --total-bytes {} is not a multiple of --block-size {}: each pass moves {} ({} whole "
               "blocks); the {} left over is not moved\n",
               FormatBytes(static_cast<double>(a.total_bytes)), FormatBytes(static_cast<double>(a.block_size)),
               FormatBytes(static_cast<double>(moved)), a.total_bytes / a.block_size,
               FormatBytes(static_cast<double>(a.total_bytes - moved)));
  }
  std::filesystem::path dir = a.dir.empty() ? std::filesystem::path("terrace-bench") : std::filesystem::path(a.dir);
  if (a.tier == "nvme") {
    if (Status s = CheckBenchPaths(a, dir); !s.ok()) return FailUsage(s.message());
    if (Status s = RemoveLeftovers(a, dir); !s.ok()) return s.IsInvalidArgument() ? FailUsage(s.message()) : Fail(s.ToString());
  }
  bool reopened = false;  // --dir holds the store an earlier --keep run made
  if (a.tier == "nvme") {
    if (Status s = CheckDirContents(dir, &reopened); !s.ok()) return FailUsage(s.message());
  }
  if (Status s = CheckBenchSizes(a, dir); !s.ok()) return FailUsage(s.message());
  // Declared before the tier, so it runs after the tier is closed, on every return path.
  RemoveCreatedDirs cleanup;
  bool created_dir = false, created_index = false;
  if (a.tier == "nvme" && !a.keep) {
    created_dir = cleanup.Add(dir, "--dir", /*index=*/false);
    if (!a.index_dir.empty()) created_index = cleanup.Add(a.index_dir, "--index-dir", /*index=*/true);
  }
  const std::uint64_t blocks = a.total_bytes / a.block_size;
  AlignedBuffer payload_buf(a.block_size);
  if (!payload_buf.ok()) {
    return Fail(fmt::format("cannot allocate one --block-size {} buffer; lower --block-size",
                            FormatBytes(static_cast<double>(a.block_size))));
  }
  std::span<const std::byte> payload = payload_buf.span();
  FillPattern(7, BenchKey(0), payload_buf.span());
  BlockDesc desc = DescribeBlock(payload);
  // The memcpy baseline faults its buffers in before the tier opens: built after, it would give a
  // --host-prefault background thread a head start, and the "fresh tier" puts would land on memory
  // already faulted in.
  std::unique_ptr<MemcpyBaseline> baseline;  // memory tiers; null when its buffer cannot be allocated
  if (a.tier != "nvme") {
    baseline = std::make_unique<MemcpyBaseline>(payload, blocks * a.block_size, a.op != "write",
                                                static_cast<unsigned>(a.BlocksPerCall()));
    if (!baseline->ok()) baseline.reset();
  }
  if (a.tier == "nvme" && !reopened && !IsBlockDevice(dir.string())) {
    // The file is preallocated whole: say how large before it is made (a tiny --total-bytes of tiny
    // blocks still takes 64 MiB and 8 KiB a block).
    const BenchRoom room = RoomFor(a);
    fmt::print(stderr, "bench: creating the NVMe tier's data file {} of {} ({} bytes: {} blocks x {} KiB on disk, "
               "plus an eighth and 64 MiB)\n", (dir / "terrace.data").string(),
               FormatBytes(static_cast<double>(room.capacity)), room.capacity, room.blocks, room.per_block / kKiB);
  }
  const auto open0 = Clock::now();
  auto tier_or = MakeTier(a, dir);
  const double open_seconds = SecondsSince(open0);
  if (!tier_or.ok()) {
    // InvalidArgument: what the flags asked for cannot be done with this --dir (a usage error).
    const Status& s = tier_or.status();
    store_cmd::StoreWords w;  // the bench sizes its store from --total-bytes: it has no --capacity
    w.capacity_flag = "--total-bytes";
    w.lower_capacity = "give a smaller --total-bytes (the bench sizes its store from it)";
    return s.IsInvalidArgument() ? FailUsage(store_cmd::InCliWords(s.message(), w))
                                 : Fail(store_cmd::InCliWords(s.ToString(), w));
  }
  std::unique_ptr<Tier> tier = std::move(*tier_or);
  if (a.tier == "nvme" && !a.keep && IsBlockDevice(dir.string())) {
    const auto* formatted = dynamic_cast<const NvmeTier*>(tier.get());
    if (formatted != nullptr && formatted->recovery_report().created) cleanup.AddFormattedDevice(dir);
  }
  if (created_dir && !IsBlockDevice(dir.string())) {
    if (Status s = WriteMarker(dir, kBenchMarker, "terrace bench tiers"); !s.ok()) return Fail(s.ToString());
  }
  if (created_index) {
    if (Status s = WriteMarker(a.index_dir, kBenchMarker, "terrace bench tiers"); !s.ok()) return Fail(s.ToString());
  }
  if (a.tier == "nvme" && a.keep && !reopened && !IsBlockDevice(dir.string())) {
    if (Status s = WriteMarker(dir, kBenchKeptMarker, "terrace bench tiers --keep"); !s.ok()) return Fail(s.ToString());
  }

  fmt::print(stderr, "bench: {} tier{}, {} {} x {} blocks, queue depth {}, {} thread(s)\n", a.tier,
             tier->caps().emulated ? " (emulated)" : "", a.op, blocks, FormatBytes(static_cast<double>(a.block_size)),
             a.queue_depth, a.threads);
  auto seq = [](std::uint64_t i) { return i; };
  std::vector<std::uint64_t> order(a.op == "randread" ? blocks : 0);
  std::mt19937_64 rng(1);
  for (auto& o : order) o = rng() % blocks;
  auto rand = [&](std::uint64_t i) { return order[i]; };
  // Allocated and faulted in once, before the first pass: every pass (the first included) reads into
  // memory that is already mapped, like the memcpy baseline's destination.
  auto read_buffers = AllocateReadBuffers(a);
  if (!read_buffers.ok()) return Fail(read_buffers.status().ToString());
  const ReadBuffers& outs = *read_buffers;
  // The NVMe tier's per-I/O latency over the timed passes only (not the warm-up passes, the prep
  // writes or the emptying between write passes): each timed pass adds its own I/Os' samples.
  const NvmeTier* nvme = a.tier == "nvme" ? dynamic_cast<const NvmeTier*>(tier.get()) : nullptr;
  if (a.tier == "nvme" && nvme == nullptr) return Fail("bench: the NVMe tier is not an NvmeTier; no latency to report");
  const auto nvme_latency = [&]() -> const LatencyHistogram& {
    return a.op == "write" ? nvme->write_latency() : nvme->read_latency();
  };
  LatencyHistogram timed_latency;
  // One pass of the measured operation; `batch`/`threads` 0: the flags' values; `timed`: its NVMe
  // latency samples go to timed_latency.
  bool written = false;  // some write pass ran: the NVMe tier holds every block
  auto one_pass = [&](unsigned batch, unsigned threads, std::uint64_t ops, bool timed) -> Result<BenchResult> {
    if (a.op == "write" && a.tier == "nvme" && written) {
      // Untimed: the NVMe tier is sized for one copy of each block, and an overwrite needs a new
      // extent before the old one is freed, so every write pass starts from an empty tier.
      for (std::uint64_t i = 0; i < blocks; ++i) TERRACE_RETURN_IF_ERROR(tier->Erase(BenchKey(i)));
      TERRACE_RETURN_IF_ERROR(tier->Flush());
    }
    written = true;
    LatencyHistogram before;
    if (timed && nvme) before.MergeFrom(nvme_latency());
    Result<BenchResult> r = a.op == "write" ? RunOps(*tier, a, true, ops, seq, payload, desc, outs, batch, threads)
                            : a.op == "read" ? RunOps(*tier, a, false, ops, seq, payload, desc, outs, batch, threads)
                                             : RunOps(*tier, a, false, ops, rand, payload, desc, outs, batch, threads);
    if (timed && nvme) AddSamplesSince(nvme_latency(), before, &timed_latency);
    return r;
  };
  std::vector<BenchResult> passes;
  BenchResult single{};  // memory tiers: the per-operation latency pass
  std::uint64_t prep_writes = 0;  // blocks written (untimed) before a read pass; 0 when a kept store held them
  std::vector<double> memcpy_passes;  // one after each timed pass
  auto run_op = [&]() -> Result<BenchResult> {
    if (a.op != "write" && HoldsDataSet(*tier, blocks, desc)) {
      // A store kept by an earlier run (--keep) with these blocks: read the same data set again, as
      // fio rereads its file, instead of rewriting it before every run.
      fmt::print(stderr, "bench: the kept store in --dir holds the {} blocks already; reading them\n", blocks);
    } else if (a.op != "write") {
      fmt::print(stderr, "bench: writing {} blocks first (not timed)\n", blocks);
      TERRACE_RETURN_IF_ERROR(RunOps(*tier, a, true, blocks, seq, payload, desc, outs).status());
      prep_writes = blocks;
    }
    for (unsigned w = 0; w < a.warmup; ++w) {
      fmt::print(stderr, "bench: warm-up pass {}/{} (not timed)\n", w + 1, a.warmup);
      TERRACE_RETURN_IF_ERROR(one_pass(0, 0, blocks, false).status());
    }
    for (unsigned p = 0; p < a.repeat; ++p) {
      fmt::print(stderr, "bench: timed pass {}/{}\n", p + 1, a.repeat);
      TERRACE_ASSIGN_OR_RETURN(BenchResult r1, one_pass(0, 0, blocks, true));
      passes.push_back(r1);
      if (baseline) memcpy_passes.push_back(baseline->Pass());
    }
    if (a.tier != "nvme") {
      fmt::print(stderr, "bench: per-operation latency pass (single-operation calls, not in MB/s)\n");
      TERRACE_ASSIGN_OR_RETURN(single, one_pass(1, 1, std::min<std::uint64_t>(blocks, 4096), false));
    }
    return MedianPass(passes);
  };
  Result<BenchResult> r = StopSignalReceived() != 0 ? Result<BenchResult>(Status::Cancelled("interrupted")) : run_op();
  TierStatsSnapshot stats = tier->Stats();
  // Closed here, not by the destructor: a failed close (the final commit, the index flush) fails
  // the run. The memory tiers have nothing to close.
  const Status closed = nvme != nullptr ? static_cast<NvmeTier*>(tier.get())->Close() : Status::Ok();
  tier.reset();
  cleanup.Run();
  const int close_rc = closed.ok() ? 0 : store_cmd::FailStatus(closed);
  if (const int sig = StopSignalReceived(); sig != 0) {
    fmt::print(stderr, "bench: stopped by {}{}\n", StopSignalName(sig),
               created_dir || created_index ? "; removed what it created" : "");
    return 128 + sig;
  }
  if (!r.ok() && r.status().IsOutOfCapacity() && a.tier == "nvme") {
    return Fail(fmt::format("the NVMe store in --dir {} is full ({} of {} allocated to blocks): lower --total-bytes "
                            "or give a new --dir (a store kept by --keep keeps the size it was made with)",
                            dir.string(), FormatBytes(static_cast<double>(stats.allocated_bytes)),
                            FormatBytes(static_cast<double>(stats.capacity_bytes))));
  }
  if (!r.ok() && r.status().IsOutOfCapacity() && a.tier != "nvme") {
    // RoomFor sizes a memory tier for every block and a rewritten copy per worker; should it still
    // run out, say so in this command's flags (it has no --capacity).
    std::string m(r.status().message());
    for (std::string_view advice : {"; evict blocks or raise capacity_bytes", "; store it in a larger tier or split it"}) {
      if (std::size_t pos = m.find(advice); pos != std::string::npos) m.erase(pos, advice.size());
    }
    return Fail(fmt::format("{}; the bench made the {} tier {} for --total-bytes {} in blocks of --block-size {} and a "
                            "rewritten copy per worker: lower --block-size or --total-bytes",
                            m, a.tier, FormatBytes(static_cast<double>(stats.capacity_bytes)),
                            FormatBytes(static_cast<double>(a.total_bytes)),
                            FormatBytes(static_cast<double>(a.block_size))));
  }
  if (!r.ok()) return store_cmd::FailStatus(r.status());
  if (close_rc != 0) return close_rc;

  const double bytes = static_cast<double>(r->ops * a.block_size);
  const double mbps = bytes / 1e6 / r->seconds, iops = static_cast<double>(r->ops) / r->seconds;
  double p50 = single.p50_us, p99 = single.p99_us;
  // Memory tiers: the median memcpy pass, and the median of (pass / the memcpy pass right after it).
  // Unmeasured (the NVMe tier, or no baseline buffer): null in JSON, not printed in text.
  std::optional<double> memcpy_mbps, ratio_vs_memcpy;
  if (!memcpy_passes.empty()) {
    std::vector<double> ratios;
    for (std::size_t i = 0; i < passes.size() && i < memcpy_passes.size(); ++i) {
      ratios.push_back(static_cast<double>(passes[i].ops * a.block_size) / 1e6 / passes[i].seconds / memcpy_passes[i]);
    }
    memcpy_mbps = Median(memcpy_passes);
    ratio_vs_memcpy = Median(ratios);
  }
  double min_mbps = mbps, max_mbps = mbps;
  std::vector<double> pass_mbps;
  for (const BenchResult& p : passes) {
    const double m = static_cast<double>(p.ops * a.block_size) / 1e6 / p.seconds;
    pass_mbps.push_back(m);
    min_mbps = std::min(min_mbps, m);
    max_mbps = std::max(max_mbps, m);
  }
  if (a.tier == "nvme") {  // the tier's per-I/O latency over the timed passes
    p50 = static_cast<double>(timed_latency.Percentile(0.5)) / 1e3;
    p99 = static_cast<double>(timed_latency.Percentile(0.99)) / 1e3;
  }
  if (a.json) {
    nlohmann::json j = {{"tier", a.tier},         {"op", a.op},
                        {"block_size", a.block_size}, {"queue_depth", a.queue_depth},
                        {"threads", a.threads}, {"batch", a.BatchSize()},   {"total_bytes", r->ops * a.block_size},
                        {"total_bytes_requested", a.total_bytes},
                        {"seconds", r->seconds},  {"mb_per_s", mbps},
                        {"iops", iops},           {"p50_us", p50},
                        {"p99_us", p99},          {"emulated", stats.emulated},
                        {"durability", a.tier == "nvme" ? a.durability : ""}, {"flush_seconds", r->flush_seconds},
                        {"open_seconds", open_seconds}, {"host_prefault", a.tier == "host" ? a.host_prefault : ""},
                        {"host_huge_pages", a.tier == "host" ? a.host_huge_pages : ""},
                        {"host_stream_gets", a.tier == "host" ? a.host_stream_gets : ""},
                        {"warmup", a.warmup}, {"repeat", a.repeat}, {"memcpy_mb_per_s", memcpy_mbps ? nlohmann::json(*memcpy_mbps) : nlohmann::json()}, {"passes_mb_per_s", pass_mbps},
                        {"memcpy_passes_mb_per_s", memcpy_passes}, {"ratio_vs_memcpy", ratio_vs_memcpy ? nlohmann::json(*ratio_vs_memcpy) : nlohmann::json()},
                        {"memcpy_baseline", baseline ? nlohmann::json(baseline->what()) : nlohmann::json()},
                        {"min_mb_per_s", min_mbps}, {"max_mb_per_s", max_mbps},
                        {"latency", a.tier == "nvme" ? "per-io (tier)" : "per-op (single-operation calls)"},
                        {"latency_samples", a.tier == "nvme" ? timed_latency.count() : single.ops},
                        {"user_us_per_op", r->user_seconds * 1e6 / static_cast<double>(r->ops)},
                        {"sys_us_per_op", r->sys_seconds * 1e6 / static_cast<double>(r->ops)},
                        {"prep_writes", prep_writes}, {"detail", stats.detail}};
    fmt::print("{}\n", JsonText(j));
  } else {
    // The latency columns say what they measured: the NVMe tier's per-I/O time at the queue depth
    // (submit to completion, queueing included), the memory tiers' separate pass of single calls.
    const std::string lat = a.tier == "nvme" ? fmt::format("us/io at qd {}", a.queue_depth) : "us/op, single calls";
    Table t({"tier", "op", "block", "qd", "moved/pass", "MB/s (median)", "MB/s min-max", "IOPS", "p50 " + lat,
             "p99 " + lat});
    t.Add({stats.emulated ? a.tier + " (emulated)" : a.tier, a.op, FormatBytes(static_cast<double>(a.block_size)),
           std::to_string(a.queue_depth), FormatBytes(bytes), fmt::format("{:.0f}", mbps),
           fmt::format("{:.0f}-{:.0f}", min_mbps, max_mbps), fmt::format("{:.0f}", iops),
           fmt::format("{:.1f}", p50), fmt::format("{:.1f}", p99)});
    fmt::print("{}", t.Render());
    if (bytes != static_cast<double>(a.total_bytes)) {
      fmt::print("moved {} a pass, not --total-bytes {}: {} whole blocks of --block-size {} (the {} left over is "
                 "not moved)\n",
                 FormatBytes(bytes), FormatBytes(static_cast<double>(a.total_bytes)), r->ops,
                 FormatBytes(static_cast<double>(a.block_size)),
                 FormatBytes(static_cast<double>(a.total_bytes) - bytes));
    }
    fmt::print("latency: {}\n", a.tier == "nvme"
                                    ? fmt::format("the NVMe tier's per-I/O time, submit to completion, with {} I/Os "
                                                  "in flight (queueing included)", a.queue_depth)
                                    : "a separate pass of single-operation calls, one at a time (not the timed "
                                      "passes' batches)");
    if (!stats.detail.empty()) fmt::print("{}: {}\n", a.tier, stats.detail);
    fmt::print("tier open ({}): {:.2f} s, not in MB/s\n",
               reopened ? "reopening the kept store" : a.tier == "host" ? "create, with any populate" : "create",
               open_seconds);
    if (memcpy_mbps && ratio_vs_memcpy) {
      fmt::print("memcpy of {}, a pass after each timed pass: {:.0f} MB/s (median); median of pass / memcpy: "
                 "{:.2f}x\n", baseline->what(), *memcpy_mbps, *ratio_vs_memcpy);
    }
  }
  return 0;
}

}  // namespace

void RegisterBench(CLI::App& app, Runner* run) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto a = std::make_shared<BenchArgs>();
  auto* tiers = bench->add_subcommand("tiers", "Throughput, IOPS and p50/p99 latency of one tier");
  tiers->add_option("--tier", a->tier, "host | nvme | hbm")->check(CLI::IsMember({"host", "nvme", "hbm"}))
      ->capture_default_str();
  tiers->add_option("--op", a->op, "write | read | randread (reads write the data first, untimed)")
      ->check(CLI::IsMember({"write", "read", "randread"}))->capture_default_str();
  AddSizeOption(tiers, "--block-size", &a->block_size,
                "Block size (--tier hbm without a CUDA device: at most 256 MiB, the emulated tier's largest block)", 1,
                kMaxBlockBytes);
  AddIntOption(tiers, "--queue-depth", &a->queue_depth, 1u, 4096u,
               "NVMe I/Os in flight (ring depth); for memory tiers the default batch size");
  AddSizeOption(tiers, "--total-bytes", &a->total_bytes,
                "Bytes moved per pass, in whole --block-size blocks (a remainder is not moved; the output says what "
                "was). Memory tiers hold it in RAM, with room to rewrite one block per --threads worker. nvme: the "
                "data file in --dir is preallocated at blocks x (--block-size rounded up to 4 KiB, plus 4 KiB) plus "
                "an eighth plus 64 MiB (--block-size 1 --total-bytes 64KiB: 640 MiB); its size goes to stderr "
                "before it is created",
                1, kMaxTotalBytes);
  auto* dir_opt = tiers->add_option("--dir", a->dir, "NVMe tier directory or block device (default ./terrace-bench). On a block device "
                                     "the tier uses the whole device and needs --index-dir; the device must be blank (its "
                                     "first and last MiB zero) and is cleared again afterwards (unless --keep). A directory the bench created is marked (terrace-bench.marker) and removed afterwards, also on "
                                     "SIGINT/SIGTERM; the next run removes a marked leftover of a killed run")->transform(NormalizedPath());
  auto* index_dir_opt = tiers->add_option("--index-dir", a->index_dir, "NVMe index (RocksDB) directory on a persistent file system; "
                                                 "required when --dir is a block device (default: <dir>/index). "
                                                 "Removed afterwards if the bench created it")->transform(NormalizedPath());
  auto* durability_opt = tiers->add_option("--durability", a->durability, "NVMe durability: async | sync")
      ->check(CLI::IsMember({"async", "sync"}))->capture_default_str();
  AddIntOption(tiers, "--batch", &a->batch, 1u, 65536u,
               "Operations per PutBatch / GetBatch call (default: for nvme 8 x queue depth or 64 MiB of blocks, "
               "whichever is more, at most 4096 blocks; else --queue-depth). A read worker's buffer holds this many "
               "blocks, or all of them when --total-bytes has fewer");
  AddIntOption(tiers, "--threads", &a->threads, 1u, 256u, "Concurrent workers (nvme: one io_uring ring each)");
  AddIntOption(tiers, "--warmup", &a->warmup, 0u, 100u,
               "Untimed passes before the timed ones (0: time the first touch of a fresh tier)");
  AddIntOption(tiers, "--repeat", &a->repeat, 1u, 100u,
               "Timed passes; MB/s and IOPS are the median pass (an even count: the mean of the two middle passes)");
  auto* keep_opt = tiers->add_flag("--keep", a->keep,
                  "Keep the NVMe directory and index directory the bench created (marked with "
                  "terrace-bench-kept.marker: a later run reuses them and never removes them; a store without "
                  "that marker is refused). A read run on a kept store that holds its blocks reads them "
                  "without writing them first");
  AddHostPrefaultOption(tiers, &a->host_prefault,
                    "Host tier: when its memory is faulted in. on: each new arena chunk on a background thread, "
                    "alongside the puts; off: on the putting thread (when a pinned chunk is added, else on first "
                    "touch); background: the whole capacity from open, on a background thread the puts never wait "
                    "for; eager: the whole capacity before the first put (open_seconds says how long). background "
                    "and eager hold the whole capacity in RAM (locked when pinned) from open")
      ->each([a](const std::string&) { a->host_prefault_given = true; });
  AddHostHugePagesOption(tiers, &a->host_huge_pages)->each([a](const std::string&) { a->host_huge_pages_given = true; });
  AddHostStreamGetsOption(tiers, &a->host_stream_gets)->each([a](const std::string&) { a->host_stream_gets_given = true; });
  tiers->add_flag("--json", a->json, "Print one JSON object (mb_per_s, iops, p50_us, p99_us, ...)");
  tiers->callback([run, a, dir_opt, index_dir_opt, durability_opt, keep_opt] {
    for (const CLI::Option* o : {dir_opt, index_dir_opt, durability_opt, keep_opt}) {
      if (o->count() > 0) a->nvme_flags_given.push_back(o->get_name());
    }
    *run = [a] { return RunBenchTiers(*a); };
  });
  RegisterBenchKv(bench, run);
  RegisterBenchExperts(bench, run);
  RegisterBenchStore(bench, run);
}

}  // namespace terrace::cli
