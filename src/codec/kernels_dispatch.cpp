// Chooses the kernel table once per process (kernels.h). This file is compiled without ISA flags:
// the CPU checks run on any x86-64 CPU.
#include <cstdlib>
#if defined(TERRACE_CODEC_X86_SIMD)
#include <cpuid.h>
#endif
#include <string_view>

#include "src/codec/kernels.h"

namespace terrace::codec::detail {

#if defined(TERRACE_CODEC_X86_SIMD)
const KernelTable& Avx2KernelTable();  // kernels_avx2.cpp

namespace {
// CPUID.1:ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c"). F16C instructions are
// VEX-encoded, so they also need the OS support for AVX state that __builtin_cpu_supports("avx2") checks.
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}
}  // namespace

const KernelTable* Avx2Kernels() {
  static const bool ok = __builtin_cpu_supports("avx2") && HasF16c();
  return ok ? &Avx2KernelTable() : nullptr;
}
#else
const KernelTable* Avx2Kernels() { return nullptr; }
#endif

const KernelTable& Kernels() {
  static const KernelTable* const table = [] {
    const char* env = std::getenv("TERRACE_CODEC_KERNELS");
    const std::string_view want = env != nullptr ? env : "";
    const KernelTable* avx2 = Avx2Kernels();
    if (want == "scalar" || avx2 == nullptr) return &ScalarKernels();
    return avx2;
  }();
  return *table;
}

}  // namespace terrace::codec::detail
