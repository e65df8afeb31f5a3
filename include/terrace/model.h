// Public model API (docs/model.md, "Public API"): the reference forward pass of a K3-style model
// (Model) and one sequence's run through it (Session).
//
// Model: embedding, decoder layers (RMSNorm -> KDA or MLA mixer -> RMSNorm -> dense or MoE FFN)
// wired through Block Attention Residuals (or a plain residual stream), final RMSNorm, lm_head;
// the math is docs/model.md, "The math". Dense weights come from a WeightSource, converted to fp32
// once at Load; routed experts from an ExpertProvider, acquired per use; per-sequence state from
// the caller's SequenceState. Thread-safety: a loaded Model is immutable; Forward may run
// concurrently on different SequenceStates (if the ExpertProvider is thread-safe).
//
// Session: prefill (chunkwise KDA, naive MLA), decode (recurrent KDA, absorbed MLA over the latent
// cache), greedy generation, with per-component timing. Ownership: the Model must outlive the
// Session. Thread-safety: one thread per Session; several Sessions may share one Model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "terrace/model_config.h"
#include "terrace/model_profile.h"
#include "terrace/model_state.h"
#include "terrace/model_tensor.h"
#include "terrace/model_weights.h"
#include "terrace/status.h"

namespace terrace::model {

// Internal types (src/model/): a layer's fp32 weights and the kernels' dimensions.
struct LayerWeights;
struct KdaDims;
struct MlaDims;
struct MoeDims;
class Model;

// The router's choice for T tokens: ids and weights [T, top_k], ids by decreasing biased score.
struct Routing {
  std::int64_t top_k = 0;
  std::vector<int> ids;
  std::vector<float> weights;
};

// A Block AttnRes forward pass's state at one of its hooks (docs/model.md, "Block Attention
// Residuals"), for predicting later layers' routing (Model::PredictRoutingAttnRes). Read-only views
// into the forward pass's own buffers: nothing is copied, and every span is valid only during the
// callback in which Model::CurrentAttnResView() returned it.
struct AttnResView {
  const Model* model = nullptr;  // the model whose forward pass this is
  // The layer whose hook is running; -1 in on_embedding (before layer 0: no layer has run).
  int layer = -1;
  std::int64_t tokens = 0;
  // The completed block vectors, oldest first (bank[0] is the embedding), each [tokens, hidden],
  // including `layer`'s own push (when layer % attn_res_block_size == 0). At layer -1 the bank is
  // [embedding]: layer 0's push, which is always the embedding, counted as done.
  std::span<const std::span<const float>> bank;
  // The running partial sum [tokens, hidden]: in on_ffn_input, the one `layer`'s FFN mix reads
  // (its mixer output included, its FFN output not); in on_layer_end, the hook's `hidden` span.
  // Empty at layer -1 (layer 0's partial sum starts with its mixer output, not known yet).
  std::span<const float> partial;
};

struct ForwardOptions {
  bool chunked_kda = true;   // chunkwise KDA core (prefill); false: recurrent (decode)
  bool absorbed_mla = false; // absorbed MLA (decode); false: naive (prefill)
  bool all_logits = true;    // logits for every token; false: only the last
  Profile* profile = nullptr;
  // Called after each MoE layer's routing with the layer index and its choice.
  std::function<void(int layer, const Routing& routing)> on_routing;
  // Called after layer `layer` (0-based) finished, with the hidden state [tokens, hidden] that
  // feeds the next layer (for AttnRes models: the running partial sum the next layer's input is
  // built from, i.e. what PredictRouting(l + 1, ...) approximates the next router's input with;
  // Model::CurrentAttnResView() gives the bank beside it). Called for every layer, the last
  // included. The span is valid only during the call. Runs on the forward pass's thread; must be
  // cheap or hand work off.
  std::function<void(int layer, std::span<const float> hidden, std::int64_t tokens)> on_layer_end;
  // Called before layer `layer`'s FFN (every layer) with the residual stream [tokens, hidden] its
  // router reads, before the FFN input norm: PredictRouting(layer, hidden, tokens) on it is the
  // layer's routing. For measuring predictors (docs/experts.md); valid only during the call; runs
  // on the forward pass's thread. Unset: no cost.
  std::function<void(int layer, std::span<const float> hidden, std::int64_t tokens)> on_ffn_input;
  // Called once per pass at token start: after the embedding lookup, before layer 0 (and before
  // on_layer_begin(0)), with the embedding rows [tokens, hidden] of this call's tokens, the
  // residual stream layer 0 starts from. For predicting the first layers' routing before any
  // layer has run: PredictRouting(l, hidden, tokens) on a plain residual model, and on a Block
  // AttnRes model PredictRoutingAttnRes(l, *Model::CurrentAttnResView()), whose view has layer
  // -1, bank [embedding] and an empty partial sum. Read-only; the span is valid only during the
  // call; runs on the forward pass's thread; must be cheap or hand work off. Unset: no cost.
  std::function<void(std::span<const float> hidden, std::int64_t tokens)> on_embedding;
  // Attention focus probe: called by every MLA layer, once per head, with that head's attention
  // probabilities for this call's tokens, `probs` [tokens, positions] row-major (positions = the
  // layer's cached tokens after this call; row i is the token at absolute position
  // positions - tokens + i and sums to 1 over columns [0, positions - tokens + i], later columns
  // are 0). Read-only; the span is valid only during the call; runs on the forward pass's thread.
  // Unset: no cost.
  std::function<void(int layer, std::int64_t head, std::span<const float> probs, std::int64_t tokens,
                     std::int64_t positions)>
      on_mla_attention;
  // Called before layer `layer` reads or updates its state (before its input norm), for every
  // layer in order, with the pass's token count: the hook may fill that layer's state (a layerwise
  // restore). A non-OK Status aborts the pass: Forward returns it unchanged and the state is
  // unusable (Reset it). Runs on the forward pass's thread.
  std::function<Status(int layer, std::int64_t tokens)> on_layer_begin;
};

// `first` with `then`'s callbacks chained after its own: for each of the six callbacks
// (on_routing, on_layer_end, on_ffn_input, on_embedding, on_layer_begin, on_mla_attention) the
// result calls first's, then then's, with the same arguments; where one side is unset the other
// side's callback is taken as is (both unset: unset, so no cost). on_layer_begin returns the
// first non-OK Status: first's error is returned unchanged and then's is not called; otherwise
// then's Status. The other fields (chunked_kda, absorbed_mla, all_logits, profile) are first's;
// then's are ignored. The chained callbacks hold both sides' callbacks (what those capture must
// outlive them), add no locking, and run on the calling thread: as thread-safe as the two sides.
ForwardOptions ChainHooks(ForwardOptions first, ForwardOptions then);

class Model {
 public:
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  // Reads and converts every dense weight, checking names and shapes (errors name the tensor).
  // experts: null -> a ResidentExpertProvider over `source`.
  static Result<std::unique_ptr<Model>> Load(const ModelConfig& config, const WeightSource& source,
                                             std::shared_ptr<ExpertProvider> experts = nullptr);

  const ModelConfig& config() const { return config_; }
  ExpertProvider* experts() const { return experts_.get(); }
  // Internal (src/model/kda.h, mla.h, moe.h): the kernels' dimensions.
  KdaDims kda_dims() const;
  MlaDims mla_dims() const;
  MoeDims moe_dims() const;
  const LayerWeights& layer(int l) const;  // internal (src/model/model.h)

  // Runs `tokens` through the model, continuing `state` (updated in place). Returns logits
  // [T, vocab] (or [1, vocab] when !all_logits). InvalidArgument for an empty input or an id >= vocab;
  // Corruption when a logit is not finite (NaN or infinite: the weights overflow), OutOfCapacity when
  // memory runs out. After an error the state is unusable (Reset it).
  Result<Tensor> Forward(std::span<const int> tokens, SequenceState* state, const ForwardOptions& options) const;

  // The routing layer `layer`'s router (with its correction bias) would choose for `hidden`
  // [tokens, hidden]: RMSNorm with that layer's FFN input norm (post_attention_layernorm), then the
  // router exactly as MoeForward applies it. A prediction: the real router input also includes
  // the layer's own mixer output (and, for AttnRes models, the mix). InvalidArgument for a dense
  // or out-of-range layer, or a span whose size is not tokens * hidden. Thread-safe.
  Result<Routing> PredictRouting(int layer, std::span<const float> hidden, std::int64_t tokens) const;

  // For Block AttnRes models (attn_res_block_size > 0), on the forward pass's thread, while its
  // on_embedding, on_ffn_input or on_layer_end callback runs: that pass's AttnResView (the innermost one, if a
  // callback runs another pass). Null anywhere else and for plain residual models.
  static const AttnResView* CurrentAttnResView();
  // The routing layer `target`'s router would choose given the AttnRes state `view` of an earlier
  // point of the same pass: the layers view.layer + 1 .. target are replayed without their mixer
  // and FFN outputs (unknown yet): a layer k with k % attn_res_block_size == 0 pushes the partial
  // sum into the bank and starts an empty one, so the target's FFN input is approximated by
  // AttnRes(bank + [partial, if not empty], target's mlp_res_w / mlp_res_n), then RMSNorm
  // post_norm and the router as MoeForward applies it (docs/experts.md, "Predictors": what is
  // known and what is approximated). With an on_ffn_input view and target == view.layer nothing
  // is replayed: the result is that layer's routing bit for bit. From an on_embedding view (layer
  // -1, bank [embedding], no partial sum) every target's mix is over [embedding] alone, i.e. the
  // embedding itself: the result equals PredictRouting(target, embedding, tokens) bit for bit.
  // InvalidArgument for a plain model, a view of another model, a dense or out-of-range target,
  // target < view.layer, a layer -1 view whose bank is not one block or whose partial sum is not
  // empty, or spans whose sizes are not tokens * hidden. Thread-safe; reads the view's spans only during the call.
  Result<Routing> PredictRoutingAttnRes(int target, const AttnResView& view) const;

 private:
  Model();
  static Result<std::unique_ptr<Model>> LoadImpl(const ModelConfig& config, const WeightSource& source,
                                                 std::shared_ptr<ExpertProvider> experts);
  Result<Tensor> ForwardImpl(std::span<const int> tokens, SequenceState* state, const ForwardOptions& options) const;
  Status RunLayer(int l, std::int64_t T, const float* normed, SequenceState* state, const ForwardOptions& o,
                  float* mixer_out) const;
  Status RunFfn(int l, std::int64_t T, const float* normed, const ForwardOptions& o, float* out) const;

  ModelConfig config_;
  std::shared_ptr<ExpertProvider> experts_;
  Tensor embed_, final_norm_, lm_head_, out_res_w_, out_res_n_;
  std::vector<std::uint16_t> lm_head_bf16_;  // lm_head's bf16 bits when stored as BF16 (one-row GEMV)
  std::vector<std::unique_ptr<LayerWeights>> layers_;
};

class Session {
 public:
  explicit Session(const Model& model) : model_(model), state_(SequenceState::ForConfig(model.config())) {}

  // Appends `tokens` to the sequence; returns their logits [T, vocab].
  Result<Tensor> Prefill(std::span<const int> tokens);
  // Appends one token; returns its logits [vocab].
  Result<std::vector<float>> Decode(int token);
  // Prefills `prompt` then decodes greedily (argmax, ties to the lowest id) max_new tokens (>= 0);
  // returns the generated ids. The last logits stay available in last_logits().
  Result<std::vector<int>> Generate(std::span<const int> prompt, int max_new);

  const std::vector<float>& last_logits() const { return last_logits_; }
  SequenceState& state() { return state_; }
  const SequenceState& state() const { return state_; }
  Profile& profile() { return profile_; }
  // Callbacks (on_routing, on_layer_end, on_ffn_input, on_embedding, on_layer_begin, on_mla_attention) copied into every later
  // Prefill / Decode's ForwardOptions; the other fields of `hooks` are ignored.
  void set_hooks(const ForwardOptions& hooks) {
    hooks_.on_routing = hooks.on_routing;
    hooks_.on_layer_end = hooks.on_layer_end;
    hooks_.on_ffn_input = hooks.on_ffn_input;
    hooks_.on_embedding = hooks.on_embedding;
    hooks_.on_layer_begin = hooks.on_layer_begin;
    hooks_.on_mla_attention = hooks.on_mla_attention;
  }
  // The callbacks set_hooks installed (so a caller can chain its own around them).
  const ForwardOptions& hooks() const { return hooks_; }
  // Wall seconds spent in Prefill / Decode calls, and the tokens they processed.
  double prefill_seconds() const { return prefill_s_; }
  double decode_seconds() const { return decode_s_; }
  std::int64_t prefill_tokens() const { return prefill_tokens_; }
  std::int64_t decode_tokens() const { return decode_tokens_; }

 private:
  const Model& model_;
  SequenceState state_;
  Profile profile_;
  ForwardOptions hooks_;
  std::vector<float> last_logits_;
  double prefill_s_ = 0.0, decode_s_ = 0.0;
  std::int64_t prefill_tokens_ = 0, decode_tokens_ = 0;
};

// Index of the largest value; ties go to the lowest index. -1 for an empty span.
int Argmax(std::span<const float> values);

}  // namespace terrace::model
