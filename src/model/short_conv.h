// The KDA mixer's causal short convolution (depthwise, `kernel` taps) followed by SiLU.
#pragma once

#include <cstdint>

namespace terrace::model {

// In place on x [tokens, channels] (row-major), with hist = kernel - 1:
//   x[t, c] <- SiLU(sum_{j < kernel} weight[c, j] * in[t + j - hist, c])
// where in[t] is x's row t as given for t >= 0, and the hist rows before the call's first token
// (in[-hist] .. in[-1], oldest first) are the rows of the conv state: row r at
// conv_state + r * state_width + col, `channels` values wide. Afterwards the state holds the last
// hist rows of in (before the activation), so consecutive calls continue one sequence, whatever
// the split into calls. weight is [channels, kernel] (PyTorch's [channels, 1, kernel]).
// AVX2 + FMA when the CPU has them and channels % 8 == 0, scalar loops otherwise (sums in tap
// order, SiLU as ops::SiluInPlace); a deterministic function of the inputs. Reentrant
// (thread-local scratch).
void ShortConvSilu(float* x, std::int64_t tokens, std::int64_t channels, const float* weight, std::int64_t kernel,
                   float* conv_state, std::int64_t state_width, std::int64_t col);

}  // namespace terrace::model
