// bench_model: prefill and decode throughput of the reference forward pass, with the share of time
// per component. Writes seeded random weights for each preset into a scratch directory (or uses
// --model DIR), then for each thread count: prefill a prompt, decode greedily; best of --rounds.
// Reports tokens/s by wall time and by this thread's CPU time (with one OpenBLAS thread the whole
// pass runs on it, and CPU time does not count the time a shared machine deschedules it).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "src/common/clock.h"
#include "src/model/model.h"
#include "src/model/ops.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "src/model/weights_init.h"

namespace {

using namespace terrace::model;

struct Args {
  std::vector<std::string> presets{"k3-toy", "k3-small"};
  std::vector<int> threads{1, 2};
  int prompt = 256, decode = 32, rounds = 2;
  std::string scratch = "/tmp/terrace-bench-model";
};

int Run(const Args& a) {
  for (const auto& preset : a.presets) {
    auto config = Preset(preset);
    if (!config.ok()) return fmt::print(stderr, "{}\n", config.status().ToString()), 1;
    const std::filesystem::path dir = std::filesystem::path(a.scratch) / preset;
    if (!std::filesystem::exists(dir / "config.json")) {
      InitOptions opt;
      opt.seed = 1;
      const terrace::Status s = InitWeights(*config, dir, opt);
      if (!s.ok()) return fmt::print(stderr, "{}\n", s.ToString()), 1;
    }
    auto md = ModelDir::Open(dir);
    if (!md.ok()) return fmt::print(stderr, "{}\n", md.status().ToString()), 1;
    auto model = Model::Load(*config, **md);
    if (!model.ok()) return fmt::print(stderr, "{}\n", model.status().ToString()), 1;
    std::mt19937 rng(3);
    std::vector<int> prompt(static_cast<std::size_t>(a.prompt));
    for (int& t : prompt) t = static_cast<int>(rng() % static_cast<unsigned>(config->vocab_size));
    for (int threads : a.threads) {
      terrace::model::ops::SetBlasThreads(threads);
      double best_prefill = 0.0, best_decode = 0.0, best_prefill_cpu = 0.0, best_decode_cpu = 0.0;
      Profile prefill_prof, decode_prof;
      for (int r = 0; r < a.rounds; ++r) {
        Session s(**model);
        const double c0 = terrace::ThreadCpuSeconds();
        if (!s.Prefill(prompt).ok()) return 1;
        const double c1 = terrace::ThreadCpuSeconds();
        const Profile after_prefill = s.profile();
        int next = Argmax(s.last_logits());
        for (int i = 0; i < a.decode; ++i) {
          auto l = s.Decode(next);
          if (!l.ok()) return 1;
          next = Argmax(*l);
        }
        const double c2 = terrace::ThreadCpuSeconds();
        best_prefill_cpu = std::max(best_prefill_cpu, static_cast<double>(a.prompt) / (c1 - c0));
        best_decode_cpu = std::max(best_decode_cpu, static_cast<double>(a.decode) / (c2 - c1));
        const double p = static_cast<double>(s.prefill_tokens()) / s.prefill_seconds();
        const double d = static_cast<double>(s.decode_tokens()) / s.decode_seconds();
        if (p > best_prefill) best_prefill = p, prefill_prof = after_prefill;
        if (d > best_decode) {
          best_decode = d;
          decode_prof = s.profile();
          for (int ph = 0; ph < kNumPhases; ++ph) decode_prof.seconds[ph] -= after_prefill.seconds[ph];
        }
      }
      const auto shares = [](const Profile& p) {
        std::string out;
        for (int ph = 0; ph < kNumPhases; ++ph)
          out += fmt::format("{}{} {:.0f}%", ph ? ", " : "", PhaseName(static_cast<Phase>(ph)),
                             100.0 * p.Share(static_cast<Phase>(ph)));
        return out;
      };
      fmt::print("{:9} threads {}  prefill {:8.1f} tok/s wall {:8.1f} tok/s cpu ({} tokens)  [{}]\n", preset, threads,
                 best_prefill, best_prefill_cpu, a.prompt, shares(prefill_prof));
      fmt::print("{:9} threads {}  decode  {:8.1f} tok/s wall {:8.1f} tok/s cpu ({} tokens)  [{}]\n", preset, threads,
                 best_decode, best_decode_cpu, a.decode, shares(decode_prof));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Reference forward pass throughput (prefill / decode tokens/s, time per component)"};
  app.add_option("--preset", a.presets, "Presets to run")->capture_default_str();
  app.add_option("--threads", a.threads, "OpenBLAS thread counts")->capture_default_str();
  app.add_option("--prompt", a.prompt, "Prompt tokens")->capture_default_str();
  app.add_option("--decode", a.decode, "Decode steps")->capture_default_str();
  app.add_option("--rounds", a.rounds, "Rounds (best is reported)")->capture_default_str();
  app.add_option("--scratch", a.scratch, "Where the random model directories are written")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return Run(a);
}
