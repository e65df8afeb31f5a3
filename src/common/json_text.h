// JSON text for output: nlohmann::json::dump throws type_error.316 on a string that is not UTF-8,
// and a file path, a model name or a file name given on the command line need not be. Every JSON
// document Terrace writes (the CLI's --json output, run files, reports' input) goes through
// JsonText, which writes each invalid byte as U+FFFD instead. Header-only; callers link
// nlohmann_json. Pure; thread-safe.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace terrace {

// `j` as JSON text: compact with indent < 0, else pretty-printed with `indent` spaces per level.
// Strings that are not valid UTF-8 have each invalid byte replaced by U+FFFD (never throws for it).
inline std::string JsonText(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace terrace
