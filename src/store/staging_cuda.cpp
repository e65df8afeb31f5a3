// CUDA builds: the bounce buffers are registered with the CUDA driver when a device is usable.
#include <cuda_runtime_api.h>

#include "src/store/staging_memory.h"

namespace terrace::store_internal::staging_memory {

bool CudaDevicePresent() {
  static const bool present = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no driver / no device" error
      return false;
    }
    return n > 0;
  }();
  return present;
}

bool Register(void* p, std::size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

void Unregister(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace terrace::store_internal::staging_memory
