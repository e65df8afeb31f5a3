// The CUDA codec kernels' bodies and plans (src/codec/cuda/kernel_bodies.h), run on the CPU one
// thread at a time, against the CPU codec bit for bit: the arithmetic a GPU runs, tested in every
// build, GPU or not. test_codec_cuda runs the same cases (device_codec_cases.h) on a device.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "src/codec/cuda/kernel_bodies.h"
#include "src/codec/format.h"
#include "src/codec/kernels.h"
#include "tests/codec/device_codec_cases.h"

namespace cuda_emulation_test {

namespace dc = terrace::codec::cuda;
namespace cases = terrace_device_codec_cases;
using terrace::codec::CodecKind;
using terrace::codec::CodecSpec;

static_assert(static_cast<int>(CodecKind::kF32) == dc::kKindF32 && static_cast<int>(CodecKind::kBf16) == dc::kKindBf16 &&
              static_cast<int>(CodecKind::kF16) == dc::kKindF16 && static_cast<int>(CodecKind::kFp8E4M3) == dc::kKindFp8 &&
              static_cast<int>(CodecKind::kInt8) == dc::kKindInt8 && static_cast<int>(CodecKind::kInt4) == dc::kKindInt4);

// The plans' Exec on the CPU: each "launch" runs its threads in order.
struct HostExec {
  int launches = 0;
  template <class Body>
  void Run(const Body& body, std::int64_t threads) {
    ++launches;
    for (std::int64_t i = 0; i < threads; ++i) body(i);
  }
  void Zero(void* p, std::size_t bytes) {
    if (bytes) std::memset(p, 0, bytes);
  }
};

dc::Layout LayoutOf(const CodecSpec& s) {
  return dc::Layout{static_cast<std::uint8_t>(s.kind), static_cast<std::uint8_t>(s.scales),
                    static_cast<std::uint16_t>(s.group)};
}

class Emulation final : public cases::Backend {
 public:
  const char* Name() const override { return "emulated kernels"; }
  cases::Encoded Encode(const CodecSpec& spec, const std::vector<float>& x, std::int64_t rows,
                        std::int64_t cols) override {
    const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
    cases::Encoded e;
    // Outputs and scratch start as garbage, as reused device memory does.
    e.scales.assign(terrace::codec::detail::ScaleCount(spec, r, c), -77.0f);
    e.payload.assign(terrace::codec::detail::RawPayloadBytes(spec.kind, r * c), 0xCD);
    std::vector<std::uint32_t> amax(static_cast<std::size_t>(dc::ScratchWords(LayoutOf(spec), rows, cols)) + 1, 0xDEADBEEFu);
    std::uint32_t flag = 0;
    HostExec ex;
    dc::EncodePlan(ex, LayoutOf(spec), x.data(), rows, cols, e.scales.data(), e.payload.data(), amax.data(), &flag);
    e.nonfinite = flag != 0;
    return e;
  }
  std::vector<float> Decode(const CodecSpec& spec, const std::vector<float>& scales,
                            const std::vector<std::uint8_t>& payload, std::int64_t rows, std::int64_t cols) override {
    std::vector<float> out(static_cast<std::size_t>(rows * cols), -99.0f);
    HostExec ex;
    dc::DecodePlan(ex, LayoutOf(spec), scales.data(), payload.data(), rows, cols, out.data());
    return out;
  }
};

std::uint32_t FBits(float f) { return std::bit_cast<std::uint32_t>(f); }

// Every fp32 rounding branch: random magnitudes, the three formats' ties, subnormals, zeros.
std::vector<float> ConversionInputs() {
  std::mt19937_64 rng(5);
  std::vector<float> x;
  for (int i = 0; i < 200000; ++i) {
    const std::uint64_t r = rng();
    float v;
    switch (r % 5) {
      case 0: v = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32) & 0x7FFFFFFFu); break;  // any finite / Inf / NaN
      case 1: v = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0x7FFF0000u) | 0x8000u); break;  // bf16 tie
      case 2: v = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0x4FFFE000u) | 0x1000u); break;  // f16 tie
      case 3: v = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0x43F00000u) | 0x80000u); break;  // fp8 tie
      default: v = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32) & 0x007FFFFFu); break;  // subnormal
    }
    x.push_back((r >> 7) & 1 ? -v : v);
  }
  for (float v : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 448.0f, 464.0f, 1e38f, 3.3961776e38f}) x.push_back(v);
  return x;
}

}  // namespace cuda_emulation_test

using namespace cuda_emulation_test;

TEST_CASE("CUDA kernel element conversions equal the CPU codec's", "[codec][cuda-emulation]") {
  namespace cd = terrace::codec::detail;
  namespace m = terrace::codec::cuda::math;
  for (float v : ConversionInputs()) {
    INFO("x bits " << FBits(v));
    REQUIRE(m::Bf16Code(v) == cd::Bf16FromF32(v));
    REQUIRE(m::F16Code(v) == cd::F16FromF32(v));
    REQUIRE(m::Fp8Code(v) == cd::Fp8FromF32(v));
  }
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    INFO("code " << h);
    REQUIRE(FBits(m::F16Value(h)) == FBits(cd::F32FromF16(static_cast<std::uint16_t>(h))));
    REQUIRE(FBits(m::Bf16Value(h)) == FBits(cd::F32FromBf16(static_cast<std::uint16_t>(h))));
  }
  for (std::uint32_t c = 0; c < 256; ++c) REQUIRE(FBits(m::Fp8Value(c)) == FBits(cd::F32FromFp8(static_cast<std::uint8_t>(c))));
}

TEST_CASE("CUDA kernel integer rounding is clamp then nearest even", "[codec][cuda-emulation]") {
  namespace m = terrace::codec::cuda::math;
  std::mt19937_64 rng(8);
  for (int i = 0; i < 200000; ++i) {
    const float qmax = i % 2 ? 127.0f : 7.0f;
    const std::uint64_t r = rng();
    // Halves (ties), values near the clamp, and random fractions.
    float y = r % 3 == 0 ? static_cast<float>(static_cast<std::int64_t>(r >> 40) % 600 - 300) / 2.0f
                         : std::ldexp(static_cast<float>(static_cast<std::int64_t>(r >> 32) % 4000000 - 2000000), -14);
    if (r % 11 == 0) y = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32) & 0x807FFFFFu);  // subnormal
    const float c = std::clamp(y, -qmax, qmax);
    INFO("y " << y << " qmax " << qmax);
    REQUIRE(m::RoundClamp(y, qmax) == static_cast<std::int32_t>(std::nearbyint(c)));
  }
  CHECK(m::RoundClamp(2.5f, 7.0f) == 2);
  CHECK(m::RoundClamp(-3.5f, 7.0f) == -4);
  CHECK(m::RoundClamp(-7.5f, 7.0f) == -7);
  CHECK(m::RoundClamp(1e30f, 127.0f) == 127);
  CHECK(m::RoundClamp(-0.0f, 7.0f) == 0);
}

TEST_CASE("CUDA kernel scale caps equal the CPU codec's max_scale", "[codec][cuda-emulation]") {
  namespace m = terrace::codec::cuda::math;
  namespace cd = terrace::codec::detail;
  const float fmax = std::numeric_limits<float>::max();
  CHECK(m::ScaleFromAmax(FBits(fmax), m::kFp8Qmax, m::kFp8Limit) == cd::MaxScale(CodecKind::kFp8E4M3));
  CHECK(m::ScaleFromAmax(FBits(fmax), m::kInt8Qmax, m::kInt8Limit) == cd::MaxScale(CodecKind::kInt8));
  CHECK(m::ScaleFromAmax(FBits(fmax), m::kInt4Qmax, m::kInt4Limit) == cd::MaxScale(CodecKind::kInt4));
  CHECK(m::ScaleFromAmax(0, m::kInt4Qmax, m::kInt4Limit) == 0.0f);
  CHECK(m::ScaleFromAmax(FBits(6.9e-38f), m::kInt4Qmax, m::kInt4Limit) == 0.0f);  // below 2^-126 after / 7
  CHECK(m::ScaleFromAmax(FBits(7.0f), m::kInt4Qmax, m::kInt4Limit) == 1.0f);
  CHECK(m::InvOf(0.0f) == 0.0f);
  CHECK(m::InvOf(0.25f) == 4.0f);
}

TEST_CASE("emulated CUDA kernels encode and decode like the CPU codec, bit for bit", "[codec][cuda-emulation]") {
  Emulation e;
  cases::CheckMatchesCpu(e);
}

TEST_CASE("emulated CUDA kernels decode any valid payload like the CPU codec", "[codec][cuda-emulation]") {
  Emulation e;
  cases::CheckDecodesAnyValidPayload(e);
}

TEST_CASE("emulated CUDA kernels flag every input the CPU codec refuses", "[codec][cuda-emulation]") {
  Emulation e;
  cases::CheckFlagsWhatCpuRefuses(e);
}

TEST_CASE("emulated int4 packing: nibble order and padding across rows and groups", "[codec][cuda-emulation]") {
  // [3, 5] int4-g32: one group per row; rows end mid-byte (odd cols), the count is odd.
  const std::int64_t rows = 3, cols = 5;
  const std::vector<float> x = {7, 1, -1, 2, -7,  //
                                7, 3, -3, 0, 6,   //
                                -7, -2, 5, 4, 1};
  Emulation e;
  const auto enc = e.Encode(cases::SpecOf("int4-g32"), x, rows, cols);
  REQUIRE(enc.scales == std::vector<float>{1.0f, 1.0f, 1.0f});
  // Value k is the low nibble of byte k / 2 when k is even, the high nibble when odd (docs/kv-codecs.md).
  const std::vector<std::uint8_t> want = {0x17, 0x2F, 0x79, 0xD3, 0x60, 0xE9, 0x45, 0x01};
  CHECK(enc.payload == want);
  CHECK_FALSE(enc.nonfinite);
}
