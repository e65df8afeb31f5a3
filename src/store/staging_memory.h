// The store core's CUDA seam: page-locking its staging (bounce) buffers with the CUDA driver, so
// host <-> HBM copies from them are DMA. Implemented by staging_cuda.cpp in CUDA builds (linking
// the CUDA runtime) and by staging_nocuda.cpp otherwise (no device, nothing registered), so the
// store core links CUDA only in CUDA builds. Internal.
// Thread-safety: free functions; safe to call concurrently.
#pragma once

#include <cstddef>

namespace terrace::store_internal::staging_memory {

// True when this build has CUDA and at least one device is usable (probed once, then cached).
bool CudaDevicePresent();
// cudaHostRegister(portable) of [p, p + bytes); false on any error (the error is cleared).
bool Register(void* p, std::size_t bytes);
// cudaHostUnregister of a region Register accepted.
void Unregister(void* p);

}  // namespace terrace::store_internal::staging_memory
