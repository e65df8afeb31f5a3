// libFuzzer target for terrace::codec::Decode: any input, decoded at the shape its header claims
// (when small) and at a shape taken from the input's last bytes, must yield OK or Corruption -
// never a crash, an out-of-bounds read (ASan), a hang, or a non-finite decoded value. The input's
// bytes are also encoded as floats with a codec picked from the first byte: that must round-trip.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "terrace/codec.h"

namespace {

constexpr std::uint64_t kMaxValues = 1u << 20;

void DecodeAt(std::span<const std::byte> in, std::uint64_t rows, std::uint64_t cols) {
  if (rows > kMaxValues || cols > kMaxValues || (cols != 0 && rows > kMaxValues / cols)) return;  // a valid caller shape
  std::vector<float> out(rows * cols);
  const terrace::Status s = terrace::codec::Decode(in, static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols), out);
  if (!s.ok()) {
    if (!s.IsCorruption() || s.message().empty()) __builtin_trap();
    return;
  }
  for (float v : out) {
    if (!std::isfinite(v)) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  if (size >= 32) {
    std::uint64_t rows, cols;
    std::memcpy(&rows, data + 16, 8);
    std::memcpy(&cols, data + 24, 8);
    DecodeAt(in, rows, cols);
  }
  if (size >= 2) DecodeAt(in, data[size - 2] % 17, data[size - 1] % 129);

  // Round trip: the input as floats (non-finite ones replaced) through every codec.
  static const char* kNames[] = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64",
                                 "fp8+zstd", "int8+lz4", "bf16+lz4", "int4-g64+zstd"};
  if (size < 1) return 0;
  const auto spec = terrace::codec::CodecSpec::Parse(kNames[data[0] % (sizeof kNames / sizeof kNames[0])]);
  if (!spec.ok()) __builtin_trap();
  std::vector<float> x((size - 1) / 4);
  std::memcpy(x.data(), data + 1, 4 * x.size());
  for (float& v : x) {
    if (!std::isfinite(v) || std::fabs(v) > 6e4f) v = 1.0f;  // f16's range
  }
  const std::int64_t cols = x.empty() ? 0 : 1 + static_cast<std::int64_t>(data[0] >> 4) % static_cast<std::int64_t>(x.size());
  const std::int64_t rows = cols == 0 ? 0 : static_cast<std::int64_t>(x.size()) / cols;
  x.resize(static_cast<std::size_t>(rows * cols));
  std::vector<std::byte> enc;
  if (!terrace::codec::Encode(*spec, x, rows, cols, &enc).ok()) __builtin_trap();
  std::vector<float> back(x.size());
  if (!terrace::codec::Decode(enc, rows, cols, back).ok()) __builtin_trap();
  if (spec->kind == terrace::codec::CodecKind::kF32 && std::memcmp(back.data(), x.data(), 4 * x.size()) != 0)
    __builtin_trap();
  return 0;
}
