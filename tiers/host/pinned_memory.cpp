#include "tiers/host/pinned_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace terrace::tiers {

int CudaDeviceCount() {
  static const int count = cuda_host::DeviceCount();
  return count;
}

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
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status::OutOfCapacity(fmt::format("mmap of a {} MiB host chunk failed: {}; lower the host tier "
                                             "capacity_bytes or free memory",
                                             bytes >> 20, std::strerror(errno)));
  }
  chunk.data = static_cast<std::byte*>(p);
#ifdef MADV_HUGEPAGE
  if (options.huge_pages) (void)madvise(p, bytes, MADV_HUGEPAGE);  // fewer TLB misses; advisory only
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
