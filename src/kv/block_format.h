// Internal: the byte formats of the prefix cache's blocks (docs/prefix-cache.md, "Block formats").
// All integers little-endian. Thread-safety: pure functions.
//
// KV chunk block (all MLA layers of one chunk):
//   [0, 64)    magic "TKVCHNK1", version u32, layers u32, chunk_tokens u32, width u32,
//              chunk id hi u64, lo u64, header_bytes u64, block_bytes u64, 8 reserved zero bytes
//   [64 + 48 i) per MLA layer i: model layer u32, codec kind u8, scales u8, lossless u8, 0 u8,
//              group u32, 0 u32, offset u64, size u64, XXH3-64 of the sub-range u64, 0 u64
//   zero padding to header_bytes (a multiple of 4 KiB), then each layer's kv_codec encoding of
//   its latents [chunk_tokens, width] at its offset (each offset a multiple of 4 KiB), then zero
//   padding to block_bytes (version 2: the block's size, a multiple of 4 KiB, so the NVMe tier
//   reads it straight into a 4 KiB-aligned buffer without staging).
// KDA snapshot block (one KDA layer at a boundary):
//   [0, 128)   magic "TKDASNP1", version u32, model layer u32, boundary tokens u64,
//              boundary id hi u64, lo u64, heads u32, head_dim u32, kernel u32,
//              codec kind u8, scales u8, lossless u8, 0 u8, group u32, 0 u32,
//              recurrent offset u64, size u64, XXH3-64 u64, conv offset u64, size u64, XXH3-64 u64,
//              block_bytes u64, 8 reserved zero bytes
//   then state_codec's encoding of the recurrent state [H*d_k, d_v] and of the conv state
//   [kernel-1, 3*H*d_k], then zero padding to block_bytes (a multiple of 4 KiB, version 2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "terrace/block.h"
#include "terrace/kv_layout.h"
#include "terrace/status.h"

namespace terrace::kv::format {

// 2: blocks padded to a multiple of kBlockAlign (block_bytes in the header). Version 1 blocks
// live in another key namespace (KvLayout::Id), so they are never looked up.
inline constexpr std::uint32_t kFormatVersion = 2;
inline constexpr std::uint64_t kBlockAlign = kSubRangeAlign;
inline constexpr std::size_t kChunkFixedHeader = 64, kChunkLayerEntry = 48, kStateHeader = 128;

// One MLA layer's sub-range inside a KV chunk block, as its header states it (checked).
struct LayerRange {
  int model_layer = 0;
  std::uint64_t offset = 0, size = 0, checksum = 0;
};

// `latents[i]`: rows [chunk_tokens, width] of layout.mla_layers()[i].
Status EncodeKvChunk(const KvLayout& layout, const ContentId& chunk_id, std::span<const std::vector<float>> latents,
                     std::vector<std::byte>* out);
// Checks the header against the layout and chunk id; returns every layer's range (one per MLA
// layer, in order). Corruption naming what is wrong.
Result<std::vector<LayerRange>> ParseKvChunkHeader(const KvLayout& layout, const ContentId& chunk_id,
                                                   std::span<const std::byte> block);
// The same from the block's first bytes (`head`: at least layout.chunk_header_bytes()) and the
// block's size as stored (a ranged read's BlockDesc::size): the ranges are checked against that.
Result<std::vector<LayerRange>> ParseKvChunkHeader(const KvLayout& layout, const ContentId& chunk_id,
                                                   std::span<const std::byte> head, std::uint64_t block_size);
// Whether DecodeKvLayer hashes the layer's sub-range against its header checksum first.
enum class LayerCheck {
  kVerify,  // the bytes came from anywhere else (a sub-range read, a caller's buffer)
  // `block` is a whole block exactly as a Store get returned it: the store verified every byte of
  // it against the checksum recorded at put (Tier::caps().verifies_gets, else its own hash), so a
  // second hash of each sub-range would find nothing the first did not.
  kBlockVerifiedByStore,
};
// Decodes one layer's sub-range into `out` (chunk_tokens * width floats), after verifying its
// checksum unless `check` says the whole block was verified already. Corruption naming the layer.
Status DecodeKvLayer(const KvLayout& layout, std::span<const std::byte> block, const LayerRange& range,
                     std::span<float> out, LayerCheck check = LayerCheck::kVerify);

Status EncodeState(const KvLayout& layout, int layer, std::int64_t boundary_tokens, const ContentId& boundary_id,
                   std::span<const float> recurrent, std::span<const float> conv, std::vector<std::byte>* out);
// Checks everything, decodes into recurrent (H*d_k*d_v floats) and conv ((kernel-1)*3*H*d_k).
Status DecodeState(const KvLayout& layout, int layer, std::int64_t boundary_tokens, const ContentId& boundary_id,
                   std::span<const std::byte> block, std::span<float> recurrent, std::span<float> conv);

}  // namespace terrace::kv::format
