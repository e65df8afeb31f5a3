// Progress of long forward passes on stderr, for the commands that run them (bench kv, verify kv,
// model run).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "terrace/model.h"

namespace terrace::cli {

// Session hooks that print "<who>: <what>: <Where()>, t s" to stderr at most every kEverySeconds,
// checked at every layer's end, so that one long pass (a whole prompt in one prefill) shows too;
// the first line comes kEverySeconds after construction. Tokens are counted at the last layer of
// each forward call. The hooks also stop the pass at the next layer once SIGINT/SIGTERM was
// recorded (StopCheck). One object may serve several sessions one after the other (its counter
// and clock run on); set_what relabels the lines. Not thread-safe: one forward pass at a time; the
// returned hooks must not outlive the object.
class PrefillProgress {
 public:
  static constexpr double kEverySeconds = 5.0;
  PrefillProgress(std::string who, std::string what, std::int64_t total, int last_layer);
  // on_layer_end (progress) and on_layer_begin (StopCheck); model::ChainHooks adds them to others.
  model::ForwardOptions Hooks();
  void set_what(std::string what) { what_ = std::move(what); }
  std::int64_t done() const { return done_; }
  // "k/n tokens" ("k tokens computed" when the total is not known: total <= 0), and while a pass is
  // inside its layers ", a P-token pass after layer l of L".
  std::string Where() const;
  // Seconds since construction.
  double seconds() const;

 private:
  void LayerEnd(int layer, std::int64_t tokens);
  std::string who_, what_;
  std::int64_t total_, done_ = 0;
  int last_layer_;
  int layer_ = -1;               // the current pass's last finished layer; -1: between passes
  std::int64_t pass_tokens_ = 0;  // the current pass's tokens
  std::chrono::steady_clock::time_point t0_, last_print_;
};

}  // namespace terrace::cli
