#include "src/model/sequence_state.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>

#include <fmt/format.h>

namespace terrace::model {
namespace {

std::vector<std::byte> ToBytes(const float* p, std::size_t n) {
  std::vector<std::byte> out(n * sizeof(float));
  if (n > 0) std::memcpy(out.data(), p, out.size());
  return out;
}

}  // namespace

SequenceState SequenceState::ForConfig(const ModelConfig& c) {
  SequenceState s;
  s.mla_width_ = c.MlaCacheWidth();
  const std::size_t hk = static_cast<std::size_t>(c.kda.num_heads) * static_cast<std::size_t>(c.kda.head_dim);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerState ls;
    ls.is_mla = c.IsMlaLayer(l);
    if (!ls.is_mla) {
      ls.recurrent.assign(hk * static_cast<std::size_t>(c.kda.head_dim), 0.0f);
      ls.conv.assign(static_cast<std::size_t>(c.kda.short_conv_kernel_size - 1) * 3 * hk, 0.0f);
    }
    s.layers_.push_back(std::move(ls));
  }
  return s;
}

void SequenceState::Reset() {
  for (auto& l : layers_) {
    std::fill(l.recurrent.begin(), l.recurrent.end(), 0.0f);
    std::fill(l.conv.begin(), l.conv.end(), 0.0f);
    l.latents.clear();
    l.tokens = 0;
  }
}

Status SequenceState::Reserve(std::int64_t tokens) {
  if (tokens < 0) return Status::InvalidArgument(fmt::format("SequenceState::Reserve: negative token count {}", tokens));
  const auto width = static_cast<std::size_t>(std::max<std::int64_t>(mla_width_, 1));
  if (static_cast<std::uint64_t>(tokens) > std::vector<float>().max_size() / width)
    return Status::OutOfCapacity(fmt::format("SequenceState::Reserve: {} tokens of MLA latents ({} floats per token per "
                                             "layer) exceed what one vector can hold", tokens, mla_width_));
  const auto n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(mla_width_);
  try {
    for (auto& l : layers_) {
      if (!l.is_mla || l.latents.capacity() >= n) continue;
      l.latents.reserve(n);
      // Write the new room once (value-initialised rows, then cut back): the pages are faulted in
      // now, not by the first restore or forward pass that appends into them.
      const std::size_t held = l.latents.size();
      l.latents.resize(n);
      l.latents.resize(held);
    }
  } catch (const std::exception&) {  // bad_alloc, or length_error from the allocator's own limit
    return Status::OutOfCapacity(
        fmt::format("SequenceState::Reserve: no memory for {} tokens of MLA latents ({} floats per layer)", tokens, n));
  }
  return Status::Ok();
}

std::int64_t SequenceState::reserved_tokens() const {
  if (mla_width_ <= 0) return 0;
  std::int64_t out = -1;
  for (const auto& l : layers_)
    if (l.is_mla) {
      const auto t = static_cast<std::int64_t>(l.latents.capacity() / static_cast<std::size_t>(mla_width_));
      out = out < 0 ? t : std::min(out, t);
    }
  return std::max<std::int64_t>(out, 0);
}

Result<std::vector<std::byte>> SequenceState::ExportLayer(int l) const {
  if (l < 0 || l >= num_layers())
    return Status::InvalidArgument(fmt::format("layer {} is out of range (the state has {} layers)", l, num_layers()));
  const LayerState& s = layer(l);
  if (s.is_mla) return ToBytes(s.latents.data(), s.latents.size());
  std::vector<std::byte> out = ToBytes(s.recurrent.data(), s.recurrent.size());
  const auto conv = ToBytes(s.conv.data(), s.conv.size());
  out.insert(out.end(), conv.begin(), conv.end());
  return out;
}

Status SequenceState::ImportLayer(int l, std::span<const std::byte> bytes, std::int64_t tokens) {
  if (l < 0 || l >= num_layers())
    return Status::InvalidArgument(fmt::format("layer {} is out of range (the state has {} layers)", l, num_layers()));
  if (tokens < 0) return Status::InvalidArgument(fmt::format("layer {}: negative token count {}", l, tokens));
  LayerState& s = layer(l);
  if (s.is_mla) {
    const std::size_t want = static_cast<std::size_t>(tokens * mla_width_) * sizeof(float);
    if (bytes.size() != want)
      return Status::InvalidArgument(fmt::format("MLA layer {}: {} bytes do not hold {} tokens x {} floats ({} bytes)",
                                                 l, bytes.size(), tokens, mla_width_, want));
    s.latents.resize(static_cast<std::size_t>(tokens * mla_width_));
    if (!bytes.empty()) std::memcpy(s.latents.data(), bytes.data(), bytes.size());
  } else {
    const std::size_t want = (s.recurrent.size() + s.conv.size()) * sizeof(float);
    if (bytes.size() != want)
      return Status::InvalidArgument(fmt::format(
          "KDA layer {}: expected {} bytes (recurrent {} + conv {} floats), got {}; the state was exported "
          "for a different config",
          l, want, s.recurrent.size(), s.conv.size(), bytes.size()));
    std::memcpy(s.recurrent.data(), bytes.data(), s.recurrent.size() * sizeof(float));
    std::memcpy(s.conv.data(), bytes.data() + s.recurrent.size() * sizeof(float), s.conv.size() * sizeof(float));
  }
  s.tokens = tokens;
  return Status::Ok();
}

Result<std::vector<std::byte>> SequenceState::ExportMlaTokens(int l, std::int64_t begin, std::int64_t end) const {
  if (l < 0 || l >= num_layers() || !layer(l).is_mla)
    return Status::InvalidArgument(fmt::format("layer {} is not an MLA layer", l));
  const LayerState& s = layer(l);
  if (begin < 0 || begin > end || end > s.tokens)
    return Status::InvalidArgument(
        fmt::format("MLA layer {}: token range [{}, {}) is outside the cache [0, {})", l, begin, end, s.tokens));
  return ToBytes(s.latents.data() + begin * mla_width_, static_cast<std::size_t>((end - begin) * mla_width_));
}

Status SequenceState::ImportMlaTokens(int l, std::int64_t begin, std::span<const std::byte> bytes) {
  if (l < 0 || l >= num_layers() || !layer(l).is_mla)
    return Status::InvalidArgument(fmt::format("layer {} is not an MLA layer", l));
  LayerState& s = layer(l);
  const std::size_t row = static_cast<std::size_t>(mla_width_) * sizeof(float);
  if (begin < 0 || begin > s.tokens)
    return Status::InvalidArgument(fmt::format(
        "MLA layer {}: import at token {} would leave a gap (the cache holds {} tokens)", l, begin, s.tokens));
  if (bytes.size() % row != 0)
    return Status::InvalidArgument(
        fmt::format("MLA layer {}: {} bytes are not a whole number of {}-byte rows", l, bytes.size(), row));
  const std::int64_t n = static_cast<std::int64_t>(bytes.size() / row);
  s.latents.resize(static_cast<std::size_t>((begin + n) * mla_width_));
  if (!bytes.empty()) std::memcpy(s.latents.data() + begin * mla_width_, bytes.data(), bytes.size());
  s.tokens = begin + n;
  return Status::Ok();
}

Status ValidateJointBoundary(const SequenceState& state) {
  std::int64_t boundary = -1;
  for (int l = 0; l < state.num_layers(); ++l)
    boundary = boundary < 0 ? state.layer(l).tokens : std::min(boundary, state.layer(l).tokens);
  int kda_ref = -1;
  for (int l = 0; l < state.num_layers(); ++l) {
    const LayerState& s = state.layer(l);
    if (s.is_mla && static_cast<std::int64_t>(s.latents.size()) != s.tokens * state.mla_width())
      return Status::InvalidArgument(fmt::format("MLA layer {}: cache holds {} floats, not {} tokens x {}", l,
                                                 s.latents.size(), s.tokens, state.mla_width()));
    if (!s.is_mla && kda_ref < 0) kda_ref = l;
  }
  const std::int64_t kda_tokens = kda_ref >= 0 ? state.layer(kda_ref).tokens : boundary;
  for (int l = 0; l < state.num_layers(); ++l) {
    const LayerState& s = state.layer(l);
    if (s.tokens != kda_tokens) {
      return Status::InvalidArgument(fmt::format(
          "hybrid state is not at a joint boundary: {} layer {} covers {} tokens but KDA layer {} covers {}; a "
          "KDA state summarises exactly its tokens, so restore only tokens [0, {}) and recompute the rest",
          s.is_mla ? "MLA" : "KDA", l, s.tokens, kda_ref, kda_tokens, boundary));
    }
  }
  return Status::Ok();
}

}  // namespace terrace::model
