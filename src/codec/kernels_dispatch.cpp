#include <cstdlib>
#include <cstring>

#include "src/codec/kernels.h"

namespace terrace::codec::detail {

const KernelTable& Kernels() {
  static const KernelTable* const table = [] {
    const char* env = std::getenv("TERRACE_CODEC_KERNELS");
    if (env != nullptr && std::strcmp(env, "scalar") == 0) return &ScalarKernels();
    const KernelTable* avx2 = Avx2Kernels();
    return avx2 != nullptr ? avx2 : &ScalarKernels();
  }();
  return *table;
}

}  // namespace terrace::codec::detail
