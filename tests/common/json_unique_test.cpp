// ParseJsonUniqueKeys: nlohmann's parse, except that a key repeated within one object is refused
// (nlohmann keeps the last value), naming the key and where it is.
#include <catch2/catch.hpp>

#include <string>

#include "src/common/json_unique.h"

using namespace terrace;

TEST_CASE("ParseJsonUniqueKeys reads what nlohmann reads") {
  JsonParseError kind = JsonParseError::kSyntax;
  auto j = ParseJsonUniqueKeys(R"({"a": 1, "b": [{"a": 2}, {"a": 3}], "c": {"a": {"a": 4}}, "d": "x"})", &kind);
  REQUIRE(j.ok());
  CHECK(kind == JsonParseError::kNone);
  CHECK((*j)["b"][1]["a"] == 3);
  CHECK((*j)["c"]["a"]["a"] == 4);
  // The same key in different objects, at any depth, is not a duplicate.
  CHECK(ParseJsonUniqueKeys(R"([{"k": 1}, {"k": 2}, [{"k": 3}]])").ok());
  CHECK(ParseJsonUniqueKeys("5").ok());
  CHECK(ParseJsonUniqueKeys("{}").ok());
}

TEST_CASE("ParseJsonUniqueKeys refuses a key repeated in one object, naming the key and its object") {
  JsonParseError kind = JsonParseError::kNone;
  auto j = ParseJsonUniqueKeys(R"({"input_length": 1000, "input_length": 5})", &kind);
  REQUIRE_FALSE(j.ok());
  CHECK(kind == JsonParseError::kDuplicateKey);
  CHECK(j.status().code() == Code::kInvalidArgument);
  CHECK_THAT(j.status().message(), Catch::Contains("duplicate key \"input_length\""));
  j = ParseJsonUniqueKeys(R"({"layers": [{"w": {"dtype": "F32", "shape": [1], "dtype": "BF16"}}]})", &kind);
  REQUIRE_FALSE(j.ok());
  CHECK(kind == JsonParseError::kDuplicateKey);
  CHECK_THAT(j.status().message(),
             Catch::Contains("duplicate key \"dtype\"") && Catch::Contains("\"layers[0].w\""));
  // A duplicate after a nested object that used the same key.
  j = ParseJsonUniqueKeys(R"({"a": {"a": 1}, "b": 2, "a": 3})");
  REQUIRE_FALSE(j.ok());
  CHECK_THAT(j.status().message(), Catch::Contains("duplicate key \"a\" (a key"));
}

TEST_CASE("ParseJsonUniqueKeys says why text is not JSON, and tells an out-of-range number apart") {
  JsonParseError kind = JsonParseError::kNone;
  auto j = ParseJsonUniqueKeys(R"({"a": 1e400})", &kind);
  REQUIRE_FALSE(j.ok());
  CHECK(kind == JsonParseError::kNumberOutOfRange);
  CHECK_THAT(j.status().message(), Catch::Contains("out of range") && Catch::Contains("1e400"));
  CHECK_THAT(j.status().message(), !Catch::Contains("[json.exception"));
  for (const char* bad : {"", "not json", R"({"a": 1)", R"({"a": 1} x)", "{\"a\": \"\xff\"}"}) {
    INFO(bad);
    j = ParseJsonUniqueKeys(bad, &kind);
    REQUIRE_FALSE(j.ok());
    CHECK(kind == JsonParseError::kSyntax);
    CHECK_THAT(j.status().message(), Catch::StartsWith("not valid JSON: "));
  }
}

TEST_CASE("ParseJsonUniqueKeys refuses nesting deeper than kMaxJsonDepth before parsing it") {
  // 200 000 levels parsed fine, but whatever walked the result (a comparison, dump(), a report's
  // flattening) recursed once per level and overflowed the stack.
  auto nest = [](int levels, const char* open, const char* close) {
    std::string s;
    for (int i = 0; i < levels; ++i) s += open;
    s += "1";
    for (int i = 0; i < levels; ++i) s += close;
    return s;
  };
  JsonParseError kind = JsonParseError::kNone;
  CHECK(ParseJsonUniqueKeys(nest(kMaxJsonDepth, "[", "]"), &kind).ok());
  CHECK(kind == JsonParseError::kNone);
  for (const std::string& deep : {nest(kMaxJsonDepth + 1, "[", "]"), "{\"a\":" + nest(200000, "[", "]") + "}"}) {
    auto j = ParseJsonUniqueKeys(deep, &kind);
    REQUIRE_FALSE(j.ok());
    CHECK(kind == JsonParseError::kTooDeep);
    CHECK_THAT(j.status().message(), Catch::Contains("over the limit of 64"));
  }
  // Brackets inside strings are not nesting.
  CHECK(JsonNestingDepth("{\"k\": \"[[[[{{{{\\\"[[[\"}") == 1);
  CHECK(ParseJsonUniqueKeys("{\"k\": \"" + std::string(1000, '[') + "\"}").ok());
}

TEST_CASE("ParseJsonUniqueKeys refuses a NUL byte anywhere, naming its line, column and offset") {
  // nlohmann reads a NUL as the end of the text: what follows it was ignored.
  JsonParseError kind = JsonParseError::kNone;
  using namespace std::string_literals;
  auto j = ParseJsonUniqueKeys("{\"base\": \"h200-gen5\"}\n\0{\"gpus\": 1}"s, &kind);
  REQUIRE_FALSE(j.ok());
  CHECK(kind == JsonParseError::kSyntax);
  CHECK_THAT(j.status().message(), Catch::Contains("a NUL byte at line 2, column 1 (byte offset 22)"));
  CHECK_THAT(ParseJsonUniqueKeys("{\"a\": 1}\0"s).status().message(),
             Catch::Contains("a NUL byte at line 1, column 9 (byte offset 8)"));
  CHECK_THAT(ParseJsonUniqueKeys("{\"a\": \"x\0y\"}"s).status().message(), Catch::Contains("a NUL byte at line 1"));
}
