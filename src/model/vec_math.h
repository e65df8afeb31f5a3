// Element-wise transcendental functions over arrays (exp, sigmoid, SiLU), AVX2 + FMA when the CPU
// has them (simd::Exp8: within 1 ulp of the correctly rounded exp; sigmoid and SiLU are the scalar
// formulas of ops.h over it), the scalar ops.h functions otherwise.
//
// Contract: every output is a function of its own input alone. The AVX2 path takes the last n % 8
// values through the same vector code (padded), so a value's result does not depend on n, on its
// position or on the buffer's alignment; two calls on equal inputs give equal bits. NaN gives NaN.
// x may be any float: exp overflows to +inf and underflows through the subnormals to 0 as std::exp.
// Thread-safety: reentrant; nothing is allocated.
#pragma once

#include <cstdint>

namespace terrace::model::ops {

// True when the CPU runs AVX2 + FMA (the vectorised paths here and in the model's kernels).
bool HasAvx2Fma();

// x[i] = exp(x[i]).
void ExpInPlace(float* x, std::int64_t n);
// x[i] = sigmoid(x[i]) = 1 / (1 + exp(-x[i])).
void SigmoidInPlace(float* x, std::int64_t n);
// x[i] = SiLU(x[i]) = x[i] * sigmoid(x[i]).
void SiluInPlace(float* x, std::int64_t n);
// x[i] *= sigmoid(gate[i]) (an output gate). x and gate may not overlap.
void MulSigmoidInPlace(float* x, const float* gate, std::int64_t n);

}  // namespace terrace::model::ops
