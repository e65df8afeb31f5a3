// Host memory chunks for the arena tiers: page-aligned, optionally pinned.
//
// Pinning order: cudaHostAlloc when this build has CUDA and a device is present at run time
// (cudaGetDeviceCount > 0); otherwise mmap'ed anonymous memory, mlock'ed when pinning is asked for.
// A refused mlock (RLIMIT_MEMLOCK) is not an error: the chunk stays pageable and says so.
// Thread-safety: free functions; safe to call concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "terrace/status.h"

namespace terrace::tiers {

enum class PinKind : std::uint8_t {
  kCudaHost = 0,  // cudaHostAlloc (page-locked, registered with the CUDA driver)
  kMlock = 1,     // mmap + mlock
  kPageable = 2,  // mmap only (pinning not asked for, or refused)
};

struct HostChunk {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  PinKind kind = PinKind::kPageable;
  std::string pin_note;  // why the chunk is pageable when pinning was asked for; empty otherwise
  // madvise(MADV_HUGEPAGE) succeeded on the chunk (which is then 2 MiB-aligned). Advice only:
  // whether the kernel grants huge pages is known once pages are faulted (AnonHugeBytes).
  bool huge_pages = false;
};

struct HostChunkOptions {
  bool pin = true;
  // With pin: true: mlock faults in and locks every page before the call returns; false: the chunk
  // is locked with mlock2(MLOCK_ONFAULT), its pages are faulted on first touch (or by a Prefaulter)
  // and locked as they are. cudaHostAlloc chunks are always faulted; unpinned chunks never are.
  bool populate = true;
  // mmap'ed chunks: align the chunk to kHugePageBytes and madvise(MADV_HUGEPAGE) it. Advisory:
  // the kernel may still fault 4 KiB pages (fragmented memory, THP "never").
  bool huge_pages = false;
};

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;  // x86-64 / arm64-4K PMD size

// Whether transparent huge pages can back MADV_HUGEPAGE memory: /sys/kernel/mm/transparent_hugepage/
// enabled reads "always" or "madvise". `why` names the mode (or why it could not be read). Cached.
struct ThpSupport {
  bool usable = false;
  std::string why;  // e.g. "THP madvise", "THP never", "no /sys/kernel/mm/transparent_hugepage/enabled"
};
const ThpSupport& TransparentHugePages();

// Bytes of [data, data + bytes) ranges backed by transparent huge pages, from the AnonHugePages
// lines of /proc/self/smaps (each mapping's count capped at its overlap with the ranges, so a
// mapping merged with neighbouring memory is not over-counted beyond the ranges). Reads and parses
// smaps: O(mappings of the process); for stats and tests, not data paths. IoError if unreadable.
struct ByteRange {
  const std::byte* data;
  std::size_t bytes;
};
Result<std::uint64_t> AnonHugeBytes(const std::vector<ByteRange>& ranges);

// Allocates `bytes` (a multiple of the page size) of zero-filled memory. Ownership passes to the
// caller, who frees it with FreeHostChunk.
Result<HostChunk> AllocateHostChunk(std::size_t bytes, const HostChunkOptions& options);

void FreeHostChunk(const HostChunk& chunk);

// What cudaGetDeviceCount said: `count` usable devices; when none, `why_none` says why in CUDA's
// words (e.g. "cudaGetDeviceCount failed: CUDA driver version is insufficient for CUDA runtime
// version (35)"), or that the build has no CUDA.
struct CudaDevices {
  int count = 0;
  std::string why_none;  // empty when count > 0
};

// The CUDA devices usable by this process. Never fails. Probed once, on the first call.
const CudaDevices& CudaDeviceProbe();
// CudaDeviceProbe().count: 0 when the build has no CUDA, there is no driver, or no device.
int CudaDeviceCount();

// CUDA-specific primitives, implemented in pinned_cuda.cpp (CUDA builds) or pinned_nocuda.cpp.
namespace cuda_host {
CudaDevices ProbeDevices();                               // uncached; clears CUDA's sticky error
Status HostAlloc(std::size_t bytes, std::byte** out);     // cudaHostAlloc(portable)
void HostFree(std::byte* p);                              // cudaFreeHost
}  // namespace cuda_host

}  // namespace terrace::tiers
