// CodecSpec: names, validation and nominal sizes.
#include <cmath>
#include <limits>
#include <string>

#include "src/codec/format.h"
#include "src/codec/spec_check.h"

namespace terrace::codec {
namespace {

constexpr const char* kValidNames =
    "f32, bf16, f16, fp8, fp8-block, int8, int4-g32, int4-g64, each optionally followed by +zstd or +lz4";

}  // namespace

Result<CodecSpec> CodecSpec::Parse(std::string_view name) {
  CodecSpec s;
  std::string_view base = name;
  if (const auto plus = name.find('+'); plus != std::string_view::npos) {
    const std::string_view suffix = name.substr(plus + 1);
    base = name.substr(0, plus);
    if (suffix == "zstd") {
      s.lossless = Lossless::kZstd;
    } else if (suffix == "lz4") {
      s.lossless = Lossless::kLz4;
    } else {
      return Status::InvalidArgument("unknown codec '" + std::string(name) + "': lossless stage '+" +
                                     std::string(suffix) + "' is not zstd or lz4; valid codecs: " + kValidNames);
    }
  }
  if (base == "f32") {
    s.kind = CodecKind::kF32;
  } else if (base == "bf16") {
    s.kind = CodecKind::kBf16;
  } else if (base == "f16") {
    s.kind = CodecKind::kF16;
  } else if (base == "fp8") {
    s.kind = CodecKind::kFp8E4M3;
    s.scales = ScaleMode::kPerChannel;
  } else if (base == "fp8-block") {
    s.kind = CodecKind::kFp8E4M3;
    s.scales = ScaleMode::kPerBlock;
  } else if (base == "int8") {
    s.kind = CodecKind::kInt8;
    s.scales = ScaleMode::kPerChannel;
  } else if (base == "int4-g32" || base == "int4-g64") {
    s.kind = CodecKind::kInt4;
    s.scales = ScaleMode::kGroup;
    s.group = base == "int4-g32" ? 32 : 64;
  } else {
    return Status::InvalidArgument("unknown codec '" + std::string(name) + "'; valid codecs: " + kValidNames);
  }
  return s;
}

std::string CodecSpec::Name() const {
  std::string n;
  switch (kind) {
    case CodecKind::kF32: n = "f32"; break;
    case CodecKind::kBf16: n = "bf16"; break;
    case CodecKind::kF16: n = "f16"; break;
    case CodecKind::kFp8E4M3: n = scales == ScaleMode::kPerBlock ? "fp8-block" : "fp8"; break;
    case CodecKind::kInt8: n = "int8"; break;
    case CodecKind::kInt4: n = "int4-g" + std::to_string(group); break;
    default: n = "invalid(" + std::to_string(static_cast<int>(kind)) + ")"; break;
  }
  if (lossless == Lossless::kZstd) n += "+zstd";
  if (lossless == Lossless::kLz4) n += "+lz4";
  return n;
}

double CodecSpec::NominalBytesPerValue() const {
  switch (kind) {
    case CodecKind::kF32: return 4;
    case CodecKind::kBf16:
    case CodecKind::kF16: return 2;
    case CodecKind::kFp8E4M3:
    case CodecKind::kInt8: return 1;
    case CodecKind::kInt4: return 0.5;
  }
  return 0;
}

namespace detail {

std::string SpecProblem(CodecKind kind, ScaleMode scales, int group, Lossless lossless) {
  const int k = static_cast<int>(kind), sm = static_cast<int>(scales), l = static_cast<int>(lossless);
  if (k > static_cast<int>(CodecKind::kInt4)) return "codec kind " + std::to_string(k) + " is not 0..5";
  if (l > static_cast<int>(Lossless::kLz4)) return "lossless stage " + std::to_string(l) + " is not 0..2";
  ScaleMode want = ScaleMode::kNone;
  switch (kind) {
    case CodecKind::kF32:
    case CodecKind::kBf16:
    case CodecKind::kF16: want = ScaleMode::kNone; break;
    case CodecKind::kFp8E4M3:
      if (scales != ScaleMode::kPerBlock && scales != ScaleMode::kPerChannel)
        return "fp8 needs per-block or per-channel scales (scale mode " + std::to_string(sm) + ")";
      want = scales;
      break;
    case CodecKind::kInt8: want = ScaleMode::kPerChannel; break;
    case CodecKind::kInt4: want = ScaleMode::kGroup; break;
  }
  if (scales != want)
    return "scale mode " + std::to_string(sm) + " does not fit codec kind " + std::to_string(k) + " (expected " +
           std::to_string(static_cast<int>(want)) + ")";
  if (kind == CodecKind::kInt4 ? (group != 32 && group != 64) : group != 0)
    return "group size " + std::to_string(group) + (kind == CodecKind::kInt4 ? " is not 32 or 64" : " must be 0");
  return {};
}

std::uint64_t ScaleCount(const CodecSpec& spec, std::uint64_t rows, std::uint64_t cols) {
  switch (spec.scales) {
    case ScaleMode::kNone: return 0;
    case ScaleMode::kPerBlock: return 1;
    // A block with no rows holds no value, so it has no channel to scale: [0, cols] writes no scales
    // (not `cols` of them for nothing; Decode still reads the `cols` zero-value scales older builds wrote).
    case ScaleMode::kPerChannel: return rows == 0 ? 0 : cols;
    case ScaleMode::kGroup: {
      const auto g = static_cast<std::uint64_t>(spec.group);
      return rows * ((cols + g - 1) / g);
    }
  }
  return 0;
}

float MaxScale(CodecKind kind) {
  const float limit = kind == CodecKind::kFp8E4M3 ? 448.0f : kind == CodecKind::kInt8 ? 128.0f : 8.0f;
  return std::nextafter(std::numeric_limits<float>::max() / limit, 0.0f);
}

std::uint64_t RawPayloadBytes(CodecKind kind, std::uint64_t n) {
  switch (kind) {
    case CodecKind::kF32: return 4 * n;
    case CodecKind::kBf16:
    case CodecKind::kF16: return 2 * n;
    case CodecKind::kFp8E4M3:
    case CodecKind::kInt8: return n;
    case CodecKind::kInt4: return (n + 1) / 2;
  }
  return 0;
}

}  // namespace detail
}  // namespace terrace::codec
