#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include <catch2/catch.hpp>

#include "src/model/tensor.h"

using namespace terrace::model;

namespace {
// Oracle for bf16 rounding: pick the nearer of the two neighbouring bf16 values (ties: even mantissa).
std::uint16_t Bf16Oracle(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dl = std::fabs(static_cast<double>(x) - Bf16ToFloat(lo));
  const double dh = std::fabs(static_cast<double>(x) - Bf16ToFloat(hi));
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}
// Oracle for f16: search the 65536 codes once for the nearest (ties even) - exhaustive, no bit tricks.
std::uint16_t F16Oracle(float x) {
  std::uint16_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (std::uint32_t c = 0; c < 0x7C00; ++c) {  // finite non-negative codes
    const double d = std::fabs(std::fabs(static_cast<double>(x)) - F16ToFloat(static_cast<std::uint16_t>(c)));
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best_d = d;
      best = static_cast<std::uint16_t>(c);
    }
  }
  return static_cast<std::uint16_t>(best | (std::signbit(x) ? 0x8000 : 0));
}
}  // namespace

TEST_CASE("dtype names and sizes", "[tensor]") {
  for (auto name : {"F32", "F16", "BF16", "F64", "U8", "I8", "I16", "I32", "I64", "U16", "U32", "U64", "BOOL"}) {
    auto d = ParseDType(name);
    REQUIRE(d.ok());
    CHECK(DTypeName(*d) == name);
  }
  CHECK(DTypeSize(DType::kBF16) == 2);
  CHECK(DTypeSize(DType::kI64) == 8);
  CHECK(DTypeSize(DType::kBool) == 1);
  auto bad = ParseDType("F8_E9M9");
  REQUIRE(bad.status().IsInvalidArgument());
  CHECK(bad.status().message().find("F8_E9M9") != std::string::npos);
  std::vector<std::int64_t> shape{2, 3, 4};
  CHECK(NumElements(shape) == 24);
  CHECK(ShapeString(shape) == "[2, 3, 4]");
}

TEST_CASE("f16 decodes known values", "[tensor]") {
  CHECK(F16ToFloat(0x3C00) == 1.0f);
  CHECK(F16ToFloat(0xC000) == -2.0f);
  CHECK(F16ToFloat(0x7BFF) == 65504.0f);
  CHECK(F16ToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(std::isinf(F16ToFloat(0x7C00)));
  CHECK(std::isnan(F16ToFloat(0x7E00)));
  CHECK(Bf16ToFloat(0x3F80) == 1.0f);
  CHECK(Bf16ToFloat(0xC040) == -3.0f);
}

TEST_CASE("bf16 and f16 rounding match nearest-even oracles", "[tensor]") {
  std::uint32_t state = 12345;
  for (int i = 0; i < 300; ++i) {
    state = state * 1664525u + 1013904223u;
    // Random bits restricted to the f16 range for the f16 oracle; bf16 takes any finite float.
    const float any = std::bit_cast<float>(state & 0xBFFFFFFFu);
    CHECK(FloatToBf16(any) == Bf16Oracle(any));
    const float small = std::ldexp(static_cast<float>(state % 100000) / 100000.0f, static_cast<int>(state % 40) - 25);
    const float x = (state & 1) ? -small : small;
    INFO("x = " << x);
    CHECK(FloatToF16(x) == F16Oracle(x));
    CHECK(F16ToFloat(FloatToF16(x)) == F16ToFloat(F16Oracle(x)));
  }
  CHECK(FloatToF16(70000.0f) == 0x7C00);
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("ToFloat converts F32/BF16/F16 views and rejects others", "[tensor]") {
  const float values[3] = {1.5f, -2.25f, 1024.0f};
  std::uint16_t bf[3], hf[3];
  for (int i = 0; i < 3; ++i) {
    bf[i] = FloatToBf16(values[i]);
    hf[i] = FloatToF16(values[i]);
  }
  using Bytes = std::span<const std::byte>;
  for (auto [dtype, bytes] : {std::pair<DType, Bytes>{DType::kF32, std::as_bytes(std::span(values))},
                              std::pair<DType, Bytes>{DType::kBF16, std::as_bytes(std::span(bf))},
                              std::pair<DType, Bytes>{DType::kF16, std::as_bytes(std::span(hf))}}) {
    auto t = ToFloat(TensorView{dtype, {3}, bytes}, "x");
    REQUIRE(t.ok());
    CHECK(t->data == std::vector<float>(values, values + 3));
  }
  auto bad = ToFloat(TensorView{DType::kU8, {6}, std::as_bytes(std::span(bf))}, "my.tensor");
  REQUIRE(bad.status().IsInvalidArgument());
  CHECK(bad.status().message().find("my.tensor") != std::string::npos);
  CHECK(!ToFloat(TensorView{DType::kF32, {4}, std::as_bytes(std::span(values))}).ok());  // size mismatch
}

TEST_CASE("NumElements is overflow-checked: -1 past int64 or for a negative dimension", "[tensor]") {
  const std::int64_t big = std::int64_t{1} << 62;
  CHECK(NumElements(std::vector<std::int64_t>{big}) == big);
  CHECK(NumElements(std::vector<std::int64_t>{big, 2}) == -1);
  CHECK(NumElements(std::vector<std::int64_t>{big, 4, 0}) == 0);  // empty, however large the rest
  CHECK(NumElements(std::vector<std::int64_t>{3, -1}) == -1);
  CHECK(NumElements(std::vector<std::int64_t>{-1, 0}) == -1);
  CHECK(NumElements(std::vector<std::int64_t>{}) == 1);
}

TEST_CASE("ToFloat refuses a shape whose byte count wraps, naming the tensor and shape", "[tensor]") {
  // 2^62 F32 elements: the byte count (2^64) wrapped to 0, so an empty span passed the size check and
  // the fp32 copy threw std::length_error.
  for (const auto& shape : {std::vector<std::int64_t>{std::int64_t{1} << 62},
                            std::vector<std::int64_t>{std::int64_t{1} << 31, std::int64_t{1} << 31, 4},
                            std::vector<std::int64_t>{std::int64_t{1} << 62, 4}}) {
    TensorView v{DType::kF32, shape, {}};
    const auto r = ToFloat(v, "w");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == terrace::Code::kInvalidArgument);
    CHECK(r.status().message().find("w:") != std::string::npos);
    CHECK(r.status().message().find(ShapeString(shape)) != std::string::npos);
  }
  TensorView neg{DType::kBF16, {2, -3}, {}};
  const auto r = ToFloat(neg, "w");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("[2, -3]") != std::string::npos);
}
