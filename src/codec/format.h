// The encoded block's header (docs/kv-codecs.md, "Byte layout"). Little-endian hosts only.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "terrace/codec.h"

namespace terrace::codec::detail {

static_assert(std::endian::native == std::endian::little, "the codec format is defined for little-endian hosts");

inline constexpr std::size_t kHeaderBytes = 64;
inline constexpr unsigned char kMagic[4] = {'T', 'K', 'V', 'C'};
inline constexpr std::uint8_t kFormatVersion = 1;

// Field offsets in the header.
inline constexpr std::size_t kOffVersion = 4, kOffKind = 5, kOffScales = 6, kOffLossless = 7, kOffGroup = 8,
                             kOffReserved = 10, kOffScaleCount = 12, kOffRows = 16, kOffCols = 24,
                             kOffRawBytes = 32, kOffStoredBytes = 40, kOffHeaderCheck = 48, kOffPad = 52;

// FNV-1a (32-bit) over header bytes [0, 48): any single changed byte changes it.
inline std::uint32_t HeaderCheck(const unsigned char* h) {
  std::uint32_t v = 2166136261u;
  for (std::size_t i = 0; i < kOffHeaderCheck; ++i) v = (v ^ h[i]) * 16777619u;
  return v;
}

// Largest finite value of each quantised format: the scale is amax / kQmax.
inline constexpr float kFp8Max = 448.0f, kInt8Max = 127.0f, kInt4Max = 7.0f;
// A scale below the smallest normal fp32 (2^-126) is stored as 0: the channel encodes as zeros.
inline constexpr float kMinScale = 1.17549435e-38f;

// Scale count and raw (pre-lossless) payload size for a valid spec and shape; n = rows * cols.
std::uint64_t ScaleCount(const CodecSpec& spec, std::uint64_t rows, std::uint64_t cols);
std::uint64_t RawPayloadBytes(CodecKind kind, std::uint64_t n);

}  // namespace terrace::codec::detail
