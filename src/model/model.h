// The reference forward pass of a K3-style model (model-notes sections 1-5): embedding, decoder layers
// (RMSNorm -> KDA or MLA mixer -> RMSNorm -> dense or LatentMoE FFN) wired through Block Attention
// Residuals (or a plain residual stream when attn_res_block_size = 0), final AttnRes mix, RMSNorm,
// lm_head.
//
// Where things come from (docs/model.md): dense weights from a WeightSource, converted to fp32 once
// at Load; routed experts from an ExpertProvider, acquired per use; per-sequence state from the
// caller's SequenceState. Thread-safety: a loaded Model is immutable; Forward may run concurrently
// on different SequenceStates (if the ExpertProvider is thread-safe).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "src/model/config.h"
#include "src/model/expert_provider.h"
#include "src/model/kda.h"
#include "src/model/mla.h"
#include "src/model/moe.h"
#include "src/model/profile.h"
#include "src/model/sequence_state.h"
#include "src/model/tensor.h"
#include "src/model/weight_source.h"
#include "terrace/status.h"

namespace terrace::model {

struct LayerWeights {
  bool is_mla = false, dense = false;
  Tensor input_norm, post_norm;                  // [d]
  Tensor attn_res_w, attn_res_n, mlp_res_w, mlp_res_n;  // [1, d] / [d] (attn_res_block_size > 0)
  KdaWeights kda;
  MlaWeights mla;
  Tensor mlp_gate, mlp_up, mlp_down;             // dense SiTU-GLU (dense layers)
  MoeWeights moe;
};

struct ForwardOptions {
  bool chunked_kda = true;   // chunkwise KDA core (prefill); false: recurrent (decode)
  bool absorbed_mla = false; // absorbed MLA (decode); false: naive (prefill)
  bool all_logits = true;    // logits for every token; false: only the last
  Profile* profile = nullptr;
  // Called after each MoE layer's routing with the layer index and its choice.
  std::function<void(int layer, const Routing& routing)> on_routing;
};

class Model {
 public:
  // Reads and converts every dense weight, checking names and shapes (errors name the tensor).
  // experts: null -> a ResidentExpertProvider over `source`.
  static Result<std::unique_ptr<Model>> Load(const ModelConfig& config, const WeightSource& source,
                                             std::shared_ptr<ExpertProvider> experts = nullptr);

  const ModelConfig& config() const { return config_; }
  ExpertProvider* experts() const { return experts_.get(); }
  KdaDims kda_dims() const;
  MlaDims mla_dims() const;
  MoeDims moe_dims() const;
  const LayerWeights& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }

  // Runs `tokens` through the model, continuing `state` (updated in place). Returns logits
  // [T, vocab] (or [1, vocab] when !all_logits). InvalidArgument for an empty input or an id >= vocab;
  // Corruption when a logit is not finite (NaN or infinite: the weights overflow), OutOfCapacity when
  // memory runs out. After an error the state is unusable (Reset it).
  Result<Tensor> Forward(std::span<const int> tokens, SequenceState* state, const ForwardOptions& options) const;

 private:
  Model() = default;
  static Result<std::unique_ptr<Model>> LoadImpl(const ModelConfig& config, const WeightSource& source,
                                                 std::shared_ptr<ExpertProvider> experts);
  Result<Tensor> ForwardImpl(std::span<const int> tokens, SequenceState* state, const ForwardOptions& options) const;
  Status RunLayer(int l, std::int64_t T, const float* normed, SequenceState* state, const ForwardOptions& o,
                  float* mixer_out) const;
  Status RunFfn(int l, std::int64_t T, const float* normed, const ForwardOptions& o, float* out) const;

  ModelConfig config_;
  std::shared_ptr<ExpertProvider> experts_;
  Tensor embed_, final_norm_, lm_head_, out_res_w_, out_res_n_;
  std::vector<LayerWeights> layers_;
};

}  // namespace terrace::model
