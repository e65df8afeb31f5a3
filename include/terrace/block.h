// Block identity and description: what every tier stores.
//
// A block is an opaque byte string (a KV chunk, a recurrent-state snapshot, an expert's weights)
// named by a BlockKey and described by a BlockDesc. Keys are plain values, hashable and ordered.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "terrace/status.h"

namespace terrace {

enum class BlockKind : std::uint8_t {
  kKv = 0,      // attention KV (e.g. MLA latents c_KV + k_pe for a token chunk)
  kState = 1,   // a recurrent-state snapshot (e.g. KDA S and conv state at a chunk boundary)
  kExpert = 2,  // MoE expert weights
  kOther = 3,
};
inline constexpr int kNumBlockKinds = 4;
std::string_view BlockKindName(BlockKind kind);  // "kv", "state", "expert", "other"

// 128-bit content id: for KV/state, the chained prefix hash (terrace/hash.h); for experts, any
// stable id (e.g. layer * num_experts + expert).
struct ContentId {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;
  auto operator<=>(const ContentId&) const = default;
};

struct BlockKey {
  std::uint32_t ns = 0;  // namespace: model / layout id; keys of different namespaces never collide
  BlockKind kind = BlockKind::kOther;
  std::uint32_t layer = 0;
  ContentId id;
  auto operator<=>(const BlockKey&) const = default;

  // Canonical text form "ns:kind:layer:<32 hex digits>", e.g. "7:kv:3:00ab...ff". Stable across
  // versions; used by the CLI and logs.
  std::string ToString() const;
  static Result<BlockKey> Parse(std::string_view text);

  // Fixed 25-byte big-endian binary form (ns, kind, layer, id.hi, id.lo), ordered like the key.
  static constexpr std::size_t kEncodedSize = 25;
  void EncodeTo(std::byte out[kEncodedSize]) const;
  static Result<BlockKey> Decode(std::span<const std::byte> in);

  // Well mixed in every bit, fixed across processes and versions; a few ns (inline: directories
  // hash on every lookup).
  std::uint64_t Hash() const {
    auto fmix = [](std::uint64_t x) {  // the murmur3 64-bit finaliser
      x ^= x >> 33;
      x *= 0xff51afd7ed558ccdull;
      x ^= x >> 33;
      x *= 0xc4ceb9fe1a85ec53ull;
      return x ^ (x >> 33);
    };
    std::uint64_t meta = (static_cast<std::uint64_t>(ns) << 32) ^ (static_cast<std::uint64_t>(kind) << 29) ^ layer;
    return fmix(id.lo ^ fmix(id.hi ^ fmix(meta)));
  }
};

// Codec / dtype tag of a block's bytes. Opaque to the store; recorded and returned as given.
enum class Codec : std::uint16_t {
  kRaw = 0,
  kF32 = 1,
  kBf16 = 2,
  kF16 = 3,
  kFp8E4M3 = 4,
  kMxfp4 = 5,
};

struct BlockDesc {
  std::uint64_t size = 0;      // bytes
  Codec codec = Codec::kRaw;
  std::uint64_t checksum = 0;  // XXH3-64 of the bytes (see Checksum())
  bool operator==(const BlockDesc&) const = default;
};

// XXH3-64 (seed 0) of `data`: the block checksum every tier records and verifies.
std::uint64_t Checksum(std::span<const std::byte> data);

inline BlockDesc DescribeBlock(std::span<const std::byte> data, Codec codec = Codec::kRaw) {
  return BlockDesc{data.size(), codec, Checksum(data)};
}

}  // namespace terrace

template <>
struct std::hash<terrace::BlockKey> {
  std::size_t operator()(const terrace::BlockKey& k) const noexcept { return k.Hash(); }
};
