// Chooses the kernel table once per process (kernels.h). This file is compiled without ISA flags:
// the CPU checks run on any x86-64 CPU.
#include <cstdlib>
#include <string_view>

#include "src/codec/kernels.h"

namespace terrace::codec::detail {

#if defined(TERRACE_CODEC_X86_SIMD)
const KernelTable& Avx2KernelTable();  // kernels_avx2.cpp
const KernelTable& AvxKernelTable();   // kernels_avx.cpp

const KernelTable* Avx2Kernels() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok ? &Avx2KernelTable() : nullptr;
}
const KernelTable* AvxKernels() {
  static const bool ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return ok ? &AvxKernelTable() : nullptr;
}
#else
const KernelTable* Avx2Kernels() { return nullptr; }
const KernelTable* AvxKernels() { return nullptr; }
#endif

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
