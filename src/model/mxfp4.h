// MXFP4 (OCP microscaling FP4) as K3's routed experts store it, in the compressed-tensors layout:
//   weight_packed U8 [rows, cols/2]: two E2M1 codes per byte, the LOW nibble holds the EVEN column;
//     code bit 3 = sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//   weight_scale  U8 [rows, cols/32]: one E8M0 exponent per 32 consecutive columns of a row;
//     scale s means 2^(s - 127); s == 255 is NaN.
//   value = E2M1(code) * 2^(s - 127).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "terrace/model_weights.h"
#include "terrace/status.h"

namespace terrace::model {

inline constexpr int kMxfp4BlockSize = 32;      // weights per E8M0 scale
inline constexpr std::uint8_t kE8M0Nan = 255;

float E2M1ToFloat(std::uint8_t nibble);        // only the low 4 bits are used
float E8M0ToFloat(std::uint8_t scale);         // 2^(scale - 127); NaN for 255
// Nearest E2M1 code to `value` (ties to the even code), saturating at +-6. NaN maps to +0.
std::uint8_t FloatToE2M1(float value);

// packed: rows * cols/2 bytes; scales: rows * cols/32 bytes; out: rows * cols floats.
// cols must be a positive multiple of 32. A NaN scale (255) is Corruption naming the row and block.
Status DequantizeMxfp4(std::span<const std::uint8_t> packed, std::span<const std::uint8_t> scales,
                       std::int64_t rows, std::int64_t cols, std::span<float> out);

// Quantizes row-major `in` [rows, cols]. Per 32-block the scale is the smallest power of two 2^e with
// max|x| <= 6 * 2^e (so the block maximum never clips; an all-zero block gets e = 0), clamped to
// the E8M0 range [-127, 127]; each value is then rounded to the nearest E2M1 value, ties to even.
// Non-finite inputs are InvalidArgument naming the row and column.
Status QuantizeMxfp4(std::span<const float> in, std::int64_t rows, std::int64_t cols,
                     std::vector<std::uint8_t>* packed, std::vector<std::uint8_t>* scales);

// OK when every weight of `m` decodes to a finite fp32 value; else Corruption naming `name`, the
// row and block: a NaN scale (E8M0 255), or a weight that overflows fp32 (a scale >= 2^126 with a
// large code). Reads every scale, and the packed nibbles only of blocks with such a scale.
Status ValidateMxfp4(const Mxfp4Matrix& m, std::string_view name);

}  // namespace terrace::model
