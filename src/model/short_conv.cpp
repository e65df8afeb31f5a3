#include "src/model/short_conv.h"

#include <algorithm>
#include <vector>

#include "src/model/avx2_math.h"
#include "src/model/vec_math.h"

namespace terrace::model {
namespace {

// Row p of the sequence [state rows; x rows] (p < hist: the state).
struct ConvInputRows {
  const float* x;
  const float* state;
  std::int64_t channels, state_width, hist;
  const float* operator()(std::int64_t p) const {
    return p < hist ? state + p * state_width : x + (p - hist) * channels;
  }
};

#ifdef TERRACE_SIMD_X86
// Row t's pre-activation sums into out (channels % 8 == 0); wt is the weight as [kernel, channels].
TERRACE_SIMD_AVX2 void ConvRowAvx2(const ConvInputRows& in, std::int64_t t, const float* wt, std::int64_t kernel,
                                   std::int64_t channels, float* out) {
  for (std::int64_t c = 0; c < channels; c += 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(wt + c), _mm256_loadu_ps(in(t) + c));
    for (std::int64_t j = 1; j < kernel; ++j)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + j * channels + c), _mm256_loadu_ps(in(t + j) + c), acc);
    _mm256_storeu_ps(out + c, acc);
  }
}
#endif

void ConvRowScalar(const ConvInputRows& in, std::int64_t t, const float* wt, std::int64_t kernel, std::int64_t channels,
                   float* out) {
  for (std::int64_t c = 0; c < channels; ++c) out[c] = 0.0f;
  for (std::int64_t j = 0; j < kernel; ++j) {
    const float* src = in(t + j);
    for (std::int64_t c = 0; c < channels; ++c) out[c] += wt[j * channels + c] * src[c];
  }
}

}  // namespace

void ShortConvSilu(float* x, std::int64_t tokens, std::int64_t channels, const float* weight, std::int64_t kernel,
                   float* conv_state, std::int64_t state_width, std::int64_t col) {
  if (tokens <= 0 || channels <= 0 || kernel <= 0) return;
  const std::int64_t hist = kernel - 1;
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  thread_local std::vector<float> wt, next, row;
  wt.resize(n(kernel * channels));
  next.resize(n(hist * channels));
  row.resize(n(channels));
  for (std::int64_t c = 0; c < channels; ++c)
    for (std::int64_t j = 0; j < kernel; ++j) wt[n(j * channels + c)] = weight[c * kernel + j];
  const ConvInputRows in{x, conv_state + col, channels, state_width, hist};
  // The next state (rows tokens .. tokens + hist - 1 of the sequence), read before x is overwritten.
  for (std::int64_t r = 0; r < hist; ++r) std::copy_n(in(tokens + r), channels, &next[n(r * channels)]);
  // Last row first: row t reads input rows t - hist .. t only, none overwritten yet.
  const bool avx2 = channels % 8 == 0 && ops::HasAvx2Fma();
  for (std::int64_t t = tokens - 1; t >= 0; --t) {
#ifdef TERRACE_SIMD_X86
    if (avx2) {
      ConvRowAvx2(in, t, wt.data(), kernel, channels, row.data());
    } else {
      ConvRowScalar(in, t, wt.data(), kernel, channels, row.data());
    }
#else
    (void)avx2;
    ConvRowScalar(in, t, wt.data(), kernel, channels, row.data());
#endif
    ops::SiluInPlace(row.data(), channels);
    std::copy_n(row.data(), channels, x + t * channels);
  }
  for (std::int64_t r = 0; r < hist; ++r) std::copy_n(&next[n(r * channels)], channels, conv_state + col + r * state_width);
}

}  // namespace terrace::model
