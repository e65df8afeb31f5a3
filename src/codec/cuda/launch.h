// The two entry points of codec_cuda.cu: asynchronous launches of kernel_bodies.h's plans on
// `stream`, returning the first launch error. No checks: codec_cuda.cpp (the Status API in
// codec_cuda.h) validates the spec, shape and buffers first. Device pointers only.
// Internal to terrace_codec_cuda.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "src/codec/cuda/kernel_bodies.h"

namespace terrace::codec::cuda {

cudaError_t LaunchEncode(const Layout& layout, const float* x, std::int64_t rows, std::int64_t cols, float* scales,
                         std::uint8_t* payload, std::uint32_t* amax, std::uint32_t* nonfinite, cudaStream_t stream);
cudaError_t LaunchDecode(const Layout& layout, const float* scales, const std::uint8_t* payload, std::int64_t rows,
                         std::int64_t cols, float* out, cudaStream_t stream);

}  // namespace terrace::codec::cuda
