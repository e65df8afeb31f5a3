// Small helpers shared by the CLI commands: size parsing and formatting, test-pattern blocks, and
// aligned text tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "terrace/block.h"
#include "terrace/stats.h"
#include "terrace/status.h"

namespace terrace::cli {

// "4096", "4KiB", "1MiB", "2GiB", "1TiB" (binary), "4K"/"1M"/"2G" (binary too), "4KB"/"1MB"/"2GB"
// (decimal). Case-insensitive. InvalidArgument naming `what` on anything else.
Result<std::uint64_t> ParseSize(std::string_view text, std::string_view what = "size");
// "1.5 MiB", "512 B".
std::string FormatBytes(double bytes);

// Adds a size option that accepts ParseSize's suffixes.
CLI::Option* AddSizeOption(CLI::App* app, const std::string& name, std::uint64_t* value, const std::string& help);

// The deterministic test pattern of block `key` under `seed`: `size` bytes from a splitmix64 stream
// seeded by (seed, key). `store fill` writes it and `store check` re-derives it.
void FillPattern(std::uint64_t seed, const BlockKey& key, std::span<std::byte> out);
// The key `store fill` uses for its i-th block under `seed`.
BlockKey FillKey(std::uint64_t seed, std::uint64_t i);

// True when `path` names a block device (following symlinks such as /dev/disk/by-id/...).
bool IsBlockDevice(const std::string& path);
// The size in bytes of block device `path` (BLKGETSIZE64); IoError naming it on failure.
Result<std::uint64_t> BlockDeviceBytes(const std::string& path);
// The NVMe paths of a command line: a block device --dir needs --index-dir (the tier keeps its
// RocksDB index there); InvalidArgument naming both flags otherwise.
Status CheckNvmePaths(const std::string& dir, const std::string& index_dir);

// A text table with right-aligned columns (except the first), printed to stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// One row per tier: name, capacity, used, blocks, hits, misses, in, out, read p50/p99, write p50/p99.
Table TierTable(std::span<const TierStatsSnapshot> tiers);

}  // namespace terrace::cli
