// terrace store stats: what an existing store holds and its per-tier counters, read-only; as a
// table, JSON, or the library's Prometheus text exposition.
#include <sys/statfs.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/cli/cli_util.h"
#include "src/cli/cmd_store.h"
#include "src/common/json_text.h"
#include "terrace/store.h"

namespace terrace::cli::store_cmd {
namespace {

struct StatsArgs {
  StorePaths paths;
  bool json = false;
  bool prometheus = false;
};

constexpr long kTmpfsMagic = 0x01021994;
constexpr long kRamfsMagic = 0x858458f6;

// Conditions under which a "durable" acknowledgement does not survive a power loss.
std::vector<std::string> DurabilityWarnings(const std::string& dir, const std::string& index_dir) {
  std::vector<std::string> out;
  auto check = [&](const std::string& path, const char* what) {
    struct statfs sf {};
    if (path.empty() || ::statfs(path.c_str(), &sf) != 0) return;
    if (static_cast<long>(sf.f_type) == kTmpfsMagic || static_cast<long>(sf.f_type) == kRamfsMagic) {
      out.push_back(fmt::format("the {} '{}' is on a RAM file system (tmpfs/ramfs): nothing in it survives a reboot",
                                what, path));
    }
  };
  check(dir, "store directory");
  if (!index_dir.empty()) check(index_dir, "index directory");
  return out;
}

int RunStats(const StatsArgs& a) {
  if (a.json && a.prometheus) return FailUsage("--json and --prometheus cannot be combined; choose one");
  auto opts = ExistingStoreOptions(a.paths, IndexDirUse::kExisting);
  if (!opts.ok()) {
    return FailStoreOptions(opts.status());
  }
  auto sb = ReadSuperblock(a.paths.dir);
  if (!sb.ok() || !*sb) return Fail(sb.ok() ? "the store has no superblock" : sb.status().ToString());
  StoreOptions so;
  so.hbm.mode = HbmMode::kOff;
  so.host.capacity_bytes = 0;  // NVMe only: nothing is cached, nothing demoted
  so.nvme = *opts;
  so.nvme.read_only = true;
  so.put_tier = TierId::kNvme;
  auto store = Store::Open(so);
  if (!store.ok()) return FailStatus(store.status());
  if (a.prometheus) {
    std::fputs((*store)->PrometheusText().c_str(), stdout);
    return 0;
  }
  const StoreStats st = (*store)->Stats();
  const TierStatsSnapshot& nv = st.tiers[static_cast<int>(TierId::kNvme)];
  const std::string index_dir =
      a.paths.index_dir.empty() ? (std::filesystem::path(a.paths.dir) / "index").string() : a.paths.index_dir;
  const std::vector<std::string> warnings = DurabilityWarnings(a.paths.dir, a.paths.index_dir);
  if (a.json) {
    nlohmann::json tiers = nlohmann::json::array();
    for (int i = 0; i < kNumTiers; ++i) {
      if (!st.present[i]) continue;
      const TierStatsSnapshot& s = st.tiers[i];
      tiers.push_back({{"tier", s.name},         {"capacity_bytes", s.capacity_bytes}, {"used_bytes", s.used_bytes},
                       {"allocated_bytes", s.allocated_bytes},
                       {"blocks", s.blocks},      {"hits", s.hits},                    {"misses", s.misses},
                       {"bytes_written", s.bytes_written}, {"bytes_read", s.bytes_read}, {"puts", s.puts},
                       {"evictions", s.evictions}, {"io_errors", s.io_errors},         {"corruptions", s.corruptions},
                       {"detail", s.detail}});
    }
    nlohmann::json j = {{"dir", a.paths.dir},
                        {"data_file", DataFilePath(a.paths.dir)},
                        {"index_dir", index_dir},
                        {"uuid", (*sb)->uuid},
                        {"format_version", (*sb)->format_version},
                        {"capacity_bytes", (*sb)->capacity_bytes},
                        {"blocks", st.blocks},
                        {"used_bytes", nv.used_bytes},
                        {"allocated_bytes", nv.allocated_bytes},
                        {"durability_warnings", warnings},
                        {"tiers", tiers}};
    fmt::print("{}\n", JsonText(j, 2));
    return 0;
  }
  const double allocated_pct = (*sb)->capacity_bytes ? 100.0 * static_cast<double>(nv.allocated_bytes) /
                                                            static_cast<double>((*sb)->capacity_bytes)
                                                      : 0;
  fmt::print("store {}\n", a.paths.dir);
  fmt::print("  data file       {}\n", DataFilePath(a.paths.dir));
  fmt::print("  index           {}\n", index_dir);
  fmt::print("  store id        {}\n", (*sb)->uuid);
  fmt::print("  format version  {}\n", (*sb)->format_version);
  fmt::print("  capacity        {}\n", FormatBytes(static_cast<double>((*sb)->capacity_bytes)));
  fmt::print("  blocks          {}\n", st.blocks);
  // The space taken decides when the store is full: each block takes its data rounded up to 4 KiB
  // plus a 4 KiB descriptor, so small blocks fill a store long before their bytes add up to it.
  fmt::print("  space taken     {} ({:.1f}% of capacity; each block: its data rounded up to 4 KiB + a 4 KiB "
             "descriptor)\n",
             FormatBytes(static_cast<double>(nv.allocated_bytes)), allocated_pct);
  fmt::print("  block bytes     {} (the blocks' own sizes summed)\n", FormatBytes(static_cast<double>(nv.used_bytes)));
  if (!nv.detail.empty()) fmt::print("  tier detail     {}\n", nv.detail);
  if (warnings.empty()) fmt::print("  durability      no warnings\n");
  for (const auto& w : warnings) fmt::print("  WARNING         {}\n", w);
  std::vector<TierStatsSnapshot> rows;
  for (int i = 0; i < kNumTiers; ++i) {
    if (st.present[i]) rows.push_back(st.tiers[i]);
  }
  fmt::print("\n{}", TierTable(rows).Render());
  return 0;
}

}  // namespace

void RegisterStoreStats(CLI::App* store, Runner* run) {
  auto a = std::make_shared<StatsArgs>();
  auto* cmd = store->add_subcommand("stats", "Show an existing store's contents and counters (read-only)");
  AddStorePathOptions(cmd, &a->paths, /*dir_created_if_missing=*/false, /*with_capacity=*/false);
  cmd->add_flag("--json", a->json, "Print one JSON object");
  cmd->add_flag("--prometheus", a->prometheus, "Print the Prometheus text exposition (format 0.0.4)");
  cmd->callback([run, a] { *run = [a] { return RunStats(*a); }; });
}

}  // namespace terrace::cli::store_cmd
