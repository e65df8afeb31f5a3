// An engine plugin's shape: Terrace linked into a shared library (an engine's extension module,
// a Python extension). It links only when every library it pulls in, RocksDB included, is
// position-independent; scripts/consumer_test.sh loads it and calls its entry point.
#include <cstddef>
#include <filesystem>
#include <span>

#include "terrace/terrace.h"

// 0 when a store (host tier, NVMe tier under `dir`) opens, puts a block and reads it back; 1 otherwise.
extern "C" int terrace_plugin_round_trip(const char* dir) {
  terrace::StoreOptions o;
  o.hbm.mode = terrace::HbmMode::kOff;
  o.host.capacity_bytes = 16 * terrace::kMiB;
  o.host.chunk_bytes = 4 * terrace::kMiB;
  o.nvme.path = std::filesystem::path(dir);
  o.nvme.capacity_bytes = 64 * terrace::kMiB;
  auto store = terrace::Store::Open(o);
  if (!store.ok()) return 1;
  const terrace::BlockKey key{};
  std::byte in[4096] = {std::byte{42}}, out[4096] = {};
  if (!(*store)->Put(key, std::span<const std::byte>(in)).ok()) return 1;
  if (!(*store)->Get(key, std::span<std::byte>(out)).ok()) return 1;
  return out[0] == std::byte{42} ? 0 : 1;
}
