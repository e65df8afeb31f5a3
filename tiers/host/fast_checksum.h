// Internal: the block checksum (XXH3-64, seed 0: the same value as terrace::Checksum) computed with
// xxHash's run-time CPU dispatch (AVX2 / AVX-512 where present, about 2x the SSE2 baseline), and a
// copy fused with it. Include this instead of <xxhash.h> in the tiers' data paths.
#pragma once

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>  // redefines XXH3_64bits / XXH3_64bits_update to the dispatching versions
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace terrace::tiers {

inline std::uint64_t FastChecksum(const std::byte* data, std::size_t n) { return XXH3_64bits(data, n); }

// Copies n bytes from src to dst and returns their checksum, hashing each piece right after it is
// copied, while it is still in cache (one pass over memory instead of two).
inline std::uint64_t CopyAndChecksum(std::byte* dst, const std::byte* src, std::size_t n) {
  constexpr std::size_t kPiece = 4 * 1024;  // a page: measured best on EPYC (docs/benchmarks.md)
  if (n <= kPiece) {
    if (n > 0) std::memcpy(dst, src, n);
    return XXH3_64bits(dst, n);
  }
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (std::size_t off = 0; off < n; off += kPiece) {
    const std::size_t len = std::min(kPiece, n - off);
    std::memcpy(dst + off, src + off, len);
    XXH3_64bits_update(&state, dst + off, len);
  }
  return XXH3_64bits_digest(&state);
}

// Hashes each `piece`-byte piece of src where it lies, then copy(dst + off, src + off, len) copies
// it from cache; returns the XXH3-64 of all n bytes. The loop behind ChecksumAndCopy and
// ChecksumAndStream.
template <typename Copy>
inline std::uint64_t HashEachPieceThenCopy(std::byte* dst, const std::byte* src, std::size_t n, std::size_t piece,
                                           Copy copy) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (std::size_t off = 0; off < n; off += piece) {
    const std::size_t len = std::min(piece, n - off);
    XXH3_64bits_update(&state, src + off, len);
    copy(dst + off, src + off, len);
  }
  return XXH3_64bits_digest(&state);
}

// Returns the checksum of n bytes at src and copies them to dst: each piece is hashed where it
// lies, then copied while it is still in cache. The checksum covers the source bytes (a get's
// verification of the tier's copy); src must not change during the call. On a DRAM-bound read
// this runs at 0.88x memcpy against 0.74x for CopyAndChecksum (one 2 GiB pass, Xeon with
// AVX-512, docs/benchmarks.md): the hash's loads pull the lines in, the copy then reads cache.
inline std::uint64_t ChecksumAndCopy(std::byte* dst, const std::byte* src, std::size_t n) {
  constexpr std::size_t kPiece = 8 * 1024;
  if (n <= kPiece) {
    const std::uint64_t sum = XXH3_64bits(src, n);
    if (n > 0) std::memcpy(dst, src, n);
    return sum;
  }
  return HashEachPieceThenCopy(dst, src, n, kPiece,
                               [](std::byte* d, const std::byte* s, std::size_t len) { std::memcpy(d, s, len); });
}

}  // namespace terrace::tiers
