// What limits the lookahead predictor on a checkpoint (`terrace bench experts`' "lookahead limit"
// line, docs/experts.md): measured on decode steps of a model, independent of any store.
#pragma once

#include <vector>

#include "terrace/model.h"
#include "terrace/status.h"

namespace terrace::experts {

// What limits the lookahead predictor on this checkpoint, per MoE layer l (decode steps of the
// resident model): the recall of the top-k that layer l's router picks from what the lookahead
// predictor sees at distance 1 (the hidden state leaving layer l - 1; on a Block AttnRes model the
// mix Model::PredictRoutingAttnRes forms from the bank after layer l - 1), the recall from the router's true input
// (that state plus layer l's attention update; 1.0 unless the predictor's router math is wrong),
// and the size of that update relative to the state, ||update|| / ||state||.
struct LookaheadLimit {
  std::vector<int> layers;
  std::vector<double> recall_lookahead, recall_true_input, update_ratio;
  // ||state leaving layer l - state leaving l - 1|| / ||state leaving l - 1||: the whole layer's
  // update (attention and MoE), in the hidden state the forward pass hands to on_layer_end.
  std::vector<double> layer_update_ratio;
  // The recall of layer l's top-k from the embedding, as lookahead predicts it at token start
  // (on_embedding: PredictRouting on the embedding, or PredictRoutingAttnRes on the layer -1 view).
  std::vector<double> recall_embedding;
};

// Prefills `prompt`, then measures over `decode` greedy decode steps (the prefill is not scored).
// Uses the model's on_embedding, on_layer_end, on_ffn_input and on_routing hooks of its own session.
Result<LookaheadLimit> MeasureLookaheadLimit(const model::Model& m, const std::vector<int>& prompt, int decode);

}  // namespace terrace::experts
