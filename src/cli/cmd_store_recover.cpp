// terrace store recover: rebuilds a lost or damaged NVMe index from a scan of the data file.
//
// SIGINT/SIGTERM (StopSignals) stop it at the next checkpoint RebuildIndex offers: after a chunk of
// the scan (which only reads: the store and its index stay as they were) or after a step of writing
// the new index into "<index>.rebuilding" (the old index is still in place; the next recover removes
// that folder first, docs/nvme-format.md "Scan and rebuild"). Once the new index is complete it is
// put in place (two renames) before the stop. The library offers no way to return early from those
// callbacks, so the stop ends the process there (std::_Exit, after the "stopped by" line): at those
// points that leaves exactly what a kill leaves, which the rebuild is built to take up.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/cli/stop_signals.h"
#include "tiers/nvme/nvme_paths.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli::store_cmd {
namespace {

namespace fs = std::filesystem;

// Test hook, so a test can signal a recover at a known point instead of racing it: when
// TERRACE_TEST_RECOVER_GATE names a file, the recover creates "<file>.waiting" at its first scan
// chunk (or, with TERRACE_TEST_RECOVER_GATE_AT=<step>, after that step of RebuildIndex) and waits
// (at most 60 s) until the file exists. Unset or empty: does nothing.
void WaitAtRecoverGate(std::string_view where) {
  static bool passed = false;
  const char* gate = std::getenv("TERRACE_TEST_RECOVER_GATE");
  if (passed || gate == nullptr || *gate == '\0') return;
  const char* at = std::getenv("TERRACE_TEST_RECOVER_GATE_AT");
  if (where != (at == nullptr || *at == '\0' ? std::string_view("scan") : std::string_view(at))) return;
  passed = true;
  const fs::path file(gate);
  std::error_code ec;
  if (std::FILE* f = std::fopen((file.string() + ".waiting").c_str(), "w")) std::fclose(f);
  for (int i = 0; i < 6000 && !fs::exists(file, ec); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// Ends the process after a stop at one of RebuildIndex's checkpoints (see the top of the file).
[[noreturn]] void StopNow(std::string_view how) {
  const int code = ExitStopped("store recover", how);
  std::fflush(nullptr);
  std::_Exit(code);
}

int RunRecover(const StorePaths& p) {
  // Ctrl-C: stop at the next chunk of the scan or step of the write (above), exit 128 + the signal.
  StopSignals stop_signals;
  auto opts = ExistingStoreOptions(p, IndexDirUse::kRebuild);
  if (!opts.ok()) {
    return FailStoreOptions(opts.status());
  }
  const std::string again = fmt::format("'terrace store recover {}'", StorePathFlags(p));
  // The rebuild writes its new index beside the store's index directory, as "<index>.rebuilding".
  auto paths = nvme::ResolveStorePaths(*opts, /*may_create=*/false);
  if (!paths.ok()) return FailStoreOptions(paths.status());
  const fs::path building = nvme::RebuildingIndexPath(paths->index);
  auto last = std::chrono::steady_clock::now();
  auto progress = [&](std::uint64_t done, std::uint64_t total) {
    WaitAtRecoverGate("scan");
    if (StopSignalReceived() != 0) {
      StopNow(fmt::format(" while scanning the data file ({} of {} scanned); the store and its index are as the "
                          "scan found them (it writes nothing); run {} again to rebuild the index",
                          FormatBytes(static_cast<double>(done)), FormatBytes(static_cast<double>(total)), again));
    }
    auto now = std::chrono::steady_clock::now();
    if (total == 0 || (done < total && now - last < std::chrono::milliseconds(500))) return;
    last = now;
    fmt::print(stderr, "store recover: scanned {} of {} ({:.0f}%)\n", FormatBytes(static_cast<double>(done)),
               FormatBytes(static_cast<double>(total)), 100.0 * static_cast<double>(done) / static_cast<double>(total));
  };
  // After "finished" the new index is complete: moving the old one aside and the new one into place
  // (two renames) are not cut short, so the store never stays without an index.
  bool complete = false;
  auto at_step = [&](std::string_view step) {
    WaitAtRecoverGate(step);
    if (step == "finished") complete = true;
    if (complete || StopSignalReceived() == 0) return;
    if (step.starts_with("leftover-")) {
      StopNow(fmt::format(" before its scan, after taking up what an earlier stopped rebuild left ({}); run {} again "
                          "to rebuild the index",
                          step == "leftover-removed" ? "removed" : "put in place", again));
    }
    StopNow(fmt::format(" while writing the new index (after its step '{}'); the old index is as it was, and the "
                        "unfinished new one is left in '{}', which the next {} removes before it rebuilds: run it "
                        "again to rebuild the index",
                        step, building.string(), again));
  };
  if (StopSignalReceived() != 0) return ExitStopped("store recover", " before it began; nothing was changed");
  auto rep = NvmeTier::RebuildIndex(*opts, progress, at_step);
  if (!rep.ok()) {  // InvalidArgument: the paths given (an --index-dir that is not this store's index)
    return rep.status().IsInvalidArgument() ? FailUsage(rep.status().message()) : FailStatus(rep.status());
  }
  const DataScanReport& scan = rep->scan;
  fmt::print("store recover: {} blocks indexed ({}) from '{}' in {:.2f} s; skipped {} corrupt extents, {} superseded "
             "extents, {} descriptors of another store\n",
             rep->blocks_indexed, FormatBytes(static_cast<double>(rep->bytes_indexed)), DataFilePath(p.dir),
             rep->seconds, rep->corrupt_skipped, scan.superseded, scan.foreign);
  for (const std::string& k : scan.corrupt_keys) fmt::print("store recover: skipped corrupt block {}\n", k);
  if (rep->kept_from_old_index > 0) {
    fmt::print("store recover: {} blocks whose descriptor is damaged or missing were kept from the old index (their "
               "data passes its checksum)\n",
               rep->kept_from_old_index);
  }
  if (rep->lost_from_old_index > 0) {
    fmt::print("store recover: {} blocks the old index listed are {}: that version of them is intact nowhere in the "
               "data file (the index now holds an older version of the block, or none)\n",
               rep->lost_from_old_index,
               rep->old_index_stale ? "possibly lost (the old index is behind the data file, so they may have been "
                                      "erased since)"
                                    : "lost");
    for (const std::string& k : rep->lost_keys)
      fmt::print("store recover: {} block {}\n", rep->old_index_stale ? "possibly lost" : "lost", k);
  }
  if (rep->old_records_unreadable > 0) {
    fmt::print("store recover: {} records of the old index were too damaged to name a block (the blocks behind them "
               "were indexed from the data file where it holds them intact)\n",
               rep->old_records_unreadable);
  }
  if (rep->cut_commit_entries > 0) {
    fmt::print("store recover: the last group commit was cut short before its descriptors; its {} entries follow the "
               "old index, and the next read-write open writes their descriptors\n",
               rep->cut_commit_entries);
  }
  if (scan.damaged > 0) {
    fmt::print("store recover: {} damaged descriptors were found; the blocks behind them are lost unless kept from the "
               "old index (above)\n",
               scan.damaged);
  }
  if (rep->moved_aside.empty()) {
    fmt::print("store recover: there was no index; a new one was written\n");
  } else {
    fmt::print("store recover: the old index was moved to '{}' (nothing was deleted; {})\n", rep->moved_aside.string(),
               rep->lost_from_old_index > 0 ? "it still lists the blocks above" : "remove it once the store checks clean");
  }
  fmt::print("store recover: run 'terrace store check {}' to verify\n", StorePathFlags(p));
  if (StopSignalReceived() != 0) {
    return ExitStopped("store recover", " after the new index was complete; it was put in place (the rebuild is done)");
  }
  return 0;
}

}  // namespace

void RegisterStoreRecover(CLI::App* store, Runner* run) {
  auto p = std::make_shared<StorePaths>();
  auto* cmd = store->add_subcommand("recover", "Rebuild the store's index from a scan of its data file");
  AddStorePathOptions(cmd, p.get(), /*dir_created_if_missing=*/false, /*with_capacity=*/false);
  cmd->callback([run, p] { *run = [p] { return RunRecover(*p); }; });
}

}  // namespace terrace::cli::store_cmd
