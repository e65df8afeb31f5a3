#include "src/kv/block_format.h"

#include <cstring>
#include <string>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"

namespace terrace::kv::format {
namespace {

constexpr char kChunkMagic[8] = {'T', 'K', 'V', 'C', 'H', 'N', 'K', '1'};
constexpr char kStateMagic[8] = {'T', 'K', 'D', 'A', 'S', 'N', 'P', '1'};

void Put(std::byte* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
std::uint64_t Get(const std::byte* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}
std::uint64_t Xxh(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

void PutCodec(std::byte* p, const codec::CodecSpec& c) {
  Put(p, static_cast<std::uint8_t>(c.kind), 1);
  Put(p + 1, static_cast<std::uint8_t>(c.scales), 1);
  Put(p + 2, static_cast<std::uint8_t>(c.lossless), 1);
  Put(p + 3, 0, 1);
  Put(p + 4, static_cast<std::uint32_t>(c.group), 4);
  Put(p + 8, 0, 4);
}
bool CodecMatches(const std::byte* p, const codec::CodecSpec& c) {
  return Get(p, 1) == static_cast<std::uint8_t>(c.kind) && Get(p + 1, 1) == static_cast<std::uint8_t>(c.scales) &&
         Get(p + 2, 1) == static_cast<std::uint8_t>(c.lossless) && Get(p + 4, 4) == static_cast<std::uint32_t>(c.group);
}

}  // namespace

Status EncodeKvChunk(const KvLayout& layout, const ContentId& chunk_id, std::span<const std::vector<float>> latents,
                     std::vector<std::byte>* out) {
  const auto& layers = layout.mla_layers();
  const std::int64_t rows = layout.chunk_tokens(), cols = layout.mla_width();
  if (latents.size() != layers.size())
    return Status::InvalidArgument(fmt::format("KV chunk: {} layers given, layout has {}", latents.size(), layers.size()));
  std::vector<std::vector<std::byte>> enc(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    TERRACE_RETURN_IF_ERROR(codec::Encode(layout.kv_codec(), latents[i], rows, cols, &enc[i])
                                .WithContext(fmt::format("encoding KV chunk layer {}", layers[i])));
  }
  const std::uint64_t header = layout.chunk_header_bytes();
  std::uint64_t total = header;
  std::vector<std::uint64_t> offsets(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    total = RoundUp(total, kSubRangeAlign);
    offsets[i] = total;
    total += enc[i].size();
  }
  total = RoundUp(total, kBlockAlign);
  out->assign(total, std::byte{0});
  std::byte* p = out->data();
  std::memcpy(p, kChunkMagic, 8);
  Put(p + 8, kFormatVersion, 4);
  Put(p + 12, layers.size(), 4);
  Put(p + 16, static_cast<std::uint64_t>(rows), 4);
  Put(p + 20, static_cast<std::uint64_t>(cols), 4);
  Put(p + 24, chunk_id.hi, 8);
  Put(p + 32, chunk_id.lo, 8);
  Put(p + 40, header, 8);
  Put(p + 48, total, 8);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    std::byte* e = p + kChunkFixedHeader + kChunkLayerEntry * i;
    std::memcpy(p + offsets[i], enc[i].data(), enc[i].size());
    Put(e, static_cast<std::uint32_t>(layers[i]), 4);
    PutCodec(e + 4, layout.kv_codec());
    Put(e + 16, offsets[i], 8);
    Put(e + 24, enc[i].size(), 8);
    Put(e + 32, Xxh(std::span(p + offsets[i], enc[i].size())), 8);
  }
  return Status::Ok();
}

Result<std::vector<LayerRange>> ParseKvChunkHeader(const KvLayout& layout, const ContentId& chunk_id,
                                                   std::span<const std::byte> block) {
  return ParseKvChunkHeader(layout, chunk_id, block, block.size());
}

Result<std::vector<LayerRange>> ParseKvChunkHeader(const KvLayout& layout, const ContentId& chunk_id,
                                                   std::span<const std::byte> head, std::uint64_t block_size) {
  const auto& layers = layout.mla_layers();
  const std::uint64_t header = layout.chunk_header_bytes();
  if (head.size() < header || block_size < head.size())
    return Status::Corruption(fmt::format("KV chunk block of {} bytes is shorter than its {}-byte header", block_size, header));
  const std::byte* p = head.data();
  if (std::memcmp(p, kChunkMagic, 8) != 0) return Status::Corruption("KV chunk block: bad magic (not a TKVCHNK1 block)");
  if (Get(p + 8, 4) != kFormatVersion) return Status::Corruption(fmt::format("KV chunk block: format version {} (this build reads {})", Get(p + 8, 4), kFormatVersion));
  if (Get(p + 12, 4) != layers.size() || Get(p + 16, 4) != static_cast<std::uint64_t>(layout.chunk_tokens()) ||
      Get(p + 20, 4) != static_cast<std::uint64_t>(layout.mla_width()) || Get(p + 40, 8) != header)
    return Status::Corruption("KV chunk block: layer count, chunk size, width or header size differ from the layout");
  if (Get(p + 24, 8) != chunk_id.hi || Get(p + 32, 8) != chunk_id.lo)
    return Status::Corruption("KV chunk block: it holds another chunk (chunk id mismatch)");
  if (Get(p + 48, 8) != block_size || block_size % kBlockAlign != 0)
    return Status::Corruption(fmt::format("KV chunk block: {} bytes stored, its header says {} (a multiple of {})", block_size,
                                          Get(p + 48, 8), kBlockAlign));
  std::vector<LayerRange> ranges(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::byte* e = p + kChunkFixedHeader + kChunkLayerEntry * i;
    LayerRange& r = ranges[i];
    r.model_layer = static_cast<int>(Get(e, 4));
    r.offset = Get(e + 16, 8);
    r.size = Get(e + 24, 8);
    r.checksum = Get(e + 32, 8);
    if (r.model_layer != layers[i]) return Status::Corruption(fmt::format("KV chunk block: entry {} names layer {}, expected {}", i, r.model_layer, layers[i]));
    if (!CodecMatches(e + 4, layout.kv_codec())) return Status::Corruption(fmt::format("KV chunk block: layer {} was encoded with another codec", r.model_layer));
    if (r.offset % kSubRangeAlign != 0 || r.offset < header || r.offset > block_size || r.size > block_size - r.offset)
      return Status::Corruption(fmt::format("KV chunk block: layer {} range [{}, +{}) is outside the {}-byte block or misaligned", r.model_layer, r.offset, r.size, block_size));
  }
  return ranges;
}

Status DecodeKvLayer(const KvLayout& layout, std::span<const std::byte> block, const LayerRange& range,
                     std::span<float> out, LayerCheck check) {
  const auto sub = block.subspan(range.offset, range.size);
  if (check == LayerCheck::kVerify && Xxh(sub) != range.checksum)
    return Status::Corruption(fmt::format("KV chunk block: layer {} fails its checksum", range.model_layer));
  return codec::Decode(sub, layout.chunk_tokens(), layout.mla_width(), out)
      .WithContext(fmt::format("KV chunk block layer {}", range.model_layer));
}

Status EncodeState(const KvLayout& layout, int layer, std::int64_t boundary_tokens, const ContentId& boundary_id,
                   std::span<const float> recurrent, std::span<const float> conv, std::vector<std::byte>* out) {
  const std::int64_t H = layout.kda_heads(), d = layout.kda_head_dim();
  std::vector<std::byte> rec, cv;
  TERRACE_RETURN_IF_ERROR(codec::Encode(layout.state_codec(), recurrent, H * d, d, &rec)
                              .WithContext(fmt::format("encoding KDA layer {} recurrent state", layer)));
  TERRACE_RETURN_IF_ERROR(codec::Encode(layout.state_codec(), conv, layout.kda_conv_rows(), layout.kda_conv_cols(), &cv)
                              .WithContext(fmt::format("encoding KDA layer {} conv state", layer)));
  const std::uint64_t total = RoundUp(kStateHeader + rec.size() + cv.size(), kBlockAlign);
  out->assign(total, std::byte{0});
  std::byte* p = out->data();
  std::memcpy(p, kStateMagic, 8);
  Put(p + 8, kFormatVersion, 4);
  Put(p + 12, static_cast<std::uint32_t>(layer), 4);
  Put(p + 16, static_cast<std::uint64_t>(boundary_tokens), 8);
  Put(p + 24, boundary_id.hi, 8);
  Put(p + 32, boundary_id.lo, 8);
  Put(p + 40, static_cast<std::uint64_t>(H), 4);
  Put(p + 44, static_cast<std::uint64_t>(d), 4);
  Put(p + 48, static_cast<std::uint64_t>(layout.kda_conv_rows() + 1), 4);
  PutCodec(p + 52, layout.state_codec());
  std::memcpy(p + kStateHeader, rec.data(), rec.size());
  std::memcpy(p + kStateHeader + rec.size(), cv.data(), cv.size());
  Put(p + 64, kStateHeader, 8);
  Put(p + 72, rec.size(), 8);
  Put(p + 80, Xxh(rec), 8);
  Put(p + 88, kStateHeader + rec.size(), 8);
  Put(p + 96, cv.size(), 8);
  Put(p + 104, Xxh(cv), 8);
  Put(p + 112, total, 8);
  return Status::Ok();
}

Status DecodeState(const KvLayout& layout, int layer, std::int64_t boundary_tokens, const ContentId& boundary_id,
                   std::span<const std::byte> block, std::span<float> recurrent, std::span<float> conv) {
  const std::string where = fmt::format("KDA snapshot of layer {} at token {}", layer, boundary_tokens);
  if (block.size() < kStateHeader) return Status::Corruption(where + ": shorter than its header");
  const std::byte* p = block.data();
  if (std::memcmp(p, kStateMagic, 8) != 0) return Status::Corruption(where + ": bad magic (not a TKDASNP1 block)");
  if (Get(p + 8, 4) != kFormatVersion) return Status::Corruption(where + ": unknown format version");
  if (Get(p + 12, 4) != static_cast<std::uint64_t>(layer) || Get(p + 16, 8) != static_cast<std::uint64_t>(boundary_tokens) ||
      Get(p + 24, 8) != boundary_id.hi || Get(p + 32, 8) != boundary_id.lo)
    return Status::Corruption(where + ": the block holds another layer or boundary");
  const std::int64_t H = layout.kda_heads(), d = layout.kda_head_dim();
  if (Get(p + 40, 4) != static_cast<std::uint64_t>(H) || Get(p + 44, 4) != static_cast<std::uint64_t>(d) ||
      Get(p + 48, 4) != static_cast<std::uint64_t>(layout.kda_conv_rows() + 1) || !CodecMatches(p + 52, layout.state_codec()))
    return Status::Corruption(where + ": dimensions or codec differ from the layout");
  if (Get(p + 112, 8) != block.size() || block.size() % kBlockAlign != 0)
    return Status::Corruption(fmt::format("{}: {} bytes read, its header says {} (a multiple of {})", where, block.size(),
                                          Get(p + 112, 8), kBlockAlign));
  const std::uint64_t ro = Get(p + 64, 8), rs = Get(p + 72, 8), co = Get(p + 88, 8), cs = Get(p + 96, 8);
  if (ro < kStateHeader || ro > block.size() || rs > block.size() - ro || co < kStateHeader || co > block.size() ||
      cs > block.size() - co)
    return Status::Corruption(where + ": a range lies outside the block");
  const auto rec = block.subspan(ro, rs), cv = block.subspan(co, cs);
  if (Xxh(rec) != Get(p + 80, 8) || Xxh(cv) != Get(p + 104, 8)) return Status::Corruption(where + ": fails its checksum");
  TERRACE_RETURN_IF_ERROR(codec::Decode(rec, H * d, d, recurrent).WithContext(where));
  return codec::Decode(cv, layout.kda_conv_rows(), layout.kda_conv_cols(), conv).WithContext(where);
}

}  // namespace terrace::kv::format
