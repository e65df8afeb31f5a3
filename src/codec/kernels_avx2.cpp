#include "src/codec/kernels.h"
namespace terrace::codec::detail {
const KernelTable* Avx2Kernels() { return nullptr; }
const KernelTable* AvxKernels() { return nullptr; }
}
