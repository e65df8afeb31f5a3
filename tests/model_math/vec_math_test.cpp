// The array exp / sigmoid / SiLU (vec_math.h) against libm, over a sweep of every float's range,
// the special values, and the tails of arrays whose length is not a multiple of the vector width.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "math_test_util.h"
#include "src/model/ops.h"
#include "src/model/vec_math.h"

namespace terrace::model {
namespace {

using testing::RandomVec;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Distance in representable floats (0 for equal values, +0 and -0 equal).
std::int64_t UlpDistance(float a, float b) {
  const auto ordered = [](float f) {
    const auto i = std::bit_cast<std::int32_t>(f);
    return i < 0 ? -static_cast<std::int64_t>(i & 0x7fffffff) : static_cast<std::int64_t>(i);
  };
  return std::abs(ordered(a) - ordered(b));
}

// x and its neighbours through every exponent: every 65521st bit pattern of all 2^32 (65521 is
// prime, so every low-bit residue is visited), plus the special values.
std::vector<float> Sweep() {
  std::vector<float> x;
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 65521)
    x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
  for (float s : {0.0f, -0.0f, 1e-30f, -1e-30f, 1.0f, -1.0f, 88.72283f, 88.72284f, 88.7229f, 89.0f, 1e30f, -87.33f,
                  -87.34f, -100.0f, -103.27f, -103.28f, -103.9f, -103.98f, -104.0f, -104.1f, -1000.0f, -1e30f, kInf,
                  -kInf, std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::quiet_NaN()})
    x.push_back(s);
  return x;
}

TEST_CASE("ExpInPlace is within 2 ulp of std::exp over the float range, specials included", "[vec_math]") {
  const std::vector<float> x = Sweep();
  std::vector<float> y = x;
  ops::ExpInPlace(y.data(), static_cast<std::int64_t>(y.size()));
  std::int64_t worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = std::exp(x[i]);
    CAPTURE(x[i], want, y[i]);
    if (std::isnan(want)) {
      CHECK(std::isnan(y[i]));
      continue;
    }
    REQUIRE_FALSE(std::isnan(y[i]));
    if (std::isinf(want) || want == 0.0f) {
      CHECK(y[i] == want);  // overflow to +inf, underflow to exactly 0
      continue;
    }
    const std::int64_t d = UlpDistance(y[i], want);
    CHECK(d <= 2);
    worst = std::max(worst, d);
  }
  // The stated edges: +inf from 88.72283935546875 (the float above ln FLT_MAX) up, a subnormal near -100, 0 from -104 down.
  float e[5] = {88.72283172607421875f, 88.72283935546875f, -100.0f, -104.0f, -kInf};
  ops::ExpInPlace(e, 5);
  CHECK(std::isfinite(e[0]));
  CHECK(e[1] == kInf);
  CHECK(e[2] > 0.0f);
  CHECK(e[2] < std::numeric_limits<float>::min());
  CHECK(e[3] == 0.0f);
  CHECK(e[4] == 0.0f);
  INFO("worst distance " << worst << " ulp");
  CHECK(worst <= 2);
}

TEST_CASE("sigmoid, SiLU and the sigmoid gate match the scalar formulas", "[vec_math]") {
  const std::vector<float> x = Sweep();
  std::vector<float> sig = x, silu = x, gated(x.size(), 3.0f);
  const auto n = static_cast<std::int64_t>(x.size());
  ops::SigmoidInPlace(sig.data(), n);
  ops::SiluInPlace(silu.data(), n);
  ops::MulSigmoidInPlace(gated.data(), x.data(), n);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float ws = ops::Sigmoid(x[i]), wl = ops::Silu(x[i]), wg = 3.0f * ops::Sigmoid(x[i]);
    CAPTURE(x[i], ws, sig[i], wl, silu[i], wg, gated[i]);
    if (std::isnan(x[i])) {
      CHECK((std::isnan(sig[i]) && std::isnan(silu[i]) && std::isnan(gated[i])));
      continue;
    }
    // exp's 2 ulp, one addition, one division (and one product): a few ulp, and equal at the ends.
    CHECK(UlpDistance(sig[i], ws) <= 4);
    CHECK(UlpDistance(silu[i], wl) <= 4);
    CHECK(UlpDistance(gated[i], wg) <= 5);
  }
  float ends[4] = {-1000.0f, 1000.0f, -kInf, kInf};
  ops::SigmoidInPlace(ends, 4);
  CHECK(ends[0] == 0.0f);
  CHECK(ends[1] == 1.0f);
  CHECK(ends[2] == 0.0f);
  CHECK(ends[3] == 1.0f);
}

TEST_CASE("vec_math results do not depend on the array length or a value's position", "[vec_math]") {
  const auto base = RandomVec(40, 17, -30.0f, 30.0f);
  std::vector<float> whole = base;
  ops::SiluInPlace(whole.data(), static_cast<std::int64_t>(whole.size()));
  std::vector<float> exp_whole = base;
  ops::ExpInPlace(exp_whole.data(), static_cast<std::int64_t>(exp_whole.size()));
  // Every length 0..19 and offset 0..20: the tail path must give the body's bits, and write
  // nothing past n.
  for (std::int64_t off = 0; off <= 20; ++off) {
    for (std::int64_t len = 0; len < 20; ++len) {
      CAPTURE(off, len);
      std::vector<float> part = base, e = base;
      ops::SiluInPlace(part.data() + off, len);
      ops::ExpInPlace(e.data() + off, len);
      for (std::int64_t i = 0; i < 40; ++i) {
        const bool inside = i >= off && i < off + len;
        CHECK(part[i] == (inside ? whole[i] : base[i]));
        CHECK(e[i] == (inside ? exp_whole[i] : base[i]));
      }
    }
  }
}

}  // namespace
}  // namespace terrace::model
