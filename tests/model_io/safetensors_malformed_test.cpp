// Malformed safetensors headers are rejected with a Corruption naming the problem, never a crash.
#include <cstring>
#include <string>

#include <catch2/catch.hpp>

#include "src/model/safetensors_header.h"
#include "model_io/mentions.h"

using namespace terrace::model;
using terrace::Status;

namespace {

std::vector<std::byte> Make(std::uint64_t header_len, const std::string& json, std::size_t data_bytes) {
  std::vector<std::byte> out(8 + json.size() + data_bytes, std::byte{0});
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>((header_len >> (8 * i)) & 0xFF);
  std::memcpy(out.data() + 8, json.data(), json.size());
  return out;
}
std::vector<std::byte> Make(const std::string& json, std::size_t data_bytes) {
  return Make(json.size(), json, data_bytes);
}

// Parses and returns the error message (empty on success).
std::string Error(const std::vector<std::byte>& bytes) {
  SafetensorsHeader h;
  Status s = ParseSafetensorsHeader(bytes, "bad.safetensors", &h);
  if (s.ok()) return "";
  CHECK(s.IsCorruption());
  CHECK(s.message().find("bad.safetensors") != std::string::npos);
  return s.message();
}

}  // namespace

TEST_CASE("a well-formed header parses", "[safetensors][malformed]") {
  const std::string json =
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},"e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}   )";
  SafetensorsHeader h;
  REQUIRE(ParseSafetensorsHeader(Make(json, 11), "ok.safetensors", &h).ok());
  REQUIRE(h.entries.size() == 3);
  CHECK(h.entries[0].name == "a");
  CHECK(h.entries[1].end == 11);
  CHECK(h.metadata.at("k") == "v");
  CHECK(h.data_start == 8 + json.size());
}

TEST_CASE("length field problems", "[safetensors][malformed]") {
  CHECK(Mentions(Error(std::vector<std::byte>(5)), "too short"));
  CHECK(Mentions(Error(Make(1000, "{}", 0)), "past the end"));
  CHECK(Mentions(Error(Make(~0ull, "{}", 0)), "limit"));
  CHECK(Mentions(Error(Make(200'000'000, "{}", 0)), "limit"));
  CHECK(Mentions(Error(Make(0, "", 0)), "too short"));
}

TEST_CASE("JSON problems", "[safetensors][malformed]") {
  CHECK(Mentions(Error(Make("{\"a\": [1, 2", 0)), "JSON"));
  CHECK(Mentions(Error(Make("[1, 2]", 0)), "'{'"));
  CHECK(Mentions(Error(Make("{\"a\": 1} trailing", 0)), "JSON"));
  CHECK(Mentions(Error(Make("{\"a\": 3}", 0)), "not a JSON object"));
  CHECK(Mentions(Error(Make(R"({"__metadata__": {"k": 1}})", 0)), "__metadata__"));
  // A tensor named twice is refused, not read last-wins (with or without the same entry).
  CHECK(Mentions(Error(Make(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                            8)),
                 "duplicate key \"a\""));
  CHECK(Mentions(Error(Make(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                            4)),
                 "duplicate key \"a\""));
  // Depth bomb: a million nested arrays is refused by the pre-scan, quickly, without recursion.
  std::string bomb = "{\"a\":" + std::string(1'000'000, '[') + std::string(1'000'000, ']') + "}";
  CHECK(Mentions(Error(Make(bomb, 0)), "deeper"));
  // Brackets inside strings do not count toward depth.
  std::string deep_string = R"({"__metadata__":{"k":")" + std::string(1000, '[') + R"("}})";
  CHECK(Error(Make(deep_string, 0)).empty());
  // Huge but flat JSON (many metadata entries) parses, within the length limit.
  std::string big = "{\"__metadata__\":{";
  // append(), not `const char* + std::string`: GCC 12 at -O3 reports a false -Wrestrict in the latter.
  for (int i = 0; i < 20000; ++i) big.append(i ? ",\"k" : "\"k").append(std::to_string(i)).append("\":\"v\"");
  big += "}}";
  CHECK(Error(Make(big, 0)).empty());
}

TEST_CASE("entry problems name the tensor", "[safetensors][malformed]") {
  auto entry = [](const std::string& body, std::size_t data = 64) {
    return Error(Make("{\"w\":" + body + "}", data));
  };
  CHECK(Mentions(entry(R"({"shape":[2],"data_offsets":[0,8]})"), "'w'"));
  CHECK(Mentions(entry(R"({"dtype":"F32","data_offsets":[0,8]})"), "shape"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2]})"), "data_offsets"));
  CHECK(Mentions(entry(R"({"dtype":"Q4","shape":[2],"data_offsets":[0,8]})"), "Q4"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), "negative"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"), "non-integer"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), "needs 12"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"), "begin > end"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), "non-negative"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[60,68]})"), "past the data section"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,9]})"), "data_offsets"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"), "overflow"));
  CHECK(Mentions(entry(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]})"), "overflow"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]})"), "2^63"));
  CHECK(Mentions(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]})"), "past"));
  CHECK(Mentions(entry(R"("F32")"), "not a JSON object"));
  // A zero dim makes the tensor empty even when another dim is huge.
  CHECK(entry(R"({"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,0]})", 0).empty());
}

TEST_CASE("overlapping tensors are rejected", "[safetensors][malformed]") {
  const std::string json =
      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})";
  const std::string msg = Error(Make(json, 32));
  CHECK(Mentions(msg, "overlap"));
  CHECK(Mentions(msg, "'a'"));
  CHECK(Mentions(msg, "'b'"));
  const std::string same =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})";
  CHECK(Mentions(Error(Make(same, 4)), "overlap"));
}

TEST_CASE("random corruptions of a valid file never crash", "[safetensors][malformed]") {
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  const auto good = Make(json, 11);
  std::uint32_t state = 99;
  int rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    auto bytes = good;
    for (int k = 0; k < 1 + i % 4; ++k) {
      state = state * 1664525u + 1013904223u;
      bytes[state % bytes.size()] = static_cast<std::byte>(state >> 24);
    }
    if (i % 7 == 0) bytes.resize(state % bytes.size());
    SafetensorsHeader h;
    Status s = ParseSafetensorsHeader(bytes, "fuzz", &h);
    if (!s.ok()) {
      ++rejected;
      CHECK(s.IsCorruption());
      CHECK(h.entries.empty());
    } else {
      for (const auto& e : h.entries) CHECK(e.end <= h.data_size);
    }
  }
  CHECK(rejected > 0);
}
