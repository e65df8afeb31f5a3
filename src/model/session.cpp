#include "src/model/session.h"

#include <chrono>

#include <fmt/format.h>

#include "src/common/clock.h"

namespace terrace::model {

int Argmax(std::span<const float> v) {
  if (v.empty()) return -1;
  std::size_t best = 0;
  for (std::size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = i;
  return static_cast<int>(best);
}

Result<Tensor> Session::Prefill(std::span<const int> tokens) {
  const auto t0 = std::chrono::steady_clock::now();
  ForwardOptions o = hooks_;
  o.chunked_kda = true;
  o.absorbed_mla = false;
  o.profile = &profile_;
  TERRACE_ASSIGN_OR_RETURN(Tensor logits, model_.Forward(tokens, &state_, o));
  const std::int64_t V = logits.dim(1);
  last_logits_.assign(logits.data.end() - V, logits.data.end());
  prefill_s_ += SecondsSince(t0);
  prefill_tokens_ += static_cast<std::int64_t>(tokens.size());
  return logits;
}

Result<std::vector<float>> Session::Decode(int token) {
  const auto t0 = std::chrono::steady_clock::now();
  ForwardOptions o = hooks_;
  o.chunked_kda = false;
  o.absorbed_mla = true;
  o.profile = &profile_;
  const int one[1] = {token};
  TERRACE_ASSIGN_OR_RETURN(Tensor logits, model_.Forward(one, &state_, o));
  last_logits_ = std::move(logits.data);
  decode_s_ += SecondsSince(t0);
  ++decode_tokens_;
  return last_logits_;
}

Result<std::vector<int>> Session::Generate(std::span<const int> prompt, int max_new) {
  if (max_new < 0) return Status::InvalidArgument(fmt::format("max_new must be >= 0 (got {})", max_new));
  TERRACE_ASSIGN_OR_RETURN(Tensor logits, Prefill(prompt));
  (void)logits;
  std::vector<int> out;
  for (int i = 0; i < max_new; ++i) {
    const int next = Argmax(last_logits_);
    out.push_back(next);
    if (i + 1 < max_new) {
      TERRACE_ASSIGN_OR_RETURN(auto unused, Decode(next));
      (void)unused;
    }
  }
  return out;
}

}  // namespace terrace::model
