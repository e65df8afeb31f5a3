// Helpers for store tests: opening a Store over fake tiers, reading blocks back.
#pragma once

#include <catch2/catch.hpp>

#include <filesystem>
#include <memory>
#include <vector>

#include "fake_tier.h"
#include "terrace/store.h"
#include "test_util.h"

namespace terrace::testing {

// Options with background demotion off (watermarks at 100%), for tests that count movements.
inline StoreOptions Quiet() {
  StoreOptions o;
  o.high_watermark = 1.0;
  o.low_watermark = 1.0;
  return o;
}

// Options for a Store over the real tiers: emulated HBM (no link model), an unpinned host arena
// growing in `host_chunk` chunks, and a 16 MiB NVMe tier in `dir`.
inline StoreOptions RealTierOptions(const std::filesystem::path& dir, std::uint64_t hbm, std::uint64_t host,
                                    std::uint64_t host_chunk) {
  StoreOptions o;
  o.hbm.mode = HbmMode::kEmulated;
  o.hbm.capacity_bytes = hbm;
  o.hbm.link.enabled = false;
  o.host.capacity_bytes = host;
  o.host.chunk_bytes = host_chunk;
  o.host.pin = false;
  o.nvme.path = dir;
  o.nvme.capacity_bytes = 16 * kMiB;
  return o;
}

inline std::unique_ptr<Store> OpenFakeStore(FakeTiers& f, const StoreOptions& options = Quiet()) {
  auto r = Store::OpenWithTiers(options, std::move(f.tiers));
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(*r);
}

// Opens a store with `options`; the test stops there, naming the status, when it cannot.
inline std::unique_ptr<Store> OpenStore(const StoreOptions& options) {
  auto r = Store::Open(options);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(*r);
}

// Gets `key` into a fresh buffer of `capacity` bytes; returns the bytes (resized to the block).
inline Result<std::vector<std::byte>> GetBytes(Store& store, const BlockKey& key, std::size_t capacity = 1 << 16) {
  std::vector<std::byte> buf(capacity);
  auto r = store.Get(key, buf);
  if (!r.ok()) return r.status();
  buf.resize(r->size);
  return buf;
}

// Checks that `key` reads back as exactly `want`.
inline void CheckReadsBack(Store& store, const BlockKey& key, const std::vector<std::byte>& want) {
  auto got = GetBytes(store, key);
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  CHECK(*got == want);
}

inline TierId TierOf(Store& store, const BlockKey& key) {
  auto r = store.Lookup({&key, 1});
  REQUIRE(r[0].found);
  return r[0].tier;
}

}  // namespace terrace::testing
