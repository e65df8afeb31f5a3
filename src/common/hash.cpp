#include "terrace/hash.h"

#include <xxhash.h>

#include <cstring>
#include <vector>

namespace terrace {
namespace {

void AppendLe(std::vector<unsigned char>& buf, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) buf.push_back(static_cast<unsigned char>((v >> (8 * i)) & 0xff));
}

ContentId FromXxh(XXH128_hash_t h) { return ContentId{h.high64, h.low64}; }

}  // namespace

ContentId RootContentId(std::uint32_t ns) {
  std::vector<unsigned char> buf;
  const char tag[] = "terrace-root";
  buf.insert(buf.end(), tag, tag + sizeof tag - 1);
  AppendLe(buf, ns, 4);
  return FromXxh(XXH3_128bits(buf.data(), buf.size()));
}

ContentId ChainContentId(const ContentId& parent, std::span<const std::int32_t> tokens) {
  std::vector<unsigned char> buf;
  buf.reserve(16 + 4 * tokens.size());
  AppendLe(buf, parent.hi, 8);
  AppendLe(buf, parent.lo, 8);
  for (std::int32_t t : tokens) AppendLe(buf, static_cast<std::uint32_t>(t), 4);
  return FromXxh(XXH3_128bits(buf.data(), buf.size()));
}

ContentId HashBytes(std::span<const std::byte> data) { return FromXxh(XXH3_128bits(data.data(), data.size())); }

}  // namespace terrace
