#include "terrace/block.h"

#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>  // XXH3_64bits with run-time AVX2 / AVX-512 dispatch; same values
#endif

#include <charconv>
#include <cstring>

#include <fmt/format.h>

namespace terrace {
namespace {

constexpr std::string_view kKindNames[kNumBlockKinds] = {"kv", "state", "expert", "other"};

void PutBe(std::byte* out, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) {
    out[i] = static_cast<std::byte>(v & 0xff);
    v >>= 8;
  }
}

std::uint64_t GetBe(const std::byte* in, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<std::uint8_t>(in[i]);
  return v;
}

template <typename T>
bool ParseUnsigned(std::string_view s, T* out, int base = 10) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, base);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

std::string_view BlockKindName(BlockKind kind) {
  auto i = static_cast<unsigned>(kind);
  return i < kNumBlockKinds ? kKindNames[i] : "invalid";
}

std::string BlockKey::ToString() const {
  return fmt::format("{}:{}:{}:{:016x}{:016x}", ns, BlockKindName(kind), layer, id.hi, id.lo);
}

Result<BlockKey> BlockKey::Parse(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(
        fmt::format("block key '{}': {}; expected 'ns:kind:layer:<32 hex digits>' with kind one of "
                    "kv|state|expert|other, e.g. '1:kv:0:000000000000000000000000000000ff'",
                    text, why));
  };
  std::string_view parts[4];
  std::string_view rest = text;
  for (int i = 0; i < 3; ++i) {
    auto colon = rest.find(':');
    if (colon == std::string_view::npos) return bad("too few ':'-separated fields");
    parts[i] = rest.substr(0, colon);
    rest = rest.substr(colon + 1);
  }
  parts[3] = rest;
  BlockKey key;
  if (!ParseUnsigned(parts[0], &key.ns)) return bad("namespace is not a 32-bit unsigned number");
  bool kind_ok = false;
  for (int i = 0; i < kNumBlockKinds; ++i) {
    if (parts[1] == kKindNames[i]) {
      key.kind = static_cast<BlockKind>(i);
      kind_ok = true;
    }
  }
  if (!kind_ok) return bad("unknown kind");
  if (!ParseUnsigned(parts[2], &key.layer)) return bad("layer is not a 32-bit unsigned number");
  if (parts[3].size() != 32) return bad("content id is not exactly 32 hex digits");
  if (!ParseUnsigned(parts[3].substr(0, 16), &key.id.hi, 16) ||
      !ParseUnsigned(parts[3].substr(16), &key.id.lo, 16)) {
    return bad("content id is not hexadecimal");
  }
  return key;
}

void BlockKey::EncodeTo(std::byte out[kEncodedSize]) const {
  PutBe(out, ns, 4);
  out[4] = static_cast<std::byte>(kind);
  PutBe(out + 5, layer, 4);
  PutBe(out + 9, id.hi, 8);
  PutBe(out + 17, id.lo, 8);
}

Result<BlockKey> BlockKey::Decode(std::span<const std::byte> in) {
  if (in.size() != kEncodedSize) {
    return Status::Corruption(fmt::format("encoded block key has {} bytes, expected {}", in.size(), kEncodedSize));
  }
  BlockKey k;
  k.ns = static_cast<std::uint32_t>(GetBe(in.data(), 4));
  auto kind = static_cast<std::uint8_t>(in[4]);
  if (kind >= kNumBlockKinds) return Status::Corruption(fmt::format("encoded block key has kind {}", kind));
  k.kind = static_cast<BlockKind>(kind);
  k.layer = static_cast<std::uint32_t>(GetBe(in.data() + 5, 4));
  k.id.hi = GetBe(in.data() + 9, 8);
  k.id.lo = GetBe(in.data() + 17, 8);
  return k;
}

std::uint64_t Checksum(std::span<const std::byte> data) { return XXH3_64bits(data.data(), data.size()); }

}  // namespace terrace
