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

std::string PrefillProgress::Where() const {
  std::string where = total_ > 0 ? fmt::format("{}/{} tokens", done_, total_) : fmt::format("{} tokens computed", done_);
  if (layer_ >= 0) where += fmt::format(", a {}-token pass after layer {} of {}", pass_tokens_, layer_ + 1, last_layer_ + 1);
  return where;
}

void PrefillProgress::LayerEnd(int layer, std::int64_t tokens) {
  layer_ = layer;
  pass_tokens_ = tokens;
  if (layer == last_layer_) {
    done_ += tokens;
    layer_ = -1;
  }
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_print_).count() < kEverySeconds) return;
  last_print_ = now;
  fmt::print(stderr, "{}: {}: {}, {:.0f} s\n", who_, what_, Where(), seconds());
  std::fflush(stderr);
}

model::ForwardOptions PrefillProgress::Hooks() {
  model::ForwardOptions o;
  o.on_layer_end = [this](int layer, std::span<const float>, std::int64_t tokens) { LayerEnd(layer, tokens); };
  o.on_layer_begin = [](int, std::int64_t) { return StopCheck(); };  // Ctrl-C stops the pass at the next layer
  return o;
}

}  // namespace terrace::cli
