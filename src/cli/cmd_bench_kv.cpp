// terrace bench kv: time to first token with the prefix cache (restore + suffix) against a full
// recompute, per prefix length, on a real model (docs/prefix-cache.md, "terrace bench kv"; figures
// in docs/benchmarks.md).
//
// Per prefix length P: turn 1 computes a P-token prefix (a system prompt and earlier turns) and
// stores its chunks and snapshots; the pools are then closed and reopened (nvme: so nothing is
// left in memory; host: kept open, the cache new). Turn 2 is the prefix plus a new 32-token
// message, restored four times. Cold unprepared: a fresh cache's first restore into a fresh
// session (every buffer and latent page first touched inside the restore). Cold prepared (the
// row's headline keys): the pools reopened again, the fresh cache's and session's restore memory
// prepared for the prompt at open (PrefixCache::Reserve, SequenceState::Reserve; timed as
// prepare_s, outside the TTFT), then the first restore. Its TTFT with the cache (restore + the
// suffix) and without (a cold prefill of the whole prompt, same chunk pieces) are measured, with
// each restore's bandwidth and the tier's raw read bandwidth (O_DIRECT sequential reads of up to
// 1 MiB of as many bytes as the restore read, from the written extents of the same pools' data
// files, into one reused 1 MiB buffer, nvme; a memcpy of the same bytes, host) measured in the same
// run, right after it. Then the
// same restore again, warm: into the same session's state after Reset (its latent caches keep
// their memory) with the same cache (its restore buffers are reused), as a serving process's
// steady state, with its own raw read right after it; and warm once more alone (Restore with no
// forward pass beside it: the restore's own cost, without contention for the CPU). Prefixes
// longer than --recompute-max-tokens are computed cold only once: turn 1 is then the whole turn-2
// prompt computed from token 0 (storing the prefix's blocks as it goes, the same ones a turn 1 of
// the prefix alone stores), and its time is the row's recompute TTFT. Each row also says which tier served the
// prepared restore's blocks, one round's (hit_rate_by_tier: the pools' store stats, deltas around it) and what
// turn 1 wrote per tier. Then a multi-turn workload (RunMultiTurn: conversations sharing a system
// prompt, each turn = the conversation so far + new tokens) reports per turn the restored and
// computed tokens, the TTFT with the cache and the tiers' shares; and a table of KV bytes per token
// and state bytes per snapshot for every codec, from KvLayout. PrefillProgress goes to stderr every
// few seconds.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/bench_kv.h"
#include "src/cli/bench_own_store.h"
#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/model_run_kv.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/prefill_progress.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/aligned_buffer.h"
#include "src/common/json_text.h"
#include "src/model/model.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "terrace/codec.h"
#include "terrace/keys.h"
#include "terrace/kv_layout.h"
#include "terrace/tier.h"

namespace terrace::cli {
namespace bench_kv {

TierTally Tally(const KvRun& run) {
  TierTally t;
  for (const Store* s : {run.kv_store.get(), run.state_store.get()}) {
    const StoreStats st = s->Stats();
    for (std::size_t i = 0; i < kNumTiers; ++i) {
      if (!st.present[i]) continue;
      t.bytes_read[i] += st.tiers[i].bytes_read;
      t.bytes_written[i] += st.tiers[i].bytes_written;
    }
  }
  return t;
}

void PutTierFigures(const TierTally& read, const TierTally& written, nlohmann::json* row) {
  (*row)["hit_rate_by_tier"] = ByTier([&](std::size_t t) { return read.HitRate(t); });
  (*row)["blocks_read_by_tier"] = ByTier([&](std::size_t t) { return read.blocks_read[t]; });
  (*row)["blocks_requested"] = read.blocks_requested;
  (*row)["range_reads_by_tier"] = ByTier([&](std::size_t t) { return read.range_reads[t]; });
  (*row)["bytes_read_by_tier"] = ByTier([&](std::size_t t) { return read.bytes_read[t]; });
  (*row)["bytes_written_by_tier"] = ByTier([&](std::size_t t) { return written.bytes_written[t]; });
}

Status MarkPools(const std::filesystem::path& dir) {
  for (const char* sub : {"state", "kv"}) TERRACE_RETURN_IF_ERROR(WriteMarker(dir / sub, kKvMarker, "terrace bench kv"));
  return Status::Ok();
}

Result<KvRun> OpenNewPools(const KvRunArgs& kv, const std::filesystem::path& dir, const model::ModelConfig& config,
                           const model::WeightSource& weights, bool* made) {
  WaitAtStoreOpenGate();
  for (const char* sub : {"kv", "state"}) TERRACE_RETURN_IF_ERROR(CheckStillNew(dir, dir / sub, "--dir"));
  *made = true;
  TERRACE_ASSIGN_OR_RETURN(KvRun run, OpenKvRun(kv, config, weights));
  TERRACE_RETURN_IF_ERROR(MarkPools(dir));
  return run;
}

bool RemovePools(const std::filesystem::path& dir, bool made, bool created_dir) {
  bool all = true;
  std::error_code ec;
  for (const char* sub : {"kv", "state"}) {
    if (!made) break;  // what is under `dir` is not this run's: left alone
    const Result<bool> r = RemoveOwnStore(dir / sub, kKvMarker, "--dir");
    if (r.ok()) std::filesystem::remove(dir / sub, ec);  // only if empty
    if (r.ok() && !std::filesystem::exists(dir / sub, ec)) continue;
    all = false;
    fmt::print(stderr, "terrace bench kv: left {} in place{}\n", (dir / sub).string(),
               r.ok() ? "" : ": " + r.status().message());
  }
  if (created_dir) std::filesystem::remove(dir, ec);  // only if empty
  return all;
}

}  // namespace bench_kv

namespace {

using bench_kv::kKvMarker;
using bench_kv::kSuffixTokens;
using bench_kv::ByTier;
using bench_kv::PutTierFigures;
using bench_kv::RemovePools;
using bench_kv::Tally;
using bench_kv::TierTally;
using BenchKvArgs = bench_kv::Args;

// "256,1024,4096"; "none": no prefix rows (the multi-turn workload only).
Result<std::vector<int>> ParseList(const std::string& text) {
  std::vector<int> out;
  if (text == "none") return out;
  for (const std::string& item : SplitCommas(text)) {
    auto v = ParseSignedInRange(item, "--prefix-tokens", 1, 1 << 20);
    if (!v.ok()) return v.status();
    out.push_back(static_cast<int>(*v));
  }
  return out;
}

// "hbm 0% host 0% nvme 100% of 7 blocks" for a row's hit_rate_by_tier / blocks_requested.
std::string TierRateText(const nlohmann::json& row) {
  std::string s;
  for (std::size_t t = 0; t < kNumTiers; ++t) {
    const std::string name(TierName(static_cast<TierId>(t)));
    s += fmt::format("{} {:.0f}% ", name, 100.0 * row["hit_rate_by_tier"][name].get<double>());
  }
  return s + fmt::format("of {} blocks", row["blocks_requested"].get<std::uint64_t>());
}

// "hbm 0 B, host 2.2 MiB, nvme 2.2 MiB" for one of a row's *_by_tier byte objects.
std::string TierBytesText(const nlohmann::json& by_tier) {
  std::string s;
  for (std::size_t t = 0; t < kNumTiers; ++t) {
    const std::string name(TierName(static_cast<TierId>(t)));
    s += fmt::format("{}{} {}", t ? ", " : "", name, FormatBytes(by_tier[name].get<double>()));
  }
  return s;
}

// Every codec a KvLayout takes for either block kind (CodecSpec::Parse's names without a lossless
// stage, whose output size depends on the data).
constexpr std::array<const char*, 8> kLayoutCodecs = {"f32", "bf16", "f16", "fp8", "fp8-block", "int8", "int4-g32",
                                                      "int4-g64"};

// KV bytes per token and KDA state bytes per snapshot (every KDA layer at one boundary) of every
// codec, from KvLayout with the run's chunk size (every size is the layout's, none computed here):
// nominal (values x the codec's bytes per value) and as stored (the blocks' upper bounds: headers,
// scales, 4 KiB alignment).
Result<nlohmann::json> BytesPerTokenByCodec(const model::ModelConfig& config, const KvRunArgs& kv) {
  nlohmann::json j = nlohmann::json::object();
  for (const char* name : kLayoutCodecs) {
    TERRACE_ASSIGN_OR_RETURN(const codec::CodecSpec spec, codec::CodecSpec::Parse(name));
    kv::KvLayoutOptions o;
    o.chunk_tokens = kv.chunk_tokens;
    o.snapshot_every = kv.snapshot_every;
    o.kv_codec = spec;
    o.state_codec = spec;
    TERRACE_ASSIGN_OR_RETURN(const kv::KvLayout l, kv::KvLayout::FromConfig(config, o));
    j[name] = {{"kv_bytes_per_token", l.mla_bytes_per_token()},
               {"kv_block_bytes_per_token",
                static_cast<double>(l.mla_chunk_block_bytes()) / static_cast<double>(l.chunk_tokens())},
               {"state_bytes_per_snapshot", l.kda_state_bytes_per_sequence()},
               {"state_block_bytes_per_snapshot", l.state_block_bytes() * l.kda_layers().size()}};
  }
  return j;
}

// A conversation's new tokens at a turn (user message; stands in for the previous answer too):
// deterministic, different for every (conversation, turn).
std::vector<std::int32_t> TurnTokens(int vocab, int conversation, int turn, int count) {
  std::mt19937_64 rng(0x6B7642ull * 1000003u + static_cast<std::uint64_t>(conversation) * 1009u +
                      static_cast<std::uint64_t>(turn) + 1);
  std::vector<std::int32_t> t(static_cast<std::size_t>(count));
  for (auto& id : t) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return t;
}

// The multi-turn workload: --conversations conversations share a --system-tokens system prompt;
// at each of --turns turns (round-robin over the conversations, as `terrace demo` plays them) a
// conversation's prompt is everything so far plus --user-tokens new tokens, run through the
// cache (restore the longest stored prefix, compute the rest, write it back), then the write-back
// is flushed (outside the turn's time). The pools stay open throughout, as in a serving process:
// blocks come from whichever tier holds them. The pools are opened with OpenNewPools (*pools_made).
// Returns the "multi_turn" object.
Result<nlohmann::json> RunMultiTurn(const BenchKvArgs& a, const KvRunArgs& kv, const std::filesystem::path& dir,
                                    const model::ModelConfig& config, const model::ModelDir& mdir,
                                    const model::Model& m, bool* pools_made) {
  TERRACE_ASSIGN_OR_RETURN(KvRun run, bench_kv::OpenNewPools(kv, dir, config, mdir, pools_made));
  std::vector<std::int32_t> system(static_cast<std::size_t>(a.system_tokens));
  for (std::size_t i = 0; i < system.size(); ++i)
    system[i] = static_cast<std::int32_t>((i * 7919 + 13) % static_cast<std::size_t>(config.vocab_size));
  std::vector<std::vector<std::int32_t>> history(static_cast<std::size_t>(a.conversations), system);
  PrefillProgress progress("terrace bench kv", "multi-turn", 0, config.num_hidden_layers - 1);
  nlohmann::json rows = nlohmann::json::array();
  TierTally all;
  std::int64_t restored = 0, computed = 0;
  double ttft_sum = 0;
  std::uint64_t bytes_written = 0;  // the blocks the turns wrote, each once
  for (int t = 0; t < a.turns; ++t) {
    for (int c = 0; c < a.conversations; ++c) {
      TERRACE_RETURN_IF_ERROR(StopCheck());
      auto& prompt = history[static_cast<std::size_t>(c)];
      const auto user = TurnTokens(config.vocab_size, c, t, a.user_tokens);
      prompt.insert(prompt.end(), user.begin(), user.end());
      progress.set_what(fmt::format("multi-turn, turn {}/{}, conversation {}/{}", t + 1, a.turns, c + 1,
                                    a.conversations));
      model::Session session(m);
      session.set_hooks(progress.Hooks());
      const TierTally before = Tally(run);
      const kv::PrefixCacheStats cache_before = run.cache->Stats();
      const auto t0 = std::chrono::steady_clock::now();
      TERRACE_ASSIGN_OR_RETURN(const kv::CachedPrefill r,
                               kv::PrefillWithCache(&session, *run.cache, run.cache->Prepare(prompt, kv.tenant)));
      const double ttft = SecondsSince(t0);
      run.cache->Flush();  // the write-back, outside the turn's time (a reply is generated meanwhile)
      TierTally turn = Tally(run) - before;
      turn.AddRestore(r.restore);
      all += turn;
      restored += r.restored_tokens;
      computed += r.computed_tokens;
      ttft_sum += ttft;
      nlohmann::json row;
      row["conversation"] = c + 1;
      row["turn"] = t + 1;
      row["prompt_tokens"] = prompt.size();
      row["restored_tokens"] = r.restored_tokens;
      row["computed_tokens"] = r.computed_tokens;
      row["ttft_restore_s"] = ttft;
      row["restore_s"] = r.restore.seconds;
      row["restore_wait_s"] = r.restore.wait_seconds;
      row["fallbacks"] = r.restore.fallbacks;
      const kv::PrefixCacheStats cache_after = run.cache->Stats();
      row["write_failures"] = cache_after.write_failures - cache_before.write_failures;
      row["bytes_written"] = cache_after.bytes_written - cache_before.bytes_written;  // each block once
      bytes_written += cache_after.bytes_written - cache_before.bytes_written;
      PutTierFigures(turn, turn, &row);
      rows.push_back(std::move(row));
    }
  }
  const kv::PrefixCacheStats st = run.cache->Stats();
  if (st.write_failures > 0)
    fmt::print(stderr, "terrace bench kv: multi-turn: {} block writes failed (a pool's tiers are full: raise "
                       "--store-nvme-size / --state-nvme-size); later turns restore only what was stored\n",
               st.write_failures);
  nlohmann::json j;
  j["conversations"] = a.conversations;
  j["turns"] = a.turns;
  j["system_tokens"] = a.system_tokens;
  j["user_tokens"] = a.user_tokens;
  j["restored_tokens"] = restored;
  j["computed_tokens"] = computed;
  j["ttft_restore_s_sum"] = ttft_sum;
  j["seconds"] = progress.seconds();
  j["write_failures"] = st.write_failures;
  j["bytes_written"] = bytes_written;
  PutTierFigures(all, all, &j);
  j["rows"] = std::move(rows);
  run.cache.reset();
  return j;
}

// "bf16" for "bf16+zstd": a codec name without its lossless stage.
std::string BaseCodec(const std::string& name) { return name.substr(0, name.find('+')); }

// Whether a prefix row restored fewer tokens than its full chunks because turn 1's writes failed.
bool ShortRestore(const nlohmann::json& r) {
  return r["write_failures"].get<std::uint64_t>() > 0 &&
         r["restored_tokens"].get<std::int64_t>() < r["restorable_tokens"].get<std::int64_t>();
}

// The text report of RunBenchKv's object `j`.
void PrintBenchKvText(const BenchKvArgs& a, const nlohmann::json& j) {
  const nlohmann::json& rows = j["rows"];
  if (!rows.empty())
    fmt::print("{:>8} {:>9} {:>14} {:>16} {:>12} {:>10} {:>16} {:>16} {:>18} {:>16} {:>16} {:>16} {:>12} {:>15}\n",
               "prefix", "restored", "ttft restore s", "ttft recompute s", "speedup", "prepare s", "restore MB/s",
               "tier read MB/s", "unprepared MB/s", "unprep tier MB/s", "warm restore MB/s", "warm tier MB/s",
               "alone MB/s", "alone tier MB/s");
  bool any_turn1 = false, any_short = false;
  for (const auto& r : rows) {
    const double tr = r["ttft_restore_s"], tc = r["ttft_recompute_s"];
    const bool turn1 = r["recompute_in_turn1"].get<bool>();
    any_turn1 = any_turn1 || turn1;
    const bool short_restore = ShortRestore(r);
    any_short = any_short || short_restore;
    fmt::print("{:>8} {:>9} {:>14.4f} {:>15.4f}{} {:>11.1f}x {:>10.4f} {:>16.1f} {:>16.1f} {:>18.1f} {:>16.1f} {:>16.1f} {:>16.1f} "
               "{:>12.1f} {:>15.1f}\n",
               r["prefix_tokens"].get<int>(),
               fmt::format("{}{}", r["restored_tokens"].get<std::int64_t>(), short_restore ? "!" : ""), tr, tc,
               turn1 ? "*" : " ", tc / tr,
               r["prepare_s"].get<double>(), r["restore_mb_per_s"].get<double>(), r["tier_read_mb_per_s"].get<double>(),
               r["cold_unprepared_restore_mb_per_s"].get<double>(), r["cold_unprepared_tier_read_mb_per_s"].get<double>(),
               r["warm_restore_mb_per_s"].get<double>(), r["warm_tier_read_mb_per_s"].get<double>(),
               r["alone_restore_mb_per_s"].get<double>(), r["alone_tier_read_mb_per_s"].get<double>());
  }
  if (any_turn1)
    fmt::print("* above --recompute-max-tokens {}: the recompute is turn 1's cold run, which also stored the prefix\n",
               a.recompute_max_tokens);
  if (any_short)
    fmt::print("! turn 1's block writes failed (a pool's tiers are full): the row restored fewer tokens than the "
               "prefix's full chunks and measures that shorter restore; raise --store-nvme-size / --state-nvme-size\n");
  for (const auto& r : rows) {
    std::uint64_t range_reads = 0;
    for (const auto& [tier, n] : r["range_reads_by_tier"].items()) range_reads += n.get<std::uint64_t>();
    fmt::print("prefix {}: the restore's blocks by tier: {}; turn 1 wrote {}; read {} (--read-order {}); the forward "
               "pass waited {:.4f} s of the restore's {:.4f} s on reads\n",
               r["prefix_tokens"].get<int>(), TierRateText(r), TierBytesText(r["bytes_written_by_tier"]),
               r["blocks_requested"].get<std::uint64_t>() == 0 ? std::string("nothing")
               : r["read_by_layer"].get<bool>()               ? fmt::format("by layer, {} sub-range reads", range_reads)
                                                              : std::string("in whole chunks"),
               a.kv.read_order,
               r["restore_wait_s"].get<double>(), r["restore_s"].get<double>());
    if (ShortRestore(r))
      fmt::print("prefix {}: restored {} of {} tokens: {} of turn 1's block writes failed\n", r["prefix_tokens"].get<int>(),
                 r["restored_tokens"].get<std::int64_t>(), r["restorable_tokens"].get<std::int64_t>(),
                 r["write_failures"].get<std::uint64_t>());
    auto yes = [&](const char* key) { return r[key].get<bool>() ? "yes" : "NO"; };
    const double rel = r["logits_max_rel_err_vs_recompute"].get<double>();
    fmt::print("prefix {}: logits bitwise equal: warm vs cold prepared {}, cold unprepared vs cold prepared {}, cold "
               "prepared across rounds {}; max rel err vs recompute {:.3g} ({})\n",
               r["prefix_tokens"].get<int>(), yes("warm_logits_bitwise_equal"),
               yes("cold_unprepared_logits_bitwise_equal"), yes("prepared_logits_bitwise_equal_across_rounds"), rel,
               r["lossless_codecs"].get<bool>() ? (rel == 0 ? "must be 0 with f32 codecs: ok" : "must be 0 with f32 codecs: FAILED")
                                                : "lossy codec: not checked");
  }
  // Bytes per token per codec (KvLayout's sizes; the run's codecs marked).
  fmt::print("\nper codec, chunk {} tokens (kv: MLA latents of every MLA layer; state: every KDA layer's snapshot at "
             "one boundary; block: as stored, headers, scales and 4 KiB alignment included)\n",
             j["chunk_tokens"].get<int>());
  Table codecs({"codec", "kv B/token", "kv block B/token", "state B/snapshot", "state block B/snapshot"});
  for (const std::string name : kLayoutCodecs) {
    const nlohmann::json& c = j["bytes_per_token_by_codec"][name];
    // A codec with a lossless stage (bf16+zstd) marks its base codec, as the report does.
    const std::string mark = std::string(name == BaseCodec(a.kv.kv_codec) ? " kv" : "") +
                             (name == BaseCodec(a.kv.state_codec) ? " state" : "");
    codecs.Add({name + (mark.empty() ? "" : " (run:" + mark + ")"),
                fmt::format("{}", c["kv_bytes_per_token"].get<std::uint64_t>()),
                fmt::format("{:.1f}", c["kv_block_bytes_per_token"].get<double>()),
                FormatBytes(c["state_bytes_per_snapshot"].get<double>()),
                FormatBytes(c["state_block_bytes_per_snapshot"].get<double>())});
  }
  fmt::print("{}", codecs.Render());
  if (!j.contains("multi_turn")) return;
  const nlohmann::json& mt = j["multi_turn"];
  fmt::print("\nmulti-turn: {} conversations x {} turns, system prompt {} tokens, {} new tokens per turn; {:.1f} s\n",
             mt["conversations"].get<int>(), mt["turns"].get<int>(), mt["system_tokens"].get<int>(),
             mt["user_tokens"].get<int>(), mt["seconds"].get<double>());
  // "written": the bytes of the blocks the turn wrote, each once (a write-through block reaches
  // two tiers; the summary line gives the bytes per tier).
  Table turns({"turn", "conversation", "prompt", "restored", "computed", "ttft restore s", "hbm", "host", "nvme",
               "blocks", "written"});
  auto pct = [](const nlohmann::json& r, const char* tier) {
    return fmt::format("{:.0f}%", 100.0 * r["hit_rate_by_tier"][tier].get<double>());
  };
  for (const auto& r : mt["rows"]) {
    turns.Add({fmt::format("{}", r["turn"].get<int>()), fmt::format("{}", r["conversation"].get<int>()),
               fmt::format("{}", r["prompt_tokens"].get<std::int64_t>()),
               fmt::format("{}", r["restored_tokens"].get<std::int64_t>()),
               fmt::format("{}", r["computed_tokens"].get<std::int64_t>()),
               fmt::format("{:.4f}", r["ttft_restore_s"].get<double>()), pct(r, "hbm"), pct(r, "host"), pct(r, "nvme"),
               fmt::format("{}", r["blocks_requested"].get<std::uint64_t>()),
               FormatBytes(r["bytes_written"].get<double>())});
  }
  fmt::print("{}", turns.Render());
  fmt::print("multi-turn: restored {} tokens, computed {}; the restores' blocks by tier: {}; wrote {} of blocks (to the "
             "tiers: {}); {} write failure(s)\n",
             mt["restored_tokens"].get<std::int64_t>(), mt["computed_tokens"].get<std::int64_t>(), TierRateText(mt),
             FormatBytes(mt["bytes_written"].get<double>()), TierBytesText(mt["bytes_written_by_tier"]),
             mt["write_failures"].get<std::uint64_t>());
}

int RunBenchKv(const BenchKvArgs& a) {
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  auto prefixes = ParseList(a.prefixes);
  if (!prefixes.ok()) return FailUsage(prefixes.status().message());
  if (prefixes->empty() && a.turns == 0)
    return FailUsage("--prefix-tokens none with --turns 0 leaves nothing to run; give prefix lengths or turns");
  if (Status s = CheckKvPoolSizes(a.kv); !s.ok()) return FailUsage(s.message());
  // A prefix shorter than one chunk has no full chunk to store or restore: its row would be all zeros
  // that look measured.
  for (int P : *prefixes) {
    if (P < a.kv.chunk_tokens)
      return FailUsage(fmt::format("--prefix-tokens {} is shorter than --chunk-tokens {}: the cache stores and "
                                   "restores whole chunks, so a prefix under one chunk has nothing to restore; give "
                                   "prefixes of at least {} tokens, or a smaller --chunk-tokens",
                                   P, a.kv.chunk_tokens, a.kv.chunk_tokens));
  }
  // --dir of the wrong kind (a regular file, a FIFO, a dangling link) is refused as every command
  // refuses it, before the check for a non-empty directory.
  if (!a.dir.empty()) {
    if (Status s = CheckStoreDirArg(a.dir, "--dir"); !s.ok()) return FailUsage(s.message());
  }
  // The model's config, and the flags checked against it (the codecs, the layout), before --dir is
  // touched or any work starts.
  auto mdir = model::ModelDir::Open(a.model);
  if (!mdir.ok()) return Fail(mdir.status().ToString());
  const model::ModelConfig& config = (*mdir)->config();
  if (Status s = CheckKvLayoutArgs(a.kv, config); !s.ok()) return FailUsage(s.message());
  std::filesystem::path dir = a.dir;
  bool created_dir = false;
  bool pools_made = false;  // OpenNewPools sets it, a prefix row's removal of its pools clears it
  if (dir.empty()) {
    auto scratch = ScratchDirPath("terrace-bench-kv", "--dir");
    if (!scratch.ok()) return Fail(scratch.status().message());
    dir = std::move(scratch).value();
    RemoveDeadScratchDirs(dir.parent_path(), "terrace-bench-kv", {"kv", "state"}, kKvMarker, "terrace bench kv");
  }
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    if (!HoldsOnlyOwnedStores(dir, {"kv", "state"}, kKvMarker, EmptySubDirs::kRefuse)) {  // else a killed run's leftover
      return FailUsage(fmt::format("--dir {} is not empty: {}; nothing was removed: give a new or empty directory (the "
                                   "bench removes what it creates there)",
                                   dir.string(), WhyNotOnlyOwnedStores(dir, {"kv", "state"}, kKvMarker, "--dir")));
    }
    const std::string note = fmt::format(
        "terrace bench kv: removing the pools in '{}', left behind by an earlier run that did not finish", dir.string());
    if (Status s = RemoveOwnedSubStores(dir, {"kv", "state"}, kKvMarker, "--dir", "terrace bench kv", note); !s.ok())
      return s.IsInvalidArgument() ? FailUsage(s.message()) : Fail(s.message());
  }
  StopSignals stop_signals;  // Ctrl-C: stop at the next layer, remove the pools, exit 128 + signal
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
    created_dir = true;
  }
  auto m = model::Model::Load(config, **mdir);
  if (!m.ok()) return Fail(m.status().ToString());
  KvRunArgs kv = a.kv;
  kv.store = dir.string();
  kv.dir_flag = "--dir";
  auto by_codec = BytesPerTokenByCodec(config, kv);
  if (!by_codec.ok()) {
    RemovePools(dir, pools_made, created_dir);
    return Fail(by_codec.status().ToString());
  }

  nlohmann::json rows = nlohmann::json::array();
  TierTally all_read, all_written;  // over every row
  int rc = 0;
  const bench_kv::RowContext row_ctx{a, kv, dir, config, **mdir, **m, &pools_made};
  for (int P : *prefixes) {
    if (StopSignalReceived() != 0) break;
    auto row = bench_kv::RunPrefixRow(row_ctx, P, &all_read, &all_written);
    if (!row.ok()) {
      rc = row.status().code() == Code::kInvalidArgument ? FailUsage(row.status().message()) : FailUnlessStopped(row.status());
      break;
    }
    rows.push_back(std::move(row).value());
  }
  nlohmann::json multi_turn;
  if (rc == 0 && a.turns > 0 && StopSignalReceived() == 0) {
    fmt::print(stderr, "terrace bench kv: multi-turn: {} conversations x {} turns (system prompt {} tokens, {} new "
                       "tokens per turn)...\n", a.conversations, a.turns, a.system_tokens, a.user_tokens);
    auto mt = RunMultiTurn(a, kv, dir, config, **mdir, **m, &pools_made);
    if (mt.ok()) multi_turn = std::move(mt).value();
    else if (mt.status().code() == Code::kInvalidArgument) rc = FailUsage(mt.status().message());
    else rc = FailUnlessStopped(mt.status());
  }
  const bool removed = RemovePools(dir, pools_made, created_dir);
  if (StopSignalReceived() != 0)
    return ExitStopped("terrace bench kv", removed ? "; removed the pools it created in --dir" : "");
  if (rc != 0) return rc;
  if (!removed) return 1;
  nlohmann::json j;
  j["model"] = a.model;
  j["tier"] = a.tier;
  j["kv_codec"] = a.kv.kv_codec;
  j["state_codec"] = a.kv.state_codec;
  j["chunk_tokens"] = a.kv.chunk_tokens;
  j["read_order"] = a.kv.read_order;
  j["tenant"] = a.kv.tenant;  // every block was written and read under it
  j["suffix_tokens"] = kSuffixTokens;
  j["rows"] = rows;
  PutTierFigures(all_read, all_written, &j);
  j["bytes_per_token_by_codec"] = *by_codec;
  if (a.turns > 0) j["multi_turn"] = multi_turn;
  if (a.json) fmt::print("{}\n", JsonText(j));
  else PrintBenchKvText(a, j);
  // A check that must hold and did not (the row's failed_checks): the figures are printed, then
  // the run fails.
  int failed = 0;
  for (const auto& r : rows) {
    for (const auto& check : r["failed_checks"]) {
      fmt::print(stderr, "terrace bench kv: prefix {} tokens: check failed: {} ({})\n", r["prefix_tokens"].get<int>(),
                 check.get<std::string>(),
                 check == "logits_max_rel_err_vs_recompute"
                     ? "with f32 codecs the restored run's logits must be the recompute's, bitwise"
                     : "restores of the same blocks must give the same logits, bitwise");
      ++failed;
    }
  }
  if (failed > 0) {
    fmt::print(stderr, "terrace bench kv: {} check(s) failed: the restore does not reproduce what it stored\n", failed);
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterBenchKv(CLI::App* bench, Runner* run) {
  auto a = std::make_shared<BenchKvArgs>();
  auto* cmd = bench->add_subcommand("kv", "Prefix cache: time to first token with restore vs recompute per prefix length");
  cmd->add_option("--model", a->model, "Model directory (e.g. from 'terrace model init --preset k3-small')")->required();
  cmd->add_option("--dir", a->dir, "Directory for the two pools (new or empty; what the bench creates there is removed "
                                   "afterwards, also on SIGINT/SIGTERM; the next run removes a marked leftover of a "
                                   "killed run). Default: a new directory terrace-bench-kv-<pid>.<host tag>-<hex> under the system "
                                   "temp dir; a later run removes those of killed runs")->transform(NormalizedPath());
  cmd->add_option("--prefix-tokens", a->prefixes,
                  "Prefix lengths, comma separated (each 1 to 1048576); none: no per-prefix rows (only the multi-turn "
                  "workload)")->capture_default_str();
  cmd->add_option("--tier", a->tier, "Where turn 2 restores from: nvme (pools reopened) | host")
      ->check(CLI::IsMember({"nvme", "host"}))->capture_default_str();
  AddIntOption(cmd, "--recompute-max-tokens", &a->recompute_max_tokens, 0, 1 << 20,
               "Longest prefix whose recompute is a separate run; longer ones are computed cold only once, in "
               "turn 1 (the whole prompt, storing the prefix as it goes), and that is their recompute time");
  AddIntOption(cmd, "--repeat", &a->repeat, 1, 100,
               "Rounds of turn 2's four restores per prefix (each round reopens the pools); the row's figures are "
               "the medians over the rounds, the *_runs lists each round's own");
  AddIntOption(cmd, "--turns", &a->turns, 0, 1000,
               "Multi-turn workload after the prefix rows: turns per conversation, each = the conversation so far + "
               "--user-tokens new tokens, through the cache (0: none)");
  AddIntOption(cmd, "--conversations", &a->conversations, 1, 1000,
               "Multi-turn workload: conversations sharing the system prompt, played round-robin");
  AddIntOption(cmd, "--system-tokens", &a->system_tokens, 0, 1 << 20,
               "Multi-turn workload: tokens of the shared system prompt");
  AddIntOption(cmd, "--user-tokens", &a->user_tokens, 1, 1 << 20, "Multi-turn workload: new tokens per turn");
  AddKvFlags(cmd, &a->kv, /*with_store=*/false);
  cmd->add_flag("--json", a->json, "Print one JSON object with a 'rows' list");
  cmd->callback([run, a] { *run = [a] { return RunBenchKv(*a); }; });
}

}  // namespace terrace::cli
