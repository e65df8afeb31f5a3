// JSON text for output: nlohmann::json::dump throws type_error.316 on a string that is not UTF-8,
// and a file path, a model name or a file name given on the command line need not be. Every JSON
// document Terrace writes (the CLI's --json output, run files, reports' input) goes through
// JsonText, which writes each invalid byte as U+FFFD instead. Header-only; callers link
// nlohmann_json. Pure; thread-safe.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "src/common/generator_mark.h"

namespace terrace {

// `j` as JSON text: compact with indent < 0, else pretty-printed with `indent` spaces per level.
// Strings that are not valid UTF-8 have each invalid byte replaced by U+FFFD (never throws for it).
inline std::string JsonText(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

// `object` (a JSON object) as JsonText writes it, with the generator mark (kJsonGeneratorKey:
// kJsonGeneratorValue, generator_mark.h) as its first member, where the CLI's check of an existing
// file's first bytes finds it (nlohmann::json keeps its keys sorted, so the mark is put in front
// of the text). A member of that name in `object` is replaced.
inline std::string JsonTextWithMark(nlohmann::json object, int indent = -1) {
  const std::string key(kJsonGeneratorKey);
  object.erase(key);
  std::string text = JsonText(nlohmann::json::object({{key, std::string(kJsonGeneratorValue)}}), indent);
  text.pop_back();                       // its closing '}'
  if (indent >= 0) text.pop_back();      // and the newline before it
  if (object.empty()) return text + (indent >= 0 ? "\n}" : "}");
  return text + "," + JsonText(object, indent).substr(1);  // the rest after its opening '{'
}

}  // namespace terrace
