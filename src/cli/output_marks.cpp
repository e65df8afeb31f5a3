// HasTerraceMark (safe_files.h): recognises the marks of src/common/generator_mark.h in the first
// bytes of an existing output file. Pure functions over bytes; no I/O.
#include <cstdint>
#include <string>
#include <string_view>

#include "src/cli/safe_files.h"
#include "src/common/generator_mark.h"

namespace terrace::cli {
namespace {

// The safetensors header (the JSON after the 8-byte little-endian length) when it lies within `head`.
std::string_view SafetensorsHeaderIn(std::string_view head) {
  if (head.size() < 8) return {};
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(head[static_cast<std::size_t>(i)]);
  if (len > head.size() - 8) return {};
  return head.substr(8, static_cast<std::size_t>(len));
}

// True when the header holds the pair "generator":"terrace" as SafetensorsWriter writes it (compact
// JSON). Unescaped quotes cannot occur inside a JSON string, so a match preceded by no backslash is a
// key and its string value, not text inside another string.
bool SafetensorsMarked(std::string_view head) {
  const std::string_view header = SafetensorsHeaderIn(head);
  if (header.empty() || header.front() != '{' || header.find("\"__metadata__\":{") == std::string_view::npos)
    return false;
  const std::string pair =
      "\"" + std::string(kSafetensorsGeneratorKey) + "\":\"" + std::string(kSafetensorsGeneratorValue) + "\"";
  for (std::size_t at = header.find(pair); at != std::string_view::npos; at = header.find(pair, at + 1)) {
    if (at == 0 || header[at - 1] != '\\') return true;
  }
  return false;
}

}  // namespace

bool HasTerraceMark(OutputFormat format, std::string_view head) {
  switch (format) {
    case OutputFormat::kHtml:
      return head.starts_with("<!DOCTYPE html>") &&
             head.substr(0, 1024).find(kHtmlGeneratorMeta) != std::string_view::npos;
    case OutputFormat::kSvg: {
      const std::size_t tag_end = head.find('>');
      return head.starts_with("<svg ") && tag_end != std::string_view::npos &&
             head.substr(tag_end + 1).starts_with(kSvgGeneratorComment);
    }
    case OutputFormat::kSafetensors: return SafetensorsMarked(head);
    case OutputFormat::kPrometheus:
      return head.starts_with(kPrometheusGeneratorLine) &&
             head.substr(kPrometheusGeneratorLine.size()).starts_with("\n");
    case OutputFormat::kPng:
    case OutputFormat::kTrace: return false;
  }
  return false;
}

}  // namespace terrace::cli
