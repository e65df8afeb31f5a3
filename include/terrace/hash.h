// Chained prefix hashing: the content id of a KV / state block is a 128-bit hash of its tokens
// chained to the id of the block before it, so equal prefixes get equal ids in every process.
//
// The hash is XXH3-128 with seed 0 (no per-process seed, unlike std::hash), over the parent id
// (16 bytes, little-endian hi then lo) followed by the tokens as little-endian int32.
#pragma once

#include <cstdint>
#include <span>

#include "terrace/block.h"

namespace terrace {

// Id of the empty prefix in namespace `ns`.
ContentId RootContentId(std::uint32_t ns);

// Id of the block holding `tokens`, following the block whose id is `parent`.
ContentId ChainContentId(const ContentId& parent, std::span<const std::int32_t> tokens);

// XXH3-128 of arbitrary bytes (seed 0).
ContentId HashBytes(std::span<const std::byte> data);

}  // namespace terrace
