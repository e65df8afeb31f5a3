#include "tiers/host/stream_copy.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "tiers/host/fast_checksum.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define TERRACE_STREAM_COPY_X86 1
#endif

namespace terrace::tiers {
namespace {

constexpr std::size_t kLine = 64;  // streaming stores write whole cache lines from here on

// Below this a streaming kernel is a plain memcpy: too few whole lines to pay for the fence.
constexpr std::size_t kMinStreamBytes = 4 * kLine;

#ifdef TERRACE_STREAM_COPY_X86

// The streaming kernels are one body (StreamBody) over an ISA's vector move: an unaligned load and
// an aligned streaming store of kWidth bytes. Each kernel is StreamBody instantiated inside a
// function compiled for its ISA; `flatten` inlines the moves there (a move compiled for AVX2
// cannot be inlined into a function compiled without it, so the body itself carries no target).
struct Sse2Move {
  static constexpr std::size_t kWidth = 16;
  static void Move(std::byte* dst, const std::byte* src) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
};
struct Avx2Move {
  static constexpr std::size_t kWidth = 32;
  __attribute__((target("avx2"))) static void Move(std::byte* dst, const std::byte* src) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
};

// memcpy up to the first 64-byte boundary of dst, stream whole steps of four moves of the body
// (unaligned loads, aligned streaming stores), memcpy the rest. No fence: the caller sfences.
template <typename V>
inline void StreamBody(std::byte* dst, const std::byte* src, std::size_t n) {
  const std::size_t head = (kLine - (reinterpret_cast<std::uintptr_t>(dst) & (kLine - 1))) & (kLine - 1);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  constexpr std::size_t kW = V::kWidth, kStep = 4 * kW;
  const std::size_t body = n / kStep * kStep;
  for (std::size_t i = 0; i < body; i += kStep) {
    V::Move(dst + i, src + i);
    V::Move(dst + i + kW, src + i + kW);
    V::Move(dst + i + 2 * kW, src + i + 2 * kW);
    V::Move(dst + i + 3 * kW, src + i + 3 * kW);
  }
  std::memcpy(dst + body, src + body, n - body);
}

__attribute__((flatten)) void StreamSse2(std::byte* dst, const std::byte* src, std::size_t n) {
  StreamBody<Sse2Move>(dst, src, n);
}
__attribute__((target("avx2"), flatten)) void StreamAvx2(std::byte* dst, const std::byte* src, std::size_t n) {
  StreamBody<Avx2Move>(dst, src, n);
}

// `k` is kSse2 or kAvx2 (supported), n >= kMinStreamBytes.
void StreamUnfenced(CopyKernel k, std::byte* dst, const std::byte* src, std::size_t n) {
  if (k == CopyKernel::kAvx2) {
    StreamAvx2(dst, src, n);
  } else {
    StreamSse2(dst, src, n);
  }
}

#endif  // TERRACE_STREAM_COPY_X86

}  // namespace

bool CopyKernelSupported(CopyKernel k) {
  switch (k) {
    case CopyKernel::kMemcpy:
      return true;
#ifdef TERRACE_STREAM_COPY_X86
    case CopyKernel::kSse2:
      return true;  // part of x86-64
    case CopyKernel::kAvx2: {
      static const bool avx2 = __builtin_cpu_supports("avx2");  // checks the OS saves the AVX state too
      return avx2;
    }
#else
    case CopyKernel::kSse2:
    case CopyKernel::kAvx2:
      return false;
#endif
  }
  return false;
}

CopyKernel BestStreamKernel() {
  static const CopyKernel best = CopyKernelSupported(CopyKernel::kAvx2)   ? CopyKernel::kAvx2
                                 : CopyKernelSupported(CopyKernel::kSse2) ? CopyKernel::kSse2
                                                                          : CopyKernel::kMemcpy;
  return best;
}

void CopyWith(CopyKernel k, void* dst, const void* src, std::size_t n) {
  if (n < kMinStreamBytes || k == CopyKernel::kMemcpy || !CopyKernelSupported(k)) {
    if (n > 0) std::memcpy(dst, src, n);
    return;
  }
#ifdef TERRACE_STREAM_COPY_X86
  StreamUnfenced(k, static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), n);
  _mm_sfence();
#endif
}

void CopyForPut(void* dst, const void* src, std::size_t n) {
  CopyWith(n >= kStreamCopyMinBytes ? BestStreamKernel() : CopyKernel::kMemcpy, dst, src, n);
}

std::uint64_t CopyForPutAndChecksum(void* dst, const void* src, std::size_t n) {
  const CopyKernel k = n >= kStreamCopyMinBytes ? BestStreamKernel() : CopyKernel::kMemcpy;
  const auto* s = static_cast<const std::byte*>(src);
  if (k == CopyKernel::kMemcpy) {
    if (n > 0) std::memcpy(dst, src, n);
    return FastChecksum(s, n);
  }
#ifdef TERRACE_STREAM_COPY_X86
  // Each piece is hashed right after it is streamed, from the source lines the copy just loaded
  // into L1; one fence at the end (a fence per piece measured slower than hashing first).
  constexpr std::size_t kPiece = 4 * 1024;
  auto* d = static_cast<std::byte*>(dst);
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (std::size_t off = 0; off < n; off += kPiece) {
    const std::size_t len = std::min(kPiece, n - off);
    if (len >= kMinStreamBytes) {
      StreamUnfenced(k, d + off, s + off, len);
    } else {
      std::memcpy(d + off, s + off, len);
    }
    XXH3_64bits_update(&state, s + off, len);
  }
  _mm_sfence();
  return XXH3_64bits_digest(&state);
#else
  return 0;  // unreachable: no streaming kernel is supported off x86-64
#endif
}

namespace {
// "32768K", "1M" or "524288" (the sysfs cache size format) in bytes; 0 if unreadable.
std::uint64_t ParseCacheSize(const std::string& text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc()) return 0;
  const char unit = end < text.data() + text.size() ? *end : '\0';
  if (unit == 'K') return v << 10;
  if (unit == 'M') return v << 20;
  if (unit == 'G') return v << 30;
  return v;
}
}  // namespace

std::uint64_t LastLevelCacheBytes() {
  static const std::uint64_t bytes = [] {
    std::uint64_t best = 0;
    for (int i = 0; i < 8; ++i) {
      std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
      std::string text;
      if (f >> text) best = std::max(best, ParseCacheSize(text));
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (best == 0) {
      const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
      if (l3 > 0) best = static_cast<std::uint64_t>(l3);
    }
#endif
    return best;
  }();
  return bytes;
}

std::uint64_t ChecksumAndStream(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const CopyKernel k = n >= kStreamCopyMinBytes ? BestStreamKernel() : CopyKernel::kMemcpy;
  if (k == CopyKernel::kMemcpy) return ChecksumAndCopy(d, s, n);
#ifdef TERRACE_STREAM_COPY_X86
  // As ChecksumAndCopy: the hash's loads bring each piece into L1, then the piece is streamed out.
  const std::uint64_t sum =
      HashEachPieceThenCopy(d, s, n, 8 * 1024, [k](std::byte* pd, const std::byte* ps, std::size_t len) {
        if (len >= kMinStreamBytes) {
          StreamUnfenced(k, pd, ps, len);
        } else {
          std::memcpy(pd, ps, len);
        }
      });
  _mm_sfence();
  return sum;
#else
  return 0;  // unreachable: no streaming kernel is supported off x86-64
#endif
}

}  // namespace terrace::tiers
