// See codec_cuda.h. The element rules mirror src/codec/kernels_scalar.cpp line for line; the
// explicit __fmul_rn / __fadd_rn / __fdiv_rn / __frcp_rn keep nvcc from contracting or
// approximating them, and the build never uses --use_fast_math (denormals are kept).
#include "src/codec/cuda/codec_cuda.h"

namespace terrace::codec::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kMinScale = 1.17549435e-38f;  // 2^-126

int Blocks(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? (b < 1 ? 1 : b) : 65535 * 8);
}

__device__ std::uint32_t Fp8Code(float y) {
  const std::uint32_t b = __float_as_uint(y);
  const std::uint32_t sign = (b >> 24) & 0x80u;
  const std::uint32_t a = min(b & 0x7FFFFFFFu, 0x43E00000u);
  std::uint32_t code;
  if (a < 0x3C800000u) {
    code = __float_as_uint(__fadd_rn(__uint_as_float(a), 16384.0f)) - 0x46800000u;
  } else {
    code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return sign | code;
}

__device__ float Fp8Value(std::uint32_t c) {
  const std::uint32_t mag = c & 0x7Fu;
  std::uint32_t v;
  if (mag == 0x7Fu) {
    v = 0x7FC00000u;
  } else if (mag < 8) {
    v = __float_as_uint(__fmul_rn(static_cast<float>(mag), 0.001953125f));
  } else {
    v = (mag << 20) + (120u << 23);
  }
  return __uint_as_float(v | ((c & 0x80u) << 24));
}

// limit: the largest code magnitude a block can hold (fp8 448, int8 128); the scale is capped at
// FLT_MAX / limit rounded down, as on the CPU (docs/kv-codecs.md, "Scales").
__device__ void ScaleFromAmax(std::uint32_t amax_bits, float qmax, float limit, float* s, float* inv) {
  const float cap = nextafterf(__fdiv_rn(3.40282347e+38f, limit), 0.0f);
  const float v = fminf(__fdiv_rn(__uint_as_float(amax_bits), qmax), cap);
  if (v < kMinScale) {
    *s = 0.0f;
    *inv = 0.0f;
  } else {
    *s = v;
    *inv = __frcp_rn(v);
  }
}

__global__ void AmaxKernel(const float* x, std::int64_t n, std::int64_t cols, bool per_channel, std::uint32_t* amax,
                           std::uint32_t* nonfinite) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t a = __float_as_uint(x[i]) & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) *nonfinite = 1;
    atomicMax(amax + (per_channel ? i % cols : 0), a);
  }
}

__global__ void ScalesKernel(const std::uint32_t* amax, std::int64_t count, float qmax, float limit, float* scales) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  float s, inv;
  ScaleFromAmax(amax[i], qmax, limit, &s, &inv);
  scales[i] = s;
}

__global__ void Fp8EncodeKernel(const float* x, std::int64_t n, std::int64_t cols, bool per_channel,
                                const float* scales, std::uint8_t* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float s = scales[per_channel ? i % cols : 0];
    const float inv = s == 0.0f ? 0.0f : __frcp_rn(s);
    out[i] = static_cast<std::uint8_t>(Fp8Code(__fmul_rn(x[i], inv)));
  }
}

__global__ void Fp8DecodeKernel(const std::uint8_t* in, std::int64_t n, std::int64_t cols, bool per_channel,
                                const float* scales, float* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __fmul_rn(Fp8Value(in[i]), scales[per_channel ? i % cols : 0]);
  }
}

__global__ void Int8EncodeKernel(const float* x, std::int64_t n, std::int64_t cols, const float* scales,
                                 std::uint8_t* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float s = scales[i % cols];
    const float inv = s == 0.0f ? 0.0f : __frcp_rn(s);
    const float y = fminf(fmaxf(__fmul_rn(x[i], inv), -127.0f), 127.0f);
    out[i] = static_cast<std::uint8_t>(static_cast<std::int8_t>(__float2int_rn(y)));
  }
}

__global__ void Int8DecodeKernel(const std::uint8_t* in, std::int64_t n, std::int64_t cols, const float* scales,
                                 float* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __fmul_rn(static_cast<float>(static_cast<std::int8_t>(in[i])), scales[i % cols]);
  }
}

__global__ void Bf16EncodeKernel(const float* x, std::int64_t n, std::uint16_t* out, std::uint32_t* nonfinite) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t b = __float_as_uint(x[i]), a = b & 0x7FFFFFFFu;
    const std::uint32_t r = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
    if (r >= 0x7F80u) *nonfinite = 1;  // NaN, Inf, or rounds past bf16's largest finite value
    out[i] = static_cast<std::uint16_t>(((b >> 16) & 0x8000u) | r);
  }
}

__global__ void Bf16DecodeKernel(const std::uint16_t* in, std::int64_t n, float* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __uint_as_float(static_cast<std::uint32_t>(in[i]) << 16);
  }
}

cudaError_t Quantise(const float* x, std::int64_t rows, std::int64_t cols, bool per_channel, float qmax, float limit,
                     std::uint32_t* amax, float* scales, std::uint32_t* nonfinite, cudaStream_t stream) {
  const std::int64_t n = rows * cols, count = per_channel ? cols : 1;
  if (cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(std::uint32_t) * count, stream); e != cudaSuccess) return e;
  if (n > 0) AmaxKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, cols, per_channel, amax, nonfinite);
  ScalesKernel<<<Blocks(count), kThreads, 0, stream>>>(amax, count, qmax, limit, scales);
  return cudaGetLastError();
}

}  // namespace

cudaError_t EncodeBf16(const float* x, std::int64_t n, std::uint16_t* out, std::uint32_t* nonfinite, cudaStream_t stream) {
  if (n > 0) Bf16EncodeKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, out, nonfinite);
  return cudaGetLastError();
}

cudaError_t DecodeBf16(const std::uint16_t* in, std::int64_t n, float* out, cudaStream_t stream) {
  if (n > 0) Bf16DecodeKernel<<<Blocks(n), kThreads, 0, stream>>>(in, n, out);
  return cudaGetLastError();
}

cudaError_t EncodeFp8(const float* x, std::int64_t rows, std::int64_t cols, bool per_channel, std::uint32_t* scratch_amax,
                      float* scales, std::uint8_t* out, std::uint32_t* nonfinite, cudaStream_t stream) {
  if (cudaError_t e = Quantise(x, rows, cols, per_channel, 448.0f, 448.0f, scratch_amax, scales, nonfinite, stream); e != cudaSuccess)
    return e;
  const std::int64_t n = rows * cols;
  if (n > 0) Fp8EncodeKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, cols, per_channel, scales, out);
  return cudaGetLastError();
}

cudaError_t DecodeFp8(const std::uint8_t* in, const float* scales, std::int64_t rows, std::int64_t cols, bool per_channel,
                      float* out, cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  if (n > 0) Fp8DecodeKernel<<<Blocks(n), kThreads, 0, stream>>>(in, n, cols, per_channel, scales, out);
  return cudaGetLastError();
}

cudaError_t EncodeInt8(const float* x, std::int64_t rows, std::int64_t cols, std::uint32_t* scratch_amax, float* scales,
                       std::uint8_t* out, std::uint32_t* nonfinite, cudaStream_t stream) {
  if (cudaError_t e = Quantise(x, rows, cols, true, 127.0f, 128.0f, scratch_amax, scales, nonfinite, stream); e != cudaSuccess)
    return e;
  const std::int64_t n = rows * cols;
  if (n > 0) Int8EncodeKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, cols, scales, out);
  return cudaGetLastError();
}

cudaError_t DecodeInt8(const std::uint8_t* in, const float* scales, std::int64_t rows, std::int64_t cols, float* out,
                       cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  if (n > 0) Int8DecodeKernel<<<Blocks(n), kThreads, 0, stream>>>(in, n, cols, scales, out);
  return cudaGetLastError();
}

}  // namespace terrace::codec::cuda
