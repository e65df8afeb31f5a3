// CUDA builds: page-locked host memory from the CUDA runtime.
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "tiers/host/pinned_memory.h"

namespace terrace::tiers::cuda_host {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
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
