#include "src/model/mxfp4_matmul.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "src/model/avx2_math.h"
#include "src/model/mxfp4.h"
#include "src/model/vec_math.h"

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

#ifdef TERRACE_SIMD_X86

// Columns within each group of 16 (8 packed bytes) in the order the AVX2 dequantiser produces
// them: the 8 even columns (low nibbles) then the 8 odd ones (high nibbles).
TERRACE_SIMD_AVX2 void PermuteColumns(const float* x, std::int64_t K, float* xp) {
  for (std::int64_t g = 0; g < K; g += 16) {
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      xp[g + j] = x[g + 2 * j];
      xp[g + 8 + j] = x[g + 2 * j + 1];
    }
  }
}

// The table Dequant16 looks codes up in, for one block's scale: entry c (0..7) holds the bits of
// E2M1 magnitude c times the scale, xor-ed with c << 28 (undone by Dequant16's sign step).
TERRACE_SIMD_AVX2 inline __m256 BlockTable(__m256 mags, float scale) {
  const __m256i code_bits = _mm256_setr_epi32(0 << 28, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
  return _mm256_xor_ps(_mm256_mul_ps(mags, _mm256_set1_ps(scale)), _mm256_castsi256_ps(code_bits));
}

// 16 weights (8 packed bytes at p) with a BlockTable: lo = even columns, hi = odd columns.
TERRACE_SIMD_AVX2 inline void Dequant16(const std::uint8_t* p, __m256 table, __m256& lo, __m256& hi) {
  std::uint64_t bytes;
  std::memcpy(&bytes, p, 8);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
  const __m256i vh = _mm256_srli_epi32(v, 4);
  // vpermps reads only bits 0-2 of each index: the magnitude c of the nibble. (nibble << 28) has
  // the nibble in bits 28-31; xor-ed with the table's (c << 28) it leaves only the sign, bit 31.
  lo = _mm256_permutevar8x32_ps(table, v);
  hi = _mm256_permutevar8x32_ps(table, vh);
  lo = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
  hi = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_slli_epi32(vh, 28)));
}

// y[r] = W[r] . xp (xp in PermuteColumns order). One row at a time, so the packed weights are
// read as one sequential stream (rows are contiguous); four rows at a time made four interleaved
// streams the hardware prefetcher followed poorly (a K3-sized 3072 x 3584 matrix from memory:
// 10.4 Gweights/s, against 15.6 one row at a time; for 256 x 256, whose four rows share cache
// lines, one row at a time is about 5% slower). Four
// accumulators (a block's two 16-column halves, even and odd columns) hide the FMA latency.
TERRACE_SIMD_AVX2 void GemvRow(const Mxfp4Matrix& w, std::int64_t r, const float* xp, float* y, bool accumulate) {
  const auto& st = ScaleTable();
  const std::int64_t K = w.cols, blocks = K / kMxfp4BlockSize;
  const __m256 mags = _mm256_loadu_ps(kMagnitudes);
  const std::uint8_t* p = w.packed + r * (K / 2);
  const std::uint8_t* s = w.scales + r * blocks;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::int64_t b = 0; b < blocks; ++b) {
    const __m256 lut = BlockTable(mags, st[s[b]]);
    __m256 lo0, hi0, lo1, hi1;
    Dequant16(p + b * 16, lut, lo0, hi0);
    Dequant16(p + b * 16 + 8, lut, lo1, hi1);
    const float* xb = xp + b * 32;
    a0 = _mm256_fmadd_ps(lo0, _mm256_loadu_ps(xb), a0);
    a1 = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(xb + 8), a1);
    a2 = _mm256_fmadd_ps(lo1, _mm256_loadu_ps(xb + 16), a2);
    a3 = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(xb + 24), a3);
  }
  const float v = simd::HorizontalSum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  y[r] = accumulate ? y[r] + v : v;
}

constexpr std::int64_t kTileRows = 16;  // two 8-float vectors of output rows
constexpr std::int64_t kTileK = 256;    // columns per tile: [256, 16] fp32 = 16 KiB (L1)
constexpr int kTileTokens = 6;          // 6 tokens x 16 rows = 12 accumulators

// Rows [r0, r0 + rr) x columns [k0, k0 + kc) of W dequantised into tmp [kTileRows, kc]
// (PermuteColumns order); rows rr.. are zero.
TERRACE_SIMD_AVX2 void DequantRows(const Mxfp4Matrix& w, std::int64_t r0, std::int64_t rr, std::int64_t k0, std::int64_t kc,
                              float* tmp) {
  const auto& st = ScaleTable();
  const std::int64_t K = w.cols, blocks = K / kMxfp4BlockSize;
  const __m256 mags = _mm256_loadu_ps(kMagnitudes);
  for (std::int64_t i = 0; i < kTileRows; ++i) {
    float* out = tmp + i * kc;
    if (i >= rr) {
      std::fill(out, out + kc, 0.0f);
      continue;
    }
    const std::uint8_t* p = w.packed + (r0 + i) * (K / 2) + k0 / 2;
    const std::uint8_t* s = w.scales + (r0 + i) * blocks + k0 / kMxfp4BlockSize;
    for (std::int64_t b = 0; b < kc / kMxfp4BlockSize; ++b) {
      const __m256 table = BlockTable(mags, st[s[b]]);
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        __m256 lo, hi;
        Dequant16(p + b * 16 + h * 8, table, lo, hi);
        _mm256_storeu_ps(out + b * 32 + h * 16, lo);
        _mm256_storeu_ps(out + b * 32 + h * 16 + 8, hi);
      }
    }
  }
}

// tile [kc, kTileRows] = transpose of tmp [kTileRows, kc], by 8 x 8 blocks.
TERRACE_SIMD_AVX2 void TransposeTile(const float* tmp, std::int64_t kc, float* tile) {
  for (std::int64_t c = 0; c < kc; c += 8) {
    for (std::int64_t h = 0; h < kTileRows; h += 8) {
      __m256 r[8], t[8];
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(tmp + (h + i) * kc + c);
      #pragma GCC unroll 8
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      const __m256 u0 = _mm256_shuffle_ps(t[0], t[2], 0x44), u1 = _mm256_shuffle_ps(t[0], t[2], 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t[1], t[3], 0x44), u3 = _mm256_shuffle_ps(t[1], t[3], 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t[4], t[6], 0x44), u5 = _mm256_shuffle_ps(t[4], t[6], 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t[5], t[7], 0x44), u7 = _mm256_shuffle_ps(t[5], t[7], 0xEE);
      const __m256 col[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      #pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(tile + (c + j) * kTileRows + h, col[j]);
    }
  }
}

// c[t, 0..16) (+)= sum_k xp[t, k] * tile[k, 0..16) for NT tokens (xp rows ldx apart, c rows ldc
// apart); load_c: continue the sums already in c, else start from zero.
template <int NT>
TERRACE_SIMD_AVX2 void TileKernel(const float* tile, std::int64_t kc, const float* xp, std::int64_t ldx, float* c,
                             std::int64_t ldc, bool load_c) {
  __m256 c0[NT], c1[NT];
  #pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    c0[t] = load_c ? _mm256_loadu_ps(c + t * ldc) : _mm256_setzero_ps();
    c1[t] = load_c ? _mm256_loadu_ps(c + t * ldc + 8) : _mm256_setzero_ps();
  }
  for (std::int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(tile + k * kTileRows), w1 = _mm256_loadu_ps(tile + k * kTileRows + 8);
    #pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(xp + t * ldx + k);
      c0[t] = _mm256_fmadd_ps(w0, xb, c0[t]);
      c1[t] = _mm256_fmadd_ps(w1, xb, c1[t]);
    }
  }
  #pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    _mm256_storeu_ps(c + t * ldc, c0[t]);
    _mm256_storeu_ps(c + t * ldc + 8, c1[t]);
  }
}

TERRACE_SIMD_AVX2 void TileKernelN(int nt, const float* tile, std::int64_t kc, const float* xp, std::int64_t ldx, float* c,
                              std::int64_t ldc, bool load_c) {
  switch (nt) {
    case 6: TileKernel<6>(tile, kc, xp, ldx, c, ldc, load_c); break;
    case 5: TileKernel<5>(tile, kc, xp, ldx, c, ldc, load_c); break;
    case 4: TileKernel<4>(tile, kc, xp, ldx, c, ldc, load_c); break;
    case 3: TileKernel<3>(tile, kc, xp, ldx, c, ldc, load_c); break;
    case 2: TileKernel<2>(tile, kc, xp, ldx, c, ldc, load_c); break;
    default: TileKernel<1>(tile, kc, xp, ldx, c, ldc, load_c); break;
  }
}

// y [m, N] = xp W^T (overwrites y), m > 1: tiles of 16 rows x 256 columns dequantised once, each
// multiplied with all m tokens.
TERRACE_SIMD_AVX2 void LinearTiled(const Mxfp4Matrix& w, const float* xp, std::int64_t m, float* y) {
  const std::int64_t K = w.cols, N = w.rows;
  thread_local std::vector<float> tmp_buf, tile_buf;
  tmp_buf.resize(static_cast<std::size_t>(kTileRows * kTileK));
  tile_buf.resize(static_cast<std::size_t>(kTileRows * kTileK));
  float* tmp = tmp_buf.data();
  float* tile = tile_buf.data();
  alignas(32) float edge[kTileTokens * kTileRows];
  for (std::int64_t r0 = 0; r0 < N; r0 += kTileRows) {
    const std::int64_t rr = std::min(kTileRows, N - r0);
    for (std::int64_t k0 = 0; k0 < K; k0 += kTileK) {
      const std::int64_t kc = std::min(kTileK, K - k0);
      DequantRows(w, r0, rr, k0, kc, tmp);
      TransposeTile(tmp, kc, tile);
      const bool load_c = k0 > 0;
      for (std::int64_t t0 = 0; t0 < m; t0 += kTileTokens) {
        const int nt = static_cast<int>(std::min<std::int64_t>(kTileTokens, m - t0));
        float* out = y + t0 * N + r0;
        if (rr == kTileRows) {
          TileKernelN(nt, tile, kc, xp + t0 * K + k0, K, out, N, load_c);
          continue;
        }
        // A partial row tile: through a 16-wide scratch so the kernel never writes past row N.
        for (int t = 0; t < nt; ++t)
          for (std::int64_t i = 0; i < kTileRows; ++i) edge[t * kTileRows + i] = (load_c && i < rr) ? out[t * N + i] : 0.0f;
        TileKernelN(nt, tile, kc, xp + t0 * K + k0, K, edge, kTileRows, load_c);
        for (int t = 0; t < nt; ++t)
          for (std::int64_t i = 0; i < rr; ++i) out[t * N + i] = edge[t * kTileRows + i];
      }
    }
  }
}

TERRACE_SIMD_AVX2 void LinearAvx2(const Mxfp4Matrix& w, const float* x, std::int64_t m, float* y, bool accumulate) {
  const std::int64_t K = w.cols, N = w.rows;
  thread_local std::vector<float> xp_buf, acc_buf;
  xp_buf.resize(static_cast<std::size_t>(m * K));
  float* xp = xp_buf.data();
  for (std::int64_t t = 0; t < m; ++t) PermuteColumns(x + t * K, K, xp + t * K);
  if (m == 1) {
    for (std::int64_t r = 0; r < N; ++r) GemvRow(w, r, xp, y, accumulate);
    return;
  }
  if (!accumulate) {
    LinearTiled(w, xp, m, y);
    return;
  }
  // y += (x W^T): the product first, then one add per output.
  acc_buf.resize(static_cast<std::size_t>(m * N));
  LinearTiled(w, xp, m, acc_buf.data());
  for (std::size_t i = 0; i < acc_buf.size(); ++i) y[i] += acc_buf[i];
}

#endif  // TERRACE_SIMD_X86

}  // namespace

bool Mxfp4Avx2Available() {
#ifdef TERRACE_SIMD_X86
  return ops::HasAvx2Fma();
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
#ifdef TERRACE_SIMD_X86
  if (kernel != Mxfp4Kernel::kScalar && Mxfp4Avx2Available()) {
    LinearAvx2(w, x, m, y, accumulate);
    return;
  }
#endif
  (void)kernel;
  LinearScalar(w, x, m, y, accumulate);
}

}  // namespace terrace::model
