#include "terrace/hash.h"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

namespace terrace {
namespace {

ContentId FromXxh(XXH128_hash_t h) { return ContentId{h.high64, h.low64}; }

void PutLe(unsigned char* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xff);
}

}  // namespace

ContentId RootContentId(std::uint32_t ns) {
  constexpr char kTag[] = "terrace-root";
  unsigned char buf[sizeof kTag - 1 + 4];
  for (std::size_t i = 0; i + 1 < sizeof kTag; ++i) buf[i] = static_cast<unsigned char>(kTag[i]);
  PutLe(buf + sizeof kTag - 1, ns, 4);
  return FromXxh(XXH3_128bits(buf, sizeof buf));
}

ContentId ChainContentId(const ContentId& parent, std::span<const std::int32_t> tokens) {
  // Streamed in pieces so no allocation is needed; the digest equals XXH3-128 of the whole
  // little-endian byte string (parent.hi, parent.lo, tokens...).
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  unsigned char buf[16 + 4 * 256];
  PutLe(buf, parent.hi, 8);
  PutLe(buf + 8, parent.lo, 8);
  std::size_t used = 16;
  for (std::int32_t t : tokens) {
    if (used + 4 > sizeof buf) {
      XXH3_128bits_update(&state, buf, used);
      used = 0;
    }
    PutLe(buf + used, static_cast<std::uint32_t>(t), 4);
    used += 4;
  }
  XXH3_128bits_update(&state, buf, used);
  return FromXxh(XXH3_128bits_digest(&state));
}

ContentId HashBytes(std::span<const std::byte> data) { return FromXxh(XXH3_128bits(data.data(), data.size())); }

}  // namespace terrace
