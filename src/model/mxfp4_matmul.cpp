#include "src/model/mxfp4_matmul.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TERRACE_MXFP4_X86 1
#endif

#include "src/model/mxfp4.h"

namespace terrace::model {
namespace {

constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// 2^(s - 127) for every E8M0 byte (NaN for 255), built once.
const std::array<float, 256>& ScaleTable() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int s = 0; s < 256; ++s) t[static_cast<std::size_t>(s)] = E8M0ToFloat(static_cast<std::uint8_t>(s));
    return t;
  }();
  return table;
}

// Row `r` of W dequantised into out[0, cols) (natural column order).
void DequantRowScalar(const Mxfp4Matrix& w, std::int64_t r, float* out) {
  const auto& st = ScaleTable();
  const std::int64_t blocks = w.cols / kMxfp4BlockSize;
  const std::uint8_t* p = w.packed + r * (w.cols / 2);
  const std::uint8_t* s = w.scales + r * blocks;
  for (std::int64_t b = 0; b < blocks; ++b) {
    const float scale = st[s[b]];
    for (int k = 0; k < kMxfp4BlockSize / 2; ++k) {
      const std::uint8_t byte = p[b * 16 + k];
      out[b * 32 + 2 * k] = E2M1ToFloat(byte & 0xFu) * scale;
      out[b * 32 + 2 * k + 1] = E2M1ToFloat(byte >> 4) * scale;
    }
  }
}

void LinearScalar(const Mxfp4Matrix& w, const float* x, std::int64_t m, float* y, bool accumulate) {
  const std::int64_t K = w.cols, N = w.rows;
  thread_local std::vector<float> row;
  row.resize(static_cast<std::size_t>(K));
  for (std::int64_t r = 0; r < N; ++r) {
    DequantRowScalar(w, r, row.data());
    for (std::int64_t t = 0; t < m; ++t) {
      const float* xt = x + t * K;
      float acc = 0.0f;
      for (std::int64_t k = 0; k < K; ++k) acc += row[static_cast<std::size_t>(k)] * xt[k];
      float& out = y[t * N + r];
      out = accumulate ? out + acc : acc;
    }
  }
}

#ifdef TERRACE_MXFP4_X86

#define TERRACE_AVX2 __attribute__((target("avx2,fma")))

// Columns within each group of 16 (8 packed bytes) in the order the AVX2 dequantiser produces
// them: the 8 even columns (low nibbles) then the 8 odd ones (high nibbles).
TERRACE_AVX2 void PermuteColumns(const float* x, std::int64_t K, float* xp) {
  for (std::int64_t g = 0; g < K; g += 16) {
    for (int j = 0; j < 8; ++j) {
      xp[g + j] = x[g + 2 * j];
      xp[g + 8 + j] = x[g + 2 * j + 1];
    }
  }
}

// 16 weights (8 packed bytes at p) with the scaled magnitude table `lut`: lo = even columns,
// hi = odd columns.
TERRACE_AVX2 inline void Dequant16(const std::uint8_t* p, __m256 lut, __m256& lo, __m256& hi) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  std::uint64_t bytes;
  std::memcpy(&bytes, p, 8);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
  // vpermps reads only bits 0-2 of each index: the magnitude of the low nibble; shifted by 4, of
  // the high nibble. Bit 3 of each nibble (the sign) is moved to bit 31.
  lo = _mm256_permutevar8x32_ps(lut, v);
  hi = _mm256_permutevar8x32_ps(lut, _mm256_srli_epi32(v, 4));
  lo = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 28), sign)));
  hi = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24), sign)));
}

TERRACE_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r0 .. r0+NR) = W[r0 .. r0+NR) . xp (xp in PermuteColumns order).
template <int NR>
TERRACE_AVX2 void GemvRows(const Mxfp4Matrix& w, std::int64_t r0, const float* xp, float* y, bool accumulate) {
  const auto& st = ScaleTable();
  const std::int64_t K = w.cols, blocks = K / kMxfp4BlockSize;
  const __m256 mags = _mm256_loadu_ps(kMagnitudes);
  const std::uint8_t* p[NR];
  const std::uint8_t* s[NR];
  __m256 acc[NR];
  for (int i = 0; i < NR; ++i) {
    p[i] = w.packed + (r0 + i) * (K / 2);
    s[i] = w.scales + (r0 + i) * blocks;
    acc[i] = _mm256_setzero_ps();
  }
  for (std::int64_t b = 0; b < blocks; ++b) {
    __m256 lut[NR];
    for (int i = 0; i < NR; ++i) lut[i] = _mm256_mul_ps(mags, _mm256_set1_ps(st[s[i][b]]));
    for (int h = 0; h < 2; ++h) {
      const __m256 xe = _mm256_loadu_ps(xp + b * 32 + h * 16);
      const __m256 xo = _mm256_loadu_ps(xp + b * 32 + h * 16 + 8);
      for (int i = 0; i < NR; ++i) {
        __m256 lo, hi;
        Dequant16(p[i] + b * 16 + h * 8, lut[i], lo, hi);
        acc[i] = _mm256_fmadd_ps(lo, xe, acc[i]);
        acc[i] = _mm256_fmadd_ps(hi, xo, acc[i]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float v = HorizontalSum(acc[i]);
    y[r0 + i] = accumulate ? y[r0 + i] + v : v;
  }
}

// Rows [r0, r0 + R) of W dequantised into tile [R, K] (PermuteColumns order).
TERRACE_AVX2 void DequantTile(const Mxfp4Matrix& w, std::int64_t r0, std::int64_t R, float* tile) {
  const auto& st = ScaleTable();
  const std::int64_t K = w.cols, blocks = K / kMxfp4BlockSize;
  const __m256 mags = _mm256_loadu_ps(kMagnitudes);
  for (std::int64_t i = 0; i < R; ++i) {
    const std::uint8_t* p = w.packed + (r0 + i) * (K / 2);
    const std::uint8_t* s = w.scales + (r0 + i) * blocks;
    float* out = tile + i * K;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const __m256 lut = _mm256_mul_ps(mags, _mm256_set1_ps(st[s[b]]));
      for (int h = 0; h < 2; ++h) {
        __m256 lo, hi;
        Dequant16(p + b * 16 + h * 8, lut, lo, hi);
        _mm256_storeu_ps(out + b * 32 + h * 16, lo);
        _mm256_storeu_ps(out + b * 32 + h * 16 + 8, hi);
      }
    }
  }
}

// out[t * ldo + i] (+)= tile row i . x row t for NT tokens and NR tile rows.
template <int NT, int NR>
TERRACE_AVX2 void MicroKernel(const float* tile, const float* xp, std::int64_t K, float* out, std::int64_t ldo,
                              bool accumulate) {
  __m256 acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) acc[t][i] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_loadu_ps(tile + i * K + k);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(xp + t * K + k);
      for (int i = 0; i < NR; ++i) acc[t][i] = _mm256_fmadd_ps(wv[i], xv, acc[t][i]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < NR; ++i) {
      const float v = HorizontalSum(acc[t][i]);
      float& o = out[t * ldo + i];
      o = accumulate ? o + v : v;
    }
}

template <int NT>
TERRACE_AVX2 void TileTokens(const float* tile, std::int64_t R, const float* xp, std::int64_t K, float* out,
                             std::int64_t ldo, bool accumulate) {
  std::int64_t i = 0;
  for (; i + 2 <= R; i += 2) MicroKernel<NT, 2>(tile + i * K, xp, K, out + i, ldo, accumulate);
  if (i < R) MicroKernel<NT, 1>(tile + i * K, xp, K, out + i, ldo, accumulate);
}

TERRACE_AVX2 void LinearAvx2(const Mxfp4Matrix& w, const float* x, std::int64_t m, float* y, bool accumulate) {
  const std::int64_t K = w.cols, N = w.rows;
  thread_local std::vector<float> xp_buf, tile_buf;
  xp_buf.resize(static_cast<std::size_t>(m * K));
  float* xp = xp_buf.data();
  for (std::int64_t t = 0; t < m; ++t) PermuteColumns(x + t * K, K, xp + t * K);
  if (m == 1) {
    std::int64_t r = 0;
    for (; r + 4 <= N; r += 4) GemvRows<4>(w, r, xp, y, accumulate);
    for (; r < N; ++r) GemvRows<1>(w, r, xp, y, accumulate);
    return;
  }
  // A tile of R rows of about 16 KiB of fp32 (L1), reused across all m tokens.
  const std::int64_t R = std::clamp<std::int64_t>(4096 / K, 2, 16);
  tile_buf.resize(static_cast<std::size_t>(R * K));
  float* tile = tile_buf.data();
  for (std::int64_t r0 = 0; r0 < N; r0 += R) {
    const std::int64_t rr = std::min(R, N - r0);
    DequantTile(w, r0, rr, tile);
    std::int64_t t = 0;
    for (; t + 4 <= m; t += 4) TileTokens<4>(tile, rr, xp + t * K, K, y + t * N + r0, N, accumulate);
    switch (m - t) {
      case 3: TileTokens<3>(tile, rr, xp + t * K, K, y + t * N + r0, N, accumulate); break;
      case 2: TileTokens<2>(tile, rr, xp + t * K, K, y + t * N + r0, N, accumulate); break;
      case 1: TileTokens<1>(tile, rr, xp + t * K, K, y + t * N + r0, N, accumulate); break;
      default: break;
    }
  }
}

#endif  // TERRACE_MXFP4_X86

}  // namespace

bool Mxfp4Avx2Available() {
#ifdef TERRACE_MXFP4_X86
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}

std::string_view Mxfp4KernelName(Mxfp4Kernel kernel) {
  if (kernel == Mxfp4Kernel::kAuto) kernel = Mxfp4Avx2Available() ? Mxfp4Kernel::kAvx2 : Mxfp4Kernel::kScalar;
  return kernel == Mxfp4Kernel::kAvx2 && Mxfp4Avx2Available() ? "avx2" : "scalar";
}

void Mxfp4Linear(const Mxfp4Matrix& w, const float* x, std::int64_t m, float* y, bool accumulate,
                 Mxfp4Kernel kernel) {
  if (m <= 0 || w.rows <= 0) return;
#ifdef TERRACE_MXFP4_X86
  if (kernel != Mxfp4Kernel::kScalar && Mxfp4Avx2Available()) {
    LinearAvx2(w, x, m, y, accumulate);
    return;
  }
#endif
  (void)kernel;
  LinearScalar(w, x, m, y, accumulate);
}

}  // namespace terrace::model
