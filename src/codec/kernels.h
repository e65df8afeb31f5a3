// The element kernels behind Encode/Decode: one scalar reference implementation and an AVX2/F16C
// one, chosen once per process by CPU feature detection (Kernels()). Both produce bit-identical
// output for every input; tests/codec checks the dispatched table against the scalar one.
//
// Conventions: `x` fp32 input, `n` element count, byte outputs/inputs are unaligned. "abs bits" of
// a float is its bit pattern with the sign cleared; its unsigned order is the order of |x|, and a
// value >= 0x7F800000 is NaN or +-Inf. Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace terrace::codec::detail {

struct KernelTable {
  const char* name;  // "scalar" or "avx2"
  // Max abs bits over x[0, n) (0 for n == 0).
  std::uint32_t (*max_abs_bits)(const float* x, std::size_t n);
  // colmax[c] = max(colmax[c], abs bits of x[r*cols + c]) for every row r.
  void (*col_max_abs_bits)(const float* x, std::size_t rows, std::size_t cols, std::uint32_t* colmax);
  // bf16 / f16, round to nearest even; returns the max abs bits of the 16-bit results (so the caller
  // can refuse a result that is Inf/NaN: >= 0x7F80 for bf16, >= 0x7C00 for f16).
  std::uint16_t (*bf16_encode)(const float* x, std::size_t n, unsigned char* out);
  // Decoders return the max abs 16-bit code read (so the caller can refuse a stored NaN / Inf).
  std::uint16_t (*bf16_decode)(const unsigned char* in, std::size_t n, float* out);
  std::uint16_t (*f16_encode)(const float* x, std::size_t n, unsigned char* out);
  std::uint16_t (*f16_decode)(const unsigned char* in, std::size_t n, float* out);
  // FP8 E4M3fn codes of y = x[i] * inv[i] (inv_stride 1) or x[i] * inv[0] (inv_stride 0), |y| clamped to 448.
  void (*fp8_encode)(const float* x, const float* inv, std::size_t inv_stride, std::size_t n, unsigned char* out);
  // out[i] = value(code[i]) * s[i or 0]; returns true when some code is a NaN (0x7F / 0xFF).
  bool (*fp8_decode)(const unsigned char* in, const float* s, std::size_t s_stride, std::size_t n, float* out);
  // int8: q = clamp(rne(x[i] * inv[i]), -127, 127) (inv per element, stride 1).
  void (*int8_encode)(const float* x, const float* inv, std::size_t n, unsigned char* out);
  void (*int8_decode)(const unsigned char* in, const float* s, std::size_t n, float* out);
  // int4, groups of `group` (> 0) columns along each row of x [rows, cols] (the last group of a row is
  // shorter when group does not divide cols): scales[r * groups + g] is ScaleFromAmax(amax of the
  // group, 7, max_scale); value k = r * cols + c is the nibble clamp(rne(x[k] * inv), -7, 7) & 0xF,
  // the low nibble of out[k / 2] for even k, the high one for odd k, and the nibble after an odd
  // count is 0. Writes every byte of out[0, (rows * cols + 1) / 2). Returns false, with scales and
  // out partly written, when x holds a NaN or Inf (each group is checked before its codes).
  bool (*int4_encode)(const float* x, std::size_t rows, std::size_t cols, std::size_t group, float max_scale,
                      float* scales, unsigned char* out);
  // out[k] = (nibble k as a signed 4-bit value, -8..7) * scales[r * groups + c / group].
  void (*int4_decode)(const unsigned char* in, std::size_t rows, std::size_t cols, std::size_t group,
                      const float* scales, float* out);
};

const KernelTable& ScalarKernels();
// nullptr when this CPU lacks AVX2 + F16C or the build is not for x86-64.
const KernelTable* Avx2Kernels();
// The table Encode/Decode use: AVX2 when the CPU has it, unless TERRACE_CODEC_KERNELS=scalar.
const KernelTable& Kernels();

// scale = min(amax / qmax, max_scale) (fp32 division), 0 below the smallest normal float (2^-126);
// inv = 1 / scale, or 0 for a zero scale (docs/kv-codecs.md, "Scales"). Encode and both kernel
// tables call this one out-of-line definition (kernels_scalar.cpp, compiled without ISA flags), so
// their scales are the same bits.
void ScaleFromAmax(std::uint32_t amax_bits, float qmax, float max_scale, float* scale, float* inv);

// Scalar element conversions, shared by the kernels and the tests.
std::uint16_t Bf16FromF32(float x);
float F32FromBf16(std::uint16_t h);
std::uint16_t F16FromF32(float x);
float F32FromF16(std::uint16_t h);
std::uint8_t Fp8FromF32(float y);  // RNE to E4M3fn, |y| clamped to 448
float F32FromFp8(std::uint8_t code);  // NaN for 0x7F / 0xFF
const float* Fp8Values();  // 256 entries: F32FromFp8 of every code

}  // namespace terrace::codec::detail
