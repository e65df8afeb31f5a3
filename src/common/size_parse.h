// The one parser of byte sizes written by a user ("4096", "4KiB", "64MB"): every CLI size flag
// (cli::AddSizeOption) and the expert cache budget (experts::CacheBudget::Parse) read sizes through
// it, so a unit means the same everywhere: K/KiB, M/MiB, G/GiB, T/TiB are binary (powers of 1024),
// KB, MB, GB, TB decimal (powers of 1000), B or no suffix bytes; case-insensitive.
// Pure function; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "terrace/status.h"

namespace terrace {

// InvalidArgument naming `what` and `text` when `text` is not a whole number with one of the units
// above, or is over 2^64 - 1 bytes. Zero is accepted (callers that refuse it say so).
Result<std::uint64_t> ParseSize(std::string_view text, std::string_view what = "size");

}  // namespace terrace
