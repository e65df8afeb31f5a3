// The expert block format (docs/model-format.md, "Expert blocks"): SerializeExpertBlock /
// ParseExpertBlock round trip, the documented byte layout, and every corruption it must refuse.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/model/mxfp4.h"
#include "terrace/model_weights.h"

namespace terrace::model {
namespace {

struct OwnedExpert {
  std::int64_t L = 0, I = 0;
  std::vector<std::uint8_t> p1, s1, p2, s2, p3, s3;
  ExpertWeights view() const {
    ExpertWeights e;
    e.format = ExpertFormat::kMxfp4;
    e.q1 = {p1.data(), s1.data(), I, L};
    e.q2 = {p2.data(), s2.data(), L, I};
    e.q3 = {p3.data(), s3.data(), I, L};
    return e;
  }
};

OwnedExpert RandomExpert(std::int64_t L, std::int64_t I, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  OwnedExpert o;
  o.L = L;
  o.I = I;
  const auto fill = [&](std::vector<std::uint8_t>& v, std::size_t n, int lo, int hi) {
    std::uniform_int_distribution<int> d(lo, hi);
    v.resize(n);
    for (auto& b : v) b = static_cast<std::uint8_t>(d(rng));
  };
  const auto packed = static_cast<std::size_t>(L * I / 2), scales = static_cast<std::size_t>(L * I / 32);
  fill(o.p1, packed, 0, 255);
  fill(o.p2, packed, 0, 255);
  fill(o.p3, packed, 0, 255);
  fill(o.s1, scales, 100, 140);
  fill(o.s2, scales, 100, 140);
  fill(o.s3, scales, 100, 140);
  return o;
}

std::uint32_t U32At(const std::vector<std::byte>& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(std::to_integer<std::uint8_t>(b[at + i])) << (8 * i);
  return v;
}

bool SameBytes(const std::uint8_t* a, const std::vector<std::uint8_t>& b) { return std::memcmp(a, b.data(), b.size()) == 0; }

TEST_CASE("Expert block: documented layout and a lossless round trip", "[expert_block]") {
  const std::int64_t L = 96, I = 64;
  const OwnedExpert o = RandomExpert(L, I, 1);
  const std::vector<std::byte> block = SerializeExpertBlock(o.view());
  // Header: magic, latent, intermediate, six 64-aligned offsets in the order w1 p/s, w3 p/s, w2 p/s, size.
  REQUIRE(block.size() == ExpertBlockBytes(L, I));
  CHECK(std::memcmp(block.data(), "TXPRT001", 8) == 0);
  CHECK(U32At(block, 8) == L);
  CHECK(U32At(block, 12) == I);
  const std::size_t packed = L * I / 2, scales = L * I / 32;
  std::size_t at = 64;
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK(U32At(block, 16 + 4 * i) == at);
    at = (at + (i % 2 == 0 ? packed : scales) + 63) / 64 * 64;
  }
  CHECK(U32At(block, 40) == block.size());
  CHECK(block.size() == at);
  for (std::size_t i = 44; i < 64; ++i) CHECK(block[i] == std::byte{0});
  // w1.packed sits right after the header.
  CHECK(std::memcmp(block.data() + 64, o.p1.data(), packed) == 0);

  auto parsed = ParseExpertBlock(block, L, I);
  REQUIRE(parsed.ok());
  const ExpertWeights& e = *parsed;
  CHECK(e.format == ExpertFormat::kMxfp4);
  CHECK(e.q1.rows == I);
  CHECK(e.q1.cols == L);
  CHECK(e.q2.rows == L);
  CHECK(e.q2.cols == I);
  CHECK(e.q3.rows == I);
  CHECK(SameBytes(e.q1.packed, o.p1));
  CHECK(SameBytes(e.q1.scales, o.s1));
  CHECK(SameBytes(e.q2.packed, o.p2));
  CHECK(SameBytes(e.q2.scales, o.s2));
  CHECK(SameBytes(e.q3.packed, o.p3));
  CHECK(SameBytes(e.q3.scales, o.s3));
  // Views into the block itself, not copies.
  const auto* base = reinterpret_cast<const std::uint8_t*>(block.data());
  CHECK(e.q1.packed >= base);
  CHECK(e.q2.scales + e.q2.scale_bytes() <= base + block.size());
  // Serialising the parsed views gives the same bytes.
  CHECK(SerializeExpertBlock(e) == block);
}

TEST_CASE("Expert block: refuses non-MXFP4 or inconsistent experts", "[expert_block]") {
  ExpertWeights f32;
  CHECK(SerializeExpertBlock(f32).empty());
  OwnedExpert o = RandomExpert(64, 32, 2);
  ExpertWeights bad = o.view();
  bad.q2.rows = 32;
  CHECK(SerializeExpertBlock(bad).empty());
  CHECK(ExpertBlockBytes(48, 32) == 0);  // latent not a multiple of 32
  CHECK_FALSE(ParseExpertBlock({}, 48, 32).ok());
}

TEST_CASE("Expert block: corruption is refused, naming what is wrong", "[expert_block]") {
  const std::int64_t L = 64, I = 96;
  const OwnedExpert o = RandomExpert(L, I, 3);
  const std::vector<std::byte> good = SerializeExpertBlock(o.view());
  REQUIRE(ParseExpertBlock(good, L, I).ok());
  const auto expect = [&](std::vector<std::byte> b, std::int64_t l, std::int64_t i, const std::string& words) {
    auto r = ParseExpertBlock(b, l, i);
    REQUIRE_FALSE(r.ok());
    CAPTURE(r.status().message());
    CHECK(r.status().IsCorruption());
    CHECK(r.status().message().find(words) != std::string::npos);
  };
  expect(std::vector<std::byte>(good.begin(), good.begin() + 10), L, I, "shorter than its 64-byte header");
  expect(std::vector<std::byte>(good.begin(), good.end() - 1), L, I, "truncated");
  {
    auto b = good;
    b.push_back(std::byte{0});
    expect(b, L, I, "expected");
  }
  {
    auto b = good;
    b[3] = std::byte{'X'};
    expect(b, L, I, "magic");
  }
  expect(good, I, L, "the model expects 96 x 64");
  {
    auto b = good;
    b[16 + 4 * 2] = std::byte{0x41};  // offset of w3.packed
    expect(b, L, I, "section 2");
  }
  {
    auto b = good;
    b[50] = std::byte{1};
    expect(b, L, I, "header byte 50");
  }
  const std::size_t w2_scales = U32At(good, 16 + 4 * 5);
  {
    auto b = good;
    b[w2_scales + 7] = std::byte{255};  // w2 [L, I]: I/32 = 3 blocks per row -> row 2, block 1
    expect(b, L, I, "expert block w2: MXFP4 scale is NaN (E8M0 255) at row 2, block 1");
  }
  {
    // A scale of 2^127 with code 7 (6.0) overflows fp32; with code 1 (0.5) it does not.
    auto b = good;
    const std::size_t w1_packed = U32At(good, 16), w1_scales = U32At(good, 20);
    for (std::size_t k = 0; k < 16; ++k) b[w1_packed + k] = std::byte{0x11};
    b[w1_scales] = std::byte{254};
    CHECK(ParseExpertBlock(b, L, I).ok());
    b[w1_packed + 5] = std::byte{0x71};
    expect(b, L, I, "expert block w1: MXFP4 weight at row 0, column 11 overflows fp32");
  }
}

}  // namespace
}  // namespace terrace::model
