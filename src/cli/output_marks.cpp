// HasTerraceMark and IsTerraceCheckpoint (safe_files.h): recognise the marks of
// src/common/generator_mark.h in the first bytes of an existing output file; WithPngMark writes the
// PNG one (the JSON one is written by JsonTextWithMark, src/common/json_text.h). Pure functions over
// bytes; no I/O.
#include <cstdint>
#include <string>
#include <string_view>

#include <boost/crc.hpp>

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

// True when the header holds `text` (the start of a key and its string value) as SafetensorsWriter
// writes it (compact JSON). Unescaped quotes cannot occur inside a JSON string, so a match preceded
// by no backslash is a key and its string value, not text inside another string.
bool SafetensorsHeaderHas(std::string_view head, std::string_view text) {
  const std::string_view header = SafetensorsHeaderIn(head);
  if (header.empty() || header.front() != '{' || header.find("\"__metadata__\":{") == std::string_view::npos)
    return false;
  for (std::size_t at = header.find(text); at != std::string_view::npos; at = header.find(text, at + 1)) {
    if (at == 0 || header[at - 1] != '\\') return true;
  }
  return false;
}

// The pair "generator":"terrace".
bool SafetensorsMarked(std::string_view head) {
  return SafetensorsHeaderHas(head, "\"" + std::string(kSafetensorsGeneratorKey) + "\":\"" +
                                        std::string(kSafetensorsGeneratorValue) + "\"");
}

constexpr std::string_view kPngSignature = "\x89PNG\r\n\x1a\n";
constexpr std::size_t kIhdrEnd = 8 + 4 + 4 + 13 + 4;  // signature, then IHDR: length, type, 13 bytes, CRC

bool StartsWithPngAndIhdr(std::string_view png) {
  return png.size() >= kIhdrEnd && png.starts_with(kPngSignature) && png.substr(8, 8) == std::string_view("\0\0\0\x0dIHDR", 8);
}

void AppendBigEndian32(std::string* out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>((v >> shift) & 0xFF));
}

// The mark's tEXt chunk without its trailing CRC: length, type, then keyword, NUL, text.
std::string PngMarkChunkWithoutCrc() {
  std::string chunk;
  AppendBigEndian32(&chunk, static_cast<std::uint32_t>(kPngGeneratorKeyword.size() + 1 + kPngGeneratorText.size()));
  chunk += "tEXt";
  chunk += kPngGeneratorKeyword;
  chunk.push_back('\0');
  chunk += kPngGeneratorText;
  return chunk;
}

// True when `head` is the start of a JSON object whose first member is kJsonGeneratorKey with the
// string value kJsonGeneratorValue, whitespace allowed between the tokens (a key or value with
// escapes is not the mark).
bool JsonMarked(std::string_view head) {
  std::size_t at = 0;
  auto token = [&](std::string_view t) {
    while (at < head.size() && (head[at] == ' ' || head[at] == '\t' || head[at] == '\n' || head[at] == '\r')) ++at;
    if (!head.substr(at).starts_with(t)) return false;
    at += t.size();
    return true;
  };
  const std::string key = "\"" + std::string(kJsonGeneratorKey) + "\"";
  const std::string value = "\"" + std::string(kJsonGeneratorValue) + "\"";
  return token("{") && token(key) && token(":") && token(value) && (token(",") || token("}"));
}

}  // namespace

bool IsTerraceCheckpoint(std::string_view head) {
  // A tensor of that name has an object as its value ({"dtype":...}), never a string.
  return SafetensorsMarked(head) &&
         SafetensorsHeaderHas(head, "\"" + std::string(kSafetensorsCheckpointKey) + "\":\"");
}

std::string WithPngMark(std::string_view png) {
  if (!StartsWithPngAndIhdr(png)) return std::string(png);
  std::string chunk = PngMarkChunkWithoutCrc();
  boost::crc_32_type crc;  // PNG's CRC-32 (ISO 3309) over the chunk type and data
  crc.process_bytes(chunk.data() + 4, chunk.size() - 4);
  AppendBigEndian32(&chunk, crc.checksum());
  std::string out(png.substr(0, kIhdrEnd));
  out += chunk;
  out.append(png.substr(kIhdrEnd));
  return out;
}

bool HasTerraceMark(OutputFormat format, std::string_view head) {
  switch (format) {
    case OutputFormat::kHtml:
      return head.starts_with("<!DOCTYPE html>") &&
             (head.substr(0, 1024).find(kHtmlGeneratorMeta) != std::string_view::npos ||
              head.substr(0, 1024).find(kHtmlGeneratorMetaOld) != std::string_view::npos);
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
      return StartsWithPngAndIhdr(head) && head.substr(kIhdrEnd).starts_with(PngMarkChunkWithoutCrc());
    case OutputFormat::kJson: return JsonMarked(head);
    case OutputFormat::kTrace: return false;
  }
  return false;
}

}  // namespace terrace::cli
