// CUDA builds: page-locked host memory from the CUDA runtime.
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "tiers/host/pinned_memory.h"

namespace terrace::tiers::cuda_host {

CudaDevices ProbeDevices() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver / no device" error
    return {0, fmt::format("cudaGetDeviceCount failed: {} ({})", cudaGetErrorString(err), static_cast<int>(err))};
  }
  if (n <= 0) return {0, "cudaGetDeviceCount found no device"};
  return {n, ""};
}

Status HostAlloc(std::size_t bytes, std::byte** out) {
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::Unavailable(fmt::format("cudaHostAlloc of {} bytes failed: {}", bytes, cudaGetErrorString(err)));
  }
  *out = static_cast<std::byte*>(p);
  return Status::Ok();
}

void HostFree(std::byte* p) { (void)cudaFreeHost(p); }

}  // namespace terrace::tiers::cuda_host
