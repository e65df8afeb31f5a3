// The optional lossless stage after quantisation: zstd (level 1) or lz4 (default acceleration).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "terrace/codec.h"

namespace terrace::codec::detail {

// Upper bound of the compressed size of `raw_bytes` bytes; 0 when the stage refuses that many (lz4
// takes at most LZ4_MAX_INPUT_SIZE bytes), as Compress does.
std::uint64_t CompressBound(Lossless l, std::uint64_t raw_bytes);
// Appends the compressed form of `raw` to *out. InvalidArgument if raw is too large for the stage.
Status Compress(Lossless l, std::span<const unsigned char> raw, std::vector<std::byte>* out);
// Decompresses `stored` into exactly raw.size() bytes; Corruption (naming the stage) if the stream
// is malformed or does not decompress to exactly raw.size() bytes. Never reads past `stored`.
Status Decompress(Lossless l, std::span<const unsigned char> stored, std::span<unsigned char> raw);

}  // namespace terrace::codec::detail
