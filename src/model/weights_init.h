// Seeded random weights for a ModelConfig, written as a model directory (config.json +
// model.safetensors, or shards + model.safetensors.index.json) in K3's dtypes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string_view>

#include "src/model/config.h"
#include "terrace/status.h"

namespace terrace::model {

struct InitOptions {
  std::uint64_t seed = 0;
  // A shard holds at most this many data bytes (a single tensor larger than this gets a shard of its
  // own). A model whose tensors fit in one shard is written as a single model.safetensors.
  std::uint64_t shard_bytes = 2ull << 30;
  // Models whose weights exceed kMaxInitBytes are refused unless force is set.
  bool force = false;
  // Routed experts as uniform random E2M1 codes under one power-of-two scale per tensor (chosen so
  // the weights' std is the nearest power of two to 1/sqrt(fan_in)) instead of quantised normals:
  // about 100x faster, for multi-GiB benchmark checkpoints. Other tensors are unchanged.
  bool random_expert_codes = false;
  // Multiplies the projections that write into the residual stream (attention and KDA o_proj, MLP
  // and shared-expert down_proj, the routed experts' routed_expert_up_proj, or, in a model without
  // that latent up-projection, the routed experts' latent norm weights) by this factor, so each
  // layer's update is this much smaller relative to the stream it is added to (`model init
  // --residual-scale`; docs/experts.md). 1 = the default init. Must be positive and finite.
  double residual_scale = 1.0;
  // Called before each tensor is generated: a non-Ok status ends InitWeights with it (what is
  // already written in `dir` stays; the caller removes it). Empty: never stops.
  std::function<Status()> stop_check;
};

inline constexpr std::uint64_t kMaxInitBytes = 4ull << 30;

// What InitWeights needs of a valid config beyond ValidateConfig: it writes the routed experts in
// MXFP4, so each dimension that becomes an MXFP4 column count (moe_intermediate_size, and
// routed_expert_hidden_size, which is hidden_size when absent) must be a multiple of 32.
// InvalidArgument naming the config field.
Status CheckInitConfig(const ModelConfig& config);
// The same check for anything that lays out the routed experts in MXFP4: "config field 'K' is V;
// <how>, whose rows are blocks of 32 values, so it must be a multiple of 32" (`how`: "model init
// writes the routed experts in MXFP4"). Ok for a model without routed experts.
Status CheckMxfp4ExpertDims(const ModelConfig& config, std::string_view how);

// Bytes the weights of `config` take on disk in K3's dtypes (tensor data only).
std::uint64_t WeightBytes(const ModelConfig& config);

// Writes random weights for `config` into `dir` (created if missing; existing model files replaced).
// The bytes depend only on (config, seed): the same inputs give identical files. Each tensor draws
// from its own stream keyed by (seed, tensor name). Scales keep activations well conditioned:
// linear weights ~ N(0, 1/fan_in) (residual-branch outputs scaled down by 1/sqrt(2 * layers)), norm
// weights ~ 1, small non-zero AttnRes pseudo-queries, decay parameters giving moderate decays, router
// rows random so every expert is chosen. Routed experts are quantised with QuantizeMxfp4.
Status InitWeights(const ModelConfig& config, const std::filesystem::path& dir, const InitOptions& options);

}  // namespace terrace::model
