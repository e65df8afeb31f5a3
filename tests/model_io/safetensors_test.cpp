#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "src/model/safetensors.h"
#include "test_util.h"

using namespace terrace::model;
using terrace::Status;
using terrace::testing::TempDir;

namespace {
std::vector<std::byte> ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  if (!c.empty()) std::memcpy(out.data(), c.data(), c.size());
  return out;
}
}  // namespace

TEST_CASE("safetensors write then read round trip", "[safetensors]") {
  TempDir dir("st");
  const auto path = dir.path() / "a.safetensors";
  SafetensorsWriter w;
  Tensor f({2, 3});
  for (int i = 0; i < 6; ++i) f.data[static_cast<std::size_t>(i)] = 0.5f * static_cast<float>(i) - 1.0f;
  REQUIRE(w.AddF32("f", f).ok());
  const std::vector<std::uint8_t> u8{1, 2, 3, 250, 251};  // odd size: later tensors must stay aligned
  REQUIRE(w.Add("bytes", DType::kU8, {5}, std::as_bytes(std::span(u8))).ok());
  const std::vector<std::uint16_t> bf{FloatToBf16(1.0f), FloatToBf16(-3.5f)};
  REQUIRE(w.Add("z.bf", DType::kBF16, {1, 2}, std::as_bytes(std::span(bf))).ok());
  const std::vector<std::int64_t> i64{-1, 1LL << 40};
  REQUIRE(w.Add("i64", DType::kI64, {2}, std::as_bytes(std::span(i64))).ok());
  REQUIRE(w.Add("empty", DType::kF32, {0, 4}, {}).ok());
  w.SetMetadata("format", "pt");
  REQUIRE(w.Write(path).ok());

  auto file = SafetensorsFile::Open(path);
  REQUIRE(file.ok());
  const auto& st = **file;
  CHECK(st.Names() == std::vector<std::string>{"bytes", "empty", "f", "i64", "z.bf"});
  CHECK(st.metadata().at("format") == "pt");
  auto fv = st.Get("f");
  REQUIRE(fv.ok());
  CHECK(fv->shape == std::vector<std::int64_t>{2, 3});
  CHECK(ToFloat(*fv)->data == f.data);
  auto bv = st.Get("bytes");
  REQUIRE(bv.ok());
  CHECK(std::memcmp(bv->data.data(), u8.data(), 5) == 0);
  auto zv = st.Get("z.bf");
  REQUIRE(zv.ok());
  CHECK(ToFloat(*zv)->data == std::vector<float>{1.0f, -3.5f});
  auto iv = st.Get("i64");
  REQUIRE(iv.ok());
  std::int64_t got[2];
  std::memcpy(got, iv->data.data(), 16);
  CHECK(got[0] == -1);
  CHECK(got[1] == (1LL << 40));
  CHECK(st.Get("empty")->numel() == 0);

  // Layout: data section 8-aligned, every tensor aligned to its element size, tensors back to back.
  const auto bytes = ReadAll(path);
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  CHECK((8 + n) % 8 == 0);
  for (const auto& name : st.Names()) {
    auto v = st.Get(name);
    const auto off = static_cast<std::size_t>(v->data.data() - (st.Get("i64")->data.data()));
    CHECK(off % DTypeSize(v->dtype) == 0);
  }
  auto missing = st.Get("nope");
  REQUIRE(missing.status().IsNotFound());
  CHECK(missing.status().message().find("nope") != std::string::npos);
}

TEST_CASE("safetensors writer rejects bad input", "[safetensors]") {
  SafetensorsWriter w;
  const std::vector<float> x(4, 1.0f);
  CHECK(w.Add("a", DType::kF32, {3}, std::as_bytes(std::span(x))).IsInvalidArgument());
  CHECK(w.Add("__metadata__", DType::kF32, {4}, std::as_bytes(std::span(x))).IsInvalidArgument());
  CHECK(w.Add("a", DType::kF32, {-4}, std::as_bytes(std::span(x))).IsInvalidArgument());
  REQUIRE(w.Add("a", DType::kF32, {2, 2}, std::as_bytes(std::span(x))).ok());
  CHECK(w.Add("a", DType::kF32, {4}, std::as_bytes(std::span(x))).IsInvalidArgument());
  CHECK(w.Write("/nonexistent-dir/x.safetensors").IsNotFound());
}

TEST_CASE("safetensors write is atomic: no temp file left, old file replaced", "[safetensors]") {
  TempDir dir("st");
  const auto path = dir.path() / "m.safetensors";
  for (float v : {1.0f, 2.0f}) {
    SafetensorsWriter w;
    Tensor t({1});
    t.data[0] = v;
    REQUIRE(w.AddF32("t", t).ok());
    REQUIRE(w.Write(path).ok());
    auto f = SafetensorsFile::Open(path);
    REQUIRE(f.ok());
    CHECK(ToFloat(*(*f)->Get("t"))->data[0] == v);
  }
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++files;
  CHECK(files == 1);
}

TEST_CASE("opening a missing file is NotFound naming the path", "[safetensors]") {
  auto f = SafetensorsFile::Open("/definitely/not/here.safetensors");
  REQUIRE(f.status().IsNotFound());
  CHECK(f.status().message().find("/definitely/not/here.safetensors") != std::string::npos);
}

TEST_CASE("a SafetensorsFile serves concurrent readers", "[safetensors]") {
  TempDir dir("st");
  const auto path = dir.path() / "c.safetensors";
  SafetensorsWriter w;
  for (int i = 0; i < 40; ++i) {
    Tensor t({3, 7});
    for (std::size_t k = 0; k < t.data.size(); ++k) t.data[k] = static_cast<float>(i * 100 + static_cast<int>(k));
    REQUIRE(w.AddF32(fmt::format("t{}", i), t).ok());
  }
  REQUIRE(w.Write(path).ok());
  auto file = SafetensorsFile::Open(path);
  REQUIRE(file.ok());
  const SafetensorsFile& st = **file;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&st, &bad, th] {
      for (int round = 0; round < 20; ++round) {
        for (int i = 0; i < 40; ++i) {
          const int j = (i + th * 7) % 40;
          auto v = st.Get(fmt::format("t{}", j));
          auto t = v.ok() ? ToFloat(*v) : terrace::Result<Tensor>(v.status());
          if (!t.ok() || t->data[5] != static_cast<float>(j * 100 + 5) || !st.Has(fmt::format("t{}", j))) ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(bad.load() == 0);
}

TEST_CASE("the tensors must cover the data section exactly: a header length off by one is refused", "[safetensors]") {
  TempDir dir("st");
  SafetensorsWriter w;
  const std::vector<float> a{1.0f, 2.0f, 3.0f}, b{4.0f};
  REQUIRE(w.Add("a", DType::kF32, {3}, std::as_bytes(std::span(a))).ok());
  REQUIRE(w.Add("b", DType::kF32, {1}, std::as_bytes(std::span(b))).ok());
  const auto path = dir.path() / "x.safetensors";
  REQUIRE(w.Write(path).ok());
  std::vector<std::byte> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes.resize(c.size());
    std::memcpy(bytes.data(), c.data(), c.size());
  }
  SafetensorsHeader h;
  REQUIRE(ParseSafetensorsHeader(bytes, "x", &h).ok());
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);  // little-endian host
  auto with_length = [&](std::uint64_t len) {
    std::vector<std::byte> v = bytes;
    std::memcpy(v.data(), &len, 8);
    return v;
  };
  // n - 1: the JSON still parses (it ends in padding) and the data section starts one byte early.
  Status minus = ParseSafetensorsHeader(with_length(n - 1), "x", &h);
  CHECK(minus.IsCorruption());
  CHECK(minus.message().find("cover") != std::string::npos);
  // n + 1 with a data section whose first byte is a space, so the JSON parses too.
  std::vector<std::byte> plus = with_length(n + 1);
  plus[8 + n] = std::byte{' '};
  Status p = ParseSafetensorsHeader(plus, "x", &h);
  CHECK(p.IsCorruption());
  // Trailing bytes after the last tensor, and a gap between tensors.
  std::vector<std::byte> trailing = bytes;
  trailing.push_back(std::byte{0});
  CHECK(ParseSafetensorsHeader(trailing, "x", &h).IsCorruption());
  const std::string gap_json = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})";
  std::vector<std::byte> gap(8 + gap_json.size() + 5, std::byte{0});
  const std::uint64_t gl = gap_json.size();
  std::memcpy(gap.data(), &gl, 8);
  std::memcpy(gap.data() + 8, gap_json.data(), gap_json.size());
  Status g = ParseSafetensorsHeader(gap, "x", &h);
  CHECK(g.IsCorruption());
  CHECK(g.message().find("[2, 3)") != std::string::npos);
  // And through SafetensorsFile::Open: the shifted file is not opened.
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const auto v = with_length(n - 1);
    out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size()));
  }
  CHECK(SafetensorsFile::Open(path).status().IsCorruption());
}

TEST_CASE("SafetensorsWriter::Add refuses a shape whose byte count wraps", "[safetensors]") {
  // [2^62] F32 is 2^64 bytes: unchecked, the count wrapped to 0 and an empty span was accepted.
  SafetensorsWriter w;
  const Status st = w.Add("w", DType::kF32, {std::int64_t{1} << 62}, {});
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("'w'") != std::string::npos);
  CHECK(st.message().find("[4611686018427387904]") != std::string::npos);
}
