#include "src/cli/prefill_progress.h"

#include <cstdio>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/stop_signals.h"

namespace terrace::cli {

PrefillProgress::PrefillProgress(std::string who, std::string what, std::int64_t total, int last_layer)
    : who_(std::move(who)), what_(std::move(what)), total_(total), last_layer_(last_layer),
      t0_(std::chrono::steady_clock::now()), last_print_(t0_) {}

double PrefillProgress::seconds() const { return SecondsSince(t0_); }

void PrefillProgress::Count(std::int64_t tokens) {
  done_ += tokens;
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_print_).count() < kEverySeconds) return;
  last_print_ = now;
  if (total_ > 0)
    fmt::print(stderr, "{}: {}: {}/{} tokens, {:.0f} s\n", who_, what_, done_, total_, seconds());
  else
    fmt::print(stderr, "{}: {}: {} tokens computed, {:.0f} s\n", who_, what_, done_, seconds());
  std::fflush(stderr);
}

model::ForwardOptions PrefillProgress::Hooks() {
  model::ForwardOptions o;
  o.on_layer_end = [this](int layer, std::span<const float>, std::int64_t tokens) {
    if (layer == last_layer_) Count(tokens);
  };
  o.on_layer_begin = [](int, std::int64_t) { return StopCheck(); };  // Ctrl-C stops the pass at the next layer
  return o;
}

}  // namespace terrace::cli
