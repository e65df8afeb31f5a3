// The cases both device-codec tests run: test_codec_cuda (the kernels on a GPU) and
// cuda_emulation_test.cpp in test_codec (the same kernel bodies run on the CPU). A Backend encodes
// and decodes host vectors its own way; every check compares it with terrace::codec::Encode /
// Decode, bit for bit. Inputs: random values whose channels span 2^-30..2^30 plus rows of edge
// values (zeros of both signs, all-equal groups, exact int4 ties, subnormals, values whose group
// scale is zero, values at the top of each format's range), shapes whose rows and int4 groups end
// mid-byte, and non-finite inputs (which both must refuse).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "terrace/codec.h"

namespace terrace_device_codec_cases {

using terrace::codec::CodecKind;
using terrace::codec::CodecSpec;

inline constexpr std::size_t kHeaderBytes = 64;
inline const char* const kCodecs[] = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64"};
// Rows and int4 groups that end mid-byte (odd cols, odd counts), widths that are not multiples of
// the group, empty shapes, and enough rows for every edge row below.
inline const std::pair<std::int64_t, std::int64_t> kShapes[] = {{1, 1},  {1, 33},  {3, 31},  {9, 100}, {11, 65},
                                                                {16, 64}, {37, 576}, {64, 129}, {0, 9},   {5, 0}};

// A scale, the payload and the non-finite flag, as a device encoder leaves them.
struct Encoded {
  std::vector<float> scales;
  std::vector<std::uint8_t> payload;
  bool nonfinite = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* Name() const = 0;
  // Encodes x [rows, cols] (spec without a lossless stage).
  virtual Encoded Encode(const CodecSpec& spec, const std::vector<float>& x, std::int64_t rows, std::int64_t cols) = 0;
  virtual std::vector<float> Decode(const CodecSpec& spec, const std::vector<float>& scales,
                                    const std::vector<std::uint8_t>& payload, std::int64_t rows, std::int64_t cols) = 0;
};

inline CodecSpec SpecOf(const char* name) {
  auto s = CodecSpec::Parse(name);
  REQUIRE(s.ok());
  return *s;
}

// The largest finite input the codec accepts, and one that sits just below its overflow point.
inline float TopValue(CodecKind kind) {
  if (kind == CodecKind::kF16) return std::bit_cast<float>(0x477FEFFFu);   // 65519.996: rounds to 65504
  if (kind == CodecKind::kBf16) return std::bit_cast<float>(0x7F7F7FFFu);  // rounds to bf16's largest finite
  return std::numeric_limits<float>::max();
}

// Row r's pattern is r % 8: 0 random; 1 one positive value repeated; 2 one negative value repeated;
// 3 int4 ties (each group starts with 7, so its scale is 1, then odd halves); 4 tiny and subnormal
// values (every int4 group's amax is below 7 * 2^-126: a zero scale of a non-zero group); 5 huge
// values up to TopValue (scales at their cap); 6 negative zeros; 7 f16 subnormal ties and values
// around the fp8 subnormal step. Column 0 is zero in every row (a zero channel); with more than
// two columns, the last one holds only tiny values (a zero fp8 / int8 channel scale).
inline std::vector<float> CaseInput(const CodecSpec& spec, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(rows * 131 + cols));
  std::normal_distribution<float> nd;
  const bool f16 = spec.kind == CodecKind::kF16;
  std::uniform_real_distribution<float> mag(f16 ? -20.0f : -30.0f, f16 ? 12.0f : 30.0f);
  std::vector<float> colmag(static_cast<std::size_t>(cols));
  for (auto& m : colmag) m = std::exp2(mag(rng));
  const float top = TopValue(spec.kind);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      float v = nd(rng) * colmag[static_cast<std::size_t>(c)];
      switch (r % 8) {
        case 1: v = 3.25f; break;
        case 2: v = -1.0e-3f; break;
        case 3: v = c % 32 == 0 ? 7.0f : static_cast<float>((c * 5) % 14 - 7) + 0.5f; break;
        case 4: {
          const float tiny[] = {1e-38f, -3e-39f, 1e-45f, 8e-38f, -5e-38f};
          v = tiny[static_cast<std::size_t>(c) % 5];
          break;
        }
        case 5: v = (c % 3 == 1 ? top : std::ldexp(top, -static_cast<int>(c % 7))) * (c % 2 ? -1.0f : 1.0f); break;
        case 6: v = -0.0f; break;
        case 7: {
          const float small[] = {std::ldexp(1.0f, -25), std::ldexp(3.0f, -25), -std::ldexp(5.0f, -25),
                                 std::ldexp(1.0f, -10), -std::ldexp(3.0f, -10), std::ldexp(1.0f, -6)};
          v = small[static_cast<std::size_t>(c) % 6];
          break;
        }
        default: break;
      }
      if (c == 0) v = 0.0f;
      if (cols > 2 && c == cols - 1) v = (r % 2 ? -1.0f : 1.0f) * std::ldexp(1.0f + static_cast<float>(r % 5), -130);
      if (f16 && std::fabs(v) > top) v = std::copysign(top, v);
      x[static_cast<std::size_t>(r * cols + c)] = v;
    }
  }
  return x;
}

inline std::string What(const Backend& b, const char* codec, std::int64_t rows, std::int64_t cols) {
  return std::string(b.Name()) + " " + codec + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

// Device encode == CPU encode (scales and payload bytes); the device's bytes under the CPU header
// decode on the CPU; device decode of the CPU's block == CPU decode. Over `shapes` (kShapes by default).
inline void CheckMatchesCpu(Backend& b, std::span<const std::pair<std::int64_t, std::int64_t>> shapes = kShapes) {
  for (auto [rows, cols] : shapes) {
    for (const char* name : kCodecs) {
      for (std::uint64_t seed : {1u, 2u}) {
        INFO(What(b, name, rows, cols) << " seed " << seed);
        const CodecSpec spec = SpecOf(name);
        const auto x = CaseInput(spec, rows, cols, seed);
        std::vector<std::byte> cpu;
        const terrace::Status st = terrace::codec::Encode(spec, x, rows, cols, &cpu);
        INFO(st.ToString());
        REQUIRE(st.ok());
        std::vector<float> cpu_dec(x.size());
        REQUIRE(terrace::codec::Decode(cpu, rows, cols, cpu_dec).ok());

        const Encoded dev = b.Encode(spec, x, rows, cols);
        CHECK_FALSE(dev.nonfinite);
        const std::size_t sbytes = 4 * dev.scales.size();
        REQUIRE(cpu.size() == kHeaderBytes + sbytes + dev.payload.size());
        CHECK((sbytes == 0 || std::memcmp(dev.scales.data(), cpu.data() + kHeaderBytes, sbytes) == 0));
        CHECK((dev.payload.empty() ||
               std::memcmp(dev.payload.data(), cpu.data() + kHeaderBytes + sbytes, dev.payload.size()) == 0));

        std::vector<std::byte> mixed(cpu.begin(), cpu.begin() + kHeaderBytes);
        const auto* sp = reinterpret_cast<const std::byte*>(dev.scales.data());
        const auto* pp = reinterpret_cast<const std::byte*>(dev.payload.data());
        mixed.insert(mixed.end(), sp, sp + sbytes);
        mixed.insert(mixed.end(), pp, pp + dev.payload.size());
        std::vector<float> mixed_dec(x.size());
        REQUIRE(terrace::codec::Decode(mixed, rows, cols, mixed_dec).ok());
        CHECK((x.empty() || std::memcmp(mixed_dec.data(), cpu_dec.data(), 4 * x.size()) == 0));

        std::vector<float> scales(dev.scales.size());
        if (sbytes) std::memcpy(scales.data(), cpu.data() + kHeaderBytes, sbytes);
        std::vector<std::uint8_t> payload(dev.payload.size());
        if (!payload.empty()) std::memcpy(payload.data(), cpu.data() + kHeaderBytes + sbytes, payload.size());
        const auto dec = b.Decode(spec, scales, payload, rows, cols);
        REQUIRE(dec.size() == x.size());
        CHECK((x.empty() || std::memcmp(dec.data(), cpu_dec.data(), 4 * x.size()) == 0));
      }
    }
  }
}

// Decoding payloads of random codes (every code the CPU Decode accepts: int8 -128, int4 -8, fp8 and
// f16 subnormals...) under random scales, against the CPU Decode of the same block.
inline void CheckDecodesAnyValidPayload(Backend& b) {
  const std::int64_t rows = 13, cols = 77;  // odd count: int4 padding nibble
  std::mt19937_64 rng(99);
  for (const char* name : kCodecs) {
    INFO(What(b, name, rows, cols));
    const CodecSpec spec = SpecOf(name);
    std::vector<std::byte> block;
    REQUIRE(terrace::codec::Encode(spec, CaseInput(spec, rows, cols, 3), rows, cols, &block).ok());
    std::uint32_t nscales = 0;
    std::memcpy(&nscales, block.data() + 12, 4);
    std::vector<float> scales(nscales);
    for (auto& s : scales) s = rng() % 5 == 0 ? 0.0f : std::ldexp(static_cast<float>(rng() % 1000 + 1), static_cast<int>(rng() % 200) - 130);
    std::vector<std::uint8_t> payload(block.size() - kHeaderBytes - 4 * nscales);
    for (std::size_t i = 0; i < payload.size(); ++i) {
      std::uint8_t v = static_cast<std::uint8_t>(rng());
      if (spec.kind == CodecKind::kFp8E4M3 && (v & 0x7F) == 0x7F) v = 0x7E;                         // not NaN
      if ((spec.kind == CodecKind::kF16 && i % 2 == 1 && (v & 0x7C) == 0x7C) ||                      // not Inf / NaN
          (spec.kind == CodecKind::kBf16 && i % 2 == 1 && (v & 0x7F) == 0x7F))
        v = static_cast<std::uint8_t>(v & 0xBF);
      if (spec.kind == CodecKind::kF32 && i % 4 == 3 && (v & 0x7F) == 0x7F) v = 0x3F;
      payload[i] = v;
    }
    if (spec.kind == CodecKind::kInt4) payload.back() &= 0x0F;  // the padding nibble of an odd count
    if (nscales) std::memcpy(block.data() + kHeaderBytes, scales.data(), 4 * nscales);
    std::memcpy(block.data() + kHeaderBytes + 4 * nscales, payload.data(), payload.size());
    std::vector<float> cpu_dec(static_cast<std::size_t>(rows * cols));
    const terrace::Status st = terrace::codec::Decode(block, rows, cols, cpu_dec);
    INFO(st.ToString());
    REQUIRE(st.ok());
    const auto dec = b.Decode(spec, scales, payload, rows, cols);
    REQUIRE(dec.size() == cpu_dec.size());
    CHECK(std::memcmp(dec.data(), cpu_dec.data(), 4 * dec.size()) == 0);
  }
}

// Every input the CPU Encode refuses (NaN, +-Inf anywhere, a bf16 / f16 value past the largest
// finite one) sets the device's non-finite flag.
inline void CheckFlagsWhatCpuRefuses(Backend& b) {
  const std::int64_t rows = 5, cols = 67;
  for (const char* name : kCodecs) {
    const CodecSpec spec = SpecOf(name);
    std::vector<float> bad = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
    if (spec.kind == CodecKind::kF16) bad.insert(bad.end(), {65520.0f, -1e6f});
    if (spec.kind == CodecKind::kBf16) bad.push_back(std::bit_cast<float>(0x7F7F8000u));  // rounds to Inf
    for (float v : bad) {
      for (std::int64_t at : {std::int64_t{0}, cols - 1, 3 * cols + 40, 2 * cols + 65, rows * cols - 1}) {  // incl. the short int4 groups
        INFO(What(b, name, rows, cols) << " value " << v << " at " << at);
        auto x = CaseInput(spec, rows, cols, 4);
        x[static_cast<std::size_t>(at)] = v;
        std::vector<std::byte> cpu;
        REQUIRE(terrace::codec::Encode(spec, x, rows, cols, &cpu).IsInvalidArgument());
        CHECK(b.Encode(spec, x, rows, cols).nonfinite);
      }
    }
  }
}

}  // namespace terrace_device_codec_cases
