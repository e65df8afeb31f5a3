// The SIMD kernels compiled for AVX2 + F16C (this file's compile flags: src/codec/CMakeLists.txt).
// Only Avx2Kernels() in kernels_dispatch.cpp, after checking the CPU, hands out this table.
#define TERRACE_CODEC_SIMD_NAME "avx2"
#include "src/codec/kernels_simd.inc"

namespace terrace::codec::detail {
const KernelTable& Avx2KernelTable() { return kSimdTable; }
}  // namespace terrace::codec::detail
