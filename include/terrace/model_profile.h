// Public model API (docs/model.md, "Public API"). Per-component wall-clock accounting for the forward
// pass (KDA, MLA, MoE, AttnRes, other). Not thread-safe: one Profile per session.
#pragma once

#include <array>
#include <chrono>
#include <string_view>

namespace terrace::model {

enum class Phase : int { kKda = 0, kMla, kMoe, kAttnRes, kOther };
inline constexpr int kNumPhases = 5;
inline constexpr std::string_view PhaseName(Phase p) {
  constexpr std::array<std::string_view, kNumPhases> kNames{"kda", "mla", "moe", "attnres", "other"};
  return kNames[static_cast<int>(p)];
}

struct Profile {
  std::array<double, kNumPhases> seconds{};
  void Add(Phase p, double s) { seconds[static_cast<std::size_t>(p)] += s; }
  double Total() const {
    double t = 0.0;
    for (double s : seconds) t += s;
    return t;
  }
  // Fraction of the total spent in p (0 when nothing was timed).
  double Share(Phase p) const {
    const double t = Total();
    return t > 0.0 ? seconds[static_cast<std::size_t>(p)] / t : 0.0;
  }
  void Reset() { seconds.fill(0.0); }
};

// Adds the time from construction to destruction to profile (if non-null) under phase.
class ScopedPhase {
 public:
  ScopedPhase(Profile* profile, Phase phase)
      : profile_(profile), phase_(phase), start_(std::chrono::steady_clock::now()) {}
  ~ScopedPhase() {
    if (profile_ != nullptr)
      profile_->Add(phase_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  ScopedPhase(const ScopedPhase&) = delete;
  ScopedPhase& operator=(const ScopedPhase&) = delete;

 private:
  Profile* profile_;
  Phase phase_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace terrace::model
