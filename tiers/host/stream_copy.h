// Internal: the copy of a put into the host arena. Large blocks are copied with non-temporal
// (streaming) stores, which write the destination's cache lines without first reading them
// (read-for-ownership) and without filling the cache with bytes that are not read back soon; small
// blocks use memcpy, whose cached stores win when the destination may still be in cache.
//
// Contract of every function here: copies n bytes from src to dst as std::memcpy does (any
// alignment, any n including 0; the ranges must not overlap) and returns after the bytes are
// globally visible (streaming kernels end with an sfence), so a later release (the arena's mutex
// in CommitWrite) publishes them like plain stores. Thread-safe (no state but the one-time CPU probe).
#pragma once

#include <cstddef>
#include <cstdint>

namespace terrace::tiers {

// Blocks of at least this many bytes are streamed by CopyForPut: above L2, where a 1 MiB copy's
// destination is not in cache when the arena is larger than the L3 (docs/benchmarks.md, "Host tier
// puts: streaming stores").
inline constexpr std::size_t kStreamCopyMinBytes = 256 * 1024;

// The copy kernels. kMemcpy is std::memcpy (every CPU); kSse2 and kAvx2 stream 64 / 128 bytes per
// step into a 64-byte-aligned destination, with memcpy for the unaligned head and the tail.
enum class CopyKernel { kMemcpy, kSse2, kAvx2 };

// True when this CPU (and build) can run `k`: kMemcpy always, kSse2 on x86-64, kAvx2 on x86-64
// CPUs with AVX2 enabled by the OS.
bool CopyKernelSupported(CopyKernel k);

// The fastest supported streaming kernel (kAvx2, else kSse2, else kMemcpy), probed once.
CopyKernel BestStreamKernel();

// Copies with kernel `k`, which must be supported (an unsupported one falls back to memcpy).
void CopyWith(CopyKernel k, void* dst, const void* src, std::size_t n);

// The put copy: BestStreamKernel() for n >= kStreamCopyMinBytes, memcpy below.
void CopyForPut(void* dst, const void* src, std::size_t n);

// CopyForPut that also returns the XXH3-64 checksum of the n bytes (terrace::Checksum's value),
// hashing each 4 KiB piece of src right after copying it, so the bytes are read from memory once.
std::uint64_t CopyForPutAndChecksum(void* dst, const void* src, std::size_t n);

// A get's copy out of the arena into a destination that will not stay in cache anyway (a large
// buffer, or a batch of them: HostTierOptions::stream_get_min_bytes): returns the XXH3-64 of the n
// bytes at src, hashing each 8 KiB piece where it lies and then streaming it to dst, so the copy
// reads the piece from L1 and writes dst without reading it first. n < kStreamCopyMinBytes, or no
// streaming kernel: ChecksumAndCopy. src must not change during the call.
std::uint64_t ChecksumAndStream(void* dst, const void* src, std::size_t n);

// The last-level cache the kernel reports for CPU 0 (the largest
// /sys/devices/system/cpu/cpu0/cache/index*/size, else sysconf), bytes; 0 when neither says.
std::uint64_t LastLevelCacheBytes();

}  // namespace terrace::tiers
