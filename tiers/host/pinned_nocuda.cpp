// Builds without CUDA: no device, no cudaHostAlloc.
#include "tiers/host/pinned_memory.h"

namespace terrace::tiers::cuda_host {

CudaDevices ProbeDevices() { return {0, "this Terrace build has no CUDA support (configure with -DTERRACE_CUDA=ON)"}; }

Status HostAlloc(std::size_t bytes, std::byte** out) {
  (void)bytes;
  *out = nullptr;
  return Status::Unavailable("this Terrace build has no CUDA support (configure with -DTERRACE_CUDA=ON)");
}

void HostFree(std::byte* p) { (void)p; }

}  // namespace terrace::tiers::cuda_host
