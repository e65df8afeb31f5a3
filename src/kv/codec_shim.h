// TEMPORARY shim of include/terrace/codec.h (owned by w/codec) with the contract's exact names, so
// terrace::kv builds before that branch lands. Passthrough f32 / bf16 / f16 only; the other codec
// names parse but Encode refuses them. Delete this file (and codec_shim.cpp) after merging w/codec
// and include "terrace/codec.h" instead.
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
  ScaleMode scales = ScaleMode::kNone;
  int group = 0;
  Lossless lossless = Lossless::kNone;
  static Result<CodecSpec> Parse(std::string_view name);
  std::string Name() const;
  double NominalBytesPerValue() const;
};

Status Encode(const CodecSpec& spec, std::span<const float> x, std::int64_t rows, std::int64_t cols,
              std::vector<std::byte>* out);
std::uint64_t MaxEncodedBytes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols);
Status Decode(std::span<const std::byte> encoded, std::int64_t rows, std::int64_t cols, std::span<float> out);

}  // namespace terrace::codec
