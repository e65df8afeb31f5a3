#include "terrace/kv_layout.h"

#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "src/codec/spec_check.h"
#include "src/common/aligned_buffer.h"

namespace terrace::kv {
namespace {


std::uint64_t Nominal(const codec::CodecSpec& spec, std::uint64_t values) {
  return static_cast<std::uint64_t>(std::ceil(static_cast<double>(values) * spec.NominalBytesPerValue()));
}

std::string Join(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

Result<KvLayout> KvLayout::FromConfig(const model::ModelConfig& config, const KvLayoutOptions& options) {
  TERRACE_RETURN_IF_ERROR(model::ValidateConfig(config));
  if (options.chunk_tokens < 1 || options.chunk_tokens > 65536)
    return Status::InvalidArgument(
        fmt::format("chunk_tokens must be in [1, 65536] (got {}); 256 is the default", options.chunk_tokens));
  if (options.snapshot_every < 0)
    return Status::InvalidArgument(fmt::format(
        "snapshot_every must be >= 0 (got {}); 0 means one KDA snapshot at the end of each request",
        options.snapshot_every));
  for (const auto& [name, spec] : {std::pair{"kv_codec", &options.kv_codec}, std::pair{"state_codec", &options.state_codec}})
    if (const std::string problem = codec::detail::SpecProblem(spec->kind, spec->scales, spec->group, spec->lossless);
        !problem.empty())
      return Status::InvalidArgument(fmt::format("{} is not a valid codec spec: {}; build it with codec::CodecSpec::Parse "
                                                 "(e.g. \"bf16\", \"int4-g32\")", name, problem));
  KvLayout l;
  l.options_ = options;
  l.num_layers_ = config.num_hidden_layers;
  for (int i = 0; i < config.num_hidden_layers; ++i) (config.IsMlaLayer(i) ? l.mla_layers_ : l.kda_layers_).push_back(i);
  l.mla_width_ = config.MlaCacheWidth();
  l.kda_heads_ = config.kda.num_heads;
  l.kda_head_dim_ = config.kda.head_dim;
  l.kda_kernel_ = config.kda.short_conv_kernel_size;
  return l;
}

std::uint64_t KvLayout::mla_bytes_per_token() const {
  return Nominal(options_.kv_codec, static_cast<std::uint64_t>(mla_width_) * mla_layers_.size());
}

std::uint64_t KvLayout::kda_recurrent_bytes_per_layer() const {
  const auto d = static_cast<std::uint64_t>(kda_head_dim_);
  return Nominal(options_.state_codec, static_cast<std::uint64_t>(kda_heads_) * d * d);
}

std::uint64_t KvLayout::kda_conv_bytes_per_layer() const {
  return Nominal(options_.state_codec,
                 static_cast<std::uint64_t>(kda_conv_rows()) * static_cast<std::uint64_t>(kda_conv_cols()));
}

std::uint64_t KvLayout::kda_state_bytes_per_sequence() const {
  return (kda_recurrent_bytes_per_layer() + kda_conv_bytes_per_layer()) * kda_layers_.size();
}

// Header: 64 fixed bytes + 48 per MLA layer (src/kv/block_format.h), padded to kSubRangeAlign.
std::uint64_t KvLayout::chunk_header_bytes() const { return RoundUp(64 + 48 * mla_layers_.size(), kSubRangeAlign); }

std::uint64_t KvLayout::mla_layer_range_bytes() const {
  return codec::MaxEncodedBytes(options_.kv_codec, options_.chunk_tokens, mla_width_);
}

std::uint64_t KvLayout::mla_chunk_block_bytes() const {
  return chunk_header_bytes() + RoundUp(mla_layer_range_bytes(), kSubRangeAlign) * mla_layers_.size();
}

// Header: 128 bytes (src/kv/block_format.h), then recurrent, then conv, padded to kSubRangeAlign.
std::uint64_t KvLayout::state_block_bytes() const {
  return RoundUp(128 +
                     codec::MaxEncodedBytes(options_.state_codec, static_cast<std::int64_t>(kda_heads_) * kda_head_dim_,
                                            kda_head_dim_) +
                     codec::MaxEncodedBytes(options_.state_codec, kda_conv_rows(), kda_conv_cols()),
                 kSubRangeAlign);
}

bool KvLayout::SnapshotDue(std::int64_t chunks, std::int64_t last_chunks) const {
  if (chunks <= 0) return false;
  if (options_.snapshot_every == 0) return chunks == last_chunks;
  return chunks % options_.snapshot_every == 0 || chunks == last_chunks;
}

std::string KvLayout::Id() const {
  return fmt::format("kv-layout-v2 chunk={} mla={} width={} kda={} kda_heads={} kda_dim={} kernel={} kv={} state={}",
                     options_.chunk_tokens, Join(mla_layers_), mla_width_, Join(kda_layers_), kda_heads_,
                     kda_head_dim_, kda_kernel_, options_.kv_codec.Name(), options_.state_codec.Name());
}

}  // namespace terrace::kv
