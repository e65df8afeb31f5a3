#pragma once
// A parameter count for people: "2.78 T", "3.11 G", "38.6 M", "912.0 K", "576" (decimal prefixes;
// never "B", which reads as bytes next to a byte column). One spelling for `model inspect` and `plan`.

#include <string>

#include <fmt/format.h>

namespace terrace {

inline std::string ParamCount(double n) {
  if (n >= 1e12) return fmt::format("{:.2f} T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f} G", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace terrace
