// The element conversions against brute-force oracles, and every SIMD kernel table this CPU can
// run against the scalar one, bit for bit (lengths with tails, ties, subnormals, edges; int4 over
// random shapes, groups and special groups, NaN / Inf included).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "src/codec/kernels.h"

using namespace terrace::codec::detail;

namespace {

std::vector<const KernelTable*> SimdTables() {
  std::vector<const KernelTable*> t;
  if (Avx2Kernels()) t.push_back(Avx2Kernels());
  if (t.empty()) WARN("no SIMD codec kernels can run on this CPU; only the scalar ones are tested");
  return t;
}

// Inputs that exercise every rounding branch: random magnitudes over the whole fp32 range that the
// codecs accept, exact fp8 / bf16 / f16 ties, subnormals, zeros of both signs, the clamp edge.
std::vector<float> Tricky(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = rng();
    switch (r % 6) {
      case 0: x[i] = std::ldexp(static_cast<float>(r >> 40) / (1u << 24), static_cast<int>((r >> 8) % 40) - 30); break;
      case 1: {  // an fp8 tie: an odd multiple of half an fp8 ulp
        const int e = static_cast<int>((r >> 8) % 15) - 9;
        x[i] = std::ldexp(static_cast<float>(2 * ((r >> 16) % 16) + 17), e - 4);
        break;
      }
      case 2: x[i] = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0x807F8000u) | 0x3F008000u); break;
      case 3: x[i] = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32) & 0x807FFFFFu); break;  // subnormal
      case 4: x[i] = static_cast<float>(static_cast<std::int64_t>(r >> 50) - 8192) / 16.0f; break;  // halves
      default: x[i] = (r >> 9) % 2 ? 448.0f + static_cast<float>((r >> 20) % 64) : -0.0f; break;
    }
    if (r % 7 == 0) x[i] = -x[i];
  }
  return x;
}

}  // namespace

TEST_CASE("Fp8FromF32 is the nearest E4M3fn value, ties to even, clamped to 448", "[codec][kernels]") {
  // Brute force over the 253 finite non-negative codes.
  const float* values = Fp8Values();
  auto oracle = [&](float y) -> std::uint8_t {
    const double a = std::min(std::fabs(static_cast<double>(y)), 448.0);
    int best = 0;
    for (int c = 1; c <= 0x7E; ++c) {
      const double d = std::fabs(values[c] - a), db = std::fabs(values[best] - a);
      if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return static_cast<std::uint8_t>(best | (std::signbit(y) ? 0x80 : 0));
  };
  const auto x = Tricky(20000, 1);
  for (float y : x) {
    INFO("y=" << y);
    REQUIRE(Fp8FromF32(y) == oracle(y));
  }
  CHECK(Fp8FromF32(1e30f) == 0x7E);
  CHECK(Fp8FromF32(-464.0f) == 0xFE);
  CHECK(std::isnan(F32FromFp8(0x7F)));
  CHECK(F32FromFp8(0x01) == std::ldexp(1.0f, -9));
  CHECK(F32FromFp8(0x08) == std::ldexp(1.0f, -6));
}

TEST_CASE("f16 conversions: every f16 round trips; f32 to f16 is nearest-even", "[codec][kernels]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F32FromF16(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(F16FromF32(f) == h);
  }
  // Midpoints between consecutive finite f16 values round to the even one; just above/below go to
  // the nearer one.
  for (std::uint32_t h = 0; h < 0x7BFF; ++h) {
    const double lo = F32FromF16(static_cast<std::uint16_t>(h)), hi = F32FromF16(static_cast<std::uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    REQUIRE(F16FromF32(mid) == ((h & 1) ? h + 1 : h));
    REQUIRE(F16FromF32(std::nextafter(mid, 0.0f)) == h);
    REQUIRE(F16FromF32(std::nextafter(mid, 1e9f)) == h + 1);
  }
}

TEST_CASE("SIMD kernels match the scalar kernels bit for bit", "[codec][kernels]") {
  const KernelTable& ref = ScalarKernels();
  for (const KernelTable* k : SimdTables()) {
    INFO("kernels " << k->name);
    for (std::size_t n : {0u, 1u, 7u, 8u, 31u, 32u, 33u, 100u, 4099u}) {
      INFO("n=" << n);
      const auto x = Tricky(n, n + 3);
      std::vector<float> inv(n), scale(n);
      std::mt19937 rng(static_cast<unsigned>(n));
      for (std::size_t i = 0; i < n; ++i) {
        inv[i] = i % 5 == 0 ? 0.0f : std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, static_cast<int>(rng() % 20) - 10);
        scale[i] = inv[i] == 0 ? 0.0f : 1.0f / inv[i];
      }
      CHECK(k->max_abs_bits(x.data(), n) == ref.max_abs_bits(x.data(), n));
      for (std::size_t rows : {1u, 3u}) {
        const std::size_t cols = n / rows;
        std::vector<std::uint32_t> a(cols, 5), b(cols, 5);
        k->col_max_abs_bits(x.data(), rows, cols, a.data());
        ref.col_max_abs_bits(x.data(), rows, cols, b.data());
        CHECK(a == b);
      }
      std::vector<unsigned char> e1(2 * n + 1), e2(2 * n + 1);
      std::vector<float> d1(n), d2(n);
      CHECK(k->bf16_encode(x.data(), n, e1.data() + 1) == ref.bf16_encode(x.data(), n, e2.data() + 1));
      CHECK(e1 == e2);
      CHECK(k->bf16_decode(e1.data() + 1, n, d1.data()) == ref.bf16_decode(e1.data() + 1, n, d2.data()));
      CHECK(((4 * n) == 0 || std::memcmp(d1.data(), d2.data(), 4 * n) == 0));
      CHECK(k->f16_encode(x.data(), n, e1.data() + 1) == ref.f16_encode(x.data(), n, e2.data() + 1));
      CHECK(e1 == e2);
      CHECK(k->f16_decode(e1.data() + 1, n, d1.data()) == ref.f16_decode(e1.data() + 1, n, d2.data()));
      CHECK(((4 * n) == 0 || std::memcmp(d1.data(), d2.data(), 4 * n) == 0));
      for (std::size_t stride : {0u, 1u}) {
        std::vector<float> unit(n, 1.0f);
        const float* iv = stride ? inv.data() : unit.data();
        k->fp8_encode(x.data(), iv, stride, n, e1.data() + 1);
        ref.fp8_encode(x.data(), iv, stride, n, e2.data() + 1);
        CHECK(((n + 1) == 0 || std::memcmp(e1.data(), e2.data(), n + 1) == 0));
        const float* sc = stride ? scale.data() : unit.data();
        CHECK(k->fp8_decode(e1.data() + 1, sc, stride, n, d1.data()) == ref.fp8_decode(e1.data() + 1, sc, stride, n, d2.data()));
        CHECK(((4 * n) == 0 || std::memcmp(d1.data(), d2.data(), 4 * n) == 0));
      }
      // Every byte value through the decoders (NaN codes included).
      std::vector<unsigned char> all(n);
      for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<unsigned char>(i * 37 + n);
      CHECK(k->fp8_decode(all.data(), scale.data(), 1, n, d1.data()) == ref.fp8_decode(all.data(), scale.data(), 1, n, d2.data()));
      CHECK(((4 * n) == 0 || std::memcmp(d1.data(), d2.data(), 4 * n) == 0));
      std::vector<float> xs(n);
      for (std::size_t i = 0; i < n; ++i) xs[i] = std::ldexp(x[i], -20);  // keep x * inv inside int8 range mostly
      k->int8_encode(x.data(), inv.data(), n, e1.data() + 1);
      ref.int8_encode(x.data(), inv.data(), n, e2.data() + 1);
      CHECK(((n + 1) == 0 || std::memcmp(e1.data(), e2.data(), n + 1) == 0));
      k->int8_encode(xs.data(), inv.data(), n, e1.data() + 1);
      ref.int8_encode(xs.data(), inv.data(), n, e2.data() + 1);
      CHECK(((n + 1) == 0 || std::memcmp(e1.data(), e2.data(), n + 1) == 0));
      k->int8_decode(all.data(), scale.data(), n, d1.data());
      ref.int8_decode(all.data(), scale.data(), n, d2.data());
      CHECK(((4 * n) == 0 || std::memcmp(d1.data(), d2.data(), 4 * n) == 0));
    }
  }
}

namespace {

// One int4 input of [rows, cols]: Tricky values, with some groups made special (all zeros of either
// sign, subnormals only, exact x * inv ties, values near FLT_MAX where the scale is capped).
std::vector<float> Int4Input(std::size_t rows, std::size_t cols, std::size_t group, std::uint64_t seed) {
  auto x = Tricky(rows * cols, seed);
  std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c0 = 0; c0 < cols; c0 += group) {
      const std::size_t c1 = std::min(cols, c0 + group);
      float* g = x.data() + r * cols;
      const std::uint64_t kind = rng() % 8;
      for (std::size_t c = c0; c < c1; ++c) {
        const std::uint64_t u = rng();
        switch (kind) {
          case 0: g[c] = u % 2 ? 0.0f : -0.0f; break;
          case 1: g[c] = std::bit_cast<float>(static_cast<std::uint32_t>(u >> 32) & 0x807FFFFFu); break;
          // amax 7 (the group's first value) makes inv 1: every half-integer is a tie.
          case 2: g[c] = c == c0 ? 7.0f : static_cast<float>(static_cast<int>(u % 15) - 7) + (u & 16 ? 0.5f : 0.0f); break;
          case 3: g[c] = (u % 2 ? 1.0f : -1.0f) * std::numeric_limits<float>::max() / static_cast<float>(1 + u % 3); break;
          case 4: g[c] = std::ldexp(static_cast<float>(u % 64) - 32.0f, static_cast<int>((u >> 8) % 16) - 140); break;
          default: break;  // Tricky as it is
        }
      }
    }
  }
  return x;
}

}  // namespace

TEST_CASE("int4 SIMD kernels match the scalar kernels bit for bit", "[codec][kernels][int4]") {
  const KernelTable& ref = ScalarKernels();
  const float max_scale = std::nextafter(std::numeric_limits<float>::max() / 8.0f, 0.0f);  // MaxScale(kInt4)
  const auto tables = SimdTables();
  std::mt19937_64 rng(42);
  std::size_t cases = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    // Groups of 32 and 64 (what the codec uses) and others the kernels accept (not multiples of 8);
    // widths with tails and odd widths (every other row starts mid-byte).
    const std::size_t group = iter % 4 == 0 ? std::size_t{1} + rng() % 40 : (iter % 2 ? 32 : 64);
    const std::size_t rows = rng() % 7, cols = iter % 5 == 0 ? rng() % 400 : rng() % 140;
    const std::size_t n = rows * cols, groups = cols == 0 ? 0 : (cols + group - 1) / group, bytes = (n + 1) / 2;
    auto x = Int4Input(rows, cols, group, rng());
    const bool nonfinite = iter % 9 == 0 && n > 0;
    if (nonfinite) {
      const float bad[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()};
      x[rng() % n] = bad[rng() % 4];
    }
    INFO("rows=" << rows << " cols=" << cols << " group=" << group << " iter=" << iter);
    // Canaries after every output: the kernels write exactly their outputs.
    std::vector<float> s_ref(groups * rows + 1, 1234.0f), s_simd(s_ref);
    std::vector<unsigned char> e_ref(bytes + 1, 0xA5), e_simd(e_ref);
    const bool ok = ref.int4_encode(x.data(), rows, cols, group, max_scale, s_ref.data(), e_ref.data());
    REQUIRE(ok == !nonfinite);
    REQUIRE(e_ref[bytes] == 0xA5);
    if (ok && (n & 1)) REQUIRE((e_ref[bytes - 1] >> 4) == 0);
    // Every byte value (padding nibble included) and random scales (zero, subnormal, huge) through
    // the decoders too.
    std::vector<unsigned char> random_bytes(bytes);
    std::vector<float> random_scales(groups * rows);
    for (auto& b : random_bytes) b = static_cast<unsigned char>(rng());
    for (auto& s : random_scales) {
      const std::uint64_t u = rng();
      s = u % 5 == 0 ? 0.0f : u % 5 == 1 ? std::bit_cast<float>(static_cast<std::uint32_t>(u >> 40)) : u % 5 == 2 ? max_scale
                                                                   : std::ldexp(static_cast<float>(u >> 40), -30);
    }
    std::vector<float> d_ref(n + 8, -5.0f), d_rand_ref(n + 8, -5.0f);
    if (ok) ref.int4_decode(e_ref.data(), rows, cols, group, s_ref.data(), d_ref.data());
    ref.int4_decode(random_bytes.data(), rows, cols, group, random_scales.data(), d_rand_ref.data());
    for (const KernelTable* k : tables) {
      INFO("kernels " << k->name);
      REQUIRE(k->int4_encode(x.data(), rows, cols, group, max_scale, s_simd.data(), e_simd.data()) == ok);
      REQUIRE(e_simd[bytes] == 0xA5);
      REQUIRE(s_simd.back() == 1234.0f);
      if (ok) {
        REQUIRE(std::memcmp(s_simd.data(), s_ref.data(), 4 * s_ref.size()) == 0);
        REQUIRE(e_simd == e_ref);
        std::vector<float> d(n + 8, -5.0f);
        k->int4_decode(e_ref.data(), rows, cols, group, s_ref.data(), d.data());
        REQUIRE(std::memcmp(d.data(), d_ref.data(), 4 * d.size()) == 0);
      }
      std::vector<float> d(n + 8, -5.0f);
      k->int4_decode(random_bytes.data(), rows, cols, group, random_scales.data(), d.data());
      REQUIRE(std::memcmp(d.data(), d_rand_ref.data(), 4 * d.size()) == 0);
      ++cases;
    }
  }
  if (!tables.empty()) CHECK(cases == 1500 * tables.size());
}
