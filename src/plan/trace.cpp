#include "src/plan/trace.h"

#include <bit>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/json_unique.h"

namespace terrace::plan {
namespace {

using json = nlohmann::json;

// `text` with every byte that is not part of valid UTF-8, and every control character, written as
// \xNN: a damaged file's bytes echoed into an error would reach the terminal raw.
std::string EscapeText(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char b) { out += fmt::format("\\x{:02x}", b); };
  for (std::size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    if (b < 0x80) {
      if (b < 0x20 || b == 0x7f) {
        escape(b);
      } else {
        out += static_cast<char>(b);
      }
      ++i;
      continue;
    }
    // A lead byte and its continuation bytes, refusing overlong forms, surrogates and > U+10FFFF.
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xbf;  // range of the second byte
    if (b >= 0xc2 && b <= 0xdf) {
      n = 2;
    } else if (b >= 0xe0 && b <= 0xef) {
      n = 3;
      if (b == 0xe0) lo = 0xa0;
      if (b == 0xed) hi = 0x9f;
    } else if (b >= 0xf0 && b <= 0xf4) {
      n = 4;
      if (b == 0xf0) lo = 0x90;
      if (b == 0xf4) hi = 0x8f;
    }
    bool valid = n > 0 && i + n <= text.size();
    for (std::size_t k = 1; valid && k < n; ++k) {
      const auto c = static_cast<unsigned char>(text[i + k]);
      valid = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xbf);
    }
    if (valid) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      escape(b);
      ++i;
    }
  }
  return out;
}

Status LineError(std::string_view source, std::size_t line, std::string_view what) {
  return Status::InvalidArgument(fmt::format("{}:{}: {}", source, line, EscapeText(what)));
}

// The JSON parser's message for one line names "line 1, column N" (it sees the line alone), which
// read after "file:LINE:" points at the file's first line: say "column N of that line" instead.
std::string LineColumnText(std::string message) {
  static constexpr std::string_view kLine1 = "line 1, column ";
  const std::size_t at = message.find(kLine1);
  if (at == std::string::npos) return message;
  std::size_t end = at + kLine1.size();
  while (end < message.size() && message[end] >= '0' && message[end] <= '9') ++end;
  const std::string column = message.substr(at + kLine1.size(), end - at - kLine1.size());
  return message.replace(at, end - at, fmt::format("column {} of that line", column));
}

// "4294967296 (2^32)" for a power of two, else the number.
std::string LimitText(std::uint64_t max) {
  if (max != 0 && (max & (max - 1)) == 0) return fmt::format("{} (2^{})", max, std::countr_zero(max));
  return std::to_string(max);
}

// A JSON number that is a whole non-negative integer <= max (floats with no fraction are accepted:
// some tools write 1.0 for timestamps; -0 and -0.0 are 0).
Result<std::uint64_t> ReadCount(const json& obj, const char* key, std::uint64_t max, std::string_view source,
                                std::size_t line) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    return LineError(source, line, fmt::format("missing \"{}\" (every line needs timestamp, input_length, "
                                               "output_length and hash_ids)", key));
  }
  auto over = [&](auto v) {
    return LineError(source, line, fmt::format("\"{}\" is {}, over the limit {}", key, v, LimitText(max)));
  };
  std::uint64_t v = 0;
  if (it->is_number_unsigned()) {
    v = it->get<std::uint64_t>();
  } else if (it->is_number_integer()) {
    const auto i = it->get<std::int64_t>();
    if (i < 0) return LineError(source, line, fmt::format("\"{}\" is negative ({})", key, i));
    v = static_cast<std::uint64_t>(i);  // -0: nlohmann reads it as a signed 0
  } else if (it->is_number_float()) {
    const double d = it->get<double>();
    // A whole number too large for an integer (99999999999999999999999) is read as a float.
    if (d > static_cast<double>(max)) return over(d);
    if (!(d >= 0.0) || d != static_cast<double>(static_cast<std::uint64_t>(d))) {
      return LineError(source, line, fmt::format("\"{}\" must be a non-negative whole number, got {}", key, d));
    }
    v = static_cast<std::uint64_t>(d);
  } else {
    return LineError(source, line, fmt::format("\"{}\" must be a number, got {}", key, it->type_name()));
  }
  if (v > max) return over(v);
  return v;
}

}  // namespace

Result<TraceRequest> ParseTraceLine(std::string_view line, std::string_view source, std::size_t line_number) {
  JsonParseError error = JsonParseError::kNone;
  auto parsed = ParseJsonUniqueKeys(line, &error);
  if (!parsed.ok()) {
    // A repeated key is refused, not read last-wins: which value the writer meant is unknown.
    if (error != JsonParseError::kSyntax) return LineError(source, line_number, parsed.status().message());
    // A '\r' inside a line: the file ends its lines with CR alone (classic Mac OS), so this "line" is
    // the whole file, and the parser stops at the second request.
    const std::string hint =
        line.find('\r') != std::string_view::npos
            ? "; the file uses CR line endings (\\r without \\n, old Mac OS): one request per line needs LF or "
              "CRLF line endings; convert it, e.g. tr '\\r' '\\n' < FILE > FILE.lf"
            : "";
    return LineError(source, line_number,
                     fmt::format("{} (expected one request object per line{})",
                                 LineColumnText(std::string(parsed.status().message())), hint));
  }
  const json& obj = *parsed;
  if (!obj.is_object()) {
    return LineError(source, line_number, fmt::format("expected a JSON object, got {}", obj.type_name()));
  }
  TraceRequest r;
  TERRACE_ASSIGN_OR_RETURN(r.timestamp_ms, ReadCount(obj, "timestamp", UINT64_MAX / 2, source, line_number));
  TERRACE_ASSIGN_OR_RETURN(r.input_length, ReadCount(obj, "input_length", kMaxTraceTokens, source, line_number));
  TERRACE_ASSIGN_OR_RETURN(r.output_length, ReadCount(obj, "output_length", kMaxTraceTokens, source, line_number));
  auto it = obj.find("hash_ids");
  if (it == obj.end()) return LineError(source, line_number, "missing \"hash_ids\" (a list of block ids)");
  if (!it->is_array()) {
    return LineError(source, line_number, fmt::format("\"hash_ids\" must be a list, got {}", it->type_name()));
  }
  if (it->size() > kMaxTraceBlocksPerRequest) {
    return LineError(source, line_number,
                     fmt::format("\"hash_ids\" has {} ids, over the limit {}", it->size(), kMaxTraceBlocksPerRequest));
  }
  r.hash_ids.reserve(it->size());
  for (std::size_t i = 0; i < it->size(); ++i) {
    const json& id = (*it)[i];
    if (id.is_number_integer() && !id.is_number_unsigned() && id.get<std::int64_t>() == 0) {
      r.hash_ids.push_back(0);  // -0
      continue;
    }
    if (!id.is_number_unsigned()) {
      return LineError(source, line_number,
                       fmt::format("\"hash_ids\"[{}] must be a non-negative integer, got {}", i,
                                   id.is_primitive() ? id.dump() : std::string("an ") + id.type_name()));
    }
    r.hash_ids.push_back(id.get<std::uint64_t>());
  }
  return r;
}

namespace {

// What a trace that is no UTF-8 text is (a compressed file, UTF-16 text), with the fix; empty when
// `text` does not start like one.
std::string NotTextTrace(std::string_view text) {
  if (text.starts_with("\x1f\x8b")) return "gzip-compressed (it starts with gzip's magic bytes); decompress it first (gunzip)";
  if (text.starts_with("\x28\xb5\x2f\xfd")) return "zstd-compressed (it starts with zstd's magic bytes); decompress it first (unzstd)";
  if (text.starts_with("BZh")) return "bzip2-compressed (it starts with bzip2's magic bytes); decompress it first (bunzip2)";
  if (text.starts_with(std::string_view("\xfd" "7zXZ\0", 6)))
    return "xz-compressed (it starts with xz's magic bytes); decompress it first (unxz)";
  // UTF-16 with a byte-order mark, or without one: a NUL byte at every other position of ASCII text.
  const bool utf16 = text.starts_with("\xff\xfe") || text.starts_with("\xfe\xff") ||
                     (text.size() >= 4 && ((text[0] != 0 && text[1] == 0 && text[2] != 0 && text[3] == 0) ||
                                           (text[0] == 0 && text[1] != 0 && text[2] == 0 && text[3] != 0)));
  if (utf16) return "UTF-16 text; save it as UTF-8 (iconv -f UTF-16 -t UTF-8)";
  return "";
}

}  // namespace

Result<Trace> ParseTrace(std::string_view text, std::string_view source) {
  if (const std::string what = NotTextTrace(text); !what.empty())
    return Status::InvalidArgument(fmt::format("{}: {}", source, what));
  Trace trace;
  std::size_t line_number = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    TERRACE_ASSIGN_OR_RETURN(TraceRequest r, ParseTraceLine(line, source, line_number));
    if (!trace.requests.empty() && r.timestamp_ms < trace.requests.back().timestamp_ms) {
      return LineError(source, line_number,
                       fmt::format("timestamp {} is earlier than the previous request's {}; sort the file by "
                                   "timestamp",
                                   r.timestamp_ms, trace.requests.back().timestamp_ms));
    }
    trace.requests.push_back(std::move(r));
  }
  if (trace.requests.empty()) {
    return Status::InvalidArgument(fmt::format("{}: no requests (the trace is empty)", source));
  }
  return trace;
}

Result<Trace> LoadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(fmt::format("cannot read trace '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IoError(fmt::format("error reading trace '{}'", path));
  const std::string text = ss.str();
  return ParseTrace(text, path);
}

std::string FormatTraceLine(const TraceRequest& r) {
  return fmt::format(R"({{"timestamp": {}, "input_length": {}, "output_length": {}, "hash_ids": [{}]}})",
                     r.timestamp_ms, r.input_length, r.output_length, fmt::join(r.hash_ids, ", "));
}

PrefixCeiling ComputePrefixCeiling(const Trace& trace, std::uint64_t restore_every_blocks) {
  PrefixCeiling c;
  std::unordered_set<std::uint64_t> seen;
  for (const TraceRequest& r : trace.requests) {
    c.blocks += r.hash_ids.size();
    c.hit_blocks +=
        RestorablePrefix(r.hash_ids, restore_every_blocks, [&](std::uint64_t id) { return seen.contains(id); });
    for (std::uint64_t id : r.hash_ids) seen.insert(id);
  }
  c.unique_blocks = seen.size();
  return c;
}

}  // namespace terrace::plan
