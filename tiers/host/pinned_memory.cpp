#include "tiers/host/pinned_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

namespace terrace::tiers {

const CudaDevices& CudaDeviceProbe() {
  static const CudaDevices probe = cuda_host::ProbeDevices();
  return probe;
}

int CudaDeviceCount() { return CudaDeviceProbe().count; }

Result<HostChunk> AllocateHostChunk(std::size_t bytes, const HostChunkOptions& options) {
  const bool pin = options.pin;
  HostChunk chunk;
  chunk.bytes = bytes;
  if (pin && CudaDeviceCount() > 0) {
    Status st = cuda_host::HostAlloc(bytes, &chunk.data);
    if (st.ok()) {
      std::memset(chunk.data, 0, bytes);
      chunk.kind = PinKind::kCudaHost;
      return chunk;
    }
    chunk.pin_note = st.message() + "; using mmap+mlock instead";
  }
  // Huge pages need 2 MiB-aligned virtual memory: map one huge page more and trim both ends.
  const bool align = options.huge_pages && bytes >= kHugePageBytes;
  const std::size_t map_bytes = align ? bytes + kHugePageBytes : bytes;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    return Status::OutOfCapacity(fmt::format("mmap of a {} MiB host chunk failed: {}; lower the host tier "
                                             "capacity_bytes or free memory",
                                             bytes >> 20, std::strerror(errno)));
  }
  void* p = m;
  if (align) {
    const auto base = reinterpret_cast<std::uintptr_t>(m);
    const std::uintptr_t aligned = (base + kHugePageBytes - 1) & ~std::uintptr_t{kHugePageBytes - 1};
    if (aligned > base) (void)munmap(m, aligned - base);
    if (const std::uintptr_t tail = base + map_bytes - (aligned + bytes); tail > 0) {
      (void)munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    }
    p = reinterpret_cast<void*>(aligned);
  }
  chunk.data = static_cast<std::byte*>(p);
#ifdef MADV_HUGEPAGE
  if (options.huge_pages) chunk.huge_pages = madvise(p, bytes, MADV_HUGEPAGE) == 0;  // advisory only
#endif
  if (!pin) return chunk;
  int rc = options.populate ? mlock(p, bytes) : mlock2(p, bytes, MLOCK_ONFAULT);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS) && !options.populate) rc = mlock(p, bytes);  // kernel without MLOCK_ONFAULT
  if (rc == 0) {
    chunk.kind = PinKind::kMlock;
    return chunk;
  }
  int err = errno;
  rlimit lim{};
  getrlimit(RLIMIT_MEMLOCK, &lim);
  std::string limit = lim.rlim_cur == RLIM_INFINITY ? "unlimited" : fmt::format("{} KiB", lim.rlim_cur >> 10);
  std::string note = fmt::format("mlock refused ({}; RLIMIT_MEMLOCK {}); raise `ulimit -l` to pin", std::strerror(err), limit);
  chunk.pin_note = chunk.pin_note.empty() ? note : chunk.pin_note + "; " + note;
  return chunk;
}

const ThpSupport& TransparentHugePages() {
  static const ThpSupport support = [] {
    ThpSupport s;
    std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    if (!in || !std::getline(in, line)) {
      s.why = "no /sys/kernel/mm/transparent_hugepage/enabled";
      return s;
    }
    // "always [madvise] never": the bracketed word is the mode.
    const auto open = line.find('['), close = line.find(']');
    const std::string mode = open != std::string::npos && close > open ? line.substr(open + 1, close - open - 1) : line;
    s.usable = mode == "always" || mode == "madvise";
    s.why = "THP " + mode;
    return s;
  }();
  return support;
}

Result<std::uint64_t> AnonHugeBytes(const std::vector<ByteRange>& ranges) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return Status::IoError("cannot read /proc/self/smaps to count huge pages");
  std::uint64_t total = 0, overlap = 0;
  std::string line;
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(' ') > line.find('-')) {
      overlap = 0;  // a new mapping: its overlap with the ranges
      for (const ByteRange& r : ranges) {
        const auto a = reinterpret_cast<std::uintptr_t>(r.data), b = a + r.bytes;
        if (a < hi && lo < b) overlap += std::min<std::uintptr_t>(b, hi) - std::max<std::uintptr_t>(a, lo);
      }
    } else if (overlap > 0 && std::sscanf(line.c_str(), "AnonHugePages: %llu kB", &kb) == 1) {
      total += std::min<std::uint64_t>(std::uint64_t{kb} << 10, overlap);
    }
  }
  return total;
}

void FreeHostChunk(const HostChunk& chunk) {
  if (chunk.data == nullptr) return;
  if (chunk.kind == PinKind::kCudaHost) {
    cuda_host::HostFree(chunk.data);
    return;
  }
  if (chunk.kind == PinKind::kMlock) (void)munlock(chunk.data, chunk.bytes);
  (void)munmap(chunk.data, chunk.bytes);
}

}  // namespace terrace::tiers
