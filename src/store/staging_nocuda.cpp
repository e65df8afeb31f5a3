// Builds without CUDA: no device, so the bounce buffers are never registered.
#include "src/store/staging_memory.h"

namespace terrace::store_internal::staging_memory {

bool CudaDevicePresent() { return false; }

bool Register(void* p, std::size_t bytes) {
  (void)p;
  (void)bytes;
  return false;
}

void Unregister(void* p) { (void)p; }

}  // namespace terrace::store_internal::staging_memory
