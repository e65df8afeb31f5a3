// KV / state codecs: fp32 tensors [rows, cols] to a self-describing byte block and back.
//
// Codecs: passthrough f32 / bf16 / f16; FP8 E4M3 ("fn": no infinities, max 448) with one scale per
// block or per channel; INT8 with one scale per channel; INT4 with one scale per group of 32 or 64
// consecutive values of a row. Channels are columns. An optional lossless stage (zstd or lz4)
// compresses the quantised payload. The byte format, the scale rule and the rounding rule are in
// docs/kv-codecs.md; in short: rounding is to nearest, ties to even, everywhere; a scale is
// amax / qmax in fp32 (qmax = 448, 127, 7); a scale of zero means "every value of this channel /
// group / block is zero" and decodes to zeros; non-finite input (NaN, +-Inf, or a bf16/f16 value
// that rounds past the format's largest finite value) is refused with InvalidArgument naming the
// row and column.
//
// Thread-safety: every function is pure and may be called from any thread concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::codec {

enum class CodecKind : std::uint8_t { kF32, kBf16, kF16, kFp8E4M3, kInt8, kInt4 };
enum class ScaleMode : std::uint8_t { kNone, kPerBlock, kPerChannel, kGroup };
enum class Lossless : std::uint8_t { kNone, kZstd, kLz4 };

struct CodecSpec {
  CodecKind kind = CodecKind::kF32;
  ScaleMode scales = ScaleMode::kNone;   // fp8: kPerBlock or kPerChannel; int8: kPerChannel; int4: kGroup
  int group = 0;                          // int4: 32 or 64
  Lossless lossless = Lossless::kNone;
  // "f32" "bf16" "f16" "fp8" (= fp8 per-channel) "fp8-block" "int8" "int4-g32" "int4-g64", each with an
  // optional "+zstd" / "+lz4" suffix. InvalidArgument listing the valid names otherwise.
  static Result<CodecSpec> Parse(std::string_view name);
  std::string Name() const;               // inverse of Parse
  double NominalBytesPerValue() const;    // 4, 2, 2, 1, 1, 0.5 (before scales and lossless)
};

// Encodes row-major fp32 x [rows, cols] ("channels" are columns). The output is self-describing:
// a small header (magic, format version, codec, rows, cols, scale layout) then scales then payload,
// then (if lossless) the whole payload compressed. Thread-safe, pure.
// InvalidArgument: an invalid spec (a combination Parse cannot produce), x.size() != rows * cols,
// negative rows / cols, non-finite input (the message names the row and column).
// `out` is replaced (not appended to).
Status Encode(const CodecSpec& spec, std::span<const float> x, std::int64_t rows, std::int64_t cols,
              std::vector<std::byte>* out);
// An upper bound of Encode's output size for this spec and shape (exact without a lossless stage).
std::uint64_t MaxEncodedBytes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols);
// Decodes into out (rows*cols floats); rows/cols must match the header. Corruption naming what is
// wrong for a bad magic/version/size/shape; never reads past `encoded`.
// InvalidArgument when out.size() != rows * cols. On error `out`'s contents are unspecified.
Status Decode(std::span<const std::byte> encoded, std::int64_t rows, std::int64_t cols, std::span<float> out);

}  // namespace terrace::codec
