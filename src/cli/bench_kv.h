// terrace bench kv, shared by its files: cmd_bench_kv.cpp (flags, the run's order, the multi-turn
// workload, text output) and bench_kv_row.cpp (one prefix length's row: turn 1, the rounds of
// turn-2 restores, the row's figures). Private to the CLI.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "src/cli/model_run_kv.h"
#include "src/model/model.h"
#include "src/model/safetensors.h"
#include "terrace/prefix_cache.h"
#include "terrace/tier.h"

namespace terrace::cli::bench_kv {

// Marks the pools' directories as this bench's (owned_dirs.h): only marked ones are ever removed.
inline constexpr const char* kKvMarker = "terrace-bench-kv.marker";
// Tokens of the turn-2 message after each prefix.
inline constexpr int kSuffixTokens = 32;

struct Args {
  std::string model;
  std::string dir;
  std::string prefixes = "256,1024,4096";
  std::string tier = "nvme";
  int recompute_max_tokens = 4096;
  int repeat = 1;
  // The multi-turn workload (RunMultiTurn); turns = 0 leaves it out.
  int turns = 4;
  int conversations = 3;
  int system_tokens = 1024;
  int user_tokens = 192;
  KvRunArgs kv;
  bool json = false;
};

// Per-tier counters: the bytes both pools read and wrote (the KV and the state pool's StoreStats,
// summed: Tally), and the blocks of the restores added with AddRestore. The difference of two
// tallies is what happened between them.
struct TierTally {
  std::array<std::uint64_t, kNumTiers> bytes_read{}, bytes_written{};
  // Blocks the restores asked for, each once per restore, and those each tier served; per-layer
  // sub-range reads each tier served (kv::RestoreReport's blocks_requested, blocks_read,
  // range_reads). A block read as sub-ranges is one block and several range reads.
  std::uint64_t blocks_requested = 0;
  std::array<std::uint64_t, kNumTiers> blocks_read{}, range_reads{};
  TierTally& operator+=(const TierTally& o) { return Combine(o, 1); }
  TierTally operator-(const TierTally& o) const { return TierTally(*this).Combine(o, -1); }
  TierTally& AddRestore(const kv::RestoreReport& r) {
    blocks_requested += r.blocks_requested;
    for (std::size_t t = 0; t < kNumTiers; ++t) {
      blocks_read[t] += r.blocks_read[t];
      range_reads[t] += r.range_reads[t];
    }
    return *this;
  }
  // The share of the requested blocks tier t served (0 when none were requested).
  double HitRate(std::size_t t) const {
    return blocks_requested > 0 ? static_cast<double>(blocks_read[t]) / static_cast<double>(blocks_requested) : 0.0;
  }

 private:
  // Adds (sign 1) or subtracts (-1: o must be an earlier tally of the same pools) o's counters.
  TierTally& Combine(const TierTally& o, int sign) {
    auto add = [sign](std::uint64_t* a, std::uint64_t b) { *a = sign > 0 ? *a + b : *a - b; };
    for (std::size_t t = 0; t < kNumTiers; ++t) {
      add(&bytes_read[t], o.bytes_read[t]);
      add(&bytes_written[t], o.bytes_written[t]);
      add(&blocks_read[t], o.blocks_read[t]);
      add(&range_reads[t], o.range_reads[t]);
    }
    add(&blocks_requested, o.blocks_requested);
    return *this;
  }
};

// The bytes both pools' stores read and wrote so far, per tier (no blocks: AddRestore adds those).
TierTally Tally(const KvRun& run);

// {"hbm": v(0), "host": v(1), "nvme": v(2)}.
template <typename F>
nlohmann::json ByTier(F v) {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t t = 0; t < kNumTiers; ++t) j[std::string(TierName(static_cast<TierId>(t)))] = v(t);
  return j;
}

// The tier keys of a row: what `read` (the restores: their blocks, and the pools' bytes read
// around them) read per tier and what `written` (the write-back's deltas) wrote per tier.
void PutTierFigures(const TierTally& read, const TierTally& written, nlohmann::json* row);

// Writes the marker into both pools under `dir`, the state pool's first: the kv pool's one then
// says both pools are marked (a run killed between the two leaves a pool the next run refuses,
// untouched, rather than one it removes). The first WriteMarker error.
Status MarkPools(const std::filesystem::path& dir);

// Opens new pools under `dir` for this run: right before OpenKvRun, `dir`/kv and `dir`/state must
// be absent or empty (CheckStillNew: Unavailable, a runtime failure, nothing opened, *made left
// as it is); then *made is set (from here the pools are this run's, marked or not: a failed
// creation leaves them unmarked) and the pools are opened and marked (MarkPools). OpenKvRun's or
// MarkPools' error otherwise. TERRACE_TEST_STORE_OPEN_GATE holds it before the check
// (WaitAtStoreOpenGate).
Result<KvRun> OpenNewPools(const KvRunArgs& kv, const std::filesystem::path& dir, const model::ModelConfig& config,
                           const model::WeightSource& weights, bool* made);

// Removes the pools under `dir` when this run made them (`made`, as OpenNewPools set it), marked or
// not (RemoveOwnStore), and their folders; then `dir` itself when this run created it and it is
// empty. Without `made` it removes nothing of the pools: what is there is another process's. True
// when none of this run's pools is left; each pool left is named on stderr with the reason.
bool RemovePools(const std::filesystem::path& dir, bool made, bool created_dir);

// What every prefix row shares.
struct RowContext {
  const Args& a;
  KvRunArgs kv;  // a.kv with the store set to `dir`
  std::filesystem::path dir;
  const model::ModelConfig& config;
  const model::ModelDir& mdir;
  const model::Model& m;
  bool* pools_made;  // whether pools of this run's are under `dir` now (OpenNewPools, RemovePools)
};

// One prefix length's row (the file comment of cmd_bench_kv.cpp says what it measures): its JSON
// object. Adds what its prepared restore read (one round's: the row's tier figures are per restore)
// and what its turn 1 wrote, per tier, to *all_read / *all_written.
// The pools are opened with OpenNewPools and removed afterwards (*ctx.pools_made cleared then). InvalidArgument: the pools could not be opened with these flags.
Result<nlohmann::json> RunPrefixRow(const RowContext& ctx, int prefix_tokens, TierTally* all_read, TierTally* all_written);

}  // namespace terrace::cli::bench_kv
