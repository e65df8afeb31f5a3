#include "src/common/json_unique.h"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace terrace {
namespace {

using json = nlohmann::json;

// One open object or array of the document being parsed.
struct JsonUniqueFrame {
  bool object = false;
  std::unordered_set<std::string> keys;  // objects: the keys read so far
  std::string key;                       // objects: the key of the value being read
  std::size_t count = 0;                 // arrays: the elements read so far
};

// "layers.0.weight", "a[2].b": where the innermost open object sits ("" at the top level).
std::string JsonUniquePath(const std::vector<JsonUniqueFrame>& stack) {
  std::string path;
  for (std::size_t i = 0; i + 1 < stack.size(); ++i) {
    if (stack[i].object) {
      if (!path.empty()) path += '.';
      path += stack[i].key;
    } else {
      path += fmt::format("[{}]", stack[i].count);
    }
  }
  return path;
}

// nlohmann's own DOM builder, fed every SAX event, with the first key seen twice in one object
// recorded beside it. The builder throws nlohmann's parse errors (allow_exceptions), as
// json::parse does.
class JsonUniqueBuilder {
 public:
  explicit JsonUniqueBuilder(json& root) : dom_(root, /*allow_exceptions=*/true) {}

  bool null() { return Value() && dom_.null(); }
  bool boolean(bool v) { return Value() && dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return Value() && dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return Value() && dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) { return Value() && dom_.number_float(v, s); }
  bool string(json::string_t& v) { return Value() && dom_.string(v); }
  bool binary(json::binary_t& v) { return Value() && dom_.binary(v); }
  bool start_object(std::size_t n) {
    stack_.push_back(JsonUniqueFrame{.object = true});
    return dom_.start_object(n);
  }
  bool key(json::string_t& k) {
    JsonUniqueFrame& f = stack_.back();
    f.key = k;
    if (!f.keys.insert(k).second && !duplicate) {
      duplicate = true;
      duplicate_key = k;
      duplicate_path = JsonUniquePath(stack_);
    }
    return dom_.key(k);
  }
  bool end_object() {
    stack_.pop_back();
    return Value() && dom_.end_object();
  }
  bool start_array(std::size_t n) {
    stack_.push_back(JsonUniqueFrame{.object = false});
    return dom_.start_array(n);
  }
  bool end_array() {
    stack_.pop_back();
    return Value() && dom_.end_array();
  }
  // Templated as nlohmann's own: the error is rethrown with its type (out_of_range for 1e400).
  template <class Exception>
  bool parse_error(std::size_t pos, const std::string& token, const Exception& e) {
    return dom_.parse_error(pos, token, e);
  }

  bool duplicate = false;
  std::string duplicate_key, duplicate_path;

 private:
  // A value (or a closed container) is one more element of the array it sits in.
  bool Value() {
    if (!stack_.empty() && !stack_.back().object) ++stack_.back().count;
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::vector<JsonUniqueFrame> stack_;
};

// nlohmann's exception text without its "[json.exception.parse_error.101] " prefix.
std::string JsonUniqueReason(const json::exception& e) {
  std::string_view what = e.what();
  if (const std::size_t end = what.find("] "); what.starts_with("[json.exception.") && end != std::string_view::npos) {
    what.remove_prefix(end + 2);
  }
  return std::string(what);
}

// "line 2, column 5" of byte `offset` in `text` (both from 1; a column counts bytes, as nlohmann's do).
std::string JsonTextPosition(std::string_view text, std::size_t offset) {
  const std::string_view before = text.substr(0, offset);
  const std::size_t line_start = before.rfind('\n');
  const std::size_t column = line_start == std::string_view::npos ? offset + 1 : offset - line_start;
  return fmt::format("line {}, column {}", std::count(before.begin(), before.end(), '\n') + 1, column);
}

}  // namespace

int JsonNestingDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

Result<json> ParseJsonUniqueKeys(std::string_view text, JsonParseError* error) {
  if (error != nullptr) *error = JsonParseError::kNone;
  auto fail = [&](JsonParseError kind, std::string message) -> Result<json> {
    if (error != nullptr) *error = kind;
    return Status::InvalidArgument(std::move(message));
  };
  // nlohmann reads a NUL byte as the end of the input and ignores what follows it.
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return fail(JsonParseError::kSyntax,
                fmt::format("not valid JSON: a NUL byte at {} (byte offset {}); JSON text cannot hold one, remove it",
                            JsonTextPosition(text, nul), nul));
  }
  if (const int depth = JsonNestingDepth(text); depth > kMaxJsonDepth) {
    return fail(JsonParseError::kTooDeep,
                fmt::format("objects and arrays nest {} levels deep, over the limit of {}", depth, kMaxJsonDepth));
  }
  // One SAX pass builds the document (nlohmann's own DOM builder) and checks the keys. nlohmann's
  // callback parser, which could do both, rescans the parent container after every nested object:
  // quadratic in a container's size.
  json j;
  JsonUniqueBuilder builder(j);
  try {
    json::sax_parse(text.begin(), text.end(), &builder);
  } catch (const json::out_of_range& e) {
    return fail(JsonParseError::kNumberOutOfRange, fmt::format("a number is out of range: {}", JsonUniqueReason(e)));
  } catch (const json::exception& e) {
    return fail(JsonParseError::kSyntax, fmt::format("not valid JSON: {}", JsonUniqueReason(e)));
  }
  if (builder.duplicate) {
    return fail(JsonParseError::kDuplicateKey,
                builder.duplicate_path.empty()
                    ? fmt::format("duplicate key \"{}\" (a key may appear once per object)", builder.duplicate_key)
                    : fmt::format("duplicate key \"{}\" in the object at \"{}\" (a key may appear once per object)",
                                  builder.duplicate_key, builder.duplicate_path));
  }
  return j;
}

}  // namespace terrace
