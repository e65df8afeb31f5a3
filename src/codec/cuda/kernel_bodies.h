// What every thread of the CUDA codec kernels computes, and the order the kernels run in, written
// once for two compilers:
//   - nvcc (codec_cuda.cu) compiles the bodies as __host__ __device__ and launches each with one
//     thread per element, per output byte or per int4 group (DeviceExec there);
//   - a plain C++ compiler (tests/codec/cuda_emulation_test.cpp, in every build) runs the same
//     bodies and plans in loops on the CPU (one "thread" at a time) and compares the bytes with
//     terrace::codec::Encode / Decode.
// So the arithmetic that runs on a GPU is exercised bit for bit on machines without one. The bodies
// mirror src/codec/kernels_scalar.cpp and codec.cpp (docs/kv-codecs.md is the spec): every fp32
// operation is one IEEE operation rounded to nearest even, spelled with its _rn intrinsic on the
// device (no FMA contraction, no approximate division; the build never uses --use_fast_math, so
// subnormals are kept), and every integer rounding is `y + 1.5 * 2^23` (one fp32 add, ties to even,
// exact for |y| <= 2^22), which equals nearbyint under the default rounding mode.
//
// Plain C++17, no CUDA header: only the device pass of nvcc (__CUDA_ARCH__) sees intrinsics.
// Pointers in a body are device pointers on the GPU and host pointers in the emulation.
// Thread-safety: bodies write disjoint outputs, except the shared non-finite flag (every writer
// stores 1) and the amax scratch (atomic max on the device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TERRACE_HD __host__ __device__ inline
#else
#define TERRACE_HD inline
#endif

namespace terrace::codec::cuda {

// The codec of one block in the format's own codes (docs/kv-codecs.md, "Byte layout": kind, scale
// mode and group size of the header).
struct Layout {
  std::uint8_t kind = 0;        // kKind*
  std::uint8_t scale_mode = 0;  // kScale*
  std::uint16_t group = 0;      // int4: 32 or 64; else 0
};
inline constexpr std::uint8_t kKindF32 = 0, kKindBf16 = 1, kKindF16 = 2, kKindFp8 = 3, kKindInt8 = 4, kKindInt4 = 5;
inline constexpr std::uint8_t kScaleNone = 0, kScalePerBlock = 1, kScalePerChannel = 2, kScaleGroup = 3;

namespace math {

inline constexpr float kMinScale = 1.17549435e-38f;  // 2^-126, the smallest normal fp32
inline constexpr float kFltMax = 3.40282347e+38f;
inline constexpr float kRoundMagic = 12582912.0f;    // 1.5 * 2^23
inline constexpr std::int32_t kRoundMagicBits = 0x4B400000;

TERRACE_HD std::uint32_t Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}
TERRACE_HD float FromBits(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}
TERRACE_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TERRACE_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TERRACE_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// *p = max(*p, v); atomic on the device (the emulation runs one body at a time).
TERRACE_HD void AtomicMaxU32(std::uint32_t* p, std::uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMax(p, v);
#else
  if (v > *p) *p = v;
#endif
}

// ---- Element conversions (kernels_scalar.cpp) ----

// bf16 code of x, nearest even (Bf16FromF32). Its magnitude is >= 0x7F80 for NaN, +-Inf and values
// that round past bf16's largest finite value: the encoder flags those.
TERRACE_HD std::uint32_t Bf16Code(float x) {
  const std::uint32_t b = Bits(x), a = b & 0x7FFFFFFFu;
  const std::uint32_t r = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
  return ((b >> 16) & 0x8000u) | r;
}
TERRACE_HD float Bf16Value(std::uint32_t h) { return FromBits(h << 16); }

// IEEE binary16 code of x, nearest even, subnormals included (F16FromF32); magnitude >= 0x7C00
// (Inf / NaN) for NaN, +-Inf and |x| >= 65520.
TERRACE_HD std::uint32_t F16Code(float x) {
  const std::uint32_t b = Bits(x), a = b & 0x7FFFFFFFu;
  const std::uint32_t sign = (b >> 16) & 0x8000u;
  std::uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u;
  } else if (a >= 0x477FF000u) {
    h = 0x7C00u;
  } else if (a < 0x38800000u) {
    h = Bits(Add(FromBits(a), 0.5f)) - 0x3F000000u;  // below 2^-14: a multiple of 2^-24
  } else {
    h = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
  }
  return sign | h;
}
TERRACE_HD float F16Value(std::uint32_t h) {  // F32FromF16
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) return FromBits(Bits(Mul(static_cast<float>(m), 5.9604644775390625e-08f)) | sign);  // m * 2^-24
  if (e == 0x1Fu) return FromBits(sign | 0x7F800000u | (m << 13));
  return FromBits(sign | ((e + 112u) << 23) | (m << 13));
}

// E4M3fn code of y, |y| clamped to 448, nearest even (Fp8FromF32).
TERRACE_HD std::uint32_t Fp8Code(float y) {
  const std::uint32_t b = Bits(y);
  const std::uint32_t sign = (b >> 24) & 0x80u;
  const std::uint32_t abs = b & 0x7FFFFFFFu;
  const std::uint32_t a = abs < 0x43E00000u ? abs : 0x43E00000u;
  std::uint32_t code;
  if (a < 0x3C800000u) {
    code = Bits(Add(FromBits(a), 16384.0f)) - 0x46800000u;  // below 2^-6: a multiple of 2^-9
  } else {
    code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return sign | code;
}
// The value of an E4M3fn code (F32FromFp8): NaN for 0x7F / 0xFF.
TERRACE_HD float Fp8Value(std::uint32_t c) {
  const std::uint32_t mag = c & 0x7Fu;
  std::uint32_t v;
  if (mag == 0x7Fu) {
    v = 0x7FC00000u;
  } else if (mag < 8) {
    v = Bits(Mul(static_cast<float>(mag), 0.001953125f));  // m * 2^-9
  } else {
    v = (mag << 20) + (120u << 23);
  }
  return FromBits(v | ((c & 0x80u) << 24));
}

// clamp(round_even(y), -qmax, qmax) for qmax <= 2^22 (std::clamp, then nearbyint).
TERRACE_HD std::int32_t RoundClamp(float y, float qmax) {
  const float c = y < -qmax ? -qmax : (qmax < y ? qmax : y);
  return static_cast<std::int32_t>(Bits(Add(c, kRoundMagic))) - kRoundMagicBits;
}

// ---- Scales (kernels_scalar.cpp, ScaleFromAmax; docs/kv-codecs.md "Scales") ----

// scale = min(amax / qmax, max_scale), 0 below 2^-126; `limit` is the largest code magnitude a
// block can hold (fp8 448, int8 128, int4 8): max_scale = FLT_MAX / limit rounded down (the next
// smaller fp32 of a positive normal is its bits minus one).
TERRACE_HD float ScaleFromAmax(std::uint32_t amax_bits, float qmax, float limit) {
  const float cap = FromBits(Bits(Div(kFltMax, limit)) - 1u);
  const float v = Div(FromBits(amax_bits), qmax);
  const float s = cap < v ? cap : v;  // std::min(v, cap)
  return s < kMinScale ? 0.0f : s;
}
// The multiplier of a scale: 1 / scale, 0 for a zero scale (what ScaleFromAmax's `inv` is).
TERRACE_HD float InvOf(float scale) { return scale == 0.0f ? 0.0f : Div(1.0f, scale); }

inline constexpr float kFp8Qmax = 448.0f, kFp8Limit = 448.0f;
inline constexpr float kInt8Qmax = 127.0f, kInt8Limit = 128.0f;
inline constexpr float kInt4Qmax = 7.0f, kInt4Limit = 8.0f;

TERRACE_HD bool NonFiniteBits(std::uint32_t abs_bits) { return abs_bits >= 0x7F800000u; }

}  // namespace math

// ---- Bodies: operator()(i) is what thread i does. ----

struct F32EncodeBody {
  const float* x;
  float* out;
  std::uint32_t* nonfinite;
  TERRACE_HD void operator()(std::int64_t i) const {
    if (math::NonFiniteBits(math::Bits(x[i]) & 0x7FFFFFFFu)) *nonfinite = 1;
    out[i] = x[i];
  }
};
struct F32DecodeBody {
  const float* in;
  float* out;
  TERRACE_HD void operator()(std::int64_t i) const { out[i] = in[i]; }
};

// bf16 (f16 = false) or f16 (f16 = true).
struct Half16EncodeBody {
  const float* x;
  std::uint16_t* out;
  std::uint32_t* nonfinite;
  bool f16;
  TERRACE_HD void operator()(std::int64_t i) const {
    const std::uint32_t h = f16 ? math::F16Code(x[i]) : math::Bf16Code(x[i]);
    if ((h & 0x7FFFu) >= (f16 ? 0x7C00u : 0x7F80u)) *nonfinite = 1;  // NaN, Inf, or past the largest finite value
    out[i] = static_cast<std::uint16_t>(h);
  }
};
struct Half16DecodeBody {
  const std::uint16_t* in;
  float* out;
  bool f16;
  TERRACE_HD void operator()(std::int64_t i) const { out[i] = f16 ? math::F16Value(in[i]) : math::Bf16Value(in[i]); }
};

// Per-channel (amax[i % cols]) or per-block (amax[0]) max of |x| bits; flags NaN / Inf.
struct AmaxBody {
  const float* x;
  std::int64_t cols;
  bool per_channel;
  std::uint32_t* amax;
  std::uint32_t* nonfinite;
  TERRACE_HD void operator()(std::int64_t i) const {
    const std::uint32_t a = math::Bits(x[i]) & 0x7FFFFFFFu;
    if (math::NonFiniteBits(a)) *nonfinite = 1;
    math::AtomicMaxU32(amax + (per_channel ? i % cols : 0), a);
  }
};
struct ScalesBody {
  const std::uint32_t* amax;
  float qmax, limit;
  float* scales;
  TERRACE_HD void operator()(std::int64_t i) const { scales[i] = math::ScaleFromAmax(amax[i], qmax, limit); }
};

// fp8 (int8 = false, per-channel or per-block scales) or int8 (int8 = true, per-channel).
struct ScaledEncodeBody {
  const float* x;
  std::int64_t cols;
  bool per_channel, int8;
  const float* scales;
  std::uint8_t* out;
  TERRACE_HD void operator()(std::int64_t i) const {
    const float y = math::Mul(x[i], math::InvOf(scales[per_channel ? i % cols : 0]));
    out[i] = static_cast<std::uint8_t>(int8 ? static_cast<std::uint32_t>(math::RoundClamp(y, math::kInt8Qmax))
                                            : math::Fp8Code(y));
  }
};
struct ScaledDecodeBody {
  const std::uint8_t* in;
  std::int64_t cols;
  bool per_channel, int8;
  const float* scales;
  float* out;
  TERRACE_HD void operator()(std::int64_t i) const {
    const float v = int8 ? static_cast<float>(static_cast<std::int8_t>(in[i])) : math::Fp8Value(in[i]);
    out[i] = math::Mul(v, scales[per_channel ? i % cols : 0]);
  }
};

// int4: thread t owns group t % groups of row t / groups, columns [g*G, min(cols, (g+1)*G)).
struct Int4ScalesBody {
  const float* x;
  std::int64_t cols, group;
  float* scales;
  std::uint32_t* nonfinite;
  TERRACE_HD void operator()(std::int64_t t) const {
    const std::int64_t groups = (cols + group - 1) / group;
    const std::int64_t r = t / groups, c0 = (t % groups) * group;
    const std::int64_t c1 = c0 + group < cols ? c0 + group : cols;
    std::uint32_t amax = 0;
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::uint32_t a = math::Bits(x[r * cols + c]) & 0x7FFFFFFFu;
      amax = a > amax ? a : amax;
    }
    if (math::NonFiniteBits(amax)) *nonfinite = 1;
    scales[t] = math::ScaleFromAmax(amax, math::kInt4Qmax, math::kInt4Limit);
  }
};
// int4 packing: thread j writes byte j, values k = 2j (low nibble) and 2j + 1 (high nibble; 0 past
// the last value), so no two threads share a byte even when a row or group ends mid-byte.
struct Int4PackBody {
  const float* x;
  std::int64_t n, cols, group;
  const float* scales;
  std::uint8_t* out;
  TERRACE_HD void operator()(std::int64_t j) const {
    const std::int64_t groups = (cols + group - 1) / group;
    std::uint32_t byte = 0;
    for (std::int64_t k = 2 * j; k < 2 * j + 2 && k < n; ++k) {
      const std::int64_t r = k / cols, c = k % cols;
      const float inv = math::InvOf(scales[r * groups + c / group]);
      const auto q = static_cast<std::uint32_t>(math::RoundClamp(math::Mul(x[k], inv), math::kInt4Qmax)) & 0xFu;
      byte |= q << ((k & 1) * 4);
    }
    out[j] = static_cast<std::uint8_t>(byte);
  }
};
struct Int4DecodeBody {
  const std::uint8_t* in;
  std::int64_t cols, group;
  const float* scales;
  float* out;
  TERRACE_HD void operator()(std::int64_t k) const {
    const std::int64_t groups = (cols + group - 1) / group;
    const std::int32_t nib = (in[k >> 1] >> ((k & 1) * 4)) & 0xF;
    const std::int32_t q = nib >= 8 ? nib - 16 : nib;
    out[k] = math::Mul(static_cast<float>(q), scales[(k / cols) * groups + (k % cols) / group]);
  }
};

// ---- Plans: the kernels of one encode / decode, in stream order. ----
// Exec provides `template <class B> void Run(const B& body, std::int64_t threads)` (nothing for
// threads <= 0) and `void Zero(void* p, std::size_t bytes)`. Shapes and buffers are the caller's
// to check (codec_cuda.cpp): rows * cols values; `scales` holds the block's scale count, `payload`
// its raw payload bytes (4-byte aligned), `amax` the scratch of ScratchWords.

// uint32 scratch words an encode needs: per-channel `cols` (0 when there are no rows: such a block
// has no scales, detail::ScaleCount), per-block 1, else 0.
inline std::int64_t ScratchWords(const Layout& l, std::int64_t rows, std::int64_t cols) {
  if (l.kind != kKindFp8 && l.kind != kKindInt8) return 0;
  return l.scale_mode == kScalePerChannel ? (rows == 0 ? 0 : cols) : 1;
}

template <class Exec>
void EncodePlan(Exec& ex, const Layout& l, const float* x, std::int64_t rows, std::int64_t cols, float* scales,
                std::uint8_t* payload, std::uint32_t* amax, std::uint32_t* nonfinite) {
  const std::int64_t n = rows * cols;
  switch (l.kind) {
    case kKindF32: ex.Run(F32EncodeBody{x, reinterpret_cast<float*>(payload), nonfinite}, n); break;
    case kKindBf16:
    case kKindF16:
      ex.Run(Half16EncodeBody{x, reinterpret_cast<std::uint16_t*>(payload), nonfinite, l.kind == kKindF16}, n);
      break;
    case kKindFp8:
    case kKindInt8: {
      const bool per_channel = l.scale_mode == kScalePerChannel, int8 = l.kind == kKindInt8;
      const std::int64_t count = ScratchWords(l, rows, cols);
      ex.Zero(amax, sizeof(std::uint32_t) * static_cast<std::size_t>(count));
      ex.Run(AmaxBody{x, cols, per_channel, amax, nonfinite}, n);
      ex.Run(ScalesBody{amax, int8 ? math::kInt8Qmax : math::kFp8Qmax, int8 ? math::kInt8Limit : math::kFp8Limit, scales},
             count);
      ex.Run(ScaledEncodeBody{x, cols, per_channel, int8, scales, payload}, n);
      break;
    }
    case kKindInt4: {
      const std::int64_t group = l.group, groups = (cols + group - 1) / group;
      ex.Run(Int4ScalesBody{x, cols, group, scales, nonfinite}, rows * groups);
      ex.Run(Int4PackBody{x, n, cols, group, scales, payload}, (n + 1) / 2);
      break;
    }
    default: break;
  }
}

template <class Exec>
void DecodePlan(Exec& ex, const Layout& l, const float* scales, const std::uint8_t* payload, std::int64_t rows,
                std::int64_t cols, float* out) {
  const std::int64_t n = rows * cols;
  switch (l.kind) {
    case kKindF32: ex.Run(F32DecodeBody{reinterpret_cast<const float*>(payload), out}, n); break;
    case kKindBf16:
    case kKindF16:
      ex.Run(Half16DecodeBody{reinterpret_cast<const std::uint16_t*>(payload), out, l.kind == kKindF16}, n);
      break;
    case kKindFp8:
    case kKindInt8:
      ex.Run(ScaledDecodeBody{payload, cols, l.scale_mode == kScalePerChannel, l.kind == kKindInt8, scales, out}, n);
      break;
    case kKindInt4: ex.Run(Int4DecodeBody{payload, cols, l.group, scales, out}, n); break;
    default: break;
  }
}

}  // namespace terrace::codec::cuda
