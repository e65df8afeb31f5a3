#include "src/model/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace terrace::model {
namespace {

constexpr float kE2M1Magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

Status CheckDims(std::int64_t rows, std::int64_t cols, std::string_view op) {
  if (rows < 0 || cols <= 0 || cols % kMxfp4BlockSize != 0) {
    return Status::InvalidArgument(fmt::format(
        "{}: shape [{}, {}] is not valid for MXFP4; rows must be >= 0 and cols a positive multiple of {}", op,
        rows, cols, kMxfp4BlockSize));
  }
  if (rows > (std::int64_t{1} << 40) / cols) {
    return Status::InvalidArgument(fmt::format("{}: shape [{}, {}] is too large", op, rows, cols));
  }
  return Status::Ok();
}

}  // namespace

float E2M1ToFloat(std::uint8_t nibble) {
  const float m = kE2M1Magnitudes[nibble & 0x7u];
  return (nibble & 0x8u) ? -m : m;
}

float E8M0ToFloat(std::uint8_t scale) {
  if (scale == kE8M0Nan) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(scale) - 127);
}

std::uint8_t FloatToE2M1(float value) {
  if (std::isnan(value)) return 0;
  const std::uint8_t sign = std::signbit(value) ? 0x8u : 0x0u;
  const float a = std::fabs(value);
  // Midpoints between consecutive magnitudes; at a tie pick the even code.
  std::uint8_t code = 7;
  for (std::uint8_t c = 0; c < 7; ++c) {
    const float mid = 0.5f * (kE2M1Magnitudes[c] + kE2M1Magnitudes[c + 1]);
    if (a < mid || (a == mid && (c % 2 == 0))) {
      code = c;
      break;
    }
  }
  return static_cast<std::uint8_t>(sign | code);
}

Status DequantizeMxfp4(std::span<const std::uint8_t> packed, std::span<const std::uint8_t> scales,
                       std::int64_t rows, std::int64_t cols, std::span<float> out) {
  TERRACE_RETURN_IF_ERROR(CheckDims(rows, cols, "DequantizeMxfp4"));
  const auto r = static_cast<std::size_t>(rows);
  const auto c = static_cast<std::size_t>(cols);
  const std::size_t blocks = c / kMxfp4BlockSize;
  if (packed.size() != r * c / 2 || scales.size() != r * blocks || out.size() != r * c) {
    return Status::InvalidArgument(fmt::format(
        "DequantizeMxfp4: for [{}, {}] expected {} packed bytes, {} scales and {} outputs; got {}, {}, {}", rows,
        cols, r * c / 2, r * blocks, r * c, packed.size(), scales.size(), out.size()));
  }
  for (std::size_t i = 0; i < r; ++i) {
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::uint8_t s = scales[i * blocks + b];
      if (s == kE8M0Nan) {
        return Status::Corruption(fmt::format(
            "MXFP4 scale is NaN (E8M0 255) at row {}, block {} (columns {}..{}); the weights are damaged",
            i, b, b * kMxfp4BlockSize, (b + 1) * kMxfp4BlockSize - 1));
      }
      const float scale = E8M0ToFloat(s);
      const std::uint8_t* p = packed.data() + (i * c + b * kMxfp4BlockSize) / 2;
      float* o = out.data() + i * c + b * kMxfp4BlockSize;
      for (int k = 0; k < kMxfp4BlockSize / 2; ++k) {
        o[2 * k] = E2M1ToFloat(p[k] & 0xFu) * scale;
        o[2 * k + 1] = E2M1ToFloat(p[k] >> 4) * scale;
      }
    }
  }
  return Status::Ok();
}

Status ValidateMxfp4(const Mxfp4Matrix& m, std::string_view name) {
  if (m.rows < 0 || m.cols <= 0 || m.cols % kMxfp4BlockSize != 0)
    return Status::Corruption(fmt::format("{}: MXFP4 shape [{}, {}] is not valid (cols must be a positive multiple of {})",
                                          name, m.rows, m.cols, kMxfp4BlockSize));
  const std::int64_t blocks = m.cols / kMxfp4BlockSize;
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::uint8_t s = m.scales[r * blocks + b];
      if (s < 253) continue;  // 6 * 2^125 is finite: no code can overflow
      if (s == kE8M0Nan) {
        return Status::Corruption(fmt::format(
            "{}: MXFP4 scale is NaN (E8M0 255) at row {}, block {} (columns {}..{}); the weights are damaged", name, r,
            b, b * kMxfp4BlockSize, (b + 1) * kMxfp4BlockSize - 1));
      }
      const float scale = E8M0ToFloat(s);
      for (int k = 0; k < kMxfp4BlockSize; ++k) {
        const std::uint8_t byte = m.packed[(r * m.cols + b * kMxfp4BlockSize + k) / 2];
        const std::uint8_t code = (k % 2 == 0) ? (byte & 0xFu) : static_cast<std::uint8_t>(byte >> 4);
        if (std::isinf(E2M1ToFloat(code) * scale)) {
          return Status::Corruption(fmt::format(
              "{}: MXFP4 weight at row {}, column {} overflows fp32 (E2M1 {} x 2^{}); the weights are damaged", name,
              r, b * kMxfp4BlockSize + k, E2M1ToFloat(code), static_cast<int>(s) - 127));
        }
      }
    }
  }
  return Status::Ok();
}

Status QuantizeMxfp4(std::span<const float> in, std::int64_t rows, std::int64_t cols,
                     std::vector<std::uint8_t>* packed, std::vector<std::uint8_t>* scales) {
  TERRACE_RETURN_IF_ERROR(CheckDims(rows, cols, "QuantizeMxfp4"));
  const auto r = static_cast<std::size_t>(rows);
  const auto c = static_cast<std::size_t>(cols);
  if (in.size() != r * c) {
    return Status::InvalidArgument(
        fmt::format("QuantizeMxfp4: {} inputs for shape [{}, {}] (expected {})", in.size(), rows, cols, r * c));
  }
  const std::size_t blocks = c / kMxfp4BlockSize;
  packed->assign(r * c / 2, 0);
  scales->assign(r * blocks, 0);
  for (std::size_t i = 0; i < r; ++i) {
    for (std::size_t b = 0; b < blocks; ++b) {
      const float* x = in.data() + i * c + b * kMxfp4BlockSize;
      float amax = 0.0f;
      for (int k = 0; k < kMxfp4BlockSize; ++k) {
        if (!std::isfinite(x[k])) {
          return Status::InvalidArgument(fmt::format("QuantizeMxfp4: non-finite value {} at row {}, column {}",
                                                     x[k], i, b * kMxfp4BlockSize + k));
        }
        amax = std::fmax(amax, std::fabs(x[k]));
      }
      int e = 0;
      if (amax > 0.0f) {
        e = std::ilogb(amax) - 3;  // 6 * 2^e < amax here; step up to the first e that fits
        while (amax > std::ldexp(6.0f, e)) ++e;
        e = std::clamp(e, -127, 127);
      }
      (*scales)[i * blocks + b] = static_cast<std::uint8_t>(e + 127);
      std::uint8_t* p = packed->data() + (i * c + b * kMxfp4BlockSize) / 2;
      for (int k = 0; k < kMxfp4BlockSize; k += 2) {
        // ldexp by a power of two is exact unless the result underflows, which only rounds toward 0.
        const std::uint8_t lo = FloatToE2M1(std::ldexp(x[k], -e));
        const std::uint8_t hi = FloatToE2M1(std::ldexp(x[k + 1], -e));
        p[k / 2] = static_cast<std::uint8_t>(lo | (hi << 4));
      }
    }
  }
  return Status::Ok();
}

}  // namespace terrace::model
