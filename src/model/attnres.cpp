#include "src/model/attnres.h"

#include <cmath>
#include <vector>

#include "src/model/ops.h"

namespace terrace::model {

void AttnResMix(std::span<const float* const> sources, std::int64_t tokens, std::int64_t d, const float* w,
                const float* n, float* out) {
  const std::size_t S = sources.size();
  std::vector<float> wn(static_cast<std::size_t>(d)), p(S);
  for (std::int64_t i = 0; i < d; ++i) wn[static_cast<std::size_t>(i)] = w[i] * n[i];
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::size_t s = 0; s < S; ++s) {
      const float* v = sources[s] + t * d;
      const float dot = ops::Dot(wn.data(), v, d), ss = ops::SumSquares(v, d);
      p[s] = dot / std::sqrt(ss / static_cast<float>(d) + kAttnResEps);
    }
    ops::SoftmaxInPlace(p.data(), static_cast<std::int64_t>(S));
    float* o = out + t * d;
    for (std::int64_t i = 0; i < d; ++i) o[i] = 0.0f;
    for (std::size_t s = 0; s < S; ++s) ops::Axpy(p[s], sources[s] + t * d, o, d);
  }
}

}  // namespace terrace::model
