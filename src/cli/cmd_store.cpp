// terrace store fill | check (and, in their own files, recover | drill | stats).
//
// `fill` puts test-pattern blocks in sync durability and prints "durable <key>" as each put is
// acknowledged; kill it at any moment, then `check --expect` proves every acknowledged block
// survived intact. `check` is read-only unless --repair.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/owned_dirs.h"
#include "src/cli/safe_files.h"
#include "src/cli/stop_signals.h"
#include "tiers/nvme/fault_engine.h"
#include "tiers/nvme/format.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/power_cut.h"
#include "tiers/nvme/uring_engine.h"

namespace terrace::cli {
namespace {

using namespace store_cmd;
namespace fs = std::filesystem;

constexpr std::uint64_t kDefaultCapacity = 1 * kGiB;
constexpr std::uint64_t kMaxBlockSize = 1 * kGiB;
constexpr unsigned kMaxFillThreads = 256;
constexpr int kMaxConsecutiveFailures = 8;

struct FillArgs {
  StorePaths paths;
  std::uint64_t count = 0;
  std::uint64_t block_size = 64 * kKiB;
  std::uint64_t seed = 1;
  std::uint64_t threads = 4;
  std::uint64_t first = 0;  // hidden (drill): index of the first block
  FillFault fault;          // hidden (drill)
};

struct CheckArgs {
  StorePaths paths;
  std::uint64_t seed = 1;
  std::string expect;
  bool repair = false;
  bool quick = false;
  bool checksums_only = false;  // --checksums-only: no pattern comparison (a store 'store fill' did not write)
};

// Opens the tier for `fill`, with the drill's fault engine or power cut when one is asked for.
Result<std::unique_ptr<NvmeTier>> OpenFillTier(const NvmeTierOptions& o, const FillFault& f,
                                               nvme::FaultInjectingIoEngine** fault_engine, nvme::PowerCut* cut) {
  if (f.kind.empty()) return NvmeTier::Open(o);
  if (f.kind == "powercut") {
    cut->CutAfter(f.cut_after);
    NvmeOpenHooks hooks;
    hooks.engine = cut->WrapEngine(nvme::OpenUringEngine);
    hooks.index_env = cut->index_env();
    return NvmeTier::OpenWithHooks(o, hooks);
  }
  if (f.kind == "eio" || f.kind == "enospc" || f.kind == "short" || f.kind == "close-eio") {
    nvme::FaultKind kind = f.kind == "eio" || f.kind == "close-eio" ? nvme::FaultKind::kEio
                           : f.kind == "enospc" ? nvme::FaultKind::kEnospc
                                                : nvme::FaultKind::kShort;
    const std::uint64_t seed = f.seed;
    const double rate = f.kind == "close-eio" ? 0.0 : f.rate;  // close-eio: RunFill arms a failed sync at the close
    return NvmeTier::OpenWithEngine(o, [=](const nvme::IoEngineConfig& cfg) -> Result<std::unique_ptr<nvme::IoEngine>> {
      TERRACE_ASSIGN_OR_RETURN(auto base, nvme::OpenUringEngine(cfg));
      auto e = std::make_unique<nvme::FaultInjectingIoEngine>(std::move(base), seed);
      e->SetRandom(rate, {kind});
      *fault_engine = e.get();
      return std::unique_ptr<nvme::IoEngine>(std::move(e));
    });
  }
  return Status::InvalidArgument(fmt::format("unknown drill fault '{}'", f.kind));
}

// The kinds of `fill`'s paths, checked before anything is created: --dir a directory (created if
// missing) or a block device, --index-dir a directory (created if missing), and for a new store in
// a directory an absent or empty one. InvalidArgument naming the flag otherwise.
Status CheckFillPaths(const StorePaths& p) {
  TERRACE_RETURN_IF_ERROR(CheckNvmePaths(p.dir, p.index_dir));
  const bool device = IsBlockDevice(p.dir);
  if (!device) TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(p.dir, "--dir"));
  if (p.index_dir.empty()) return Status::Ok();
  TERRACE_RETURN_IF_ERROR(CheckStoreDirArg(p.index_dir, "--index-dir"));
  if (device || StoreDataExists(p.dir) || fs::exists(fs::symlink_status(fs::path(p.dir) / "terrace.data.creating")))
    return Status::Ok();  // the store's own index (or an interrupted creation's): the tier checks it
  std::error_code ec;
  if (fs::is_directory(p.index_dir, ec) && !fs::is_empty(p.index_dir, ec)) {
    return Status::InvalidArgument(fmt::format(
        "--index-dir {} is not empty, and --dir {} holds no store yet: a new store needs a new or empty index "
        "directory; give one, or the --dir of the store this index belongs to",
        p.index_dir, p.dir));
  }
  return Status::Ok();
}

int RunFill(const FillArgs& a) {
  if (Status s = CheckFillPaths(a.paths); !s.ok()) return FailUsage(s.message());
  auto existing = ReadSuperblock(a.paths.dir);
  if (!existing.ok()) return FailStatus(existing.status());
  // Without --capacity: the store's own, or that of a creation a kill interrupted (which this run
  // completes), else the default for a new store.
  std::uint64_t capacity = a.paths.capacity != 0 ? a.paths.capacity : kDefaultCapacity;
  if (a.paths.capacity == 0 && !*existing) {
    if (auto creating = InterruptedCreationCapacity(a.paths.dir); creating.ok()) capacity = *creating;
  }
  if (*existing) {
    if (a.paths.capacity != 0 && a.paths.capacity != (*existing)->capacity_bytes) {
      return FailUsage(fmt::format(
          "--capacity {} does not match the store at '{}', which was created with --capacity {}; omit --capacity "
          "to use the store's own",
          FormatBytes(static_cast<double>(a.paths.capacity)), a.paths.dir,
          FormatBytes(static_cast<double>((*existing)->capacity_bytes))));
    }
    capacity = (*existing)->capacity_bytes;
  }
  if (capacity < nvme::kDataStart + 2 * nvme::kUnit || capacity % nvme::kUnit != 0) {
    return FailUsage(fmt::format("--capacity {} is too small or not a multiple of 4 KiB; give at least 12KiB, e.g. 1GiB",
                                 capacity));
  }
  if (a.block_size < 1 || a.block_size > kMaxBlockSize) {
    return FailUsage(fmt::format("--block-size {} is out of range; use 1 B..{}", a.block_size,
                                  FormatBytes(static_cast<double>(kMaxBlockSize))));
  }
  if (a.block_size > capacity - std::min(capacity, nvme::kDataStart)) {
    return FailUsage(fmt::format("--block-size {} does not fit in a store of --capacity {} (its first 4 KiB hold "
                                 "the store's header); lower --block-size{}",
                                 FormatBytes(static_cast<double>(a.block_size)),
                                 FormatBytes(static_cast<double>(capacity)),
                                 *existing ? "" : ", or raise --capacity for a new store"));
  }
  // Each block takes its data rounded up to 4 KiB plus one 4 KiB descriptor (docs/nvme-format.md).
  const std::uint64_t per_block = nvme::RoundUp(a.block_size, nvme::kUnit) + nvme::kUnit;
  std::uint64_t total = 0;
  if (__builtin_mul_overflow(a.count, per_block, &total) || total > capacity - nvme::kDataStart) {
    return FailUsage(fmt::format(
        "--count {} x --block-size {} is more than the {} store can hold ({}); lower --count or --block-size{}",
        a.count, FormatBytes(static_cast<double>(a.block_size)), *existing ? "existing" : "new",
        FormatBytes(static_cast<double>(capacity)),
        *existing ? "" : ", or raise --capacity"));
  }

  NvmeTierOptions o;
  o.path = a.paths.dir;
  o.index_dir = a.paths.index_dir;
  o.capacity_bytes = capacity;
  o.durability = Durability::kSync;
  o.io_threads = static_cast<unsigned>(std::min<std::uint64_t>(a.threads, 64));
  nvme::FaultInjectingIoEngine* fault_engine = nullptr;
  // Ctrl-C: the writers stop after their current put (every one printed 'durable' stays so) and the
  // tier closes before the exit.
  StopSignals stop_signals;
  std::unique_ptr<nvme::PowerCut> cut;  // outlives the tier (its Env serves the index)
  if (a.fault.kind == "powercut") cut = std::make_unique<nvme::PowerCut>(a.fault.seed);
  std::error_code dir_ec;
  const bool dir_was_absent = !std::filesystem::exists(std::filesystem::symlink_status(a.paths.dir, dir_ec));
  auto tier = OpenFillTier(o, a.fault, &fault_engine, cut.get());
  std::mutex out_mu;
  std::atomic<std::uint64_t> next{0}, written{0}, unchanged{0}, failed{0}, last_faults{0};
  std::atomic<std::uint64_t> rewritten{0};  // listed with identical bytes but read back damaged: written again
  std::atomic<std::uint64_t> reported{0};  // 'durable' lines standard output took
  std::atomic<int> consecutive{0};
  std::atomic<bool> stop{false};
  Status stdout_failed;  // the first failed write of a line to stdout (under out_mu): the fill stops
  // Writes `line` to stdout now (under out_mu); false, and the fill stopping, when it cannot.
  auto print_line = [&](const std::string& line) {
    Status out = WriteStdoutNow(line);
    if (out.ok()) return true;
    if (stdout_failed.ok()) stdout_failed = std::move(out);
    stop = true;
    return false;
  };
  // The blocks are durable, yet the record of them (the 'durable' lines) is not complete.
  const auto fail_unreported = [&] {
    return Fail(fmt::format("{}; the fill stopped: {} blocks are durable in the store, {} of them reported on "
                            "'durable' lines (the record 'store check --expect' reads lacks the rest)",
                            stdout_failed.message(), written.load() + unchanged.load(), reported.load()));
  };
  // A simulated power cut ends the process the way a real one would: the tier is closed, everything
  // not durable is thrown away, and the puts acknowledged so far are what the drill checks.
  auto finish_cut = [&]() -> int {
    if (tier.ok()) tier->reset();
    auto rep = cut->Cut();
    if (!rep.ok()) return FailStatus(rep.status());
    if (!stdout_failed.ok() || !print_line("injected 1\n")) return fail_unreported();
    fmt::print(stderr, "store fill: {}\n", rep->ToString());
    return 0;
  };
  if (!tier.ok()) {
    if (cut && cut->powered_off()) return finish_cut();
    // A --dir this run made and a failed creation left empty goes too (remove refuses a non-empty one).
    if (dir_was_absent) std::filesystem::remove(a.paths.dir, dir_ec);
    return FailStatus(tier.status());
  }

  const auto start = std::chrono::steady_clock::now();
  auto worker = [&] {
    std::vector<std::byte> buf, stored;  // stored: an existing block read back before it is acknowledged
    try {
      buf.resize(a.block_size);
      stored.resize(a.block_size);
    } catch (const std::bad_alloc&) {
      std::lock_guard<std::mutex> l(out_mu);
      fmt::print(stderr, "terrace: error: cannot allocate a {} buffer for --block-size\n",
                 FormatBytes(static_cast<double>(a.block_size)));
      stop = true;
      failed.fetch_add(1);
      return;
    }
    for (std::uint64_t i; !stop && StopSignalReceived() == 0 && (i = next.fetch_add(1)) < a.count;) {
      const BlockKey key = FillKey(a.seed, a.first + i);
      FillPattern(a.seed, key, buf);
      const BlockDesc desc = DescribeBlock(buf);
      // A block the index already lists with this size and checksum is acknowledged only once it
      // reads back intact (the tier verifies its checksum): a damaged one is written again.
      auto have = (*tier)->Lookup(key);
      const bool listed = have.ok() && *have == desc;
      bool damaged = false;
      Status s;
      if (listed) {
        BlockDesc got;
        const Status read = (*tier)->Get(key, stored, &got);
        // Damaged: the read refused it (checksum; a corrupt block is dropped, so NotFound once
        // another writer saw it first) or returned other bytes. Any other read error is this put's
        // failure: the block is not acknowledged, and not rewritten on a transient error.
        damaged = read.IsCorruption() || read.IsNotFound() || (read.ok() && !(got == desc && stored == buf));
        if (!damaged) s = read;
      }
      const bool same = listed && !damaged;  // with s ok: acknowledged as it is
      if (!same) {
        s = (*tier)->Put(key, desc, buf);
        if (s.ok() && damaged) rewritten.fetch_add(1);
      }
      std::lock_guard<std::mutex> l(out_mu);
      if (fault_engine) {
        std::uint64_t n = fault_engine->injected_total();
        if (n != last_faults.exchange(n)) print_line(fmt::format("injected {}\n", n));
      }
      if (s.ok()) {
        consecutive = 0;
        (same ? unchanged : written).fetch_add(1);
        if (print_line(fmt::format("durable {}\n", key.ToString()))) reported.fetch_add(1);
        continue;
      }
      failed.fetch_add(1);
      fmt::print(stderr, "terrace: put of {} failed: {}\n", key.ToString(), InCliWords(s.ToString()));
      if (++consecutive >= kMaxConsecutiveFailures && !stop.exchange(true)) {
        fmt::print(stderr, "terrace: stopping after {} consecutive failed puts\n", kMaxConsecutiveFailures);
      }
    }
  };
  std::vector<std::thread> threads;
  try {
    for (std::uint64_t t = 0; t < a.threads; ++t) threads.emplace_back(worker);
  } catch (const std::system_error& e) {
    stop = true;
    for (auto& t : threads) t.join();
    return Fail(fmt::format("cannot start {} --threads: {}", a.threads, e.what()));
  }
  for (auto& t : threads) t.join();
  if (cut) {
    cut->PowerOff();  // the power goes off at the latest at the end of the run, before the close
    return finish_cut();
  }
  const double secs = SecondsSince(start);
  const std::uint64_t w = written.load(), same = unchanged.load(), bad = failed.load();
  const std::uint64_t attempted = w + same + bad;
  // Closed before the exit, not by it: a failed close (final commit, superblock, index flush) fails
  // the run. Every put printed 'durable' was already durable.
  if (a.fault.kind == "close-eio") fault_engine->ArmSync(EIO);
  const Status closed = (*tier)->Close();
  if (!stdout_failed.ok()) {
    if (!closed.ok()) FailStatus(closed);
    return fail_unreported();
  }
  if (StopSignalReceived() != 0) {
    if (!closed.ok()) return FailStatus(closed);
    return ExitStopped("store fill", fmt::format(
        "; {} of {} blocks acknowledged durable (the 'durable' lines: {} written, {} already stored), {} failed, {} "
        "not attempted; the store in --dir is closed and keeps them",
        w + same, a.count, w, same, bad, a.count - attempted));
  }
  if (w == 0 && same > 0 && bad == 0) {
    fmt::print(stderr,
               "store fill: all {} blocks were already in the store with identical bytes (same --seed {}); nothing "
               "was written\n",
               same, a.seed);
  } else if (w == 0) {
    fmt::print(stderr, "store fill: no block was written{}{}\n",
               same ? fmt::format("; {} were already stored with identical bytes", same) : std::string(),
               bad ? fmt::format("; {} failed", bad) : std::string());
  } else {
    fmt::print(stderr, "store fill: {} of {} blocks written and durable ({}) in {:.2f} s, {:.1f} MB/s, sync durability{}\n",
               w, a.count, FormatBytes(static_cast<double>(w * a.block_size)), secs,
               secs > 0 ? static_cast<double>(w * a.block_size) / 1e6 / secs : 0.0,
               same ? fmt::format("; {} more were already stored with identical bytes", same) : std::string());
  }
  if (const std::uint64_t n = rewritten.load(); n > 0) {
    fmt::print(stderr,
               "store fill: {} block{} the store listed with identical bytes did not read back intact and {} written "
               "again (counted as written)\n",
               n, n == 1 ? "" : "s", n == 1 ? "was" : "were");
  }
  if (fault_engine) fmt::print(stderr, "store fill: {} faults injected\n", fault_engine->injected_total());
  const int close_rc = closed.ok() ? 0 : FailStatus(closed);
  if (bad) {
    return Fail(fmt::format("{} of {} attempted puts failed{}", bad, attempted,
                            attempted < a.count ? fmt::format("; {} blocks not attempted", a.count - attempted) : ""));
  }
  return close_rc;
}

// "a, b and c".
std::string JoinWords(const std::vector<std::string>& words) {
  std::string out;
  for (std::size_t i = 0; i < words.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == words.size() ? " and " : ", ") + words[i];
  }
  return out;
}

// "'a', 'b' and 'c'": the file names of `paths`, the first kMaxBlockLines, then how many more.
std::string QuotedNames(const std::vector<fs::path>& paths) {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < paths.size() && i < kMaxBlockLines; ++i) {
    names.push_back(fmt::format("'{}'", paths[i].filename().string()));
  }
  if (paths.size() > kMaxBlockLines) names.push_back(fmt::format("{} more entries", paths.size() - kMaxBlockLines));
  return JoinWords(names);
}

// What the user does to lift `r` and still rebuild the index where it is, in the CLI's words;
// nullopt when nothing short of another --index-dir lifts it.
std::optional<std::string> FixInPlace(const NvmeTier::RebuildRefusal& r) {
  if (r.in_the_way) return fmt::format("move '{}' away", r.path.string());
  if (r.status.code() == Code::kUnavailable) {
    return fmt::format("close the process that has '{}' open", r.path.string());
  }
  if (!r.strays.empty()) return fmt::format("move {} out of '{}'", QuotedNames(r.strays), r.path.string());
  return std::nullopt;
}

// Why 'terrace store recover' with the paths of `p` would refuse, and what to do instead; nullopt
// when it would not. Asks the rebuild's own test (NvmeTier::RebuildTargetRefusals), so the advice
// to run recover is never a dead end; names every reason and every fix, so none is found only
// after the first is fixed.
std::optional<std::string> RecoverWouldRefuse(const StorePaths& p) {
  auto opts = ExistingStoreOptions(p, IndexDirUse::kRebuild);
  if (!opts.ok()) return std::nullopt;  // the data file's own problem is reported elsewhere
  // An error: no store, or in use (recover needs the store to itself; the failure says to close
  // that process first, and another index directory would not help).
  auto refusals = NvmeTier::RebuildTargetRefusals(*opts);
  if (!refusals.ok() || refusals->empty()) return std::nullopt;
  std::string why;
  std::vector<std::string> fixes;
  for (std::size_t i = 0; i < refusals->size(); ++i) {
    const NvmeTier::RebuildRefusal& r = (*refusals)[i];
    if (refusals->size() > 1) why += fmt::format("{}({}) ", i == 0 ? "" : "; ", i + 1);
    why += InCliWords(r.reason);
    if (std::optional<std::string> fix = FixInPlace(r)) fixes.push_back(std::move(*fix));
  }
  const std::string give_new = fmt::format(
      "give --index-dir a new or empty directory and run 'terrace store recover --dir {} --index-dir NEW_DIR' to "
      "rebuild the index there from the data file",
      p.dir);
  const std::string head = refusals->size() > 1
                               ? fmt::format("'terrace store recover' would refuse, for {} reasons: {}",
                                             refusals->size(), why)
                               : fmt::format("'terrace store recover' would refuse: {}", why);
  // Another index directory would let a rebuild leave out what the other version's records describe.
  const bool another_version = std::any_of(refusals->begin(), refusals->end(),
                                           [](const NvmeTier::RebuildRefusal& r) { return r.another_version; });
  if (another_version) return fmt::format("{}; use the Terrace version that wrote this store to recover it", head);
  if (fixes.size() < refusals->size()) return fmt::format("{}; {}", head, give_new);
  return fmt::format("{}; {}, then run 'terrace store recover {}'; or {}", head, JoinWords(fixes), StorePathFlags(p),
                     give_new);
}

// What `store check` tells the user to run to rebuild the index of `p` from the data file: 'terrace
// store recover' with the same paths, or what RecoverWouldRefuse says.
std::string StoreCheckRecoverAdvice(const StorePaths& p) {
  if (auto refusal = RecoverWouldRefuse(p)) return *refusal;
  return fmt::format("run 'terrace store recover {}' to rebuild the index from the data file", StorePathFlags(p));
}

// Test hook, so a test can start a writer exactly between `store check`'s scan of the data file and
// its opening of the index instead of racing one: when TERRACE_TEST_CHECK_GATE names a file, check
// creates "<file>.scanned" after its scan and waits (at most 60 s) until the file is removed.
// Unset: nothing happens. Runs nothing and writes only that one marker.
void WaitAtCheckGate() {
  const char* gate = std::getenv("TERRACE_TEST_CHECK_GATE");
  if (gate == nullptr || *gate == '\0') return;
  const std::filesystem::path file(gate);
  std::error_code ec;
  { std::ofstream(std::filesystem::path(file) += ".scanned"); }
  for (int i = 0; i < 6000 && std::filesystem::exists(file, ec); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// What CheckOneMoment saw, for RunCheck to report.
struct CheckedStore {
  BlockCheck check;
  std::uint64_t damaged_descriptors = 0;  // the scan's DataScanReport::damaged (0 with --quick)
  // What the read-only open found, its damaged index records among it (a read-write open refuses
  // the store until it is rebuilt).
  RecoveryReport recovery;
};

// Checks the store `o` names (opened read-only) as of one moment: a SharedDataLock keeps writers
// out from before the scan until the check is done, so the scan, the index's pending commit and the
// index describe the same store. Fills `out` and returns nullopt; or prints why it cannot check and
// returns the exit code.
std::optional<int> CheckOneMoment(const CheckArgs& a, const NvmeTierOptions& o, const std::vector<BlockKey>& expected,
                                  CheckedStore* out) {
  auto lock = SharedDataLock::Take(o);
  if (!lock.ok()) return FailStatus(lock.status());
  // The scan runs first: it needs no index, so it works when the index does not open.
  std::optional<ScannedBlocks> scan;
  if (!a.quick) {
    auto s = ScanDataArea(o);
    if (!s.ok()) return FailStatus(s.status());
    fmt::print(stderr, "store check: data file scan: {}\n", s->report.ToString());
    scan = std::move(*s);
    WaitAtCheckGate();
  }
  auto tier = NvmeTier::Open(o);
  if (!tier.ok()) {
    if (scan) {
      fmt::print("store check: the index does not open; the data file holds {} committed blocks; {}\n",
                 scan->blocks.size(), StoreCheckRecoverAdvice(a.paths));
    }
    // The tier's own advice to run recover (NvmeTier::RecoverAdvice) already says whether recover
    // would refuse this index directory; a failure without it gains ours.
    const bool advised = tier.status().message().find("terrace store recover") != std::string::npos;
    if (auto refusal = RecoverWouldRefuse(a.paths); refusal && !advised) {
      return Fail(fmt::format("{}; {}", InCliWords(tier.status().ToString()), *refusal));
    }
    return FailStatus(tier.status());
  }
  if (scan) {
    scan->pending = ReadPendingCommit(**tier);
    out->damaged_descriptors = scan->report.damaged;
  }
  out->recovery = (*tier)->recovery_report();
  const std::optional<std::uint64_t> seed = a.checksums_only ? std::nullopt : std::optional(a.seed);
  out->check = CheckBlocks(**tier, seed, expected, scan ? &*scan : nullptr, [](const std::string& line) {
    fmt::print(stderr, "{}\n", line);
  });
  return std::nullopt;
}

// `store check --repair`: opens the store read-write (exclusively) and reads each of `keys`, found
// corrupt by CheckOneMoment, again; the tier drops a block that still fails its checksum. Returns
// how many it dropped: a key that reads back good or is gone now (another process rewrote or
// erased it between the check and this open) is not dropped.
Result<std::uint64_t> DropCorruptBlocks(NvmeTierOptions o, const std::vector<BlockKey>& keys) {
  o.read_only = false;
  TERRACE_ASSIGN_OR_RETURN(std::unique_ptr<NvmeTier> tier, NvmeTier::Open(o));
  std::uint64_t dropped = 0;
  std::vector<std::byte> buf;
  for (const BlockKey& key : keys) {
    auto desc = tier->Lookup(key);
    if (!desc.ok()) continue;
    buf.resize(desc->size);
    BlockDesc got;
    Status s = tier->Get(key, buf, &got);
    if (s.IsCorruption()) {
      ++dropped;
    } else if (!s.ok()) {
      return s;
    }
  }
  TERRACE_RETURN_IF_ERROR(tier->Close());
  return dropped;
}

int RunCheck(const CheckArgs& a) {
  std::vector<BlockKey> expected;
  if (!a.expect.empty()) {
    auto keys = ReadDurableLines(a.expect);
    if (!keys.ok()) {
      return keys.status().IsIoError() ? FailStatus(keys.status()) : FailUsage(keys.status().message());
    }
    expected = std::move(*keys);
  }
  auto opts = ExistingStoreOptions(a.paths, IndexDirUse::kExisting);
  if (!opts.ok()) {
    return FailStoreOptions(opts.status());
  }
  NvmeTierOptions o = *opts;
  o.read_only = true;  // the check writes nothing; --repair drops corrupt blocks after it (DropCorruptBlocks)
  CheckedStore checked;
  if (std::optional<int> failed = CheckOneMoment(a, o, expected, &checked)) return *failed;
  const BlockCheck& c = checked.check;
  for (std::size_t i = 0; i < c.lost_keys.size() && i < kMaxBlockLines; ++i) {
    fmt::print(stderr, "not in the index: {}\n", c.lost_keys[i].ToString());
  }
  if (c.lost_keys.size() > kMaxBlockLines) {
    fmt::print(stderr, "... and {} more blocks not in the index\n", c.lost_keys.size() - kMaxBlockLines);
  }
  fmt::print("store check: {} blocks in the index: ok {}  missing {}  corrupt {}  wrong-content {}  lost-from-index {}\n",
             c.indexed, c.ok, c.missing, c.corrupt, c.wrong_content,
             c.scanned ? std::to_string(c.lost_from_index) : std::string("not scanned"));
  if (c.index_only > 0) {  // a warning: the blocks read back; only a rebuild without this index would lose them
    fmt::print("store check: {} indexed blocks have no valid descriptor in the data file ({} damaged descriptors "
               "found): they are served from the index, and 'terrace store recover' keeps them only while this "
               "index opens; keep the index\n",
               c.index_only, checked.damaged_descriptors);
  }
  if (c.pending_commit > 0) {  // a note: nothing is damaged, and nothing is to be done
    fmt::print("store check: {} indexed blocks belong to the index's pending group commit, whose descriptors are "
               "not in the data file yet (its writer stopped between the index write and the descriptors, or "
               "'terrace store recover' kept them from the old index); they read back from the index, and the next "
               "read-write open of the store (a 'store fill' or 'model run' on it, or a 'store check --repair' that "
               "drops blocks) writes their descriptors; no action needed\n",
               c.pending_commit);
  }
  if (c.pending_release > 0) {  // a note, as above
    fmt::print("store check: {} blocks the data file still describes were erased or replaced by the index's "
               "pending group commit; the next read-write open of the store clears their descriptors; no action "
               "needed\n",
               c.pending_release);
  }
  const std::string where = fmt::format("--dir {}{}", a.paths.dir,
                                        a.paths.index_dir.empty() ? "" : " --index-dir " + a.paths.index_dir);
  const std::uint64_t damaged_records = checked.recovery.damaged_records();
  if (damaged_records > 0) {
    fmt::print("store check: the index holds {} damaged records ({}); no writer can open the store until its index "
               "is rebuilt (dropping them could free space that holds intact blocks); {}\n",
               damaged_records, checked.recovery.DamagedRecordsText(), StoreCheckRecoverAdvice(a.paths));
  }
  if (c.corrupt) {
    if (a.repair && damaged_records > 0) {
      fmt::print("store check: {} corrupt blocks were left as they are: --repair opens the store for writing, which "
                 "its damaged index refuses; run 'terrace store recover' first (it skips corrupt blocks)\n",
                 c.corrupt);
    } else if (a.repair) {
      auto dropped = DropCorruptBlocks(o, c.corrupt_keys);
      if (!dropped.ok()) return FailStatus(dropped.status());
      fmt::print("store check: {} corrupt blocks were dropped from the store; recompute or refetch them\n", *dropped);
      if (*dropped < c.corrupt) {
        fmt::print("store check: {} of the corrupt blocks were not dropped: another process rewrote or erased them "
                   "after the check; run 'terrace store check --repair {}' again to check the store as it is now\n",
                   c.corrupt - *dropped, where);
      }
    } else {
      fmt::print("store check: {} corrupt blocks were left as they are (check is read-only); run 'terrace store check "
                 "--repair {}' to drop them\n",
                 c.corrupt, where);
    }
  }
  if (c.lost_from_index) {
    fmt::print("store check: the data file holds {} committed blocks the index does not (blocks the index lost, or "
               "puts in flight when a writer died); {}\n",
               c.lost_from_index, StoreCheckRecoverAdvice(a.paths));
  }
  if (c.index_mismatch) {
    fmt::print("store check: the index points {} keys at bytes their descriptors in the data file do not describe "
               "(the index is damaged); {}\n",
               c.index_mismatch, StoreCheckRecoverAdvice(a.paths));
  }
  if (const std::uint64_t other = c.wrong_content - c.index_mismatch; other > 0 && !a.checksums_only) {
    fmt::print("store check: {} blocks differ from the pattern of --seed {}: give the --seed 'store fill' used, or "
               "--checksums-only for a store that 'store fill' did not write\n",
               other, a.seed);
  } else if (other > 0) {
    fmt::print("store check: {} blocks read back with another size than their index entry\n", other);
  }
  if (c.missing) {
    fmt::print("store check: {} expected blocks are missing{}\n", c.missing,
               c.scanned ? "" : "; run without --quick to look for them in the data file");
  }
  return (c.missing || c.corrupt || c.wrong_content || c.lost_from_index || damaged_records) ? 1 : 0;
}

}  // namespace

void RegisterStore(CLI::App& app, Runner* run) {
  auto* store = app.add_subcommand("store", "Check, repair, recover, measure and drill an NVMe store");
  store->require_subcommand(1);

  auto fa = std::make_shared<FillArgs>();
  auto* fill = store->add_subcommand("fill", "Put test-pattern blocks in sync durability, printing 'durable <key>' "
                                             "for each acknowledged put");
  AddStorePathOptions(fill, &fa->paths, /*dir_created_if_missing=*/true, /*with_capacity=*/true);
  AddIntOption<std::uint64_t>(fill, "--count", &fa->count, 1, UINT64_MAX / 2, "Number of blocks")->required();
  AddSizeOption(fill, "--block-size", &fa->block_size, "Block size", 1, kMaxBlockSize);
  AddIntOption<std::uint64_t>(fill, "--seed", &fa->seed, 0, UINT64_MAX, "Seed of the keys and contents");
  AddIntOption<std::uint64_t>(fill, "--threads", &fa->threads, 1, kMaxFillThreads,
                "Concurrent writers (their puts share group commits)");
  // Hidden flags used by `store drill` for its child processes.
  AddIntOption<std::uint64_t>(fill, "--first", &fa->first, 0, UINT64_MAX / 2, "")->group("");
  fill->add_option("--drill-fault", fa->fault.kind, "")->group("")->check(CLI::IsMember({"eio", "enospc", "short", "powercut", "close-eio"}));
  AddIntOption<std::uint64_t>(fill, "--drill-fault-seed", &fa->fault.seed, 0, UINT64_MAX, "")->group("");
  fill->add_option("--drill-fault-rate", fa->fault.rate, "")->group("")->check(CLI::Range(0.0, 1.0));
  AddIntOption<std::uint64_t>(fill, "--drill-cut-after", &fa->fault.cut_after, 0, UINT64_MAX, "")->group("");
  fill->callback([run, fa] { *run = [fa] { return RunFill(*fa); }; });

  auto ca = std::make_shared<CheckArgs>();
  auto* check = store->add_subcommand(
      "check", "Verify every block's checksum and its content against the pattern of --seed (or only the checksum, "
               "with --checksums-only) and look for blocks the index lost; read-only unless --repair");
  AddStorePathOptions(check, &ca->paths, /*dir_created_if_missing=*/false, /*with_capacity=*/true);
  auto* check_seed = AddIntOption<std::uint64_t>(check, "--seed", &ca->seed, 0, UINT64_MAX, "Seed given to 'fill'");
  check->add_flag("--checksums-only", ca->checksums_only,
                  "Verify only each block's checksum, not the pattern of 'fill': for a store 'store fill' did not "
                  "write (a prefix-cache pool, an expert store)")
      ->excludes(check_seed);
  check->add_option("--expect", ca->expect, "File of 'durable <key>' lines as 'fill' printed them; each must be ok");
  check->add_flag("--repair", ca->repair, "Drop corrupt blocks from the store (their bytes are lost)");
  check->add_flag("--quick", ca->quick, "Skip the scan of the data file for blocks the index lost");
  check->callback([run, ca] { *run = [ca] { return RunCheck(*ca); }; });

  RegisterStoreRecover(store, run);
  RegisterStoreDrill(store, run);
  RegisterStoreStats(store, run);
}

}  // namespace terrace::cli
