// terrace store recover: rebuilds a lost or damaged NVMe index from a scan of the data file.
#include <chrono>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli::store_cmd {
namespace {

int RunRecover(const StorePaths& p) {
  auto opts = ExistingStoreOptions(p, IndexDirUse::kRebuild);
  if (!opts.ok()) {
    return FailStoreOptions(opts.status());
  }
  auto last = std::chrono::steady_clock::now();
  auto progress = [&](std::uint64_t done, std::uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    if (total == 0 || (done < total && now - last < std::chrono::milliseconds(500))) return;
    last = now;
    fmt::print(stderr, "store recover: scanned {} of {} ({:.0f}%)\n", FormatBytes(static_cast<double>(done)),
               FormatBytes(static_cast<double>(total)), 100.0 * static_cast<double>(done) / static_cast<double>(total));
  };
  auto rep = NvmeTier::RebuildIndex(*opts, progress);
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
    fmt::print("store recover: the old index was moved to '{}' (nothing was deleted; remove it once the store checks "
               "clean)\n",
               rep->moved_aside.string());
  }
  fmt::print("store recover: run 'terrace store check {}' to verify\n", StorePathFlags(p));
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
