// terrace store recover: rebuilds a lost or damaged NVMe index from a scan of the data file.
#include <memory>
#include <string>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace::cli::store_cmd {
namespace {

int RunRecover(const StorePaths& p) {
  auto opts = ExistingStoreOptions(p);
  if (!opts.ok()) {
    return opts.status().IsInvalidArgument() ? FailUsage(opts.status().message()) : FailStatus(opts.status());
  }
  return Fail("store recover needs NvmeTier::RebuildIndex (not merged yet)");
}

}  // namespace

void RegisterStoreRecover(CLI::App* store, Runner* run) {
  auto p = std::make_shared<StorePaths>();
  auto* cmd = store->add_subcommand("recover", "Rebuild the store's index from a scan of its data file");
  AddStorePathOptions(cmd, p.get(), /*dir_created_if_missing=*/false, /*with_capacity=*/false);
  cmd->callback([run, p] { *run = [p] { return RunRecover(*p); }; });
}

}  // namespace terrace::cli::store_cmd
