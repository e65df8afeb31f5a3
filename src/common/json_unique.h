// JSON parsing that refuses a key repeated within one object. nlohmann::json::parse accepts
// {"a": 1, "a": 2} and keeps the last value, so a file whose writer repeated a key is read as
// something its author may not have meant; every parser of Terrace input files (trace lines,
// hardware files, the model's safetensors header) should refuse it instead and say which key.
//
// Built into terrace_common only when nlohmann_json is available (TERRACE_BUILD_MODEL=ON: the
// libraries that read JSON all need it); the header-only library is a build-time dependency only,
// so the installed package does not need it. Callers link nlohmann_json for this header.
// Pure function; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "terrace/status.h"

namespace terrace {

// What was wrong with the text, for callers that word their own message.
enum class JsonParseError : std::uint8_t {
  kNone,
  kSyntax,            // not one valid JSON document (RFC 8259), e.g. a missing brace, bad UTF-8, a NUL byte
  kNumberOutOfRange,  // a number no double holds (1e400)
  kDuplicateKey,      // a key appears twice in one object
  kTooDeep,           // objects and arrays nested deeper than kMaxJsonDepth
};

// The deepest nesting of objects and arrays any Terrace input file may have. Deeper documents are
// refused before they are parsed: code that walks a parsed document (comparisons, dump(), the
// report's flattening) recurses once per level, and a few hundred thousand levels (a few hundred
// KiB of brackets) would overflow the stack.
inline constexpr int kMaxJsonDepth = 64;

// The deepest nesting of objects and arrays in `text` (0 for a scalar), by a linear scan that skips
// string contents; the text need not be valid JSON.
int JsonNestingDepth(std::string_view text);

// Parses `text` as one JSON document, as nlohmann::json::parse does (trailing text is refused; so
// is a NUL byte anywhere, which nlohmann would read as the end of the text),
// except that a key repeated within one object is refused. On failure: InvalidArgument with a
// message naming what was wrong and where, without any file name (the caller prefixes its own):
//   duplicate key "input_length" (a key may appear once per object)
//   duplicate key "dtype" in the object at "layers.0.weight" (a key may appear once per object)
//   a number is out of range: number overflow parsing '1e400'
//   not valid JSON: parse error at line 1, column 1: syntax error while parsing value - invalid literal; last read: 'x'
//   objects and arrays nest 100000 levels deep, over the limit of 64
//   not valid JSON: a NUL byte at line 1, column 77 (byte offset 76); JSON text cannot hold one, remove it
// and, when `error` is given, sets *error to the kind (kNone on success).
Result<nlohmann::json> ParseJsonUniqueKeys(std::string_view text, JsonParseError* error = nullptr);

}  // namespace terrace
