// The CUDA launches of the codec kernels (launch.h). What each thread computes, and the kernels of
// one encode / decode in order, are in kernel_bodies.h, shared with the host emulation test; this
// file only turns each body into a grid-stride kernel. The build never uses --use_fast_math
// (subnormals are kept, divisions are IEEE), which the bodies' bit-exactness relies on.
#include "src/codec/cuda/launch.h"

namespace terrace::codec::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? (b < 1 ? 1 : b) : 65535 * 8);
}

template <class Body>
__global__ void ForEach(Body body, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    body(i);
  }
}

// The Exec of kernel_bodies.h's plans on a stream: the first failure stops the later launches.
struct DeviceExec {
  cudaStream_t stream;
  cudaError_t err = cudaSuccess;
  template <class Body>
  void Run(const Body& body, std::int64_t threads) {
    if (err != cudaSuccess || threads <= 0) return;
    ForEach<<<Blocks(threads), kThreads, 0, stream>>>(body, threads);
    err = cudaGetLastError();
  }
  void Zero(void* p, std::size_t bytes) {
    if (err == cudaSuccess && bytes > 0) err = cudaMemsetAsync(p, 0, bytes, stream);
  }
};

}  // namespace

cudaError_t LaunchEncode(const Layout& layout, const float* x, std::int64_t rows, std::int64_t cols, float* scales,
                         std::uint8_t* payload, std::uint32_t* amax, std::uint32_t* nonfinite, cudaStream_t stream) {
  DeviceExec ex{stream};
  EncodePlan(ex, layout, x, rows, cols, scales, payload, amax, nonfinite);
  return ex.err;
}

cudaError_t LaunchDecode(const Layout& layout, const float* scales, const std::uint8_t* payload, std::int64_t rows,
                         std::int64_t cols, float* out, cudaStream_t stream) {
  DeviceExec ex{stream};
  DecodePlan(ex, layout, scales, payload, rows, cols, out);
  return ex.err;
}

}  // namespace terrace::codec::cuda
