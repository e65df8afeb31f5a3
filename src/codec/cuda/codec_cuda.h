// CUDA kernels for the KV codecs (docs/kv-codecs.md): bf16, fp8 E4M3fn (per-channel and per-block
// scales) and int8 per-channel. They write exactly the scales and payload bytes that the CPU
// Encode writes for the same input (same scale rule, same nearest-even rounding, IEEE fp32 multiply
// and division, no FMA contraction), so device-encoded payloads decode on the CPU and back.
//
// Every pointer is a device pointer; rows * cols values, row-major. Calls are asynchronous on
// `stream` and return the launch status. `scratch_amax` holds `cols` (per-channel) or 1 (per-block)
// uint32 values; the encoders overwrite it. Non-finite input: the encoders set *nonfinite (a device
// uint32, zeroed by the caller) to 1 and the payload is unspecified; the caller refuses the block.
// Internal to Terrace (not installed). Thread-safety: as the CUDA stream.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace terrace::codec::cuda {

cudaError_t EncodeBf16(const float* x, std::int64_t n, std::uint16_t* out, std::uint32_t* nonfinite, cudaStream_t stream);
cudaError_t DecodeBf16(const std::uint16_t* in, std::int64_t n, float* out, cudaStream_t stream);

// per_channel: one scale per column (codec "fp8"), else one for the block ("fp8-block").
cudaError_t EncodeFp8(const float* x, std::int64_t rows, std::int64_t cols, bool per_channel, std::uint32_t* scratch_amax,
                      float* scales, std::uint8_t* out, std::uint32_t* nonfinite, cudaStream_t stream);
cudaError_t DecodeFp8(const std::uint8_t* in, const float* scales, std::int64_t rows, std::int64_t cols, bool per_channel,
                      float* out, cudaStream_t stream);

cudaError_t EncodeInt8(const float* x, std::int64_t rows, std::int64_t cols, std::uint32_t* scratch_amax, float* scales,
                       std::uint8_t* out, std::uint32_t* nonfinite, cudaStream_t stream);
cudaError_t DecodeInt8(const std::uint8_t* in, const float* scales, std::int64_t rows, std::int64_t cols, float* out,
                       cudaStream_t stream);

}  // namespace terrace::codec::cuda
