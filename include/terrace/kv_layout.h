// KvLayout: how a model's attention state is cut into store blocks (docs/prefix-cache.md). Derived
// from a ModelConfig; every byte size of a KV chunk or a KDA snapshot is computed here and nowhere
// else (the planner, the demo and `terrace plan` call these).
//
//   KV chunk block: the MLA latents [chunk_tokens, kv_lora_rank + qk_rope_head_dim] of every MLA layer
//     for one chunk: a header (per-layer offset, size, codec, checksum) then one sub-range per MLA layer
//     at a 4 KiB-aligned offset, each encoded by kv_codec.
//   KDA snapshot block: one KDA layer's recurrent state [H, d_k, d_v] and conv state
//     [kernel-1, 3*H*d_k] at a chunk boundary, encoded by state_codec.
// Thread-safety: an immutable value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "terrace/codec.h"
#include "terrace/model_config.h"
#include "terrace/status.h"

namespace terrace::kv {

// Alignment of every per-layer sub-range inside a KV chunk block (and of the header's end).
inline constexpr std::uint64_t kSubRangeAlign = 4096;

struct KvLayoutOptions {
  int chunk_tokens = 256;
  int snapshot_every = 1;            // KDA snapshot every N chunks; 0 = end of request only
  codec::CodecSpec kv_codec = {codec::CodecKind::kBf16};    // default bf16
  codec::CodecSpec state_codec = {codec::CodecKind::kF32};  // default f32
};

class KvLayout {
 public:
  KvLayout() = default;
  // InvalidArgument for an invalid config, chunk_tokens outside [1, 65536], snapshot_every < 0 or a
  // kv_codec / state_codec that Encode refuses (a combination CodecSpec::Parse cannot produce),
  // naming the option.
  static Result<KvLayout> FromConfig(const model::ModelConfig& config, const KvLayoutOptions& options);

  int chunk_tokens() const { return options_.chunk_tokens; }
  int snapshot_every() const { return options_.snapshot_every; }
  const codec::CodecSpec& kv_codec() const { return options_.kv_codec; }
  const codec::CodecSpec& state_codec() const { return options_.state_codec; }
  const std::vector<int>& mla_layers() const { return mla_layers_; }   // 0-based model layer indices
  const std::vector<int>& kda_layers() const { return kda_layers_; }
  int num_layers() const { return num_layers_; }
  int mla_width() const { return mla_width_; }  // kv_lora_rank + qk_rope_head_dim values per token per MLA layer
  int kda_heads() const { return kda_heads_; }
  int kda_head_dim() const { return kda_head_dim_; }  // d_k == d_v
  int kda_conv_rows() const { return kda_kernel_ - 1; }
  int kda_conv_cols() const { return 3 * kda_heads_ * kda_head_dim_; }

  std::uint64_t mla_bytes_per_token() const;      // all MLA layers, at kv_codec's nominal size (bf16: 2 B/value, no headers)
  std::uint64_t kda_recurrent_bytes_per_layer() const;  // H * d_k * d_v at state_codec nominal size
  std::uint64_t kda_conv_bytes_per_layer() const;       // (kernel-1) * 3*H*d_k at state_codec nominal size
  std::uint64_t kda_state_bytes_per_sequence() const;   // (recurrent + conv) * number of KDA layers
  std::uint64_t mla_chunk_block_bytes() const;    // upper bound of one KV chunk block (header + 4 KiB-aligned per-layer sub-ranges)
  std::uint64_t state_block_bytes() const;        // upper bound of one KDA layer snapshot block

  // Bytes of the KV chunk block header (a multiple of kSubRangeAlign) and the upper bound of one
  // MLA layer's encoded sub-range.
  std::uint64_t chunk_header_bytes() const;
  std::uint64_t mla_layer_range_bytes() const;

  // Whether a KDA snapshot is due at the boundary after chunk `chunks` (1-based count of chunks),
  // when the request's last full chunk is `last_chunks`: every snapshot_every chunks, or (0) only
  // at last_chunks.
  bool SnapshotDue(std::int64_t chunks, std::int64_t last_chunks) const;

  // Canonical text of everything above that changes a block's bytes or meaning (not snapshot_every,
  // which only decides which snapshots exist), e.g.
  // "kv-layout-v2 chunk=256 mla=3,7 width=80 kda=0,1,2,4,5,6 kda_heads=4 kda_dim=64 kernel=4 kv=bf16 state=f32".
  std::string Id() const;

 private:
  KvLayoutOptions options_;
  std::vector<int> mla_layers_, kda_layers_;
  int num_layers_ = 0;
  int mla_width_ = 0;
  int kda_heads_ = 0, kda_head_dim_ = 0, kda_kernel_ = 0;
};

}  // namespace terrace::kv
