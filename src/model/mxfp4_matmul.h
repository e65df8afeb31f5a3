// The fused MXFP4 dequantise-and-multiply kernel the MoE computes MXFP4 experts with
// (docs/model.md, "MXFP4 experts"): y = x W^T for W an Mxfp4Matrix, read straight from the packed
// E2M1 nibbles and E8M0 scales; no fp32 copy of W is made (the T > 1 path dequantises a few rows at
// a time into a small per-thread tile and reuses it across the tokens).
//
// Exactness: every dequantised weight E2M1 x 2^(s-127) is exact in fp32 (subnormals included) for
// the scales ValidateMxfp4 accepts, and products and sums are fp32 with fp32 accumulation. Only the
// summation order differs from an fp32 GEMV over DequantizeMxfp4's output, so the two differ by at
// most 2 * gamma_K * sum_k |w_k x_k| per output (gamma_K = K u / (1 - K u), u = 2^-24). For one
// kernel choice the result is a deterministic function of (W's bytes, x): an expert served from
// any tier or buffer gives bit-identical outputs.
//
// Thread-safety: reentrant (per-thread scratch). W must have passed ValidateMxfp4 (no NaN scale).
#pragma once

#include <cstdint>
#include <string_view>

#include "terrace/model_weights.h"

namespace terrace::model {

enum class Mxfp4Kernel : std::uint8_t {
  kAuto,    // kAvx2 when the CPU has AVX2 and FMA, else kScalar
  kScalar,  // portable loops (the oracle-like path; any CPU)
  kAvx2,    // AVX2 + FMA: vpermps over a scaled 8-entry magnitude table, sign from the nibble's bit 3
};

// True when this build and CPU can run Mxfp4Kernel::kAvx2.
bool Mxfp4Avx2Available();
// The kernel kAuto resolves to; "scalar" or "avx2".
std::string_view Mxfp4KernelName(Mxfp4Kernel kernel);

// y[m, w.rows] = x[m, w.cols] * W^T (+ y when accumulate), row-major, as ops::Linear. kAvx2 on a
// CPU without AVX2 falls back to kScalar.
void Mxfp4Linear(const Mxfp4Matrix& w, const float* x, std::int64_t m, float* y, bool accumulate = false,
                 Mxfp4Kernel kernel = Mxfp4Kernel::kAuto);

}  // namespace terrace::model
