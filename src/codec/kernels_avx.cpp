// The SIMD kernels compiled for AVX + F16C (256-bit float, 128-bit integer operations; this file's
// compile flags: src/codec/CMakeLists.txt). Only AvxKernels() in kernels_dispatch.cpp, after
// checking the CPU, hands out this table.
#define TERRACE_CODEC_SIMD_NAME "avx"
#include "src/codec/kernels_simd.inc"

namespace terrace::codec::detail {
const KernelTable& AvxKernelTable() { return kSimdTable; }
}  // namespace terrace::codec::detail
