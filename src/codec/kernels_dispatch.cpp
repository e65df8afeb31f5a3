#include <cstdlib>
#include <cstring>
#include <string_view>

#include "src/codec/kernels.h"

namespace terrace::codec::detail {

const KernelTable& Kernels() {
  static const KernelTable* const table = [] {
    const char* env = std::getenv("TERRACE_CODEC_KERNELS");
    const std::string_view want = env != nullptr ? env : "";
    const KernelTable* avx2 = Avx2Kernels();
    const KernelTable* avx = AvxKernels();
    if (want == "scalar") return &ScalarKernels();
    if (want == "avx" && avx != nullptr) return avx;
    if (avx2 != nullptr) return avx2;
    if (avx != nullptr) return avx;
    return &ScalarKernels();
  }();
  return *table;
}

}  // namespace terrace::codec::detail
