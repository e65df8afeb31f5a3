// libFuzzer target for the prefix cache's block formats (src/kv/block_format.h): a valid KV chunk
// block and a valid KDA snapshot block, built from the input at a layout the input picks, then
// damaged at positions the input picks. Undamaged, they decode (f32: to exactly what was encoded);
// damaged, they decode to exactly what the undamaged block decodes to (the damage hit bytes that
// carry nothing) or are refused as Corruption - corrupt data is never returned as good. Never a
// crash, an out-of-bounds read (ASan) or a hang. The raw input is offered as a block too.
//
// Input: [codec][chunk tokens][block size delta] floats... then (u16 position, u8 xor) damage triples
// from the input's tail (the last byte says how many).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "src/kv/block_format.h"
#include "terrace/kv_layout.h"
#include "terrace/model_config.h"

namespace {

using namespace terrace;

void ExpectOkOrCorruption(const Status& s) {
  if (!s.ok() && (!s.IsCorruption() || s.message().empty())) __builtin_trap();
}

struct Damage {
  std::size_t position;
  std::uint8_t mask;
};

// Applies the damage; true when a byte of `block` changed.
bool Apply(std::vector<std::byte>& block, std::span<const Damage> damage) {
  bool changed = false;
  for (const Damage& d : damage) {
    if (block.empty() || d.mask == 0) continue;
    block[d.position % block.size()] ^= static_cast<std::byte>(d.mask);
    changed = true;
  }
  return changed;
}

void FuzzChunk(const kv::KvLayout& layout, std::span<const float> values, std::span<const Damage> damage,
               std::int64_t size_delta) {
  const ContentId id{0x1234, 0x5678};
  const auto per_layer = static_cast<std::size_t>(layout.chunk_tokens()) * static_cast<std::size_t>(layout.mla_width());
  std::vector<std::vector<float>> latents(layout.mla_layers().size(), std::vector<float>(per_layer));
  for (std::size_t i = 0; i < latents.size(); ++i) {
    for (std::size_t j = 0; j < per_layer; ++j) latents[i][j] = values.empty() ? 0.5f : values[(i * per_layer + j) % values.size()];
  }
  std::vector<std::byte> block;
  if (!kv::format::EncodeKvChunk(layout, id, latents, &block).ok()) __builtin_trap();
  // What the undamaged block decodes to, layer by layer.
  std::vector<std::vector<float>> expected(latents.size(), std::vector<float>(per_layer));
  {
    auto ranges = kv::format::ParseKvChunkHeader(layout, id, block);
    if (!ranges.ok() || ranges->size() != latents.size()) __builtin_trap();
    for (std::size_t i = 0; i < ranges->size(); ++i) {
      if (!kv::format::DecodeKvLayer(layout, block, (*ranges)[i], expected[i]).ok()) __builtin_trap();
      if (layout.kv_codec().kind == codec::CodecKind::kF32 &&
          std::memcmp(expected[i].data(), latents[i].data(), 4 * per_layer) != 0)
        __builtin_trap();
    }
  }
  const bool damaged = Apply(block, damage);

  // The head-only parse (a ranged read's), at the stored size or a size the input changed.
  const std::size_t head = std::min<std::size_t>(block.size(), layout.chunk_header_bytes());
  const auto claimed = static_cast<std::uint64_t>(static_cast<std::int64_t>(block.size()) + size_delta);
  auto from_head = kv::format::ParseKvChunkHeader(layout, id, std::span(block).first(head), claimed);
  ExpectOkOrCorruption(from_head.status());
  if (!damaged) {
    if (from_head.ok() != (size_delta == 0)) __builtin_trap();  // a wrong stored size is refused
    return;
  }

  auto ranges = kv::format::ParseKvChunkHeader(layout, id, block);
  ExpectOkOrCorruption(ranges.status());
  if (!ranges.ok()) return;
  if (ranges->size() != latents.size()) __builtin_trap();
  std::vector<float> out(per_layer);
  for (std::size_t i = 0; i < ranges->size(); ++i) {
    const Status s = kv::format::DecodeKvLayer(layout, block, (*ranges)[i], out);
    ExpectOkOrCorruption(s);
    if (s.ok() && std::memcmp(out.data(), expected[i].data(), 4 * per_layer) != 0) __builtin_trap();
  }
}

void FuzzState(const kv::KvLayout& layout, std::span<const float> values, std::span<const Damage> damage) {
  if (layout.kda_layers().empty()) return;
  const ContentId id{0x9abc, 0xdef0};
  const int layer = layout.kda_layers().front();
  const std::int64_t boundary = layout.chunk_tokens();
  const auto rec_n = static_cast<std::size_t>(layout.kda_heads()) * layout.kda_head_dim() * layout.kda_head_dim();
  const auto conv_n = static_cast<std::size_t>(layout.kda_conv_rows()) * layout.kda_conv_cols();
  std::vector<float> rec(rec_n), conv(conv_n);
  for (std::size_t j = 0; j < rec_n; ++j) rec[j] = values.empty() ? 0.25f : values[j % values.size()];
  for (std::size_t j = 0; j < conv_n; ++j) conv[j] = values.empty() ? -0.25f : values[(j + 7) % values.size()];
  std::vector<std::byte> block;
  if (!kv::format::EncodeState(layout, layer, boundary, id, rec, conv, &block).ok()) __builtin_trap();
  std::vector<float> rec_ok(rec_n), conv_ok(conv_n);
  if (!kv::format::DecodeState(layout, layer, boundary, id, block, rec_ok, conv_ok).ok()) __builtin_trap();
  if (layout.state_codec().kind == codec::CodecKind::kF32 &&
      (std::memcmp(rec_ok.data(), rec.data(), 4 * rec_n) != 0 || std::memcmp(conv_ok.data(), conv.data(), 4 * conv_n) != 0))
    __builtin_trap();
  if (!Apply(block, damage)) return;
  std::vector<float> rec_out(rec_n), conv_out(conv_n);
  const Status s = kv::format::DecodeState(layout, layer, boundary, id, block, rec_out, conv_out);
  ExpectOkOrCorruption(s);
  if (s.ok() && (std::memcmp(rec_out.data(), rec_ok.data(), 4 * rec_n) != 0 ||
                 std::memcmp(conv_out.data(), conv_ok.data(), 4 * conv_n) != 0))
    __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const model::ModelConfig config = *model::Preset("k3-toy");
  static const char* kCodecs[] = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32", "int4-g64",
                                  "fp8+zstd", "int8+lz4", "bf16+lz4", "f32+zstd"};
  if (size < 4) return 0;
  // The tail: how many damage triples, then the triples.
  const std::size_t triples = std::min<std::size_t>(data[size - 1] % 8, (size - 4) / 3);
  std::vector<Damage> damage(triples);
  const std::uint8_t* t = data + size - 1 - 3 * triples;
  for (std::size_t i = 0; i < triples; ++i) {
    damage[i] = {static_cast<std::size_t>(t[3 * i] | (t[3 * i + 1] << 8)), t[3 * i + 2]};
  }
  const std::size_t body = static_cast<std::size_t>(t - data);

  kv::KvLayoutOptions options;
  const auto kv_spec = codec::CodecSpec::Parse(kCodecs[data[0] % (sizeof kCodecs / sizeof kCodecs[0])]);
  const auto state_spec = codec::CodecSpec::Parse(kCodecs[(data[0] >> 4) % (sizeof kCodecs / sizeof kCodecs[0])]);
  if (!kv_spec.ok() || !state_spec.ok()) __builtin_trap();
  options.kv_codec = *kv_spec;
  options.state_codec = *state_spec;
  options.chunk_tokens = 1 + data[1] % 8;
  const std::int64_t size_delta = static_cast<std::int8_t>(data[2]) % 2 == 0 ? 0 : static_cast<std::int8_t>(data[2]) * 512;
  auto layout = kv::KvLayout::FromConfig(config, options);
  if (!layout.ok()) __builtin_trap();

  std::vector<float> values(body > 3 ? (body - 3) / 4 : 0);
  if (!values.empty()) std::memcpy(values.data(), data + 3, 4 * values.size());
  for (float& v : values) {
    if (!std::isfinite(v) || std::fabs(v) > 6e4f) v = 1.0f;  // f16's range
  }
  FuzzChunk(*layout, values, damage, size_delta);
  FuzzState(*layout, values, damage);

  // The raw input as a block of each kind.
  const std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(data), size);
  ExpectOkOrCorruption(kv::format::ParseKvChunkHeader(*layout, ContentId{}, raw).status());
  const auto rec_n = static_cast<std::size_t>(layout->kda_heads()) * layout->kda_head_dim() * layout->kda_head_dim();
  std::vector<float> rec(rec_n), conv(static_cast<std::size_t>(layout->kda_conv_rows()) * layout->kda_conv_cols());
  if (!layout->kda_layers().empty())
    ExpectOkOrCorruption(kv::format::DecodeState(*layout, layout->kda_layers().front(), 0, ContentId{}, raw, rec, conv));
  return 0;
}
