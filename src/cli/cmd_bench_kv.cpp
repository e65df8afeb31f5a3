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
// each restore's bandwidth and the tier's raw read bandwidth (O_DIRECT 1 MiB sequential reads of
// the bytes the restore read, from the same pools' data files, into one reused 1 MiB buffer,
// nvme; a memcpy of the same bytes, host) measured in the same run, right after it. Then the
// same restore again, warm: into the same session's state after Reset (its latent caches keep
// their memory) with the same cache (its restore buffers are reused), as a serving process's
// steady state, with its own raw read right after it; and warm once more alone (Restore with no
// forward pass beside it: the restore's own cost, without contention for the CPU). Prefixes
// longer than --recompute-max-tokens are computed cold only once: turn 1 is then the whole turn-2
// prompt computed from token 0 (storing the prefix as it
// goes), and its time is the row's recompute TTFT. Each row also says which tier served the
// prepared restore's blocks (hit_rate_by_tier: the pools' store stats, deltas around it) and what
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

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/model_run_kv.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/prefill_progress.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "src/common/aligned_buffer.h"
#include "src/model/model.h"
#include "src/model/safetensors.h"
#include "src/model/session.h"
#include "terrace/codec.h"
#include "terrace/keys.h"
#include "terrace/kv_layout.h"
#include "terrace/tier.h"

namespace terrace::cli {
namespace {

constexpr const char* kKvMarker = "terrace-bench-kv.marker";
constexpr int kSuffixTokens = 32;

struct BenchKvArgs {
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

// The process's minor page faults so far (every thread, getrusage RUSAGE_SELF).
long MinorFaults() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// "256,1024,4096"; "none": no prefix rows (the multi-turn workload only).
Result<std::vector<int>> ParseList(const std::string& text) {
  std::vector<int> out;
  if (text == "none") return out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t end = std::min(text.find(',', pos), text.size());
    auto v = ParseSignedInRange(text.substr(pos, end - pos), "--prefix-tokens", 1, 1 << 20);
    if (!v.ok()) return v.status();
    out.push_back(static_cast<int>(*v));
    pos = end + 1;
  }
  return out;
}

// One timed pass of O_DIRECT sequential 1 MiB reads over the first bytes of each (file, bytes)
// (at least 1 MiB; a part of 0 bytes after the first is skipped); adds the bytes read to *done and returns the seconds.
Result<double> RawReadPass(std::span<const std::pair<std::filesystem::path, std::uint64_t>> parts, void* buf,
                           std::uint64_t* done) {
  constexpr std::size_t kIo = 1 << 20;
  double seconds = 0;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const auto& [file, bytes] = parts[p];
    if (bytes == 0 && p > 0) continue;  // a pool the restore did not read
    const int fd = ::open(file.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) return Status::IoError(fmt::format("cannot open {} with O_DIRECT: {}", file.string(), std::strerror(errno)));
    const std::uint64_t total = std::max<std::uint64_t>(bytes, kIo);
    std::uint64_t got = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (got < total) {
      const ssize_t n = ::pread(fd, buf, kIo, static_cast<off_t>(got));
      if (n <= 0) break;
      got += static_cast<std::uint64_t>(n);
    }
    seconds += SecondsSince(t0);
    ::close(fd);
    if (got == 0) return Status::IoError(fmt::format("reading {} returned no bytes", file.string()));
    *done += got;
  }
  return seconds;
}

// The NVMe tier's raw read rate for a restore that read `parts` (each pool's data file and the
// bytes the restore took from it), MB/s (1e6 bytes per second): the median of three passes of
// O_DIRECT sequential 1 MiB reads of that many bytes from the start of each file, right after the
// restore, so the same files, the same byte counts and the same (just written, just read) state
// of the disk's caches. 1 MiB requests are the tier's best case; the restore reads its 150-230
// KiB blocks as batches.
Result<double> RawReadMbPerS(std::span<const std::pair<std::filesystem::path, std::uint64_t>> parts) {
  AlignedBuffer buffer(1 << 20);
  if (!buffer.data()) return Status::OutOfCapacity("no memory for a 1 MiB read buffer");
  void* buf = buffer.data();
  std::vector<double> rates;
  Status error;
  for (int pass = 0; pass < 3 && error.ok(); ++pass) {
    std::uint64_t done = 0;
    auto s = RawReadPass(parts, buf, &done);
    if (!s.ok()) error = s.status();
    else rates.push_back(static_cast<double>(done) / *s / 1e6);
  }
  if (!error.ok()) return error;
  std::sort(rates.begin(), rates.end());
  return rates[1];
}

double MemcpyMbPerS(std::uint64_t bytes) {
  std::vector<std::byte> a(std::max<std::uint64_t>(bytes, 4 << 20), std::byte{1}), b(a.size());
  const auto t0 = std::chrono::steady_clock::now();
  std::memcpy(b.data(), a.data(), a.size());
  const double s = SecondsSince(t0);
  return static_cast<double>(a.size()) / s / 1e6;
}

// Per-tier counters of both pools (the KV and the state pool's StoreStats, summed). The difference
// of two tallies is what the pools did between them.
struct TierTally {
  std::array<std::uint64_t, kNumTiers> hits{}, bytes_read{}, bytes_written{};
  // Gets: served by a tier (its hits) or by none (the slowest slot's misses: a Get that no tier
  // served counts a miss in every slot).
  std::uint64_t gets = 0;
  TierTally& operator+=(const TierTally& o) { return Combine(o, 1); }
  TierTally operator-(const TierTally& o) const { return TierTally(*this).Combine(o, -1); }
  // The share of the Gets tier t served (0 when there were none).
  double HitRate(std::size_t t) const {
    return gets > 0 ? static_cast<double>(hits[t]) / static_cast<double>(gets) : 0.0;
  }

 private:
  // Adds (sign 1) or subtracts (-1: o must be an earlier tally of the same pools) o's counters.
  TierTally& Combine(const TierTally& o, int sign) {
    auto add = [sign](std::uint64_t* a, std::uint64_t b) { *a = sign > 0 ? *a + b : *a - b; };
    for (std::size_t t = 0; t < kNumTiers; ++t) {
      add(&hits[t], o.hits[t]);
      add(&bytes_read[t], o.bytes_read[t]);
      add(&bytes_written[t], o.bytes_written[t]);
    }
    add(&gets, o.gets);
    return *this;
  }
};

TierTally Tally(const KvRun& run) {
  TierTally t;
  for (const Store* s : {run.kv_store.get(), run.state_store.get()}) {
    const StoreStats st = s->Stats();
    for (std::size_t i = 0; i < kNumTiers; ++i) {
      if (!st.present[i]) continue;
      t.hits[i] += st.tiers[i].hits;
      t.bytes_read[i] += st.tiers[i].bytes_read;
      t.bytes_written[i] += st.tiers[i].bytes_written;
    }
    for (const TierStatsSnapshot& slot : st.slots) t.gets += slot.hits;
    if (!st.slots.empty()) t.gets += st.slots.back().misses;
  }
  return t;
}

// {"hbm": v(0), "host": v(1), "nvme": v(2)}.
template <typename F>
nlohmann::json ByTier(F v) {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t t = 0; t < kNumTiers; ++t) j[std::string(TierName(static_cast<TierId>(t)))] = v(t);
  return j;
}

// The tier keys of a row: what `read` (the restores' deltas) read per tier and what `written`
// (the write-back's deltas) wrote per tier.
void PutTierFigures(const TierTally& read, const TierTally& written, nlohmann::json* row) {
  (*row)["hit_rate_by_tier"] = ByTier([&](std::size_t t) { return read.HitRate(t); });
  (*row)["blocks_read_by_tier"] = ByTier([&](std::size_t t) { return read.hits[t]; });
  (*row)["blocks_requested"] = read.gets;
  (*row)["bytes_read_by_tier"] = ByTier([&](std::size_t t) { return read.bytes_read[t]; });
  (*row)["bytes_written_by_tier"] = ByTier([&](std::size_t t) { return written.bytes_written[t]; });
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

void RemovePools(const std::filesystem::path& dir, bool created_dir) {
  for (const char* sub : {"kv", "state"}) {
    auto r = RemoveOwnedStore(dir / sub, kKvMarker, "--dir", "terrace bench kv");
    if (!r.ok()) fmt::print(stderr, "terrace bench kv: left {} in place: {}\n", (dir / sub).string(), r.status().message());
    std::error_code ec;
    std::filesystem::remove(dir / sub, ec);  // only if empty
  }
  if (created_dir) {
    std::error_code ec;
    std::filesystem::remove(dir, ec);
  }
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
// blocks come from whichever tier holds them. Returns the "multi_turn" object.
Result<nlohmann::json> RunMultiTurn(const BenchKvArgs& a, const KvRunArgs& kv, const std::filesystem::path& dir,
                                    const model::ModelConfig& config, const model::ModelDir& mdir,
                                    const model::Model& m) {
  TERRACE_ASSIGN_OR_RETURN(KvRun run, OpenKvRun(kv, config, mdir));
  for (const char* sub : {"state", "kv"}) (void)WriteMarker(dir / sub, kKvMarker, "terrace bench kv");
  std::vector<std::int32_t> system(static_cast<std::size_t>(a.system_tokens));
  for (std::size_t i = 0; i < system.size(); ++i)
    system[i] = static_cast<std::int32_t>((i * 7919 + 13) % static_cast<std::size_t>(config.vocab_size));
  std::vector<std::vector<std::int32_t>> history(static_cast<std::size_t>(a.conversations), system);
  PrefillProgress progress("terrace bench kv", "multi-turn", 0, config.num_hidden_layers - 1);
  nlohmann::json rows = nlohmann::json::array();
  TierTally all;
  std::int64_t restored = 0, computed = 0;
  double ttft_sum = 0;
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
      const std::uint64_t failures_before = run.cache->Stats().write_failures;
      const auto t0 = std::chrono::steady_clock::now();
      TERRACE_ASSIGN_OR_RETURN(const kv::CachedPrefill r,
                               kv::PrefillWithCache(&session, *run.cache, run.cache->Prepare(prompt, "")));
      const double ttft = SecondsSince(t0);
      run.cache->Flush();  // the write-back, outside the turn's time (a reply is generated meanwhile)
      const TierTally turn = Tally(run) - before;
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
      row["write_failures"] = run.cache->Stats().write_failures - failures_before;
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
  PutTierFigures(all, all, &j);
  j["rows"] = std::move(rows);
  run.cache.reset();
  return j;
}

// The text report of RunBenchKv's object `j`.
void PrintBenchKvText(const BenchKvArgs& a, const nlohmann::json& j) {
  const nlohmann::json& rows = j["rows"];
  if (!rows.empty())
    fmt::print("{:>8} {:>9} {:>14} {:>16} {:>12} {:>10} {:>16} {:>16} {:>18} {:>16} {:>16} {:>16} {:>12} {:>15}\n",
               "prefix", "restored", "ttft restore s", "ttft recompute s", "speedup", "prepare s", "restore MB/s",
               "tier read MB/s", "unprepared MB/s", "unprep tier MB/s", "warm restore MB/s", "warm tier MB/s",
               "alone MB/s", "alone tier MB/s");
  bool any_turn1 = false;
  for (const auto& r : rows) {
    const double tr = r["ttft_restore_s"], tc = r["ttft_recompute_s"];
    const bool turn1 = r["recompute_in_turn1"].get<bool>();
    any_turn1 = any_turn1 || turn1;
    fmt::print("{:>8} {:>9} {:>14.4f} {:>15.4f}{} {:>11.1f}x {:>10.4f} {:>16.1f} {:>16.1f} {:>18.1f} {:>16.1f} {:>16.1f} {:>16.1f} "
               "{:>12.1f} {:>15.1f}\n",
               r["prefix_tokens"].get<int>(), r["restored_tokens"].get<std::int64_t>(), tr, tc, turn1 ? "*" : " ", tc / tr,
               r["prepare_s"].get<double>(), r["restore_mb_per_s"].get<double>(), r["tier_read_mb_per_s"].get<double>(),
               r["cold_unprepared_restore_mb_per_s"].get<double>(), r["cold_unprepared_tier_read_mb_per_s"].get<double>(),
               r["warm_restore_mb_per_s"].get<double>(), r["warm_tier_read_mb_per_s"].get<double>(),
               r["alone_restore_mb_per_s"].get<double>(), r["alone_tier_read_mb_per_s"].get<double>());
  }
  if (any_turn1)
    fmt::print("* above --recompute-max-tokens {}: the recompute is turn 1's cold run, which also stored the prefix\n",
               a.recompute_max_tokens);
  for (const auto& r : rows)
    fmt::print("prefix {}: the restore's blocks by tier: {}; turn 1 wrote {}; read {} (--read-order {}), the forward "
               "pass waited {:.4f} s of its {:.4f} s\n",
               r["prefix_tokens"].get<int>(), TierRateText(r), TierBytesText(r["bytes_written_by_tier"]),
               r["read_by_layer"].get<bool>() ? "by layer" : "in whole chunks", a.kv.read_order,
               r["restore_wait_s"].get<double>(), r["restore_s"].get<double>());
  // Bytes per token per codec (KvLayout's sizes; the run's codecs marked).
  fmt::print("\nper codec, chunk {} tokens (kv: MLA latents of every MLA layer; state: every KDA layer's snapshot at "
             "one boundary; block: as stored, headers, scales and 4 KiB alignment included)\n",
             j["chunk_tokens"].get<int>());
  Table codecs({"codec", "kv B/token", "kv block B/token", "state B/snapshot", "state block B/snapshot"});
  for (const std::string name : kLayoutCodecs) {
    const nlohmann::json& c = j["bytes_per_token_by_codec"][name];
    const std::string mark =
        std::string(name == a.kv.kv_codec ? " kv" : "") + (name == a.kv.state_codec ? " state" : "");
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
  Table turns({"turn", "conversation", "prompt", "restored", "computed", "ttft restore s", "hbm", "host", "nvme",
               "blocks", "written"});
  auto pct = [](const nlohmann::json& r, const char* tier) {
    return fmt::format("{:.0f}%", 100.0 * r["hit_rate_by_tier"][tier].get<double>());
  };
  for (const auto& r : mt["rows"]) {
    std::uint64_t written = 0;
    for (const auto& [tier, b] : r["bytes_written_by_tier"].items()) written += b.get<std::uint64_t>();
    turns.Add({fmt::format("{}", r["turn"].get<int>()), fmt::format("{}", r["conversation"].get<int>()),
               fmt::format("{}", r["prompt_tokens"].get<std::int64_t>()),
               fmt::format("{}", r["restored_tokens"].get<std::int64_t>()),
               fmt::format("{}", r["computed_tokens"].get<std::int64_t>()),
               fmt::format("{:.4f}", r["ttft_restore_s"].get<double>()), pct(r, "hbm"), pct(r, "host"), pct(r, "nvme"),
               fmt::format("{}", r["blocks_requested"].get<std::uint64_t>()),
               FormatBytes(static_cast<double>(written))});
  }
  fmt::print("{}", turns.Render());
  fmt::print("multi-turn: restored {} tokens, computed {}; the restores' blocks by tier: {}; written {}; {} write "
             "failure(s)\n",
             mt["restored_tokens"].get<std::int64_t>(), mt["computed_tokens"].get<std::int64_t>(), TierRateText(mt),
             TierBytesText(mt["bytes_written_by_tier"]), mt["write_failures"].get<std::uint64_t>());
}

int RunBenchKv(const BenchKvArgs& a) {
  if (Status s = CheckModelDirInput(a.model, "--model"); !s.ok()) return FailUsage(s.message());
  auto prefixes = ParseList(a.prefixes);
  if (!prefixes.ok()) return FailUsage(prefixes.status().message());
  if (prefixes->empty() && a.turns == 0)
    return FailUsage("--prefix-tokens none with --turns 0 leaves nothing to run; give prefix lengths or turns");
  std::filesystem::path dir = a.dir;
  bool created_dir = false;
  if (dir.empty()) {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() / fmt::format("terrace-bench-kv-{:08x}", rd());
  }
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    if (!HoldsOnlyOwnedStores(dir, {"kv", "state"}, kKvMarker))  // else a killed run's leftover
      return FailUsage(fmt::format("--dir {} is not empty; give a new or empty directory (the bench removes what it "
                                   "creates there)", dir.string()));
    fmt::print(stderr, "terrace bench kv: removing the pools in '{}', left behind by an earlier run that did not "
                       "finish\n", dir.string());
    RemovePools(dir, false);
  }
  StopSignals stop_signals;  // Ctrl-C: stop at the next layer, remove the pools, exit 128 + signal
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
    created_dir = true;
  }
  auto mdir = model::ModelDir::Open(a.model);
  if (!mdir.ok()) return Fail(mdir.status().ToString());
  const model::ModelConfig& config = (*mdir)->config();
  auto m = model::Model::Load(config, **mdir);
  if (!m.ok()) return Fail(m.status().ToString());
  KvRunArgs kv = a.kv;
  kv.store = dir.string();
  auto by_codec = BytesPerTokenByCodec(config, kv);
  if (!by_codec.ok()) {
    RemovePools(dir, created_dir);
    return Fail(by_codec.status().ToString());
  }

  nlohmann::json rows = nlohmann::json::array();
  TierTally all_read, all_written;  // over every row
  int rc = 0;
  for (int P : *prefixes) {
    if (StopSignalReceived() != 0) break;
    std::vector<std::int32_t> prompt(static_cast<std::size_t>(P + kSuffixTokens));
    for (std::size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<std::int32_t>((i * 7919 + 13 + (i >= static_cast<std::size_t>(P) ? 1 : 0)) %
                                            static_cast<std::size_t>(config.vocab_size));
    std::vector<std::int32_t> prefix(prompt.begin(), prompt.begin() + P);
    TierTally written;  // turn 1's write-back, per tier (both pools)
    // Long prefixes: turn 1 computes the whole prompt cold and is the row's recompute measurement.
    const bool recompute_in_turn1 = P > a.recompute_max_tokens;
    fmt::print(stderr, "terrace bench kv: prefix {} tokens: turn 1 (compute and store{})...\n", P,
               recompute_in_turn1 ? fmt::format(", timed as the recompute of all {} tokens", prompt.size()) : "");
    auto run = OpenKvRun(kv, config, **mdir);
    if (!run.ok()) {
      rc = run.status().code() == Code::kInvalidArgument ? FailUsage(run.status().message()) : Fail(run.status().ToString());
      break;
    }
    // The state pool's marker first: the kv pool's one then says both pools are marked (a run killed
    // between the two leaves a pool the next run refuses, untouched, rather than one it removes).
    for (const char* sub : {"state", "kv"}) (void)WriteMarker(dir / sub, kKvMarker, "terrace bench kv");
    const int last_layer = config.num_hidden_layers - 1;
    double ttft_recompute = 0;
    std::optional<kv::CachedPrefill> r3;  // the cold run of the turn-2 prompt
    {
      const TierTally before = Tally(*run);
      model::Session s1(**m);
      PrefillProgress progress("terrace bench kv", "turn 1",
                               static_cast<std::int64_t>(recompute_in_turn1 ? prompt.size() : prefix.size()),
                               last_layer);
      s1.set_hooks(progress.Hooks());
      const auto t1 = std::chrono::steady_clock::now();
      auto r1 = recompute_in_turn1
                    ? kv::PrefillWithCache(&s1, *run->cache, run->cache->Prepare(prompt, ""), {.restore = false})
                    : kv::PrefillWithCache(&s1, *run->cache, run->cache->Prepare(prefix, ""));
      if (!r1.ok()) {
        rc = FailUnlessStopped(r1.status());
        break;
      }
      if (recompute_in_turn1) {
        ttft_recompute = SecondsSince(t1);
        r3 = std::move(r1).value();
      }
      run->cache->Flush();
      written = Tally(*run) - before;
    }
    const auto cache_written = run->cache->Stats();
    // A fresh cache on the pools, as a new process opens it (nvme: the pools closed and reopened,
    // so nothing is left in memory; host: the pools kept, the cache and its restore buffers new).
    auto fresh_cache = [&]() -> Status {
      if (a.tier != "nvme") {
        const kv::KvLayout layout = run->cache->layout();
        run->cache.reset();
        auto c = kv::PrefixCache::Create(layout, keys::ModelId(config, **mdir), run->kv_store.get(), run->state_store.get());
        if (!c.ok()) return c.status();
        run->cache = std::move(c).value();
        run->cache->SetRestoreReadOrder(ReadOrder(kv));
        return Status::Ok();
      }
      run->cache.reset();
      TERRACE_RETURN_IF_ERROR(run->kv_store->Flush());
      TERRACE_RETURN_IF_ERROR(run->state_store->Flush());
      *run = KvRun{};
      auto again = OpenKvRun(kv, config, **mdir);
      if (!again.ok()) return again.status();
      *run = std::move(again).value();
      return Status::Ok();
    };
    // Read requests the NVMe tiers of both pools have completed (0 for --tier host).
    auto nvme_reads = [&]() -> std::uint64_t {
      std::uint64_t n = 0;
      for (Store* s : {run->kv_store.get(), run->state_store.get()}) {
        const StoreStats st = s->Stats();
        if (st.present[static_cast<std::size_t>(TierId::kNvme)])
          n += st.tiers[static_cast<std::size_t>(TierId::kNvme)].read_requests;
      }
      return n;
    };
    // The tier's raw read of what a restore read, right after it.
    auto tier_read = [&](const kv::RestoreReport& r) -> Result<double> {
      if (a.tier != "nvme") return MemcpyMbPerS(r.kv_bytes + r.state_bytes);
      const std::pair<std::filesystem::path, std::uint64_t> parts[] = {
          {dir / "kv" / "terrace.data", r.kv_bytes}, {dir / "state" / "terrace.data", r.state_bytes}};
      return RawReadMbPerS(parts);
    };
    // One round of turn 2: the unprepared, the prepared and the warm restore (each with its raw
    // read right after it); round 0 also runs the recompute (unless turn 1 was it).
    struct Round {
      std::optional<kv::CachedPrefill> ru, r2, rw;
      kv::RestoreReport alone;  // PrefixCache::Restore with no forward pass beside it
      std::uint64_t alone_requests = 0;  // NVMe read requests it issued (both pools)
      double ttft_unprepared = 0, tier_unprepared = 0, ttft_restore = 0, tier_mb = 0, ttft_warm = 0, tier_warm = 0;
      double tier_alone = 0;
      double prepare_s = 0;
      std::uint64_t prepare_bytes = 0;
      TierTally read;  // what the prepared restore read, per tier (both pools)
      long faults_unprepared = 0, faults_prepared = 0, faults_warm = 0;
    };
    // One restore into `session`, timed with its minor faults, then the tier's raw read of what it read.
    auto timed_restore = [&](model::Session* session, const auto& req, std::optional<kv::CachedPrefill>* result,
                             double* ttft_s, long* faults, double* tier_mb) -> Status {
      const long f0 = MinorFaults();
      const auto t0 = std::chrono::steady_clock::now();
      auto r = kv::PrefillWithCache(session, *run->cache, req, {.restore = true, .write_back = false});
      *ttft_s = SecondsSince(t0);
      *faults = MinorFaults() - f0;
      if (!r.ok()) return r.status();
      *result = std::move(r).value();
      TERRACE_ASSIGN_OR_RETURN(*tier_mb, tier_read((*result)->restore));
      return Status::Ok();
    };
    auto round = [&](int index, Round* out) -> Status {
      TERRACE_RETURN_IF_ERROR(StopCheck());
      TERRACE_RETURN_IF_ERROR(fresh_cache());
      // Cold, unprepared: a fresh cache's first restore into a fresh session, every buffer and
      // latent page touched for the first time inside the restore.
      {
        model::Session fresh(**m);
        TERRACE_RETURN_IF_ERROR(timed_restore(&fresh, run->cache->Prepare(prompt, ""), &out->ru, &out->ttft_unprepared,
                                              &out->faults_unprepared, &out->tier_unprepared));
      }
      TERRACE_RETURN_IF_ERROR(fresh_cache());
      const auto req = run->cache->Prepare(prompt, "");
      // Cold, prepared (the row's headline): a fresh cache and session whose restore memory was
      // prepared at open (PrefixCache::Reserve + SequenceState::Reserve for the prompt), outside
      // the request; the preparation is timed on its own (prepare_s).
      model::Session turn2(**m);
      const auto tp = std::chrono::steady_clock::now();
      TERRACE_ASSIGN_OR_RETURN(auto reserved, run->cache->Reserve(static_cast<std::int64_t>(prompt.size())));
      TERRACE_RETURN_IF_ERROR(turn2.state().Reserve(static_cast<std::int64_t>(prompt.size())));
      out->prepare_s = SecondsSince(tp);
      out->prepare_bytes = reserved.bytes_prepared + static_cast<std::uint64_t>(turn2.state().reserved_tokens()) *
                                                         static_cast<std::uint64_t>(turn2.state().mla_width()) *
                                                         sizeof(float) * run->cache->layout().mla_layers().size();
      const TierTally before = Tally(*run);
      TERRACE_RETURN_IF_ERROR(
          timed_restore(&turn2, req, &out->r2, &out->ttft_restore, &out->faults_prepared, &out->tier_mb));
      out->read = Tally(*run) - before;
      if (index == 0 && !recompute_in_turn1) {
        fmt::print(stderr, "terrace bench kv: prefix {} tokens: recompute...\n", P);
        model::Session cold(**m);
        PrefillProgress progress("terrace bench kv", "recompute", static_cast<std::int64_t>(prompt.size()), last_layer);
        cold.set_hooks(progress.Hooks());
        const auto t1 = std::chrono::steady_clock::now();
        auto cold_run = kv::PrefillWithCache(&cold, *run->cache, req, {.restore = false, .write_back = false});
        ttft_recompute = SecondsSince(t1);
        if (!cold_run.ok()) return cold_run.status();
        r3 = std::move(cold_run).value();
      }
      // Warm: the same restore into the same state after Reset (memory reused), same cache.
      turn2.state().Reset();
      TERRACE_RETURN_IF_ERROR(timed_restore(&turn2, req, &out->rw, &out->ttft_warm, &out->faults_warm, &out->tier_warm));
      // Alone: the same warm restore, whole (PrefixCache::Restore), with no forward pass sharing
      // the cores: what the restore engine reaches when the compute is elsewhere (an engine's
      // forward pass runs on the GPU, not beside the restore on a CPU core).
      turn2.state().Reset();
      const std::uint64_t requests_before = nvme_reads();
      TERRACE_ASSIGN_OR_RETURN(out->alone, run->cache->Restore(req, &turn2.state()));
      out->alone_requests = nvme_reads() - requests_before;
      if (out->alone.boundary_tokens != out->rw->restored_tokens)
        return Status::Internal(fmt::format("bench kv: the restore alone restored {} tokens, the warm one {}",
                                            out->alone.boundary_tokens, out->rw->restored_tokens));
      TERRACE_ASSIGN_OR_RETURN(out->tier_alone, tier_read(out->alone));
      return Status::Ok();
    };
    fmt::print(stderr, "terrace bench kv: prefix {} tokens: turn 2 restore unprepared, prepared, warm ({} round{})...\n",
               P, a.repeat, a.repeat == 1 ? "" : "s");
    std::vector<Round> rounds(static_cast<std::size_t>(a.repeat));
    Status round_error;
    for (int i = 0; i < a.repeat && round_error.ok(); ++i) round_error = round(i, &rounds[static_cast<std::size_t>(i)]);
    if (!round_error.ok()) {
      rc = FailUnlessStopped(round_error);
      break;
    }
    // Scalar figures: the median over the rounds (each round's own value is in the *_runs lists).
    auto median = [&](auto get) {
      std::vector<double> v;
      for (const Round& r : rounds) v.push_back(static_cast<double>(get(r)));
      std::sort(v.begin(), v.end());
      return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    auto runs = [&](auto get) {
      nlohmann::json l = nlohmann::json::array();
      for (const Round& r : rounds) l.push_back(get(r));
      return l;
    };
    auto report_mb_per_s = [](const kv::RestoreReport& r) {
      return r.seconds > 0 ? static_cast<double>(r.kv_bytes + r.state_bytes) / r.seconds / 1e6 : 0.0;
    };
    auto report_ratio = [&](const kv::RestoreReport& r, double tier) { return tier > 0 ? report_mb_per_s(r) / tier : 0.0; };
    auto mb_per_s = [&](const kv::CachedPrefill& c) { return report_mb_per_s(c.restore); };
    auto ratio = [&](const kv::CachedPrefill& c, double tier) { return report_ratio(c.restore, tier); };
    auto alone_ratio = [&](const Round& r) { return report_ratio(r.alone, r.tier_alone); };
    const Round& first = rounds.front();
    const kv::CachedPrefill* r2 = &*first.r2;
    const kv::CachedPrefill* ru = &*first.ru;
    const kv::CachedPrefill* rw = &*first.rw;
    bool unprepared_equal = true, warm_equal = true, prepared_equal = true;
    int warm_fallbacks = 0, fallbacks = 0;
    for (const Round& r : rounds) {
      unprepared_equal = unprepared_equal && r.ru->logits.data == r2->logits.data;
      warm_equal = warm_equal && r.rw->logits.data == r2->logits.data;
      prepared_equal = prepared_equal && r.r2->logits.data == r2->logits.data;
      warm_fallbacks += r.rw->restore.fallbacks;
      fallbacks += r.r2->restore.fallbacks;
    }
    // The restored run's logits against the recompute's for the same positions.
    double num = 0, den = 0;
    const std::size_t off = static_cast<std::size_t>(r2->restored_tokens) * static_cast<std::size_t>(config.vocab_size);
    for (std::size_t i = 0; i < r2->logits.data.size() && off + i < r3->logits.data.size(); ++i) {
      num = std::max(num, static_cast<double>(std::abs(r2->logits.data[i] - r3->logits.data[off + i])));
      den = std::max(den, static_cast<double>(std::abs(r3->logits.data[off + i])));
    }
    nlohmann::json row;
    row["prefix_tokens"] = P;
    row["prompt_tokens"] = prompt.size();
    row["rounds"] = a.repeat;
    row["restored_tokens"] = r2->restored_tokens;
    row["ttft_restore_s"] = median([](const Round& r) { return r.ttft_restore; });
    row["ttft_recompute_s"] = ttft_recompute;
    row["recompute_in_turn1"] = recompute_in_turn1;  // true: timed while storing the prefix
    row["restore_s"] = median([](const Round& r) { return r.r2->restore.seconds; });
    row["restore_wait_s"] = median([](const Round& r) { return r.r2->restore.wait_seconds; });
    row["restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.r2); });
    row["tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_mb; });
    row["restore_over_tier"] = median([&](const Round& r) { return ratio(*r.r2, r.tier_mb); });
    row["restore_s_runs"] = runs([](const Round& r) { return r.r2->restore.seconds; });
    row["restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.r2, r.tier_mb); });
    row["prepare_s"] = median([](const Round& r) { return r.prepare_s; });
    row["prepare_bytes"] = first.prepare_bytes;
    // Minor page faults of the whole process during each TTFT (restore + the suffix's forward pass).
    row["ttft_minor_faults"] = median([](const Round& r) { return r.faults_prepared; });
    row["cold_unprepared_ttft_minor_faults"] = median([](const Round& r) { return r.faults_unprepared; });
    row["warm_ttft_minor_faults"] = median([](const Round& r) { return r.faults_warm; });
    row["cold_unprepared_ttft_restore_s"] = median([](const Round& r) { return r.ttft_unprepared; });
    row["cold_unprepared_restored_tokens"] = ru->restored_tokens;
    row["cold_unprepared_restore_s"] = median([](const Round& r) { return r.ru->restore.seconds; });
    row["cold_unprepared_restore_wait_s"] = median([](const Round& r) { return r.ru->restore.wait_seconds; });
    row["cold_unprepared_restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.ru); });
    row["cold_unprepared_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_unprepared; });
    row["cold_unprepared_restore_over_tier"] = median([&](const Round& r) { return ratio(*r.ru, r.tier_unprepared); });
    row["cold_unprepared_restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.ru, r.tier_unprepared); });
    row["cold_unprepared_logits_bitwise_equal"] = unprepared_equal;
    row["prepared_logits_bitwise_equal_across_rounds"] = prepared_equal;
    row["warm_ttft_restore_s"] = median([](const Round& r) { return r.ttft_warm; });
    row["warm_restored_tokens"] = rw->restored_tokens;
    row["warm_restore_s"] = median([](const Round& r) { return r.rw->restore.seconds; });
    row["warm_restore_wait_s"] = median([](const Round& r) { return r.rw->restore.wait_seconds; });
    row["warm_restore_mb_per_s"] = median([&](const Round& r) { return mb_per_s(*r.rw); });
    row["warm_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_warm; });
    row["warm_restore_over_tier"] = median([&](const Round& r) { return ratio(*r.rw, r.tier_warm); });
    row["warm_restore_s_runs"] = runs([](const Round& r) { return r.rw->restore.seconds; });
    row["warm_restore_over_tier_runs"] = runs([&](const Round& r) { return ratio(*r.rw, r.tier_warm); });
    row["alone_restore_s"] = median([](const Round& r) { return r.alone.seconds; });
    row["alone_restore_mb_per_s"] = median([&](const Round& r) { return report_mb_per_s(r.alone); });
    row["alone_tier_read_mb_per_s"] = median([](const Round& r) { return r.tier_alone; });
    row["alone_restore_over_tier"] = median(alone_ratio);
    row["alone_restore_s_runs"] = runs([](const Round& r) { return r.alone.seconds; });
    row["alone_restore_over_tier_runs"] = runs(alone_ratio);
    row["alone_read_requests"] = median([](const Round& r) { return r.alone_requests; });
    row["read_by_layer"] = r2->restore.read_by_layer;
    row["range_rereads"] = r2->restore.range_rereads;
    row["warm_fallbacks"] = warm_fallbacks;
    row["warm_logits_bitwise_equal"] = warm_equal;
    row["kv_bytes"] = r2->restore.kv_bytes;
    row["state_bytes"] = r2->restore.state_bytes;
    row["bytes_read"] = ByTier([&](std::size_t t) { return r2->restore.bytes_read[t]; });
    row["bytes_written"] = cache_written.bytes_written;
    row["kv_bytes_per_token"] = run->cache->layout().mla_bytes_per_token();
    row["state_bytes_per_sequence"] = run->cache->layout().kda_state_bytes_per_sequence();
    row["fallbacks"] = fallbacks;
    TierTally read;  // the prepared restores of every round
    for (const Round& r : rounds) read += r.read;
    PutTierFigures(read, written, &row);
    all_read += read;
    all_written += written;
    row["logits_max_rel_err_vs_recompute"] = den > 0 ? num / den : 0.0;
    rows.push_back(row);
    run->cache.reset();
    *run = KvRun{};
    RemovePools(dir, false);
  }
  nlohmann::json multi_turn;
  if (rc == 0 && a.turns > 0 && StopSignalReceived() == 0) {
    fmt::print(stderr, "terrace bench kv: multi-turn: {} conversations x {} turns (system prompt {} tokens, {} new "
                       "tokens per turn)...\n", a.conversations, a.turns, a.system_tokens, a.user_tokens);
    auto mt = RunMultiTurn(a, kv, dir, config, **mdir, **m);
    if (mt.ok()) multi_turn = std::move(mt).value();
    else if (mt.status().code() == Code::kInvalidArgument) rc = FailUsage(mt.status().message());
    else rc = FailUnlessStopped(mt.status());
  }
  RemovePools(dir, created_dir);
  if (StopSignalReceived() != 0) return ExitStopped("terrace bench kv", "; removed the pools it created in --dir");
  if (rc != 0) return rc;
  nlohmann::json j;
  j["model"] = a.model;
  j["tier"] = a.tier;
  j["kv_codec"] = a.kv.kv_codec;
  j["state_codec"] = a.kv.state_codec;
  j["chunk_tokens"] = a.kv.chunk_tokens;
  j["read_order"] = a.kv.read_order;
  j["suffix_tokens"] = kSuffixTokens;
  j["rows"] = rows;
  PutTierFigures(all_read, all_written, &j);
  j["bytes_per_token_by_codec"] = *by_codec;
  if (a.turns > 0) j["multi_turn"] = multi_turn;
  if (a.json) {
    fmt::print("{}\n", j.dump());
    return 0;
  }
  PrintBenchKvText(a, j);
  return 0;
}

}  // namespace

void RegisterBenchKv(CLI::App* bench, Runner* run) {
  auto a = std::make_shared<BenchKvArgs>();
  auto* cmd = bench->add_subcommand("kv", "Prefix cache: time to first token with restore vs recompute per prefix length");
  cmd->add_option("--model", a->model, "Model directory (e.g. from 'terrace model init --preset k3-small')")->required();
  cmd->add_option("--dir", a->dir, "Directory for the two pools (new or empty; what the bench creates there is removed "
                                   "afterwards, also on SIGINT/SIGTERM; the next run removes a marked leftover of a "
                                   "killed run). Default: a new directory under the system temp dir");
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
