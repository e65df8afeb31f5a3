// An embedder's smoke test: open a store (emulated HBM, host, NVMe under argv[1]), put blocks,
// read them back, prefetch them to HBM and check where they are. Exits non-zero on any failure.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "terrace/terrace.h"

namespace {

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

std::vector<std::byte> Bytes(std::uint64_t i, std::size_t n) {
  std::vector<std::byte> v(n);
  std::uint64_t x = i * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer DIR   (an empty or absent directory for the NVMe tier)\n");
    return 2;
  }
  terrace::StoreOptions o;
  o.hbm.mode = terrace::HbmMode::kAuto;  // emulated without a GPU
  o.hbm.capacity_bytes = 16 * terrace::kMiB;
  o.host.capacity_bytes = 16 * terrace::kMiB;
  o.host.chunk_bytes = 4 * terrace::kMiB;
  o.nvme.path = std::filesystem::path(argv[1]);
  o.nvme.capacity_bytes = 64 * terrace::kMiB;
  o.write_policy = terrace::WritePolicy::kWriteThrough;
  o.logger = terrace::StderrLogger(terrace::LogLevel::kWarning);
  auto store = terrace::Store::Open(o);
  if (!store.ok()) {
    std::fprintf(stderr, "consumer: open: %s\n", store.status().ToString().c_str());
    return 1;
  }

  constexpr int kBlocks = 8;
  constexpr std::size_t kSize = 64 * 1024;
  std::vector<terrace::BlockKey> keys;
  terrace::ContentId id = terrace::RootContentId(7);
  for (int i = 0; i < kBlocks; ++i) {
    const std::vector<std::int32_t> tokens{i, i + 1, i + 2};
    id = terrace::ChainContentId(id, tokens);
    keys.push_back(terrace::BlockKey{1, terrace::BlockKind::kKv, static_cast<std::uint32_t>(i), id});
    terrace::Status s = (*store)->Put(keys.back(), Bytes(i, kSize));
    Expect(s.ok(), "put " + std::to_string(i) + ": " + s.ToString());
  }

  std::vector<std::byte> out(kSize);
  for (int i = 0; i < kBlocks; ++i) {
    auto desc = (*store)->Get(keys[i], out);
    Expect(desc.ok() && desc->size == kSize && out == Bytes(i, kSize), "get " + std::to_string(i));
  }

  auto ready = (*store)->Prefetch(keys, terrace::TierId::kHbm);
  std::vector<terrace::Status> statuses = ready.get();
  Expect(statuses.size() == keys.size(), "prefetch returns one status per key");
  for (const auto& s : statuses) Expect(s.ok(), "prefetch: " + s.ToString());
  for (const auto& r : (*store)->Lookup(keys)) {
    Expect(r.found && r.tier == terrace::TierId::kHbm, "block is in HBM after prefetch");
  }
  for (int i = 0; i < kBlocks; ++i) {
    auto desc = (*store)->Get(keys[i], out);
    Expect(desc.ok() && out == Bytes(i, kSize), "get after prefetch " + std::to_string(i));
  }
  store->reset();

  // Reopen: the blocks were written through to NVMe and survive.
  auto reopened = terrace::Store::Open(o);
  Expect(reopened.ok(), "reopen");
  if (reopened.ok()) {
    for (int i = 0; i < kBlocks; ++i) {
      auto desc = (*reopened)->Get(keys[i], out);
      Expect(desc.ok() && out == Bytes(i, kSize), "get after reopen " + std::to_string(i));
    }
  }
  if (failures) return 1;
  std::printf("consumer: ok (%d blocks: put, get, prefetch to HBM, reopen)\n", kBlocks);
  return 0;
}
