// The one parser of byte sizes written by a user ("4096", "4KiB", "64MB"): every CLI size flag
// (cli::AddSizeOption) and the expert cache budget (experts::CacheBudget::Parse) read sizes through
// it, so a unit means the same everywhere: K/KiB, M/MiB, G/GiB, T/TiB are binary (powers of 1024),
// KB, MB, GB, TB decimal (powers of 1000), B or no suffix bytes; case-insensitive. FormatBytes is
// the one way sizes are written back to a user (CLI output, planner warnings).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "terrace/status.h"

namespace terrace {

// InvalidArgument naming `what` and `text` when `text` is not a whole number with one of the units
// above, or is over 2^64 - 1 bytes. Zero is accepted (callers that refuse it say so).
Result<std::uint64_t> ParseSize(std::string_view text, std::string_view what = "size");

// "512 B", or one decimal in the largest binary unit under the value: "1.5 KiB", "3.0 MiB", "1.2 TiB".
std::string FormatBytes(double bytes);

}  // namespace terrace
