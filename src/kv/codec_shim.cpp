// TEMPORARY (see codec_shim.h): passthrough codecs until w/codec lands.
#include "src/kv/codec_shim.h"

#include <cstring>

#include <fmt/format.h>

#include "terrace/model_tensor.h"

namespace terrace::codec {
namespace {
constexpr std::uint32_t kMagic = 0x4d485354;  // "TSHM"
constexpr std::size_t kHeader = 24;           // magic u32, kind u32, rows u64, cols u64
std::size_t ValueBytes(CodecKind k) { return k == CodecKind::kF32 ? 4 : 2; }
}  // namespace

Result<CodecSpec> CodecSpec::Parse(std::string_view name) {
  std::string_view base = name;
  Lossless lossless = Lossless::kNone;
  if (auto p = name.find('+'); p != std::string_view::npos) {
    base = name.substr(0, p);
    const auto suffix = name.substr(p + 1);
    if (suffix == "zstd") lossless = Lossless::kZstd;
    else if (suffix == "lz4") lossless = Lossless::kLz4;
    else base = "?";
  }
  CodecSpec s;
  s.lossless = lossless;
  if (base == "f32") s.kind = CodecKind::kF32;
  else if (base == "bf16") s.kind = CodecKind::kBf16;
  else if (base == "f16") s.kind = CodecKind::kF16;
  else if (base == "fp8") { s.kind = CodecKind::kFp8E4M3; s.scales = ScaleMode::kPerChannel; }
  else if (base == "fp8-block") { s.kind = CodecKind::kFp8E4M3; s.scales = ScaleMode::kPerBlock; }
  else if (base == "int8") { s.kind = CodecKind::kInt8; s.scales = ScaleMode::kPerChannel; }
  else if (base == "int4-g32") { s.kind = CodecKind::kInt4; s.scales = ScaleMode::kGroup; s.group = 32; }
  else if (base == "int4-g64") { s.kind = CodecKind::kInt4; s.scales = ScaleMode::kGroup; s.group = 64; }
  else {
    return Status::InvalidArgument(fmt::format(
        "unknown codec '{}'; valid: f32, bf16, f16, fp8, fp8-block, int8, int4-g32, int4-g64 (optionally +zstd or +lz4)",
        name));
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
    case CodecKind::kInt4: n = group == 64 ? "int4-g64" : "int4-g32"; break;
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
  return 4;
}

std::uint64_t MaxEncodedBytes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols) {
  return kHeader + static_cast<std::uint64_t>(rows * cols) * ValueBytes(spec.kind);
}

Status Encode(const CodecSpec& spec, std::span<const float> x, std::int64_t rows, std::int64_t cols,
              std::vector<std::byte>* out) {
  if (spec.kind != CodecKind::kF32 && spec.kind != CodecKind::kBf16 && spec.kind != CodecKind::kF16)
    return Status::InvalidArgument(fmt::format("codec '{}' is not built yet (temporary shim: f32, bf16, f16)", spec.Name()));
  if (spec.lossless != Lossless::kNone)
    return Status::InvalidArgument("lossless stages are not built yet (temporary shim)");
  if (rows < 0 || cols < 0 || x.size() != static_cast<std::size_t>(rows * cols))
    return Status::InvalidArgument("codec: x.size() != rows * cols");
  out->assign(MaxEncodedBytes(spec, rows, cols), std::byte{0});
  std::byte* p = out->data();
  const std::uint32_t magic = kMagic, kind = static_cast<std::uint32_t>(spec.kind);
  const std::uint64_t r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &kind, 4);
  std::memcpy(p + 8, &r, 8);
  std::memcpy(p + 16, &c, 8);
  p += kHeader;
  if (spec.kind == CodecKind::kF32) {
    std::memcpy(p, x.data(), x.size_bytes());
  } else {
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::uint16_t v = spec.kind == CodecKind::kBf16 ? model::FloatToBf16(x[i]) : model::FloatToF16(x[i]);
      std::memcpy(p + 2 * i, &v, 2);
    }
  }
  return Status::Ok();
}

Status Decode(std::span<const std::byte> encoded, std::int64_t rows, std::int64_t cols, std::span<float> out) {
  if (out.size() != static_cast<std::size_t>(rows * cols)) return Status::InvalidArgument("codec: out.size() != rows * cols");
  if (encoded.size() < kHeader) return Status::Corruption("codec block shorter than its header");
  std::uint32_t magic = 0, kind = 0;
  std::uint64_t r = 0, c = 0;
  std::memcpy(&magic, encoded.data(), 4);
  std::memcpy(&kind, encoded.data() + 4, 4);
  std::memcpy(&r, encoded.data() + 8, 8);
  std::memcpy(&c, encoded.data() + 16, 8);
  if (magic != kMagic) return Status::Corruption("codec block: bad magic");
  if (kind > 2) return Status::Corruption("codec block: unknown codec");
  if (r != static_cast<std::uint64_t>(rows) || c != static_cast<std::uint64_t>(cols))
    return Status::Corruption(fmt::format("codec block: shape [{}, {}], expected [{}, {}]", r, c, rows, cols));
  const std::size_t vb = kind == 0 ? 4 : 2;
  if (encoded.size() != kHeader + out.size() * vb) return Status::Corruption("codec block: wrong size");
  const std::byte* p = encoded.data() + kHeader;
  if (kind == 0) {
    std::memcpy(out.data(), p, out.size_bytes());
  } else {
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t v = 0;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = kind == 1 ? model::Bf16ToFloat(v) : model::F16ToFloat(v);
    }
  }
  return Status::Ok();
}

}  // namespace terrace::codec
