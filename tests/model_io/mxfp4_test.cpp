#include <cmath>
#include <random>

#include <catch2/catch.hpp>

#include "src/model/mxfp4.h"

using namespace terrace::model;

namespace {
// Independent oracle for E2M1: decode from the bit fields (1 sign, 2 exponent bits bias 1, 1 mantissa).
float DecodeE2M1Bits(std::uint8_t code) {
  const int sign = (code >> 3) & 1;
  const int exp = (code >> 1) & 3;
  const int mant = code & 1;
  const float mag = exp == 0 ? 0.5f * static_cast<float>(mant)  // subnormal: mant * 2^(1-1) * 0.5
                             : std::ldexp(1.0f + 0.5f * static_cast<float>(mant), exp - 1);
  return sign ? -mag : mag;
}
}  // namespace

TEST_CASE("every E2M1 code decodes to its value", "[mxfp4]") {
  const float expected[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (std::uint8_t code = 0; code < 16; ++code) {
    CHECK(E2M1ToFloat(code) == expected[code]);
    CHECK(E2M1ToFloat(code) == DecodeE2M1Bits(code));
    CHECK(std::signbit(E2M1ToFloat(code)) == (code >= 8));
    // Encoding the decoded value gives the code back (except -0, which encodes as -0 = code 8).
    CHECK(FloatToE2M1(E2M1ToFloat(code)) == code);
  }
}

TEST_CASE("E8M0 scales are powers of two and 255 is NaN", "[mxfp4]") {
  CHECK(E8M0ToFloat(127) == 1.0f);
  CHECK(E8M0ToFloat(128) == 2.0f);
  CHECK(E8M0ToFloat(120) == std::ldexp(1.0f, -7));
  CHECK(E8M0ToFloat(0) == std::ldexp(1.0f, -127));
  CHECK(E8M0ToFloat(254) == std::ldexp(1.0f, 127));
  CHECK(std::isnan(E8M0ToFloat(255)));
}

TEST_CASE("E2M1 rounding is to nearest, ties to even", "[mxfp4]") {
  // Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  const std::pair<float, float> cases[] = {{0.25f, 0}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2},
                                           {3.5f, 4},  {5.0f, 4},  {0.26f, 0.5f}, {5.01f, 6}, {100.f, 6},
                                           {-2.6f, -3}, {-0.1f, -0.0f}};
  for (auto [in, out] : cases) {
    INFO("input " << in);
    CHECK(E2M1ToFloat(FloatToE2M1(in)) == out);
  }
}

TEST_CASE("MXFP4 round trip is exact for representable values", "[mxfp4]") {
  const std::int64_t rows = 3, cols = 64;
  std::mt19937 rng(7);
  std::vector<float> in(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t b = 0; b < cols / 32; ++b) {
      const int e = static_cast<int>(rng() % 40) - 20;
      for (int k = 0; k < 32; ++k) {
        const auto code = static_cast<std::uint8_t>(rng() % 16);
        in[static_cast<std::size_t>(r * cols + b * 32 + k)] = std::ldexp(E2M1ToFloat(code), e);
      }
      in[static_cast<std::size_t>(r * cols + b * 32)] = std::ldexp(6.0f, e);  // pin the block max
    }
  }
  std::vector<std::uint8_t> packed, scales;
  REQUIRE(QuantizeMxfp4(in, rows, cols, &packed, &scales).ok());
  REQUIRE(packed.size() == static_cast<std::size_t>(rows * cols / 2));
  REQUIRE(scales.size() == static_cast<std::size_t>(rows * cols / 32));
  std::vector<float> out(in.size());
  REQUIRE(DequantizeMxfp4(packed, scales, rows, cols, out).ok());
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(out[i] == in[i]);
}

TEST_CASE("MXFP4 quantization error is within half a step", "[mxfp4]") {
  const std::int64_t rows = 8, cols = 96;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> in(static_cast<std::size_t>(rows * cols));
  for (auto& x : in) x = normal(rng) * 0.03f;
  std::vector<std::uint8_t> packed, scales;
  REQUIRE(QuantizeMxfp4(in, rows, cols, &packed, &scales).ok());
  std::vector<float> out(in.size());
  REQUIRE(DequantizeMxfp4(packed, scales, rows, cols, out).ok());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t b = 0; b < cols / 32; ++b) {
      const float scale = E8M0ToFloat(scales[static_cast<std::size_t>(r * (cols / 32) + b)]);
      float amax = 0;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(in[static_cast<std::size_t>(r * cols + b * 32 + k)]));
      CHECK(amax <= 6.0f * scale);         // the block max never clips
      CHECK(amax > 3.0f * scale);          // and the scale is the smallest that fits
      for (int k = 0; k < 32; ++k) {
        const auto i = static_cast<std::size_t>(r * cols + b * 32 + k);
        const float x = in[i] / scale;
        // Step between neighbouring E2M1 values at |x|: 0.5 below 2, 1 in [2, 4), 2 above.
        const float step = std::fabs(x) < 2 ? 0.5f : (std::fabs(x) < 4 ? 1.0f : 2.0f);
        CHECK(std::fabs(out[i] - in[i]) <= 0.5f * step * scale);
      }
    }
  }
}

TEST_CASE("MXFP4 nibble order: low nibble holds the even column", "[mxfp4]") {
  std::vector<std::uint8_t> packed(16, 0), scales{127};
  packed[0] = 0x72;  // column 0 -> code 2 (1.0), column 1 -> code 7 (6.0)
  packed[15] = 0x9F;  // column 30 -> code 15 (-6), column 31 -> code 9 (-0.5)
  std::vector<float> out(32);
  REQUIRE(DequantizeMxfp4(packed, scales, 1, 32, out).ok());
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == 6.0f);
  CHECK(out[30] == -6.0f);
  CHECK(out[31] == -0.5f);
  CHECK(out[2] == 0.0f);
}

TEST_CASE("MXFP4 rejects NaN scales, bad shapes and non-finite inputs", "[mxfp4]") {
  std::vector<std::uint8_t> packed(32, 0x11), scales{127, 255};
  std::vector<float> out(64);
  auto s = DequantizeMxfp4(packed, scales, 1, 64, out);
  REQUIRE(s.IsCorruption());
  CHECK(s.message().find("row 0, block 1") != std::string::npos);

  CHECK(DequantizeMxfp4(packed, scales, 1, 48, out).IsInvalidArgument());  // cols not a multiple of 32
  CHECK(DequantizeMxfp4(packed, scales, 2, 64, out).IsInvalidArgument());  // sizes do not match

  std::vector<float> in(32, 1.0f);
  in[5] = std::numeric_limits<float>::infinity();
  std::vector<std::uint8_t> p, sc;
  auto q = QuantizeMxfp4(in, 1, 32, &p, &sc);
  REQUIRE(q.IsInvalidArgument());
  CHECK(q.message().find("column 5") != std::string::npos);
}

TEST_CASE("MXFP4 all-zero block and tiny values", "[mxfp4]") {
  std::vector<float> in(64, 0.0f);
  in[40] = 1e-40f;  // subnormal: the scale clamps at 2^-127
  std::vector<std::uint8_t> packed, scales;
  REQUIRE(QuantizeMxfp4(in, 1, 64, &packed, &scales).ok());
  CHECK(scales[0] == 127);
  CHECK(scales[1] == 0);
  std::vector<float> out(64);
  REQUIRE(DequantizeMxfp4(packed, scales, 1, 64, out).ok());
  for (std::size_t i = 0; i < 40; ++i) CHECK(out[i] == 0.0f);
  CHECK(std::fabs(out[40] - in[40]) <= 0.25f * std::ldexp(1.0f, -127));
}
