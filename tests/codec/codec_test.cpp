// terrace::codec properties: exact f32 round trips, nearest-even bf16/f16, documented error bounds for
// fp8/int8/int4 with scales recomputed here from the rule in docs/kv-codecs.md, lossless stages
// that change nothing, refused non-finite input, and refused damaged blocks.
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "terrace/codec.h"

using namespace terrace;
using namespace terrace::codec;

namespace {

constexpr std::size_t kHeader = 64;

std::vector<float> RandomMatrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed, float spread = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> col_scale(-6.0f, 6.0f);
  std::vector<float> colmul(static_cast<std::size_t>(cols));
  for (auto& m : colmul) m = std::exp2(col_scale(rng) * spread);  // channels of very different magnitude
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) x[r * cols + c] = nd(rng) * colmul[c];
  return x;
}

CodecSpec Spec(const char* name) {
  auto s = CodecSpec::Parse(name);
  REQUIRE(s.ok());
  return *s;
}

std::vector<float> RoundTrip(const CodecSpec& spec, const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                             std::vector<std::byte>* enc_out = nullptr) {
  std::vector<std::byte> enc;
  const Status st = Encode(spec, x, rows, cols, &enc);
  INFO(st.ToString());
  REQUIRE(st.ok());
  REQUIRE(enc.size() <= MaxEncodedBytes(spec, rows, cols));
  std::vector<float> out(x.size(), -12345.0f);
  const Status dst = Decode(enc, rows, cols, out);
  INFO(dst.ToString());
  REQUIRE(dst.ok());
  if (enc_out) *enc_out = std::move(enc);
  return out;
}

std::uint32_t Bits(float f) { return std::bit_cast<std::uint32_t>(f); }

// amax / qmax in fp32, 0 below the smallest normal float (docs/kv-codecs.md "Scales").
float DocScale(float amax, float qmax) {
  const float s = amax / qmax;
  return s < 1.17549435e-38f ? 0.0f : s;
}

const char* kAllNames[] = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64"};

}  // namespace

TEST_CASE("codec names parse and print back; unknown names list the valid ones", "[codec]") {
  for (const char* base : kAllNames) {
    for (const std::string suffix : {"", "+zstd", "+lz4"}) {
      const std::string name = base + suffix;
      auto s = CodecSpec::Parse(name);
      REQUIRE(s.ok());
      CHECK(s->Name() == name);
    }
  }
  CHECK(Spec("fp8").scales == ScaleMode::kPerChannel);
  CHECK(Spec("fp8-block").scales == ScaleMode::kPerBlock);
  CHECK(Spec("int4-g64").group == 64);
  CHECK(Spec("bf16").NominalBytesPerValue() == 2);
  CHECK(Spec("int4-g32+lz4").NominalBytesPerValue() == 0.5);
  for (const char* bad : {"", "fp16", "int4", "int4-g16", "bf16+gzip", "fp8+", "FP8"}) {
    auto s = CodecSpec::Parse(bad);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().IsInvalidArgument());
    CHECK(s.status().message().find("int4-g32") != std::string::npos);
  }
}

TEST_CASE("f32 round trips bit-exactly, including -0 and subnormals", "[codec]") {
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {1, 1}, {3, 7}, {17, 576}}) {
    auto x = RandomMatrix(rows, cols, 7);
    if (!x.empty()) x[0] = -0.0f;
    if (x.size() > 2) x[1] = 1e-42f;
    for (const char* name : {"f32", "f32+zstd", "f32+lz4"}) {
      const auto y = RoundTrip(Spec(name), x, rows, cols);
      REQUIRE(y.size() == x.size());
      REQUIRE((x.empty() || std::memcmp(x.data(), y.data(), 4 * x.size()) == 0));
    }
  }
}

TEST_CASE("bf16 and f16 return the nearest value, ties to even", "[codec]") {
  // Every decoded value must be representable and no representable neighbour may be closer; on a
  // tie the even code wins. Inputs include exact ties and values near the format's edges.
  std::vector<float> x = RandomMatrix(9, 333, 11, 2.0f);
  x.push_back(std::bit_cast<float>(0x3F808000u));   // bf16 tie, even below
  x.push_back(std::bit_cast<float>(0x3F818000u));   // bf16 tie, even above
  x.push_back(1.0f + 0.00048828125f);               // f16 tie (1 + 2^-11)
  x.push_back(65504.0f);
  x.push_back(3e-8f);                                // f16 subnormal range
  x.push_back(-5.9604645e-08f * 1.5f);              // f16: 1.5 ulp of the smallest subnormal
  x.push_back(1e-39f);                               // fp32 subnormal
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  for (const char* name : {"bf16", "f16", "bf16+lz4"}) {
    const bool bf = name[0] == 'b';
    const auto y = RoundTrip(Spec(name), x, 1, n);
    for (std::int64_t i = 0; i < n; ++i) {
      const double xi = x[i], yi = y[i];
      double ulp;
      if (bf) {
        REQUIRE((Bits(y[i]) & 0xFFFFu) == 0);  // representable in bf16
        const int e = std::ilogb(yi == 0 ? x[i] : y[i]);
        ulp = std::ldexp(1.0, std::max(e, -126) - 7);
      } else {
        REQUIRE(static_cast<float>(static_cast<double>(y[i])) == y[i]);
        const int e = yi == 0 ? -14 : std::max(std::ilogb(yi), -14);
        ulp = std::ldexp(1.0, e - 10);
        REQUIRE(std::fmod(std::fabs(yi), std::ldexp(1.0, -24)) == 0);  // a multiple of f16's smallest step
      }
      const double err = std::fabs(xi - yi);
      INFO(name << " i=" << i << " x=" << xi << " y=" << yi << " ulp=" << ulp);
      REQUIRE(err <= ulp / 2);
      if (err == ulp / 2 && yi != 0) {
        // Tie: the chosen value's last mantissa bit is 0.
        const double m = std::fabs(yi) / ulp;
        REQUIRE(std::fmod(m, 2.0) == 0.0);
      }
    }
  }
}

TEST_CASE("fp8, int8 and int4 stay within the documented error bound of their scales", "[codec]") {
  const std::int64_t rows = 33, cols = 200;
  auto x = RandomMatrix(rows, cols, 3);
  for (std::int64_t r = 0; r < rows; ++r) x[r * cols + 5] = 0.0f;  // an all-zero channel
  for (const char* name : {"fp8", "fp8-block", "int8", "int4-g32", "int4-g64", "fp8+zstd", "int8+lz4"}) {
    const CodecSpec spec = Spec(name);
    const auto y = RoundTrip(spec, x, rows, cols);
    const int group = spec.kind == CodecKind::kInt4 ? spec.group : 0;
    const float qmax = spec.kind == CodecKind::kFp8E4M3 ? 448.0f : spec.kind == CodecKind::kInt8 ? 127.0f : 7.0f;
    float block_amax = 0;
    for (float v : x) block_amax = std::max(block_amax, std::fabs(v));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        float amax = 0;
        if (spec.scales == ScaleMode::kPerBlock) {
          amax = block_amax;
        } else if (spec.scales == ScaleMode::kPerChannel) {
          for (std::int64_t rr = 0; rr < rows; ++rr) amax = std::max(amax, std::fabs(x[rr * cols + c]));
        } else {
          const std::int64_t c0 = c / group * group;
          for (std::int64_t cc = c0; cc < std::min(cols, c0 + group); ++cc) amax = std::max(amax, std::fabs(x[r * cols + cc]));
        }
        const double s = DocScale(amax, qmax), xi = x[r * cols + c], yi = y[r * cols + c];
        double bound;
        if (spec.kind == CodecKind::kFp8E4M3) {
          bound = std::ldexp(std::fabs(xi), -4) + std::ldexp(s, -10);  // half an ulp: 3 mantissa bits, subnormal step 2^-9
        } else {
          bound = 0.5 * s;  // half a quantisation step
        }
        bound = bound * (1 + 1e-6) + 1e-6 * std::fabs(xi);  // the fp32 rounding of x / s and q * s
        INFO(name << " r=" << r << " c=" << c << " x=" << xi << " y=" << yi << " s=" << s);
        REQUIRE(std::fabs(xi - yi) <= bound);
        if (amax == 0) REQUIRE(yi == 0);
      }
    }
  }
}

TEST_CASE("a lossless stage changes nothing after decode and shrinks compressible data", "[codec]") {
  const std::int64_t rows = 64, cols = 256;
  auto x = RandomMatrix(rows, cols, 5);
  for (std::int64_t i = 0; i < rows * cols / 2; ++i) x[i] = 0.0f;  // half zeros: compressible
  for (const char* base : kAllNames) {
    std::vector<std::byte> plain_enc;
    const auto plain = RoundTrip(Spec(base), x, rows, cols, &plain_enc);
    for (const char* stage : {"+zstd", "+lz4"}) {
      std::vector<std::byte> enc;
      const auto y = RoundTrip(Spec((std::string(base) + stage).c_str()), x, rows, cols, &enc);
      INFO(base << stage);
      REQUIRE(((4 * y.size()) == 0 || std::memcmp(plain.data(), y.data(), 4 * y.size()) == 0));
      CHECK(enc.size() < plain_enc.size());
    }
  }
}

TEST_CASE("non-finite input is refused, naming the row and column", "[codec]") {
  const std::int64_t rows = 4, cols = 10;
  for (const char* name : {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "f32+zstd"}) {
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      auto x = RandomMatrix(rows, cols, 9);
      x[2 * cols + 7] = bad;
      std::vector<std::byte> enc;
      const Status st = Encode(Spec(name), x, rows, cols, &enc);
      INFO(name << " " << bad << " " << st.ToString());
      REQUIRE(st.IsInvalidArgument());
      CHECK(st.message().find("row 2, column 7") != std::string::npos);
    }
  }
  // Finite values that overflow the 16-bit formats.
  std::vector<float> x(6, 1.0f);
  x[4] = 3.4e38f;
  std::vector<std::byte> enc;
  Status st = Encode(Spec("bf16"), x, 2, 3, &enc);
  REQUIRE(st.IsInvalidArgument());
  CHECK(st.message().find("row 1, column 1") != std::string::npos);
  x[4] = 65520.0f;
  st = Encode(Spec("f16"), x, 2, 3, &enc);
  REQUIRE(st.IsInvalidArgument());
  x[4] = 65519.0f;  // rounds down to 65504
  REQUIRE(Encode(Spec("f16"), x, 2, 3, &enc).ok());
}

TEST_CASE("Encode and Decode refuse bad arguments", "[codec]") {
  std::vector<float> x(6, 1.0f);
  std::vector<std::byte> enc;
  CHECK(Encode(Spec("f32"), x, 2, 4, &enc).IsInvalidArgument());
  CHECK(Encode(Spec("f32"), x, -2, -3, &enc).IsInvalidArgument());
  CodecSpec bad = Spec("int4-g32");
  bad.group = 48;
  CHECK(Encode(bad, x, 2, 3, &enc).IsInvalidArgument());
  bad = Spec("int8");
  bad.scales = ScaleMode::kPerBlock;
  CHECK(Encode(bad, x, 2, 3, &enc).IsInvalidArgument());
  REQUIRE(Encode(Spec("f32"), x, 2, 3, &enc).ok());
  std::vector<float> out(5);
  CHECK(Decode(enc, 2, 3, out).IsInvalidArgument());
  out.resize(6);
  const Status st = Decode(enc, 3, 2, out);
  CHECK(st.IsCorruption());
  CHECK(st.message().find("[2, 3]") != std::string::npos);
}

TEST_CASE("damaged blocks are refused with Corruption, never decoded", "[codec]") {
  const std::int64_t rows = 5, cols = 40;
  const auto x = RandomMatrix(rows, cols, 13);
  std::vector<float> out(x.size());
  for (const char* base : kAllNames) {
    for (const std::string suffix : {"", "+zstd"}) {
      const std::string name = base + suffix;
      std::vector<std::byte> enc;
      REQUIRE(Encode(Spec(name.c_str()), x, rows, cols, &enc).ok());
      INFO(name);
      // Every single-byte change in the header.
      for (std::size_t i = 0; i < kHeader; ++i) {
        for (unsigned flip : {0x01u, 0x80u, 0xFFu}) {
          auto bad = enc;
          bad[i] ^= static_cast<std::byte>(flip);
          const Status st = Decode(bad, rows, cols, out);
          INFO("byte " << i << " ^ " << flip << ": " << st.ToString());
          REQUIRE(st.IsCorruption());
          REQUIRE_FALSE(st.message().empty());
        }
      }
      // Every truncation and an extension.
      for (std::size_t len = 0; len < enc.size(); len += (len < kHeader + 8 ? 1 : 97)) {
        const Status st = Decode(std::span(enc).first(len), rows, cols, out);
        INFO("truncated to " << len << ": " << st.ToString());
        REQUIRE(st.IsCorruption());
      }
      auto longer = enc;
      longer.push_back(std::byte{0});
      REQUIRE(Decode(longer, rows, cols, out).IsCorruption());
    }
  }
}

TEST_CASE("damaged scales, NaN codes and damaged compressed payloads are refused", "[codec]") {
  const std::int64_t rows = 6, cols = 64;
  const auto x = RandomMatrix(rows, cols, 17);
  std::vector<float> out(x.size());
  std::vector<std::byte> enc;
  // A scale made negative / NaN.
  REQUIRE(Encode(Spec("int8"), x, rows, cols, &enc).ok());
  auto bad = enc;
  bad[kHeader + 4 * 3 + 3] ^= std::byte{0x80};  // sign bit of scale 3
  Status st = Decode(bad, rows, cols, out);
  REQUIRE(st.IsCorruption());
  CHECK(st.message().find("scale 3") != std::string::npos);
  // A subnormal scale, which Encode never writes (it stores 0 below 2^-126), for every scaled kind.
  for (const char* name : {"int8", "int4-g32", "fp8", "fp8-block"}) {
    REQUIRE(Encode(Spec(name), x, rows, cols, &enc).ok());
    for (const std::uint32_t bits : {0x00000001u, 0x007FFFFFu}) {
      bad = enc;
      for (int i = 0; i < 4; ++i) bad[kHeader + i] = static_cast<std::byte>(bits >> (8 * i));  // scale 0
      st = Decode(bad, rows, cols, out);
      INFO(name << " scale 0 bits " << bits << ": " << st.ToString());
      REQUIRE(st.IsCorruption());
      CHECK(st.message().find("scale 0") != std::string::npos);
    }
  }
  // An fp8 NaN code in the payload.
  REQUIRE(Encode(Spec("fp8"), x, rows, cols, &enc).ok());
  bad = enc;
  bad[kHeader + 4 * cols + 17] = std::byte{0x7F};
  REQUIRE(Decode(bad, rows, cols, out).IsCorruption());
  bad[kHeader + 4 * cols + 17] = std::byte{0xFF};
  REQUIRE(Decode(bad, rows, cols, out).IsCorruption());
  // A zstd payload with a flipped bit fails zstd's checksum or its frame parse, or (a bit zstd
  // ignores, such as an unused frame-header flag) still decodes to exactly the right values.
  REQUIRE(Encode(Spec("bf16+zstd"), x, rows, cols, &enc).ok());
  std::vector<float> good(x.size());
  REQUIRE(Decode(enc, rows, cols, good).ok());
  int refused = 0;
  for (std::size_t i = kHeader; i < enc.size(); ++i) {
    for (unsigned flip : {0x01u, 0x10u, 0x80u}) {
      bad = enc;
      bad[i] ^= static_cast<std::byte>(flip);
      st = Decode(bad, rows, cols, out);
      INFO("zstd byte " << i << " ^ " << flip << ": " << st.ToString());
      if (st.ok()) {
        REQUIRE(((4 * out.size()) == 0 || std::memcmp(out.data(), good.data(), 4 * out.size()) == 0));
      } else {
        REQUIRE(st.IsCorruption());
        ++refused;
      }
    }
  }
  CHECK(refused > static_cast<int>(3 * (enc.size() - kHeader)) * 9 / 10);
}

TEST_CASE("an int4 block with an odd value count and a non-zero padding nibble is refused", "[codec]") {
  // docs/kv-codecs.md "Payload": value k is the low nibble of byte k / 2 (k even) or its high nibble
  // (k odd); with an odd count the high nibble of the last byte is padding, which Encode writes as 0
  // and Decode refuses otherwise.
  const std::int64_t rows = 3, cols = 5;  // 15 values: 8 payload bytes, the last one half padding
  const auto x = RandomMatrix(rows, cols, 23);
  std::vector<float> out(x.size());
  for (const char* name : {"int4-g32", "int4-g64"}) {
    INFO(name);
    std::vector<std::byte> enc;
    REQUIRE(Encode(Spec(name), x, rows, cols, &enc).ok());
    // Header, one scale per row (one group of 5 columns), then the payload: the last byte is the
    // last payload byte (no lossless stage).
    REQUIRE(enc.size() == kHeader + 4 * rows + (rows * cols + 1) / 2);
    REQUIRE((enc.back() & std::byte{0xF0}) == std::byte{0});
    REQUIRE(Decode(enc, rows, cols, out).ok());
    for (unsigned pad : {0x10u, 0x80u, 0xF0u}) {
      auto bad = enc;
      bad.back() |= static_cast<std::byte>(pad);
      const Status st = Decode(bad, rows, cols, out);
      INFO("padding nibble " << (pad >> 4) << ": " << st.ToString());
      REQUIRE(st.IsCorruption());
      CHECK(st.message().find("padding nibble") != std::string::npos);
    }
    // The low nibble of that byte is value 14, a real value: another code there decodes.
    auto other = enc;
    other.back() = (other.back() & std::byte{0xF0}) | std::byte{0x03};
    REQUIRE(Decode(other, rows, cols, out).ok());
  }
}

TEST_CASE("stored NaN / Inf values and overflowing scales are refused; huge inputs decode finite", "[codec]") {
  const std::int64_t rows = 3, cols = 16;
  const auto x = RandomMatrix(rows, cols, 19);
  std::vector<float> out(x.size());
  std::vector<std::byte> enc;
  for (const char* name : {"bf16", "f16"}) {
    REQUIRE(Encode(Spec(name), x, rows, cols, &enc).ok());
    for (std::uint16_t code : {0x7F80, 0xFFC0, 0x7C00, 0xFE00}) {
      if ((name[0] == 'b') != (code == 0x7F80 || code == 0xFFC0)) continue;
      auto bad = enc;
      std::memcpy(bad.data() + kHeader + 2 * 21, &code, 2);
      const Status st = Decode(bad, rows, cols, out);
      INFO(name << " code " << code << ": " << st.ToString());
      REQUIRE(st.IsCorruption());
    }
  }
  for (const char* name : {"fp8", "fp8-block", "int8", "int4-g32"}) {
    REQUIRE(Encode(Spec(name), x, rows, cols, &enc).ok());
    auto bad = enc;
    const float huge = 3e38f;
    std::memcpy(bad.data() + kHeader, &huge, 4);
    const Status st = Decode(bad, rows, cols, out);
    INFO(name << ": " << st.ToString());
    REQUIRE(st.IsCorruption());
    CHECK(st.message().find("scale 0") != std::string::npos);
    // Inputs at the top of the fp32 range encode and decode to finite values.
    std::vector<float> big(x.size(), 3.4028e38f);
    for (std::size_t i = 0; i < big.size(); i += 2) big[i] = -big[i];
    const auto y = RoundTrip(Spec(name), big, rows, cols);
    for (std::size_t i = 0; i < y.size(); ++i) {
      REQUIRE(std::isfinite(y[i]));
      REQUIRE(std::fabs(y[i] - big[i]) <= 0.13 * std::fabs(big[i]));  // int4: clamped at 7/8 of FLT_MAX
    }
  }
}

TEST_CASE("sizes: MaxEncodedBytes is exact without a lossless stage", "[codec]") {
  for (const char* name : kAllNames) {
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 33}, {4, 576}, {0, 9}}) {
      const auto x = RandomMatrix(rows, cols, 21);
      std::vector<std::byte> enc;
      REQUIRE(Encode(Spec(name), x, rows, cols, &enc).ok());
      CHECK(enc.size() == MaxEncodedBytes(Spec(name), rows, cols));
      RoundTrip(Spec(name), x, rows, cols);
    }
  }
  // int4 g32 on 576 columns: 64 + 4 * 4 * 18 scales + 4 * 576 / 2 bytes.
  CHECK(MaxEncodedBytes(Spec("int4-g32"), 4, 576) == 64 + 4 * 4 * 18 + 4 * 576 / 2);
  CHECK(MaxEncodedBytes(Spec("fp8"), 4, 576) == 64 + 4 * 576 + 4 * 576);
  CHECK(MaxEncodedBytes(Spec("fp8-block"), 4, 576) == 64 + 4 + 4 * 576);
  // 0 where Encode refuses the shape: more scales than a block's 32-bit count holds, or more payload
  // than the lz4 stage takes.
  CHECK(MaxEncodedBytes(Spec("int4-g32"), std::int64_t{1} << 33, 1) == 0);
  CHECK(MaxEncodedBytes(Spec("int8"), 1, std::int64_t{1} << 33) == 0);
  CHECK(MaxEncodedBytes(Spec("fp8"), 1, std::int64_t{1} << 32) == 0);
  CHECK(MaxEncodedBytes(Spec("fp8-block+lz4"), 1, std::int64_t{3} << 30) == 0);
  CHECK(MaxEncodedBytes(Spec("fp8-block+zstd"), 1, std::int64_t{3} << 30) > (std::uint64_t{3} << 30));
}

TEST_CASE("an empty tensor with a huge row count encodes and decodes without visiting its rows", "[codec]") {
  // [2^40, 0] holds no value: a loop over its rows would run for hours (the test would time out).
  constexpr std::int64_t kRows = std::int64_t{1} << 40;
  for (const char* name : kAllNames) {
    INFO(name);
    std::vector<std::byte> enc;
    REQUIRE(Encode(Spec(name), {}, kRows, 0, &enc).ok());
    std::vector<float> out;
    REQUIRE(Decode(enc, kRows, 0, out).ok());
    REQUIRE(enc.size() <= MaxEncodedBytes(Spec(name), kRows, 0));
  }
}

TEST_CASE("an empty tensor with many columns encodes without per-channel scales", "[codec]") {
  // [0, 2^24] holds no value: it has no channel to scale, so its block is the header (and the one
  // per-block scale), not 64 MiB of scales (at 2^32 - 1 columns the old 16 GiB threw std::bad_alloc).
  constexpr std::int64_t kCols = std::int64_t{1} << 24;
  for (const char* name : kAllNames) {
    INFO(name);
    std::vector<std::byte> enc;
    REQUIRE(Encode(Spec(name), {}, 0, kCols, &enc).ok());
    CHECK(enc.size() <= 64 + 4);
    CHECK(enc.size() <= MaxEncodedBytes(Spec(name), 0, kCols));
    std::vector<float> out;
    REQUIRE(Decode(enc, 0, kCols, out).ok());
  }
}

TEST_CASE("an empty tensor with many columns encodes small with a lossless stage too", "[codec]") {
  constexpr std::int64_t kCols = std::int64_t{1} << 24;
  for (const char* name : {"int8+zstd", "fp8+lz4", "int4-g32+zstd"}) {
    INFO(name);
    std::vector<std::byte> enc;
    REQUIRE(Encode(Spec(name), {}, 0, kCols, &enc).ok());
    CHECK(enc.size() <= 64 + 64);  // the header, and a lossless frame of nothing
    std::vector<float> out;
    REQUIRE(Decode(enc, 0, kCols, out).ok());
  }
}

TEST_CASE("a [0, cols] per-channel block with cols zero scales (older builds) still decodes", "[codec]") {
  constexpr std::uint64_t kCols = 5;
  std::vector<std::byte> enc;
  REQUIRE(Encode(Spec("int8"), {}, 0, static_cast<std::int64_t>(kCols), &enc).ok());
  REQUIRE(enc.size() == 64);
  // Rewrite the header the way older builds did: scale count `cols`, then `cols` zero scales.
  auto* h = reinterpret_cast<unsigned char*>(enc.data());
  const std::uint32_t count = kCols;
  std::memcpy(h + 12, &count, 4);
  std::uint32_t fnv = 2166136261u;
  for (int i = 0; i < 48; ++i) fnv = (fnv ^ h[i]) * 16777619u;
  std::memcpy(h + 48, &fnv, 4);
  enc.resize(64 + 4 * kCols, std::byte{0});
  std::vector<float> out;
  CHECK(Decode(enc, 0, static_cast<std::int64_t>(kCols), out).ok());
  // A negative scale is still refused, even where no value uses it.
  enc[64 + 4 * 2 + 3] = std::byte{0x80};
  const Status st = Decode(enc, 0, static_cast<std::int64_t>(kCols), out);
  CHECK(st.code() == Code::kCorruption);
}

TEST_CASE("a block of another codec format version (0 or 2) is refused as Corruption even with a valid header check", "[codec]") {
  const std::vector<float> x = {1.0f, -2.0f, 3.0f, 0.5f, 0.25f, -1.0f};
  std::vector<std::byte> enc;
  REQUIRE(Encode(Spec("int8"), x, 2, 3, &enc).ok());
  auto* h = reinterpret_cast<unsigned char*>(enc.data());
  for (unsigned char v : {0, 2}) {
    h[4] = v;
    std::uint32_t fnv = 2166136261u;
    for (int i = 0; i < 48; ++i) fnv = (fnv ^ h[i]) * 16777619u;
    std::memcpy(h + 48, &fnv, 4);
    std::vector<float> out(6);
    const Status st = Decode(enc, 2, 3, out);
    INFO(int(v) << " " << st.ToString());
    CHECK(st.code() == Code::kCorruption);
  }
}
