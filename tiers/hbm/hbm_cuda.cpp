// The CUDA HBM tier (CUDA builds only). Runtime API only (no kernels), so the host compiler builds
// it with the project's full warning set.
#include "tiers/hbm/hbm_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "src/common/clock.h"
#include "src/common/mutex.h"
#include "tiers/host/block_arena.h"
#include "tiers/host/fast_checksum.h"

namespace terrace::tiers {
namespace {

constexpr std::size_t kStageBytes = 8 * 1024 * 1024;  // per staging buffer; two per stream

Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  return Status::IoError(fmt::format("hbm tier: {} failed: {} ({})", what, cudaGetErrorString(err), static_cast<int>(err)));
}

bool IsPinnedHost(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

bool IsDevice(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// One copy stream with two pinned staging buffers; used by one operation at a time (mu).
struct Lane {
  Mutex mu;
  cudaStream_t stream TERRACE_GUARDED_BY(mu) = nullptr;
  std::byte* stage[2] TERRACE_GUARDED_BY(mu) = {nullptr, nullptr};
  cudaEvent_t done[2] TERRACE_GUARDED_BY(mu) = {nullptr, nullptr};
};

class CudaHbmTier final : public Tier {
 public:
  CudaHbmTier(const HbmTierOptions& o, std::uint64_t page_bytes)
      : options_(o),
        arena_(BlockArenaOptions{"hbm", o.capacity_bytes, o.capacity_bytes, page_bytes},
               [](std::uint32_t, std::uint64_t) { return Status::Ok(); }),  // memory is allocated up front
        lanes_(std::max(1u, o.copy_streams)) {}

  ~CudaHbmTier() override {
    (void)cudaSetDevice(options_.device);
    for (Lane& l : lanes_) {
      MutexLock lock(&l.mu);
      if (l.stream) (void)cudaStreamSynchronize(l.stream);
      for (int b = 0; b < 2; ++b) {
        if (l.stage[b]) (void)cudaFreeHost(l.stage[b]);
        if (l.done[b]) (void)cudaEventDestroy(l.done[b]);
      }
      if (l.stream) (void)cudaStreamDestroy(l.stream);
    }
    UnregisterAll();
    if (base_) (void)cudaFree(base_);
  }

  // Page-locks another tier's memory (the host arena) with CUDA, so H2D copies from it are DMA
  // (CopyIn's IsPinnedHost) instead of staged. Regions already registered stay registered until
  // this tier is destroyed (the store destroys its tiers fastest first, so before the host tier
  // unmaps them). Unavailable when CUDA refuses a region (the copies are then staged).
  Status RegisterIoRegions(std::span<const std::span<std::byte>> regions) override {
    MutexLock lock(&regions_mu_);
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    for (std::span<std::byte> r : regions) {
      if (r.empty() || std::find(registered_.begin(), registered_.end(), r.data()) != registered_.end()) continue;
      if (IsPinnedHost(r.data())) continue;  // already page-locked with CUDA (cudaHostAlloc'ed)
      Status st = CudaStatus(cudaHostRegister(r.data(), r.size(), cudaHostRegisterPortable),
                             fmt::format("cudaHostRegister of {} MiB of host-tier memory", r.size() >> 20));
      if (!st.ok()) return Status::Unavailable(st.message());
      registered_.push_back(r.data());
    }
    return Status::Ok();
  }

  Status Init() {
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), fmt::format("cudaSetDevice({})", options_.device)));
    cudaDeviceProp prop{};
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, options_.device), "cudaGetDeviceProperties"));
    device_name_ = prop.name;
    void* p = nullptr;
    Status st = CudaStatus(cudaMalloc(&p, arena_.capacity_bytes()),
                           fmt::format("cudaMalloc of the {} MiB device arena", arena_.capacity_bytes() >> 20));
    if (!st.ok()) return Status::OutOfCapacity(st.message() + "; lower HbmTierOptions::capacity_bytes");
    base_ = static_cast<std::byte*>(p);
    for (Lane& l : lanes_) {
      MutexLock lock(&l.mu);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
      for (int b = 0; b < 2; ++b) {
        void* s = nullptr;
        TERRACE_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&s, kStageBytes, cudaHostAllocPortable), "cudaHostAlloc (staging)"));
        l.stage[b] = static_cast<std::byte*>(s);
        TERRACE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&l.done[b], cudaEventDisableTiming), "cudaEventCreate"));
      }
    }
    caps_.id = TierId::kHbm;
    caps_.name = "hbm";
    caps_.memory = MemoryKind::kDevice;
    caps_.verifies_gets = true;  // the host bytes are hashed after the D2H copy
    caps_.device_buffers = true;  // PutDevice / GetDevice: device-to-device copies
    caps_.capacity_bytes = arena_.capacity_bytes();
    caps_.max_block_bytes = arena_.max_block_bytes();
    return Status::Ok();
  }

  const TierCaps& caps() const override { return caps_; }

  Status Put(const BlockKey& key, const BlockDesc& desc, std::span<const std::byte> data) override {
    if (desc.size != data.size()) {
      return Status::InvalidArgument(fmt::format("hbm tier: put of block {}: desc.size {} != data size {}",
                                                 key.ToString(), desc.size, data.size()));
    }
    const std::uint64_t t0 = SteadyNanos();
    TERRACE_ASSIGN_OR_RETURN(BlockArena::Ticket t, arena_.BeginWrite(key, desc));
    Status st = desc.size ? CopyIn(base_ + arena_.ByteOffset(t.extent), data) : Status::Ok();
    if (!st.ok()) {
      arena_.AbortWrite(t);
      counters_.Add(counters_.io_errors);
      return st.WithContext(fmt::format("put of block {}", key.ToString()));
    }
    TERRACE_RETURN_IF_ERROR(arena_.CommitWrite(key, t));
    counters_.Add(counters_.puts);
    counters_.Add(counters_.bytes_written, desc.size);
    counters_.write_latency.Record(SteadyNanos() - t0);
    return Status::Ok();
  }

  Status Get(const BlockKey& key, std::span<std::byte> out, BlockDesc* desc) override {
    const std::uint64_t t0 = SteadyNanos();
    auto r = arena_.BeginRead(key);
    if (!r.ok()) {
      counters_.Add(counters_.misses);
      return r.status();
    }
    const BlockArena::Ticket t = *r;
    if (out.size() < t.desc.size) {
      arena_.EndRead(key, t, false);
      return Status::InvalidArgument(fmt::format("hbm tier: get of block {}: buffer of {} bytes is smaller than the "
                                                 "block ({} bytes)", key.ToString(), out.size(), t.desc.size));
    }
    std::uint64_t sum = XXH3_64bits(nullptr, 0);
    Status st = t.desc.size ? CopyOut(out.first(t.desc.size), base_ + arena_.ByteOffset(t.extent), &sum) : Status::Ok();
    const bool corrupt = st.ok() && sum != t.desc.checksum;
    arena_.EndRead(key, t, corrupt);
    if (!st.ok()) {
      counters_.Add(counters_.io_errors);
      return st.WithContext(fmt::format("get of block {}", key.ToString()));
    }
    if (corrupt) {
      counters_.Add(counters_.corruptions);
      return Status::Corruption(fmt::format("hbm tier: block {} failed its checksum; it was dropped: fetch it from a "
                                            "lower tier or recompute it", key.ToString()));
    }
    if (desc) *desc = t.desc;
    counters_.Add(counters_.hits);
    counters_.Add(counters_.bytes_read, t.desc.size);
    counters_.read_latency.Record(SteadyNanos() - t0);
    return Status::Ok();
  }

  // Copies just each range out of device memory (CopyOut of [offset, offset + length), not
  // hashed: ranged reads are unverified), under the block's read reference.
  std::vector<Status> GetRangeBatch(std::span<RangeOp> ops) override {
    std::vector<Status> st;
    st.reserve(ops.size());
    for (RangeOp& op : ops) {
      const std::uint64_t t0 = SteadyNanos();
      Status s = arena_.ReadRange(op, [&](const BlockArena::Ticket& t) {
        return CopyOut(op.out.first(op.length), base_ + arena_.ByteOffset(t.extent) + op.offset, nullptr);
      });
      if (s.ok()) {
        counters_.Add(counters_.hits);
        counters_.Add(counters_.bytes_read, op.length);
        counters_.read_latency.Record(SteadyNanos() - t0);
      } else if (s.IsNotFound()) {
        counters_.Add(counters_.misses);
      } else if (!s.IsInvalidArgument()) {
        counters_.Add(counters_.io_errors);
        s = s.WithContext(fmt::format("range read of block {}", op.key.ToString()));
      }
      st.push_back(std::move(s));
    }
    return st;
  }

  // Device buffers: a device-to-device copy into the arena, then the stored bytes hashed through
  // the staging buffers (no device kernel); the caller's buffer is never copied to the host.
  Result<BlockDesc> PutDevice(const BlockKey& key, Codec codec, std::span<const std::byte> device_data) override {
    const std::uint64_t t0 = SteadyNanos();
    BlockDesc desc{device_data.size(), codec, XXH3_64bits(nullptr, 0)};
    TERRACE_ASSIGN_OR_RETURN(BlockArena::Ticket t, arena_.BeginWrite(key, desc));
    std::byte* dev = base_ + arena_.ByteOffset(t.extent);
    Status st = Status::Ok();
    if (desc.size > 0) {
      st = CopyIn(dev, device_data);  // D2D when device_data is a device pointer
      if (st.ok()) st = HashDevice(dev, desc.size, &desc.checksum);
    }
    if (!st.ok()) {
      arena_.AbortWrite(t);
      counters_.Add(counters_.io_errors);
      return st.WithContext(fmt::format("put of block {} from device memory", key.ToString()));
    }
    t.desc = desc;
    TERRACE_RETURN_IF_ERROR(arena_.CommitWrite(key, t));
    counters_.Add(counters_.puts);
    counters_.Add(counters_.bytes_written, desc.size);
    counters_.write_latency.Record(SteadyNanos() - t0);
    return desc;
  }

  // Verifies the stored bytes (hashed from a staged copy), then copies them device to device.
  Status GetDevice(const BlockKey& key, std::span<std::byte> device_out, BlockDesc* desc) override {
    return Get(key, device_out, desc);  // CopyOut takes the device-to-device path for a device pointer
  }

  Result<BlockDesc> Lookup(const BlockKey& key) const override { return arena_.Lookup(key); }
  Status Erase(const BlockKey& key) override { return arena_.Erase(key); }
  Status Pin(const BlockKey& key) override { return arena_.Pin(key); }
  Status Unpin(const BlockKey& key) override { return arena_.Unpin(key); }
  const std::byte* ResidentPtr(const BlockKey& key) const override {
    auto e = arena_.Locate(key);
    return e.ok() ? base_ + arena_.ByteOffset(*e) : nullptr;
  }
  std::uint64_t used_bytes() const override { return arena_.used_bytes(); }
  std::uint64_t allocated_bytes() const override { return arena_.allocated_bytes(); }
  std::uint64_t block_count() const override { return arena_.block_count(); }
  void ForEach(const std::function<void(const BlockKey&, const BlockDesc&)>& fn) const override { arena_.ForEach(fn); }

  TierStatsSnapshot Stats() const override {
    TierStatsSnapshot s = SnapshotCounters(counters_);
    s.name = "hbm";
    s.capacity_bytes = caps_.capacity_bytes;
    s.used_bytes = used_bytes();
    s.allocated_bytes = allocated_bytes();
    s.blocks = block_count();
    s.detail = fmt::format("CUDA device {} ({}); {} copy streams; copies direct from pinned memory {}, staged {}",
                           options_.device, device_name_, lanes_.size(), direct_.load(), staged_.load());
    return s;
  }

 private:
  void UnregisterAll() {
    MutexLock lock(&regions_mu_);
    for (void* p : registered_) (void)cudaHostUnregister(p);
    registered_.clear();
  }

  Lane& PickLane() { return lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size()]; }

  Status CopyIn(std::byte* dev, std::span<const std::byte> src) {
    Lane& l = PickLane();
    MutexLock lock(&l.mu);
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    if (IsDevice(src.data())) {  // a device pointer: device to device, no host bounce
      direct_.fetch_add(1, std::memory_order_relaxed);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev, src.data(), src.size(), cudaMemcpyDeviceToDevice, l.stream), "cudaMemcpyAsync D2D"));
      return CudaStatus(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize (D2D)");
    }
    if (IsPinnedHost(src.data())) {
      direct_.fetch_add(1, std::memory_order_relaxed);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev, src.data(), src.size(), cudaMemcpyHostToDevice, l.stream), "cudaMemcpyAsync H2D"));
      return CudaStatus(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize (H2D)");
    }
    staged_.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t off = 0, i = 0; off < src.size(); off += kStageBytes, ++i) {
      const std::size_t len = std::min(kStageBytes, src.size() - off);
      const int b = static_cast<int>(i & 1);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(l.done[b]), "cudaEventSynchronize (staging)"));
      std::memcpy(l.stage[b], src.data() + off, len);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev + off, l.stage[b], len, cudaMemcpyHostToDevice, l.stream), "cudaMemcpyAsync H2D"));
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(l.done[b], l.stream), "cudaEventRecord"));
    }
    return CudaStatus(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize (H2D)");
  }

  // Copies the device bytes to `out` and returns their XXH3-64 in *sum (null: not hashed).
  Status CopyOut(std::span<std::byte> out, const std::byte* dev, std::uint64_t* sum) {
    Lane& l = PickLane();
    MutexLock lock(&l.mu);
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    if (IsDevice(out.data())) {  // device to device; the checksum from a staged copy of the source
      direct_.fetch_add(1, std::memory_order_relaxed);
      if (sum) TERRACE_RETURN_IF_ERROR(StagedHash(l, dev, out.size(), sum));
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(out.data(), dev, out.size(), cudaMemcpyDeviceToDevice, l.stream), "cudaMemcpyAsync D2D"));
      return CudaStatus(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize (D2D)");
    }
    if (IsPinnedHost(out.data())) {
      direct_.fetch_add(1, std::memory_order_relaxed);
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(out.data(), dev, out.size(), cudaMemcpyDeviceToHost, l.stream), "cudaMemcpyAsync D2H"));
      TERRACE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize (D2H)"));
      if (sum) *sum = XXH3_64bits(out.data(), out.size());
      return Status::Ok();
    }
    staged_.fetch_add(1, std::memory_order_relaxed);
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    const std::size_t pieces = (out.size() + kStageBytes - 1) / kStageBytes;
    Status st = IssueStage(l, dev, out.size(), 0);
    for (std::size_t i = 0; st.ok() && i < pieces; ++i) {
      if (i + 1 < pieces) st = IssueStage(l, dev, out.size(), i + 1);  // its buffer was drained in iteration i - 1
      if (!st.ok()) break;
      const int b = static_cast<int>(i & 1);
      st = CudaStatus(cudaEventSynchronize(l.done[b]), "cudaEventSynchronize (D2H)");
      if (!st.ok()) break;
      const std::size_t off = i * kStageBytes, len = std::min(kStageBytes, out.size() - off);
      std::memcpy(out.data() + off, l.stage[b], len);
      if (sum) XXH3_64bits_update(&state, out.data() + off, len);
    }
    if (!st.ok()) {
      (void)cudaStreamSynchronize(l.stream);  // never leave a copy into the staging buffers in flight
      return st;
    }
    if (sum) *sum = XXH3_64bits_digest(&state);
    return Status::Ok();
  }

  // Starts the D2H copy of piece i (kStageBytes each) of the `size` device bytes at `dev` into
  // staging buffer i % 2, and records its event.
  Status IssueStage(Lane& l, const std::byte* dev, std::size_t size, std::size_t i) TERRACE_REQUIRES(l.mu) {
    const std::size_t off = i * kStageBytes, len = std::min(kStageBytes, size - off);
    const int b = static_cast<int>(i & 1);
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(l.stage[b], dev + off, len, cudaMemcpyDeviceToHost, l.stream), "cudaMemcpyAsync D2H"));
    return CudaStatus(cudaEventRecord(l.done[b], l.stream), "cudaEventRecord");
  }

  // XXH3-64 of `size` device bytes at `dev`, hashed on the host from staged copies (no device
  // kernel): the checksum computed where a copy of the data is, without touching the caller's
  // buffer.
  Status StagedHash(Lane& l, const std::byte* dev, std::size_t size, std::uint64_t* sum) TERRACE_REQUIRES(l.mu) {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    const std::size_t pieces = (size + kStageBytes - 1) / kStageBytes;
    Status st = pieces > 0 ? IssueStage(l, dev, size, 0) : Status::Ok();
    for (std::size_t i = 0; st.ok() && i < pieces; ++i) {
      if (i + 1 < pieces) st = IssueStage(l, dev, size, i + 1);
      if (!st.ok()) break;
      const int b = static_cast<int>(i & 1);
      st = CudaStatus(cudaEventSynchronize(l.done[b]), "cudaEventSynchronize (hash)");
      if (!st.ok()) break;
      const std::size_t off = i * kStageBytes, len = std::min(kStageBytes, size - off);
      XXH3_64bits_update(&state, l.stage[b], len);
    }
    if (!st.ok()) {
      (void)cudaStreamSynchronize(l.stream);
      return st;
    }
    *sum = XXH3_64bits_digest(&state);
    return Status::Ok();
  }

  // Hashes `size` device bytes at `dev` on one lane.
  Status HashDevice(const std::byte* dev, std::size_t size, std::uint64_t* sum) {
    Lane& l = PickLane();
    MutexLock lock(&l.mu);
    TERRACE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    return StagedHash(l, dev, size, sum);
  }

  const HbmTierOptions options_;
  BlockArena arena_;
  std::vector<Lane> lanes_;
  std::atomic<std::size_t> next_lane_{0};
  std::byte* base_ = nullptr;
  std::string device_name_;
  TierCaps caps_;
  mutable TierCounters counters_;
  std::atomic<std::uint64_t> direct_{0}, staged_{0};
  Mutex regions_mu_;
  std::vector<void*> registered_ TERRACE_GUARDED_BY(regions_mu_);  // cudaHostRegister'ed region bases
};

}  // namespace

Result<std::unique_ptr<Tier>> CreateCudaHbmTier(const HbmTierOptions& options) {
  if (options.capacity_bytes < 4096) {
    return Status::InvalidArgument(fmt::format("hbm tier: capacity_bytes {} is below 4 KiB", options.capacity_bytes));
  }
  // Keep the allocator's page table near 4M entries at most: 4 KiB pages up to 16 GiB, larger above.
  std::uint64_t page = std::max<std::uint64_t>(4096, std::bit_ceil(options.capacity_bytes >> 22));
  auto tier = std::make_unique<CudaHbmTier>(options, page);
  TERRACE_RETURN_IF_ERROR(tier->Init().WithContext(fmt::format("hbm tier on CUDA device {}", options.device)));
  return std::unique_ptr<Tier>(std::move(tier));
}

}  // namespace terrace::tiers
