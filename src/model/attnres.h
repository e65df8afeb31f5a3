// Block Attention Residuals (docs/model.md, "Block Attention Residuals"): a softmax mix over the bank
// of completed block vectors plus the running partial sum, scored by a learned pseudo-query against
// RMS-normed keys. Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <span>

namespace terrace::model {

inline constexpr float kAttnResEps = 1e-5f;

// For every token row t (of `tokens` rows, width d):
//   score_i = sum_d w[d] n[d] v_i[t][d] / rms(v_i[t]),  rms(x) = sqrt(mean(x^2) + 1e-5)
//   out[t]  = sum_i softmax(score)_i v_i[t]     (the raw sources)
// sources: one pointer per source to its [tokens, d] rows. w is the pseudo-query ([1, d] projection),
// n the key-norm weight [d]. out must not alias a source.
void AttnResMix(std::span<const float* const> sources, std::int64_t tokens, std::int64_t d, const float* w,
                const float* n, float* out);

}  // namespace terrace::model
