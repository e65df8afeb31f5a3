// Public model API (docs/model.md, "Public API"). Per-sequence inference state of the reference model:
// the KDA recurrent and conv state of every KDA layer and the MLA latent cache of every MLA layer,
// plus export/import as flat bytes so a later layer can snapshot it into Terrace store blocks.
//
// Byte layouts (native-endian fp32, no header):
//   KDA layer: recurrent [H, d_k, d_v] then conv [kernel-1, 3*H*d_k] (oldest conv row first).
//   MLA layer (or a token range of it): latents [tokens, kv_lora + rope], each row [c_KV | k_pe].
// Hybrid-cache rule (docs/model.md, "The joint-boundary rule"): a restored state is only usable at
// a joint boundary, where every KDA layer and every MLA cache covers the same tokens; see
// ValidateJointBoundary.
// Thread-safety: none (one owner).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "terrace/model_config.h"
#include "terrace/status.h"

namespace terrace::model {

struct LayerState {
  bool is_mla = false;
  std::vector<float> recurrent;  // KDA: [H, d_k, d_v]
  std::vector<float> conv;       // KDA: [kernel-1, 3*H*d_k]
  std::vector<float> latents;    // MLA: [tokens, width]
  std::int64_t tokens = 0;       // tokens this layer's state covers
};

class SequenceState {
 public:
  SequenceState() = default;
  // Zero state (no tokens) shaped for `config` (which must be valid).
  static SequenceState ForConfig(const ModelConfig& config);

  int num_layers() const { return static_cast<int>(layers_.size()); }
  LayerState& layer(int l) { return layers_[static_cast<std::size_t>(l)]; }
  const LayerState& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }
  // Tokens covered by layer 0 (all layers agree after a forward pass).
  std::int64_t num_tokens() const { return layers_.empty() ? 0 : layers_.front().tokens; }
  std::int64_t mla_width() const { return mla_width_; }
  // Clears every layer to 0 tokens; the MLA caches keep their memory (capacity), so a state reused
  // for the next request (or prepared with Reserve) restores and computes into pages already
  // faulted in.
  void Reset();

  // Makes every MLA layer's latent cache own room for `tokens` tokens, its pages faulted in
  // (written once), ahead of a request, so the first restore or forward pass into this state
  // pays no first-touch page faults for them. The rows held are kept. Idempotent: a cache with
  // that room already is left alone (nothing touched). A request longer than reserved still
  // works (the cache grows, paying the faults). For a prefix-cache restore, reserve the whole
  // prompt (restored + computed tokens): a restore decodes into this memory only when it has
  // room for all of the prompt (docs/prefix-cache.md, "Buffers"). KDA layers own their
  // fixed-size state from ForConfig on. InvalidArgument for tokens < 0; OutOfCapacity when the
  // memory cannot be had.
  Status Reserve(std::int64_t tokens);
  // The tokens every MLA layer's cache has room for without growing (its capacity); 0 without MLA layers.
  std::int64_t reserved_tokens() const;

  // One layer's state as bytes (layouts above). InvalidArgument for a bad layer index.
  Result<std::vector<std::byte>> ExportLayer(int layer) const;
  // Replaces one layer's state; `tokens` is the count it covers (for MLA it must equal the rows
  // in bytes). InvalidArgument naming the layer if the size does not fit.
  Status ImportLayer(int layer, std::span<const std::byte> bytes, std::int64_t tokens);
  // Rows [begin, end) of an MLA layer's cache.
  Result<std::vector<std::byte>> ExportMlaTokens(int layer, std::int64_t begin, std::int64_t end) const;
  // Writes rows starting at `begin` (<= the current length), dropping any rows after them.
  Status ImportMlaTokens(int layer, std::int64_t begin, std::span<const std::byte> bytes);

 private:
  std::vector<LayerState> layers_;
  std::int64_t mla_width_ = 0;
};

// OK if every KDA layer covers the same token count b and every MLA cache holds exactly b rows.
// Otherwise InvalidArgument naming the first mismatching layer and the largest usable joint
// boundary (restore only tokens [0, boundary), then recompute the rest).
Status ValidateJointBoundary(const SequenceState& state);

}  // namespace terrace::model
