// Progress of long forward passes on stderr, for the commands that run them (bench kv, verify kv).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "terrace/model.h"

namespace terrace::cli {

// Session hooks that print "<who>: <what>: k/n tokens, t s" to stderr at most every kEverySeconds
// ("k tokens computed, t s" when the total is not known: total <= 0), counting the tokens of each
// forward call at its last layer; the first line comes kEverySeconds after construction. The hooks
// also stop the pass at the next layer once SIGINT/SIGTERM was recorded (StopCheck). One object may
// serve several sessions one after the other (its counter and clock run on); set_what relabels the
// lines. Not thread-safe: one forward pass at a time; the returned hooks must not outlive the object.
class PrefillProgress {
 public:
  static constexpr double kEverySeconds = 5.0;
  PrefillProgress(std::string who, std::string what, std::int64_t total, int last_layer);
  model::ForwardOptions Hooks();
  void set_what(std::string what) { what_ = std::move(what); }
  std::int64_t done() const { return done_; }
  // Seconds since construction.
  double seconds() const;

 private:
  void Count(std::int64_t tokens);
  std::string who_, what_;
  std::int64_t total_, done_ = 0;
  int last_layer_;
  std::chrono::steady_clock::time_point t0_, last_print_;
};

}  // namespace terrace::cli
