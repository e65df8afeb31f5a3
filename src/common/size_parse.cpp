#include "src/common/size_parse.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <string>

#include <fmt/format.h>

namespace terrace {

Result<std::uint64_t> ParseSize(std::string_view text, std::string_view what) {
  auto bad = [&] {
    return Status::InvalidArgument(fmt::format(
        "{} '{}' is not a size; use a number of bytes with an optional suffix, e.g. 4096, 4KiB, 1MiB, 2GiB "
        "(binary) or 1MB (decimal)", what, text));
  };
  auto too_large = [&] {
    return Status::InvalidArgument(
        fmt::format("{} {} is out of range: sizes go up to 16 EiB (18446744073709551615 bytes)", what, text));
  };
  std::uint64_t number = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec == std::errc::result_out_of_range) return too_large();
  if (ec != std::errc() || p == text.data()) return bad();
  if (p != text.data() + text.size() && (*p == '.' || *p == ',')) {  // 1.5GiB: a whole number is needed
    return Status::InvalidArgument(fmt::format(
        "{} '{}' has a fraction, which sizes do not take; give a whole number, in a smaller unit where needed "
        "(1536MiB, not 1.5GiB) or in bytes",
        what, text));
  }
  std::string suffix(p, text.data() + text.size());
  std::transform(suffix.begin(), suffix.end(), suffix.begin(), [](unsigned char c) { return std::tolower(c); });
  struct Unit {
    const char* name;
    std::uint64_t factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},          {"b", 1},
      {"k", 1ull << 10}, {"kib", 1ull << 10}, {"kb", 1000ull},
      {"m", 1ull << 20}, {"mib", 1ull << 20}, {"mb", 1000'000ull},
      {"g", 1ull << 30}, {"gib", 1ull << 30}, {"gb", 1000'000'000ull},
      {"t", 1ull << 40}, {"tib", 1ull << 40}, {"tb", 1000'000'000'000ull},
  };
  for (const Unit& u : kUnits) {
    if (suffix == u.name) {
      if (number != 0 && u.factor > UINT64_MAX / number) return too_large();
      return number * u.factor;
    }
  }
  return bad();
}

std::string FormatBytes(double bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (bytes >= 1024 && i < 4) {
    bytes /= 1024;
    ++i;
  }
  return i == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, kNames[i]);
}

}  // namespace terrace
