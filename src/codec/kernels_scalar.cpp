// Scalar reference kernels and element conversions (see kernels.h). These define the rounding
// rules that docs/kv-codecs.md documents; the AVX2 kernels must match them bit for bit.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/codec/format.h"
#include "src/codec/kernels.h"

namespace terrace::codec::detail {
namespace {

std::uint32_t Bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float FromBits(std::uint32_t b) { return std::bit_cast<float>(b); }

constexpr std::array<float, 256> MakeFp8Table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xF, m = c & 7;
    float v;
    if (e == 15 && m == 7) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = static_cast<float>(m) / 512.0f;  // subnormal: m * 2^-9
    } else {
      v = static_cast<float>(8 + m) / 8.0f;  // (1 + m/8) * 2^(e-7)
      for (int i = 0; i < e - 7; ++i) v *= 2.0f;
      for (int i = 0; i < 7 - e; ++i) v /= 2.0f;
    }
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}
alignas(64) constexpr std::array<float, 256> kFp8Table = MakeFp8Table();

std::uint16_t Load16(const unsigned char* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void Store16(unsigned char* p, std::uint16_t v) { std::memcpy(p, &v, 2); }

std::uint32_t MaxAbsBits(const float* x, std::size_t n) {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, Bits(x[i]) & 0x7FFFFFFFu);
  return m;
}

void ColMaxAbsBits(const float* x, std::size_t rows, std::size_t cols, std::uint32_t* colmax) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (std::size_t c = 0; c < cols; ++c) colmax[c] = std::max(colmax[c], Bits(row[c]) & 0x7FFFFFFFu);
  }
}

// A 16-bit float format's encode / decode loop, returning the largest magnitude bit pattern seen
// (sign masked) so callers can detect Inf/NaN without a second pass.
template <std::uint16_t (*FromF32)(float)>
std::uint16_t Encode16(const float* x, std::size_t n, unsigned char* out) {
  std::uint16_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t h = FromF32(x[i]);
    m = std::max<std::uint16_t>(m, h & 0x7FFF);
    Store16(out + 2 * i, h);
  }
  return m;
}
template <float (*ToF32)(std::uint16_t)>
std::uint16_t Decode16(const unsigned char* in, std::size_t n, float* out) {
  std::uint16_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t h = Load16(in + 2 * i);
    m = std::max<std::uint16_t>(m, h & 0x7FFF);
    out[i] = ToF32(h);
  }
  return m;
}
std::uint16_t Bf16Encode(const float* x, std::size_t n, unsigned char* out) { return Encode16<Bf16FromF32>(x, n, out); }
std::uint16_t Bf16Decode(const unsigned char* in, std::size_t n, float* out) { return Decode16<F32FromBf16>(in, n, out); }
std::uint16_t F16Encode(const float* x, std::size_t n, unsigned char* out) { return Encode16<F16FromF32>(x, n, out); }
std::uint16_t F16Decode(const unsigned char* in, std::size_t n, float* out) { return Decode16<F32FromF16>(in, n, out); }

void Fp8Encode(const float* x, const float* inv, std::size_t inv_stride, std::size_t n, unsigned char* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = Fp8FromF32(x[i] * inv[i * inv_stride]);
}
bool Fp8Decode(const unsigned char* in, const float* s, std::size_t s_stride, std::size_t n, float* out) {
  bool nan = false;
  for (std::size_t i = 0; i < n; ++i) {
    nan |= (in[i] & 0x7F) == 0x7F;
    out[i] = kFp8Table[in[i]] * s[i * s_stride];
  }
  return nan;
}

void Int8Encode(const float* x, const float* inv, std::size_t n, unsigned char* out) {
  for (std::size_t i = 0; i < n; ++i) {
    const float y = std::clamp(x[i] * inv[i], -127.0f, 127.0f);
    out[i] = static_cast<unsigned char>(static_cast<std::int8_t>(std::nearbyint(y)));
  }
}
void Int8Decode(const unsigned char* in, const float* s, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<std::int8_t>(in[i])) * s[i];
}

// The reference int4 loops (kernels.h): group by group, amax, scale, then the codes ORed into the
// zeroed payload one nibble at a time.
bool Int4Encode(const float* x, std::size_t rows, std::size_t cols, std::size_t group, float max_scale, float* scales,
                unsigned char* out) {
  const std::size_t groups = (cols + group - 1) / group;
  std::memset(out, 0, (rows * cols + 1) / 2);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t c0 = g * group, c1 = std::min(cols, c0 + group);
      const float* v = x + r * cols;
      std::uint32_t amax = 0;
      for (std::size_t c = c0; c < c1; ++c) amax = std::max(amax, Bits(v[c]) & 0x7FFFFFFFu);
      if (amax >= 0x7F800000u) return false;
      float s, inv;
      ScaleFromAmax(amax, kInt4Max, max_scale, &s, &inv);
      scales[r * groups + g] = s;
      for (std::size_t c = c0; c < c1; ++c) {
        const float y = std::clamp(v[c] * inv, -kInt4Max, kInt4Max);
        const auto q = static_cast<unsigned>(static_cast<int>(std::nearbyint(y))) & 0xFu;
        const std::size_t k = r * cols + c;
        out[k >> 1] = static_cast<unsigned char>(out[k >> 1] | (q << ((k & 1) * 4)));
      }
    }
  }
  return true;
}

void Int4Decode(const unsigned char* in, std::size_t rows, std::size_t cols, std::size_t group, const float* scales,
                float* out) {
  const std::size_t groups = (cols + group - 1) / group;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      const std::size_t k = r * cols + c;
      const int nib = (in[k >> 1] >> ((k & 1) * 4)) & 0xF;
      const int q = nib >= 8 ? nib - 16 : nib;
      out[k] = static_cast<float>(q) * scales[r * groups + c / group];
    }
  }
}

}  // namespace

void ScaleFromAmax(std::uint32_t amax_bits, float qmax, float max_scale, float* scale, float* inv) {
  const float s = std::min(FromBits(amax_bits) / qmax, max_scale);
  if (s < kMinScale) {
    *scale = 0.0f;
    *inv = 0.0f;
  } else {
    *scale = s;
    *inv = 1.0f / s;
  }
}

std::uint16_t Bf16FromF32(float x) {
  const std::uint32_t b = Bits(x), a = b & 0x7FFFFFFFu;
  const std::uint32_t r = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(((b >> 16) & 0x8000u) | r);
}
float F32FromBf16(std::uint16_t h) { return FromBits(static_cast<std::uint32_t>(h) << 16); }

std::uint16_t F16FromF32(float x) {
  const std::uint32_t b = Bits(x), a = b & 0x7FFFFFFFu;
  const std::uint32_t sign = (b >> 16) & 0x8000u;
  std::uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u;  // NaN
  } else if (a >= 0x477FF000u) {
    h = 0x7C00u;  // >= 65520 rounds to +-Inf (65504 is the largest finite f16)
  } else if (a < 0x38800000u) {
    // Below 2^-14: an f16 subnormal, a multiple of 2^-24. Adding 0.5 (ulp 2^-24) rounds to nearest even.
    h = Bits(FromBits(a) + 0.5f) - 0x3F000000u;
  } else {
    h = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
  }
  return static_cast<std::uint16_t>(sign | h);
}
float F32FromF16(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return FromBits(Bits(v) | sign);
  }
  if (e == 0x1F) return FromBits(sign | 0x7F800000u | (m << 13));
  return FromBits(sign | ((e + 112u) << 23) | (m << 13));
}

std::uint8_t Fp8FromF32(float y) {
  const std::uint32_t b = Bits(y);
  const std::uint32_t sign = (b >> 24) & 0x80u;
  const std::uint32_t a = std::min(b & 0x7FFFFFFFu, 0x43E00000u);  // |y| <= 448
  std::uint32_t code;
  if (a < 0x3C800000u) {
    // Below 2^-6: an E4M3 subnormal, a multiple of 2^-9. Adding 2^14 (ulp 2^-9) rounds to nearest even.
    code = Bits(FromBits(a) + 16384.0f) - 0x46800000u;
  } else {
    code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return static_cast<std::uint8_t>(sign | code);
}
float F32FromFp8(std::uint8_t code) { return kFp8Table[code]; }
const float* Fp8Values() { return kFp8Table.data(); }

const KernelTable& ScalarKernels() {
  static const KernelTable t{"scalar",  MaxAbsBits, ColMaxAbsBits, Bf16Encode, Bf16Decode, F16Encode, F16Decode,
                             Fp8Encode, Fp8Decode,  Int8Encode,    Int8Decode, Int4Encode, Int4Decode};
  return t;
}

}  // namespace terrace::codec::detail
