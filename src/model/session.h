// Session: one sequence's run through a Model - prefill (chunkwise KDA, naive MLA), decode (recurrent
// KDA, absorbed MLA over the latent cache), greedy generation - with per-component timing.
// Ownership: the Model must outlive the Session. Thread-safety: one thread per Session; several
// Sessions may share one Model.
#pragma once

#include <span>
#include <vector>

#include "src/model/model.h"
#include "src/model/profile.h"
#include "src/model/sequence_state.h"
#include "terrace/status.h"

namespace terrace::model {

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
  // Wall seconds spent in Prefill / Decode calls, and the tokens they processed.
  double prefill_seconds() const { return prefill_s_; }
  double decode_seconds() const { return decode_s_; }
  std::int64_t prefill_tokens() const { return prefill_tokens_; }
  std::int64_t decode_tokens() const { return decode_tokens_; }

 private:
  const Model& model_;
  SequenceState state_;
  Profile profile_;
  std::vector<float> last_logits_;
  double prefill_s_ = 0.0, decode_s_ = 0.0;
  std::int64_t prefill_tokens_ = 0, decode_tokens_ = 0;
};

// Index of the largest value; ties go to the lowest index. -1 for an empty span.
int Argmax(std::span<const float> values);

}  // namespace terrace::model
