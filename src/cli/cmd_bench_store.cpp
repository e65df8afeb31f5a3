// terrace bench store: put, get and promote through a Store (host tier over an NVMe tier on a
// file), not through a single tier; the store's get of NVMe-resident blocks is compared with the
// NVMe tier's own GetBatch of the same blocks into the same buffers, in the same run
// (docs/benchmarks.md, "terrace bench store").
//
// Phases, in order (each batch is --batch blocks; MB/s = 1e6 bytes per second):
//   put first   PutBatch into the fresh host tier (arena pages faulted and pinned as they are first
//               used, unless --host-prefault background / eager populated them at open);
//   get host    GetBatch of those blocks (checksums verified);
// Every get lands in one --batch x --block-size output buffer, faulted in once before the first
// phase (as bench tiers' read buffers are), so no get phase times the first touch of it.
//   put warm    the blocks erased and put again, --repeat times (the arena's pages already exist);
//   put nvme    PutBatch with PutOptions::tier = nvme, then Flush;
//   get nvme    --repeat rounds; each round times the store's GetBatch of the NVMe-resident blocks
//               into host buffers (promote_on_get off, so they stay on NVMe) and the NVMe tier's
//               own GetBatch of the same keys, in alternating order. Round 1 is "first" (fresh
//               tier); mb_per_s / tier_mb_per_s are the medians over all rounds;
//   single get  --repeat rounds; each round times Store::Get of every NVMe-resident block, one key
//               per call, into a 4 KiB-aligned host buffer with room for the rounded-up block (so
//               the NVMe read lands in it directly), and the NVMe tier's own Get of the same keys
//               into the same buffers, in alternating order (single_get_* in the JSON);
//   promote     Prefetch of every NVMe block to the host tier at demand priority.
// The read data is compared with what was put (outside the timed regions).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/stop_signals.h"
#include "src/common/aligned_buffer.h"
#include "src/common/median.h"
#include "terrace/store.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli {
namespace {

constexpr const char* kStoreMarker = "terrace-bench-store.marker";
constexpr const char* kWho = "terrace bench store";

struct BenchStoreArgs {
  std::string dir;
  std::uint64_t block_size = 1 * kMiB;
  std::uint64_t total_bytes = 256 * kMiB;
  unsigned batch = 64;
  unsigned repeat = 3;
  bool json = false;
  std::string host_prefault = "on";  // --host-prefault, as in bench tiers
  std::string host_huge_pages = "off";  // --host-huge-pages, as in bench tiers
  std::string host_stream_gets = "auto";  // --host-stream-gets, as in bench tiers
};

// One get phase's rounds, store against tier: MB/s per round, and the store/tier ratio per round.
struct Rounds {
  std::vector<double> store_mb, tier_mb, ratio;
};

BlockKey Key(std::uint64_t i) { return BlockKey{0xbe57, BlockKind::kOther, 0, ContentId{0, i}}; }

// The first failed Status of `st`, naming the phase; Ok when all succeeded.
Status FirstError(const std::vector<Status>& st, std::string_view phase) {
  for (const Status& s : st)
    if (!s.ok()) return s.WithContext(fmt::format("bench store: {}", phase));
  return Status::Ok();
}

class BenchStore {
 public:
  BenchStore(const BenchStoreArgs& a, Store* store, NvmeTier* nvme)
      : a_(a), store_(store), nvme_(nvme), blocks_(a.total_bytes / a.block_size),
        stride_(RoundUp(a.block_size, 4 * kKiB)), payload_(a.block_size), out_(stride_ * a.batch) {
    Prefault(out_);  // every get phase, the first ("get host") included, reads into mapped memory
  }

  bool allocated() const { return payload_.data() != nullptr && out_.data() != nullptr; }
  std::uint64_t blocks() const { return blocks_; }
  std::span<const std::byte> payload() const { return {payload_.data(), payload_.size()}; }
  void Fill() {
    FillPattern(11, Key(0), {payload_.data(), payload_.size()});
    desc_ = DescribeBlock(payload());
  }

  // Puts keys [first, first + blocks) (optionally into `tier`); seconds.
  Result<double> Put(std::uint64_t first, std::optional<TierId> tier, std::string_view phase) {
    std::vector<Store::PutItem> items;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::uint64_t b = 0; b < blocks_; b += a_.batch) {
      items.clear();
      for (std::uint64_t i = b; i < std::min<std::uint64_t>(b + a_.batch, blocks_); ++i)
        items.push_back(Store::PutItem{Key(first + i), payload(), PutOptions{.tier = tier}});
      TERRACE_RETURN_IF_ERROR(FirstError(store_->PutBatch(items), phase));
      TERRACE_RETURN_IF_ERROR(StopCheck());
    }
    return SecondsSince(t0);
  }

  Status Erase(std::uint64_t first) {
    std::vector<BlockKey> keys;
    for (std::uint64_t i = 0; i < blocks_; ++i) keys.push_back(Key(first + i));
    return FirstError(store_->EraseBatch(keys), "erase");
  }

  // Gets keys [first, first + blocks) through the store (tier_direct false) or the NVMe tier's own
  // GetBatch (true); seconds. With verify, each batch's data is compared with the payload (not timed).
  Result<double> Get(std::uint64_t first, bool tier_direct, bool verify, std::string_view phase) {
    double seconds = 0;
    std::vector<Store::GetItem> items;
    std::vector<GetOp> ops;
    for (std::uint64_t b = 0; b < blocks_; b += a_.batch) {
      const std::uint64_t n = std::min<std::uint64_t>(b + a_.batch, blocks_) - b;
      items.clear();
      ops.clear();
      for (std::uint64_t k = 0; k < n; ++k) {
        std::span<std::byte> out{out_.data() + k * stride_, a_.block_size};
        if (tier_direct) ops.push_back(GetOp{Key(first + b + k), out, {}});
        else items.push_back(Store::GetItem{Key(first + b + k), out, {}});
      }
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<Status> st = tier_direct ? nvme_->GetBatch(ops) : store_->GetBatch(items);
      seconds += SecondsSince(t0);
      TERRACE_RETURN_IF_ERROR(FirstError(st, phase));
      TERRACE_RETURN_IF_ERROR(StopCheck());
      if (verify) {
        for (std::uint64_t k = 0; k < n; ++k) {
          if (std::memcmp(out_.data() + k * stride_, payload_.data(), a_.block_size) != 0) {
            return Status::Corruption(fmt::format("bench store: {}: block {} read back different bytes than were put",
                                                  phase, first + b + k));
          }
        }
      }
    }
    return seconds;
  }

  // Gets keys [first, first + blocks) one key per call, through Store::Get (tier_direct false) or
  // the NVMe tier's own Get (true), each into a --batch slot of stride_ bytes (4 KiB-aligned, room
  // for the block rounded up to 4 KiB); seconds. With verify, each block is compared with the
  // payload (not timed).
  Result<double> GetOneByOne(std::uint64_t first, bool tier_direct, bool verify, std::string_view phase) {
    double seconds = 0;
    for (std::uint64_t i = 0; i < blocks_; ++i) {
      std::span<std::byte> out{out_.data() + (i % a_.batch) * stride_, stride_};
      BlockDesc desc;
      const auto t0 = std::chrono::steady_clock::now();
      Status st = tier_direct ? nvme_->Get(Key(first + i), out, &desc) : store_->Get(Key(first + i), out).status();
      seconds += SecondsSince(t0);
      if (!st.ok()) return st.WithContext(fmt::format("bench store: {}", phase));
      if (i % a_.batch == 0) TERRACE_RETURN_IF_ERROR(StopCheck());
      if (verify && std::memcmp(out.data(), payload_.data(), a_.block_size) != 0) {
        return Status::Corruption(
            fmt::format("bench store: {}: block {} read back different bytes than were put", phase, first + i));
      }
    }
    return seconds;
  }

  Result<double> Promote(std::uint64_t first) {
    std::vector<BlockKey> keys;
    for (std::uint64_t i = 0; i < blocks_; ++i) keys.push_back(Key(first + i));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Status> st = store_->Prefetch(keys, TierId::kHost, Priority::kDemand).get();
    const double s = SecondsSince(t0);
    TERRACE_RETURN_IF_ERROR(FirstError(st, "promote"));
    return s;
  }

  double MbPerS(double seconds) const {
    return seconds > 0 ? static_cast<double>(blocks_ * a_.block_size) / seconds / 1e6 : 0.0;
  }

 private:
  const BenchStoreArgs& a_;
  Store* store_;
  NvmeTier* nvme_;
  std::uint64_t blocks_, stride_;
  AlignedBuffer payload_, out_;
  BlockDesc desc_;
};

// Everything after the directory is set up; the caller removes what the bench created.
Result<nlohmann::json> RunPhases(const BenchStoreArgs& a, const std::filesystem::path& nvme_dir) {
  const std::uint64_t blocks = a.total_bytes / a.block_size;
  const std::uint64_t host_need = blocks * RoundUp(a.block_size, 4 * kKiB);
  HostTierOptions ho;
  // Room for one set of blocks below the store's high watermark (0.9).
  ho.capacity_bytes = RoundUp(host_need + host_need / 4 + 64 * kMiB, 4 * kKiB);
  ho.chunk_bytes = std::max<std::uint64_t>(RoundUp(a.block_size, 4 * kKiB), 64 * kMiB);
  ApplyHostPrefault(a.host_prefault, &ho);
  ho.huge_pages = a.host_huge_pages == "on";
  ApplyHostStreamGets(a.host_stream_gets, &ho);
  NvmeTierOptions no;
  no.path = nvme_dir;
  const std::uint64_t nvme_need = blocks * nvme::Record{.length = a.block_size}.extent_bytes();
  no.capacity_bytes = RoundUp(nvme_need + nvme_need / 4 + 64 * kMiB, 4 * kKiB);
  TERRACE_ASSIGN_OR_RETURN(auto nvme, NvmeTier::Open(no));
  if (Status s = WriteMarker(nvme_dir, kStoreMarker, kWho); !s.ok()) return s;
  // The host tier opens last, just before the first put: opened before the NVMe tier's file is
  // allocated, a --host-prefault background thread would fault the "fresh" tier in meanwhile.
  const auto open0 = std::chrono::steady_clock::now();
  TERRACE_ASSIGN_OR_RETURN(auto host, HostTier::Create(ho));
  const double host_open = SecondsSince(open0);
  NvmeTier* nvme_raw = nvme.get();
  StoreOptions so;
  so.put_tier = TierId::kHost;
  so.promote_on_get = false;  // NVMe-resident blocks stay there across the get rounds
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  tiers[static_cast<std::size_t>(TierId::kHost)] = std::move(host);
  tiers[static_cast<std::size_t>(TierId::kNvme)] = std::move(nvme);
  TERRACE_ASSIGN_OR_RETURN(auto store, Store::OpenWithTiers(so, std::move(tiers)));

  BenchStore b(a, store.get(), nvme_raw);
  if (!b.allocated()) return Status::OutOfCapacity("cannot allocate the bench buffers; lower --batch or --block-size");
  b.Fill();
  const auto note = [&](std::string_view what) {
    fmt::print(stderr, "bench store: {} ({} blocks of {})\n", what, blocks, FormatBytes(static_cast<double>(a.block_size)));
  };
  const std::uint64_t host_keys = 0, nvme_keys = blocks;
  nlohmann::json j;
  note("put into the fresh host tier");
  TERRACE_ASSIGN_OR_RETURN(double put_first, b.Put(host_keys, std::nullopt, "put first"));
  note("get from the host tier");
  const long get_host_faults0 = MinorFaults();
  TERRACE_ASSIGN_OR_RETURN(double get_host, b.Get(host_keys, false, true, "get host"));
  const long get_host_faults = MinorFaults() - get_host_faults0;
  std::vector<double> put_warm;
  for (unsigned r = 0; r < a.repeat; ++r) {
    TERRACE_RETURN_IF_ERROR(b.Erase(host_keys));
    note(fmt::format("put into the warm host tier, round {}/{}", r + 1, a.repeat));
    TERRACE_ASSIGN_OR_RETURN(double s, b.Put(host_keys, std::nullopt, "put warm"));
    put_warm.push_back(b.MbPerS(s));
  }
  TERRACE_RETURN_IF_ERROR(b.Erase(host_keys));
  note("put into the NVMe tier");
  TERRACE_ASSIGN_OR_RETURN(double put_nvme, b.Put(nvme_keys, TierId::kNvme, "put nvme"));
  const auto f0 = std::chrono::steady_clock::now();
  TERRACE_RETURN_IF_ERROR(store->Flush());
  const double flush = SecondsSince(f0);
  // --repeat rounds of one get phase through the store and through the NVMe tier, in alternating
  // order (even rounds: store first); the first round also verifies the bytes.
  const auto compare = [&](std::string_view what, bool one_by_one) -> Result<Rounds> {
    Rounds out;
    const auto get = [&](bool tier, bool verify) {
      const std::string phase = fmt::format("{} ({})", one_by_one ? "single get" : "get nvme", tier ? "tier" : "store");
      return one_by_one ? b.GetOneByOne(nvme_keys, tier, verify, phase) : b.Get(nvme_keys, tier, verify, phase);
    };
    for (unsigned r = 0; r < a.repeat; ++r) {
      note(fmt::format("get NVMe-resident blocks{}: store and tier, round {}/{}", what, r + 1, a.repeat));
      const bool store_first = r % 2 == 0, verify = r == 0;
      TERRACE_ASSIGN_OR_RETURN(double first, get(!store_first, verify));
      TERRACE_ASSIGN_OR_RETURN(double second, get(store_first, verify));
      out.store_mb.push_back(b.MbPerS(store_first ? first : second));
      out.tier_mb.push_back(b.MbPerS(store_first ? second : first));
      out.ratio.push_back(out.tier_mb.back() > 0 ? out.store_mb.back() / out.tier_mb.back() : 0.0);
    }
    return out;
  };
  TERRACE_ASSIGN_OR_RETURN(const Rounds batched, compare("", false));
  // The same comparison one key per call (Store::Get against the tier's own Get).
  const StoreStats single_before = store->Stats();
  const std::uint64_t staged_ios_before = nvme_raw->staged_ios();
  TERRACE_ASSIGN_OR_RETURN(const Rounds singles, compare(" one key at a time", true));
  const StoreStats single_after = store->Stats();
  const std::uint64_t single_staged_ios = nvme_raw->staged_ios() - staged_ios_before;

  const StoreStats before = store->Stats();
  note("promote NVMe-resident blocks to the host tier");
  TERRACE_ASSIGN_OR_RETURN(double promote, b.Promote(nvme_keys));
  const StoreStats after = store->Stats();
  TERRACE_ASSIGN_OR_RETURN(double get_promoted, b.Get(nvme_keys, false, true, "get promoted"));

  j["block_size"] = a.block_size;
  j["blocks"] = blocks;
  j["total_bytes"] = blocks * a.block_size;
  j["batch"] = a.batch;
  j["repeat"] = a.repeat;
  j["host_prefault"] = a.host_prefault;
  j["host_huge_pages"] = a.host_huge_pages;
  j["host_stream_gets"] = a.host_stream_gets;
  j["host_open_seconds"] = host_open;
  j["put_first_mb_per_s"] = b.MbPerS(put_first);
  j["put_warm_mb_per_s"] = Median(put_warm);
  j["put_warm_rounds_mb_per_s"] = put_warm;
  j["get_host_mb_per_s"] = b.MbPerS(get_host);
  j["get_host_minor_faults"] = get_host_faults;  // the whole process's, over the phase (verify included)
  j["put_nvme_mb_per_s"] = b.MbPerS(put_nvme);
  j["flush_seconds"] = flush;
  j["get_nvme_first_mb_per_s"] = batched.store_mb.front();
  j["tier_first_mb_per_s"] = batched.tier_mb.front();
  j["get_nvme_rounds_mb_per_s"] = batched.store_mb;
  j["tier_rounds_mb_per_s"] = batched.tier_mb;
  j["mb_per_s"] = Median(batched.store_mb);
  j["tier_mb_per_s"] = Median(batched.tier_mb);
  j["ratio_vs_tier"] = Median(batched.ratio);
  j["single_get_mb_per_s"] = Median(singles.store_mb);
  j["single_get_tier_mb_per_s"] = Median(singles.tier_mb);
  j["single_get_ratio_vs_tier"] = Median(singles.ratio);
  j["single_get_first_mb_per_s"] = singles.store_mb.front();
  j["single_get_tier_first_mb_per_s"] = singles.tier_mb.front();
  j["single_get_rounds_mb_per_s"] = singles.store_mb;
  j["single_get_tier_rounds_mb_per_s"] = singles.tier_mb;
  j["single_get_direct_transfers"] = single_after.direct_transfers - single_before.direct_transfers;
  j["single_get_staged_transfers"] = single_after.staged_transfers - single_before.staged_transfers;
  j["single_get_nvme_staged_ios"] = single_staged_ios;  // the tier's own reads included
  j["promote_mb_per_s"] = b.MbPerS(promote);
  j["promotions"] = after.promotions - before.promotions;
  j["get_promoted_mb_per_s"] = b.MbPerS(get_promoted);
  j["direct_transfers"] = after.direct_transfers;
  j["staged_transfers"] = after.staged_transfers;
  j["host_detail"] = after.tiers[static_cast<std::size_t>(TierId::kHost)].detail;
  return j;
}

int RunBenchStore(const BenchStoreArgs& a) {
  if (a.total_bytes < a.block_size) {
    return FailUsage(fmt::format("--total-bytes {} is less than one --block-size {}; raise --total-bytes",
                                 FormatBytes(static_cast<double>(a.total_bytes)),
                                 FormatBytes(static_cast<double>(a.block_size))));
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  const std::uint64_t ram = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
  const std::uint64_t need = a.total_bytes + a.total_bytes / 4 + RoundUp(a.block_size, 4 * kKiB) * (a.batch + 1);
  if (ram != 0 && need > ram / 4 * 3) {
    return FailUsage(fmt::format("--total-bytes {} with --batch {} x --block-size {} needs about {} of memory, more than "
                                 "this machine can give ({} of RAM); lower --total-bytes or --batch",
                                 FormatBytes(static_cast<double>(a.total_bytes)), a.batch,
                                 FormatBytes(static_cast<double>(a.block_size)), FormatBytes(static_cast<double>(need)),
                                 FormatBytes(static_cast<double>(ram))));
  }
  std::filesystem::path dir = a.dir;
  if (dir.empty()) {
    auto scratch = ScratchDirPath("terrace-bench-store", "--dir");
    if (!scratch.ok()) return Fail(scratch.status().message());
    dir = std::move(scratch).value();
    RemoveDeadScratchDirs(dir.parent_path(), "terrace-bench-store", {"nvme"}, kStoreMarker, kWho);
  }
  if (Status s = CheckStoreDirArg(dir, "--dir"); !s.ok()) return FailUsage(s.message());
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    // A killed run's leftover (dir holding only its marked nvme/ store) is removed; anything else refused.
    if (!HoldsOnlyOwnedStores(dir, {"nvme"}, kStoreMarker, EmptySubDirs::kRefuse)) {
      return FailUsage(fmt::format("--dir {} is not empty: {}; nothing was removed: give a new or empty directory (the "
                                   "bench removes what it creates there)",
                                   dir.string(), WhyNotOnlyOwnedStores(dir, {"nvme"}, kStoreMarker, "--dir")));
    }
    const std::string note = fmt::format("bench store: removing '{}', left behind by an earlier run that did not finish",
                                         (dir / "nvme").string());
    if (Status s = RemoveOwnedSubStores(dir, {"nvme"}, kStoreMarker, "--dir", kWho, note); !s.ok())
      return s.IsInvalidArgument() ? FailUsage(s.message()) : Fail(s.ToString());
  }
  bool created_dir = false;
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Fail(fmt::format("--dir: cannot create {}: {}", dir.string(), ec.message()));
    created_dir = true;
  }
  const std::filesystem::path nvme_dir = dir / "nvme";
  StopSignals stop_signals;  // Ctrl-C: stop after the current batch, remove what the bench created, exit 128 + signal
  Result<nlohmann::json> j = RunPhases(a, nvme_dir);  // the store is closed when it returns
  const Status removed = RemoveOwnedSubStores(dir, {"nvme"}, kStoreMarker, "--dir", kWho);
  if (!removed.ok()) fmt::print(stderr, "bench store: left {} in place: {}\n", nvme_dir.string(), removed.message());
  if (created_dir) std::filesystem::remove(dir, ec);  // only if empty
  if (StopSignalReceived() != 0) return ExitStopped("bench store", removed.ok() ? "; removed what it created in --dir" : "");
  if (!j.ok()) return Fail(j.status().ToString());
  if (a.json) {
    fmt::print("{}\n", j->dump());
    return 0;
  }
  const nlohmann::json& r = *j;
  Table t({"phase", "MB/s"});
  const auto row = [&](const char* name, const char* k) { t.Add({name, fmt::format("{:.0f}", r[k].get<double>())}); };
  row("put, fresh host tier", "put_first_mb_per_s");
  row("put, warm host tier (median)", "put_warm_mb_per_s");
  row("get, host-resident", "get_host_mb_per_s");
  row("put, into NVMe", "put_nvme_mb_per_s");
  row("get NVMe-resident via store, first", "get_nvme_first_mb_per_s");
  row("get NVMe-resident via store (median)", "mb_per_s");
  row("NVMe tier GetBatch, first", "tier_first_mb_per_s");
  row("NVMe tier GetBatch (median)", "tier_mb_per_s");
  row("get NVMe-resident via store, one key per Get (median)", "single_get_mb_per_s");
  row("NVMe tier Get, one key per call (median)", "single_get_tier_mb_per_s");
  row("promote NVMe -> host", "promote_mb_per_s");
  row("get, promoted", "get_promoted_mb_per_s");
  fmt::print("{}", t.Render());
  fmt::print("host tier open (with any populate, --host-prefault {}): {:.2f} s, not in MB/s\n", a.host_prefault,
             r["host_open_seconds"].get<double>());
  fmt::print("store get / NVMe tier get (median of per-round ratios): {:.2f}x; one key at a time: {:.2f}x\n",
             r["ratio_vs_tier"].get<double>(), r["single_get_ratio_vs_tier"].get<double>());
  return 0;
}

}  // namespace

void RegisterBenchStore(CLI::App* bench, Runner* run) {
  auto a = std::make_shared<BenchStoreArgs>();
  auto* cmd = bench->add_subcommand("store", "Put, get and promote through a Store (host over NVMe on a file), against "
                                             "the NVMe tier's own reads");
  cmd->add_option("--dir", a->dir, "Directory for the NVMe tier (new or empty; what the bench creates there is removed "
                                   "afterwards, also on SIGINT/SIGTERM; the next run removes a marked leftover of a "
                                   "killed run). Default: a new directory terrace-bench-store-<pid>.<host tag>-<hex> under the system "
                                   "temp dir; a later run removes those of killed runs")->transform(NormalizedPath());
  AddSizeOption(cmd, "--block-size", &a->block_size, "Block size", 4096, 1 * kGiB);
  AddSizeOption(cmd, "--total-bytes", &a->total_bytes, "Bytes per phase (one set of blocks)", 4096, 1ull << 40);
  AddIntOption(cmd, "--batch", &a->batch, 1u, 4096u, "Blocks per PutBatch / GetBatch call");
  AddIntOption(cmd, "--repeat", &a->repeat, 1u, 100u, "Rounds of the warm put and of the NVMe get comparison");
  AddHostPrefaultOption(cmd, &a->host_prefault,
                        "Host tier: when its memory is faulted in (on | off | background | eager, as in bench "
                        "tiers; background and eager hold the whole host capacity in RAM from open)");
  AddHostHugePagesOption(cmd, &a->host_huge_pages);
  AddHostStreamGetsOption(cmd, &a->host_stream_gets);
  cmd->add_flag("--json", a->json, "Print one JSON object (mb_per_s, tier_mb_per_s, ratio_vs_tier, single_get_mb_per_s, ...)");
  cmd->callback([run, a] { *run = [a] { return RunBenchStore(*a); }; });
}

}  // namespace terrace::cli
